"""Images with a LoRA adapter in a job: a row's adapter and its image ride together (model.lora
and input.lora_column with input.image_column on a vision-language model), and the block key
keeps an adapter and an image apart and together."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from batchgen.cli import main
from batchgen.engine.core.block_hash import block_extra_key
from batchgen.engine.core.sequence import RequestExtras
from testkit.tiny_vision import sample_image, save_tiny_vlm
from tests.conftest import output_table, write_job, write_parquet
from tests.engine.vision.test_lora_images import adapter_and_merged


@pytest.fixture(scope="module")
def llava(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_vlm("llava", tmp_path_factory.mktemp("vlm-llava"))


def test_a_job_runs_rows_of_an_adapter_and_of_the_base_over_images(tmp_path: Path, llava: Path) -> None:
    adapter, _ = adapter_and_merged(llava, tmp_path, r".*language_model.*\.(q_proj|v_proj|down_proj)")
    sample_image(40, 24, 1).save(tmp_path / "a.png")
    rows = {"id": ["base", "tuned"], "q": ["w5 w6", "w5 w6"], "img": ["a.png", "a.png"], "lora": [None, "captions"]}
    write_parquet(tmp_path / "q.parquet", rows)
    job = {
        "model": {"path": str(llava), "lora": {"captions": str(adapter)}},
        "input": {
            "path": str(tmp_path / "q.parquet"),
            "prompt_column": "q",
            "image_column": "img",
            "id_column": "id",
            "lora_column": "lora",
        },
        "output": {"path": str(tmp_path / "out")},
        "sampling": {"max_tokens": 6, "temperature": 0.0},
        "engine": {"backend": "native"},
    }
    result = CliRunner().invoke(main, ["run", str(write_job(tmp_path / "job.yaml", job)), "--quiet"])
    assert result.exit_code == 0, result.output + repr(result.exception)
    table = output_table(tmp_path / "out").to_pylist()
    assert [r["error_code"] for r in table] == [None, None]
    assert table[0]["input_tokens"] == table[1]["input_tokens"] > 16  # the image's tokens counted in both
    assert table[0]["generated_text"] != table[1]["generated_text"]  # the adapter answers otherwise


def test_the_block_key_holds_an_adapter_and_an_image_together() -> None:
    image = RequestExtras(image_hashes=(b"i" * 16,), image_positions=((2, 4),))
    adapter = RequestExtras(adapter_hash=b"a" * 16)
    both = RequestExtras(adapter_hash=b"a" * 16, image_hashes=(b"i" * 16,), image_positions=((2, 4),))
    keys = {block_extra_key(x, 0, 4) for x in (image, adapter, both)}
    assert len(keys) == 3 and all(keys)
    assert block_extra_key(both, 8, 12) == block_extra_key(adapter, 8, 12)  # past the image: the adapter alone
