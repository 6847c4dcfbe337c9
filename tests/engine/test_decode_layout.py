"""decode_layout: a bf16 model's key layout is measured once per machine and shape, and every later
process takes the stored choice (so the processes of one job attend alike); float32 is never timed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from batchgen.engine.cpu import decode_layout, native


def test_the_first_measurement_is_stored_and_every_later_call_takes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path))
    assert decode_layout.keys_transposed(torch.float32, 2, 2, 16) is True
    assert not (tmp_path / "kernels" / "decode-layout").exists()  # float32: nothing timed, nothing stored
    choice = decode_layout.keys_transposed(torch.bfloat16, 2, 2, 16)
    (stored,) = (tmp_path / "kernels" / "decode-layout").iterdir()
    record = json.loads(stored.read_text())
    assert record["transposed"] is choice and record["batched_s"] > 0 and record["sdpa_s"] > 0
    stored.write_text(json.dumps({**record, "transposed": not choice}))  # as if another process measured first
    assert decode_layout.keys_transposed(torch.bfloat16, 2, 2, 16) is (not choice)
    assert decode_layout.keys_transposed(torch.bfloat16, 2, 4, 16) in (True, False)  # another shape: its own file
    assert len(list((tmp_path / "kernels" / "decode-layout").iterdir())) == 2


def _kernels() -> native.NativeKernels:
    kernels = native.load()
    assert kernels is not None, "the native kernel did not build (see the log)"
    return kernels


def test_the_native_kernel_against_torch_is_measured_once_and_the_backend_follows_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bf16: the kernel's bf16 twin is timed against torch's paths once per machine and shape and the
    stored answer is every later call's, and the backend's (kernels_for); float32 always takes the
    kernel untimed; fp16 never (the kernel cannot read it)."""
    from transformers import LlamaConfig

    from batchgen.engine.cpu.backend import kernels_for

    kernels = _kernels()  # why first: built (or found) in the machine's cache, not rebuilt in the temporary one
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path))
    assert decode_layout.native_wins(torch.float32, 2, 2, 16, kernels) is True
    assert decode_layout.native_wins(torch.float16, 2, 2, 16, kernels) is False
    assert not (tmp_path / "kernels" / "decode-native").exists()  # nothing timed, nothing stored
    choice = decode_layout.native_wins(torch.bfloat16, 2, 2, 16, kernels)
    (stored,) = (tmp_path / "kernels" / "decode-native").iterdir()
    record = json.loads(stored.read_text())
    assert record["native"] is choice and min(record["native_s"], record["batched_s"], record["sdpa_s"]) > 0
    config = LlamaConfig(num_attention_heads=4, num_key_value_heads=2, hidden_size=64)  # KVH 2, G 2, D 16
    for wins in (True, False):  # as if another process had measured first
        stored.write_text(json.dumps({**record, "native": wins}))
        assert decode_layout.native_wins(torch.bfloat16, 2, 2, 16, kernels) is wins
        assert (kernels_for(config, 2, 16, torch.bfloat16) is kernels) is wins
    assert kernels_for(config, 2, 16, torch.float32) is kernels
