"""`dtype: auto` on the CPU follows the checkpoint where the CPU computes bf16 natively (dtype_rule):
the CPU's flags are stated through BATCHGEN_CPU_FLAGS (the operators' override of /proc/cpuinfo),
so both kinds of host are tested on this one; the checkpoint's dtype is read from its config.json,
else its safetensors header."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from batchgen import LLM
from batchgen.engine.api import dtype_rule
from batchgen.engine.runner.models import resolve_dtype
from testkit.tiny_models import save_random_model, tiny_configs

NATIVE = "fpu avx2 fma avx512f avx512_bf16"  # a Zen 4 / Sapphire Rapids host
AMX = "avx2 amx_tile amx_bf16"
AVX2 = "fpu avx2 fma"  # a host that emulates bf16
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def stored(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny llama saved in float32, bfloat16 and float16."""
    dtypes = {"float32": None, "bfloat16": torch.bfloat16, "float16": torch.float16}
    config = tiny_configs()["llama"]
    return {
        name: save_random_model(config, tmp_path_factory.mktemp(f"llama-{name}"), dtype=d) for name, d in dtypes.items()
    }


@pytest.mark.parametrize(
    ("flags", "checkpoint", "expected"),
    [
        (NATIVE, "bfloat16", torch.bfloat16),
        (AMX, "bfloat16", torch.bfloat16),
        (NATIVE, "float16", torch.bfloat16),
        (NATIVE, "float32", torch.float32),
        (AVX2, "bfloat16", torch.float32),
        (AVX2, "float32", torch.float32),
    ],
)
def test_auto_on_the_cpu_follows_the_checkpoint_where_bf16_is_native(
    flags: str, checkpoint: str, expected: torch.dtype, stored: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(dtype_rule.FLAGS_ENV, flags)
    assert resolve_dtype("auto", CPU, str(stored[checkpoint])) == expected
    assert resolve_dtype("float32", CPU, str(stored[checkpoint])) == torch.float32  # an explicit dtype is kept


def test_the_reason_names_the_checkpoint_and_the_flags(
    stored: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(dtype_rule.FLAGS_ENV, NATIVE)
    choice = dtype_rule.resolve_auto("cpu", stored["bfloat16"])
    assert choice.line("auto") == (
        "dtype auto -> bfloat16 (checkpoint stored in bfloat16 (config.json dtype) and native bf16 on this CPU: "
        f"avx512_bf16 in {dtype_rule.FLAGS_ENV})"
    )
    monkeypatch.setenv(dtype_rule.FLAGS_ENV, AVX2)
    assert "no amx_bf16 or avx512_bf16" in dtype_rule.resolve_auto("cpu", stored["bfloat16"]).why


def test_without_a_dtype_in_the_config_the_safetensors_header_says(
    stored: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(dtype_rule.FLAGS_ENV, NATIVE)
    for name in ("bfloat16", "float32"):
        folder = tmp_path / name
        folder.mkdir()
        for f in stored[name].iterdir():
            (folder / f.name).write_bytes(f.read_bytes())
        config = json.loads((folder / "config.json").read_text())
        config.pop("dtype", None), config.pop("torch_dtype", None)
        (folder / "config.json").write_text(json.dumps(config))
        assert dtype_rule.checkpoint_dtype(folder) == (name, "model.safetensors header")
        assert resolve_dtype("auto", CPU, str(folder)) == getattr(torch, name)


def test_cuda_auto_is_unchanged() -> None:
    assert dtype_rule.resolve_auto("cuda", None, cuda_bf16=True).dtype == "bfloat16"
    assert dtype_rule.resolve_auto("cuda", None, cuda_bf16=False).dtype == "float16"
    # other devices, and a CPU without a checkpoint to read: float32 (exactness)
    assert resolve_dtype("auto", torch.device("mps")) == resolve_dtype("auto", CPU) == torch.float32


def test_the_engine_and_its_pooling_tasks_load_and_cache_in_bf16(
    stored: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(dtype_rule.FLAGS_ENV, NATIVE)
    llm = LLM(str(stored["bfloat16"]), device="cpu", max_num_seqs=4, compile=False)
    assert llm.llm_engine.model_config.dtype == torch.bfloat16
    kv = llm.engine.runner.kv_caches[0][0]  # the pool holds twice the tokens of a float32 one
    assert kv.dtype == torch.bfloat16
    embed = LLM(str(stored["bfloat16"]), device="cpu", task="embed")
    assert embed.llm_engine.model_config.dtype == torch.bfloat16
    monkeypatch.setenv(dtype_rule.FLAGS_ENV, AVX2)
    assert LLM(str(stored["bfloat16"]), device="cpu", task="embed").llm_engine.model_config.dtype == torch.float32


def test_doctor_says_what_auto_resolves_to(monkeypatch: pytest.MonkeyPatch) -> None:
    from batchgen import doctor

    monkeypatch.setenv(dtype_rule.FLAGS_ENV, NATIVE)
    facts = doctor.report()
    assert facts["dtype_auto"].startswith("CPU: bfloat16 for checkpoints stored in bf16/fp16")
    assert any(line.startswith("dtype auto    CPU: bfloat16") for line in doctor.lines(facts))
    monkeypatch.setenv(dtype_rule.FLAGS_ENV, AVX2)
    assert doctor.report()["dtype_auto"].startswith("CPU: float32 (no amx_bf16 or avx512_bf16")
