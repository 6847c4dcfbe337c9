"""Images with a LoRA adapter: refused by name, before any weights are read (LLM(enable_lora=True)
on a vision-language model) or any work (a job's model.lora with one, exit 2), never a crash deep
in the adapter checks; and the block hash keeps an adapter and an image apart and together."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from batchgen.cli import main
from batchgen.engine.core.block_hash import block_extra_key
from batchgen.engine.core.sequence import RequestExtras
from batchgen.engine.llm import LLM
from batchgen.engine.runner.model_limits import UnsupportedModelError
from testkit.tiny_vision import save_tiny_vlm
from tests.conftest import write_job, write_parquet


@pytest.fixture(scope="module")
def llava(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_vlm("llava", tmp_path_factory.mktemp("vlm-llava"))


def vlm_adapter(model: Path, path: Path) -> Path:
    """A peft adapter on the VLM's language model (q_proj, v_proj), as a user would train one."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(0)
    vlm = AutoModelForImageTextToText.from_pretrained(model, dtype=torch.float32)
    peft_model = get_peft_model(
        vlm, LoraConfig(r=4, lora_alpha=8, target_modules=r".*language_model.*\.(q_proj|v_proj)")
    )
    peft_model.save_pretrained(str(path))
    return path


def test_the_engine_refuses_lora_on_a_vlm_by_name(llava: Path) -> None:
    with pytest.raises(UnsupportedModelError, match=r"model_type 'llava': a LoRA adapter \(enable_lora\) on a vision"):
        LLM(str(llava), device="cpu", enable_lora=True)


def test_a_job_with_model_lora_on_a_vlm_fails_before_any_work(tmp_path: Path, llava: Path) -> None:
    model = llava
    adapter = vlm_adapter(model, tmp_path / "adapter")
    write_parquet(tmp_path / "q.parquet", {"id": ["a"], "q": ["w5"], "img": ["x.png"], "lora": ["captions"]})
    job = {
        "model": {"path": str(model), "lora": {"captions": str(adapter)}},
        "input": {
            "path": str(tmp_path / "q.parquet"),
            "prompt_column": "q",
            "image_column": "img",
            "id_column": "id",
            "lora_column": "lora",
        },
        "output": {"path": str(tmp_path / "out")},
        "engine": {"backend": "native"},
    }
    result = CliRunner().invoke(main, ["run", str(write_job(tmp_path / "job.yaml", job)), "--quiet"])
    assert result.exit_code == 2, result.output + repr(result.exception)
    assert "model.lora: LoRA adapters are not served on a vision-language model" in result.output
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").glob("part-*"))


def test_the_block_key_holds_an_adapter_and_an_image_together() -> None:
    image = RequestExtras(image_hashes=(b"i" * 16,), image_positions=((2, 4),))
    adapter = RequestExtras(adapter_hash=b"a" * 16)
    both = RequestExtras(adapter_hash=b"a" * 16, image_hashes=(b"i" * 16,), image_positions=((2, 4),))
    keys = {block_extra_key(x, 0, 4) for x in (image, adapter, both)}
    assert len(keys) == 3 and all(keys)
    assert block_extra_key(both, 8, 12) == block_extra_key(adapter, 8, 12)  # past the image: the adapter alone
