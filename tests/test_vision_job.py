"""jobs/vision.yaml end to end through the CLI, on the committed sample_data/vision (drawn images, a
byte-identical copy, a truncated PNG, the tiny LLaVA): every row answered or failed alone, usage
counting the image tokens the model saw (as transformers' processor makes the prompt, and as
`estimate` predicted), a repeated image served from the prefix cache."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pyarrow.parquet as pq
from click.testing import CliRunner

from batchgen.cli import main
from tests.conftest import output_table

REPO = Path(__file__).resolve().parents[1]
SAMPLE = REPO / "sample_data" / "vision"


def _script() -> object:
    spec = importlib.util.spec_from_file_location("make_vision_sample", REPO / "scripts" / "make_vision_sample.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_committed_sample_is_what_the_script_makes(tmp_path: Path) -> None:
    _script().make_sample(tmp_path, with_model=False)  # type: ignore[attr-defined]
    for image in (SAMPLE / "images").iterdir():
        assert (tmp_path / "images" / image.name).read_bytes() == image.read_bytes(), image.name
    assert pq.read_table(tmp_path / "questions.parquet").equals(pq.read_table(SAMPLE / "questions.parquet"))


def test_the_vision_job_runs_with_image_tokens_in_usage(tmp_path: Path) -> None:
    from transformers import AutoProcessor

    out = tmp_path / "vision"
    job = str(REPO / "jobs" / "vision.yaml")
    result = CliRunner().invoke(main, ["run", job, "--quiet", "--set", f"output.path={out}"])
    assert result.exit_code == 0, result.output
    assert "20 rows ok, 1 failed" in result.output
    rows = output_table(out).to_pylist()
    assert len(rows) == 21
    broken = [r for r in rows if r["image"].endswith("broken.png")]
    assert [r["error_code"] for r in broken] == ["invalid_image"]
    message = broken[0]["error_message"]
    assert "questions.parquet row 20 (id q020): image 0 (" in message and "broken.png): cannot decode" in message
    assert broken[0]["input_tokens"] == 0
    # the prompt the model saw, made by transformers' own processor from the decoded pixels
    from PIL import Image

    processor = AutoProcessor.from_pretrained(SAMPLE / "tiny-llava")
    for r in rows:
        if r["error_code"] is not None:
            continue
        parts = [{"type": "image"}, {"type": "text", "text": r["question"]}]
        text = processor.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True)
        image = Image.open(SAMPLE / r["image"]).convert("RGB")
        ids = processor(text=[text], images=[image], add_special_tokens=False)["input_ids"][0]
        assert r["input_tokens"] == len(ids), r["id"]
        assert r["finish_reason"] in ("stop", "length") and r["output_tokens"] > 0
    # red_square.png and its byte-identical copy: one image, its blocks computed once
    red = [r for r in rows if "red_square" in r["image"]]
    assert len(red) == 8 and sum(r["cached_tokens"] for r in red) >= 7 * 16
    manifest = json.loads((out / "_SUCCESS").read_text())
    assert manifest["tokens"]["input"] == sum(r["input_tokens"] for r in rows)
    estimate = CliRunner().invoke(main, ["estimate", job, "--json", "--set", f"output.path={tmp_path / 'e'}"])
    assert estimate.exit_code == 0, estimate.output
    # (the truncated PNG's header reads, so estimate counts its row; its pixels fail only in the engine)
    same_question = next(r for r in rows if r["id"] == "q000")  # red_square.png, the same question
    expected = manifest["tokens"]["input"] + same_question["input_tokens"]
    predicted = json.loads(estimate.stdout)
    assert predicted["input_tokens"]["total"] == expected
    # the same cache hits as the run: image content in the blocks' keys (one block per repeated image)
    assert predicted["prefix_cache"]["cached_tokens"] == manifest["tokens"]["cached"] == 16 * 16


def test_images_on_an_object_store(tmp_path: Path) -> None:
    """An input Parquet on a bucket whose image cells are paths relative to it and s3:// URIs: read
    through the storage layer with the input's storage_options; a missing object is that row's error."""
    import pyarrow as pa

    from tests.conftest import write_job
    from tests.s3_server import moto_s3, options
    from tests.test_vision_rows import image_job

    with moto_s3() as s3:
        fs = s3["fs"]
        for name in ("red_square.png", "sunset.jpg"):
            with fs.open_output_stream(f"inputs/job/pics/{name}") as f:
                f.write((SAMPLE / "images" / name).read_bytes())
        table = pa.table(
            {
                "q": ["w10 w11", "w10 w11", "w10 w11"],
                "img": ["pics/red_square.png", "s3://inputs/job/pics/sunset.jpg", "pics/gone.png"],
            }
        )
        with fs.open_output_stream("inputs/job/in.parquet") as f:
            pq.write_table(table, f)
        job = image_job(tmp_path, SAMPLE / "tiny-llava")
        job["input"].update(path="s3://inputs/job/in.parquet", storage_options=options(s3))  # type: ignore[attr-defined]
        job["output"] = {"path": str(tmp_path / "out")}
        result = CliRunner().invoke(main, ["run", str(write_job(tmp_path / "job.yaml", job)), "--quiet"])
        assert result.exit_code == 0, result.output
    rows = output_table(tmp_path / "out").to_pylist()
    assert [r["error_code"] for r in rows] == [None, None, "invalid_image"]
    assert rows[0]["input_tokens"] == rows[1]["input_tokens"] > 16  # 16 image tokens and the text
    assert "image 0 (s3://inputs/job/pics/gone.png): cannot be read" in rows[2]["error_message"]


def test_a_qwen2_vl_job_bills_each_images_own_token_count(tmp_path: Path) -> None:
    """Qwen2-VL's tokens follow each image's size (an 8x8-pixel patch group a token): the run bills
    what estimate predicted, row by row different, and a row of two images counts both."""
    import io

    import pyarrow as pa

    from testkit.tiny_vision import sample_image, save_tiny_vlm
    from tests.conftest import write_job
    from tests.test_vision_rows import image_job

    def png(w: int, h: int) -> bytes:
        out = io.BytesIO()
        sample_image(w, h).save(out, format="PNG")
        return out.getvalue()

    model = save_tiny_vlm("qwen2_vl", tmp_path / "qwen")
    images = [[png(64, 64)], [png(16, 16)], [png(32, 48), png(64, 16)]]
    pq.write_table(pa.table({"q": ["w5 w6"] * 3, "img": images}), tmp_path / "in.parquet")
    job = write_job(tmp_path / "job.yaml", {**image_job(tmp_path, model), "engine": {"window_rows": 2}})
    result = CliRunner().invoke(main, ["run", str(job), "--quiet"])
    assert result.exit_code == 0, result.output
    rows = output_table(tmp_path / "out").to_pylist()
    text = rows[1]["input_tokens"] - 4  # a 16x16 image is the fewest tokens: 4
    assert [r["input_tokens"] - text for r in rows] == [64, 4, 24 + 16 + 2]  # (+ a 2nd vision_start/end)
    estimate = CliRunner().invoke(main, ["estimate", str(job), "--json"])
    assert json.loads(estimate.stdout)["input_tokens"]["total"] == sum(r["input_tokens"] for r in rows)
