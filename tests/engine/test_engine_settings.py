"""LLM(**settings) forwards to EngineConfig: the one definition of the engine's settings."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from batchgen import LLM
from batchgen.engine.api.config import EngineConfig, engine_config


def test_unknown_setting_is_named_before_anything_loads(tmp_path: Path) -> None:
    # why a missing folder: the error must come before the model is read
    with pytest.raises(TypeError, match=r"unknown engine setting\(s\) \['block_sise'\].*known: block_size"):
        LLM(str(tmp_path / "nowhere"), block_sise=8)


@pytest.mark.parametrize(
    "settings, name",
    [
        ({"block_size": 0}, "block_size"),
        ({"max_num_seqs": True}, "max_num_seqs"),
        ({"kv_cache_memory_bytes": 0}, "kv_cache_memory_bytes"),
        ({"enable_prefix_caching": "yes"}, "enable_prefix_caching"),
        ({"compile": "yes"}, "compile"),
        ({"compile": 1}, "compile"),
    ],
)
def test_invalid_setting_is_a_value_error_naming_it(tmp_path: Path, settings: dict, name: str) -> None:
    with pytest.raises(ValueError, match=rf"EngineConfig.{name} must be"):
        LLM(str(tmp_path / "nowhere"), **settings)


def test_no_unused_defaults() -> None:
    assert EngineConfig().kv_cache_memory_bytes is None  # None: sized from free memory (CUDA) or a CPU default
    assert engine_config(block_size=8) == EngineConfig(block_size=8)


def test_settings_reach_the_engine(tiny_model: Callable[[str], Path]) -> None:
    llm = LLM(str(tiny_model("llama")), device="cpu", block_size=8, num_kv_blocks=20, max_num_seqs=3)
    assert (llm.config.block_size, llm.config.num_kv_blocks, llm.config.max_num_seqs) == (8, 20, 3)
    with pytest.raises(TypeError):
        LLM(str(tiny_model("llama")), "cpu")  # type: ignore[misc]  # device is keyword-only


def test_device_availability_lists_this_machines_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from batchgen.engine.runner.models import DeviceError, resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu") == resolve_device("cpu")
    for device in ("cuda", "cuda:0", "mps"):
        with pytest.raises(DeviceError, match=rf"'{device}' is not available on this machine; devices here: cpu$"):
            resolve_device(device)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("cuda:1") == torch.device("cuda:1") and resolve_device("cuda") == torch.device("cuda")
    with pytest.raises(DeviceError, match="devices here: cpu, cuda:0, cuda:1"):  # the job side makes it exit 4
        resolve_device("cuda:2")
    with pytest.raises(ValueError, match="not a device name"):
        resolve_device("banana")
