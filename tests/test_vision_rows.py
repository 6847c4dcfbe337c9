"""An image job's rows before the engine (batchgen/inputs/vision_rows, run/image_checks): the prompt
the job counts is the one transformers' processor makes, the prefix key covers the image's content,
and every bad job file or bad image is refused before any work or made an error row."""

from __future__ import annotations

import os
from collections.abc import Callable
from io import BytesIO
from pathlib import Path

import pyarrow as pa
import pytest
from click.testing import CliRunner

from batchgen.cli import main
from batchgen.inputs.grouping import prompt_key
from batchgen.inputs.prepare import RowPreparer
from batchgen.job.spec import JobSpec, load_job
from testkit.tiny_vision import sample_image, save_tiny_vlm
from tests.conftest import write_job, write_parquet


@pytest.fixture(scope="module")
def tiny_vlm(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    built: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in built:
            built[family] = save_tiny_vlm(family, tmp_path_factory.mktemp(f"vlm-{family}"))
        return built[family]

    return get


def png(width: int, height: int, seed: int = 0) -> bytes:
    out = BytesIO()
    sample_image(width, height, seed).save(out, format="PNG")
    return out.getvalue()


def image_job(tmp_path: Path, model: Path, **input_keys: object) -> dict[str, object]:
    return {
        "model": {"path": str(model)},
        "input": {"path": str(tmp_path / "in.parquet"), "prompt_column": "q", "image_column": "img", **input_keys},
        "output": {"path": str(tmp_path / "out")},
        "sampling": {"max_tokens": 4},
    }


def spec_of(tmp_path: Path, model: Path, **input_keys: object) -> JobSpec:
    return load_job(write_job(tmp_path / "job.yaml", image_job(tmp_path, model, **input_keys)))


def prepared(spec: JobSpec, table: pa.Table) -> list:
    preparer = RowPreparer(spec, None, 4096)
    return preparer.prepare(table, [f"row {i}" for i in range(table.num_rows)], [str(i) for i in range(table.num_rows)])


@pytest.mark.parametrize("family", ["llava", "qwen2_vl"])
def test_the_prompt_is_the_processors(tmp_path: Path, tiny_vlm: Callable[[str], Path], family: str) -> None:
    """Expanded from the header alone, the ids equal what transformers' processor makes from the
    decoded pixels: the job counts exactly the tokens the model sees."""
    from transformers import AutoImageProcessor

    from batchgen.engine.vision.processor import load_vision_processor

    model = tiny_vlm(family)
    sizes = [(40, 24), (64, 64)]
    table = pa.table({"q": ["w5 w6 w7"], "img": [[png(w, h, k) for k, (w, h) in enumerate(sizes)]]})
    (row,) = prepared(spec_of(tmp_path, model), table)
    assert row.ok, row.error_message
    vp = load_vision_processor(model)
    if family == "llava":
        from transformers import AutoProcessor

        processor = AutoProcessor.from_pretrained(model)
        messages = [
            {"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "w5 w6 w7"}]}
        ]
        text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        images = [sample_image(w, h, k) for k, (w, h) in enumerate(sizes)]
        expected = list(processor(text=[text], images=images)["input_ids"][0])
    else:  # (transformers' Qwen2-VL processor needs torchvision): its grid, from the pixels, per image
        grids = AutoImageProcessor.from_pretrained(model)(
            images=[sample_image(w, h, k) for k, (w, h) in enumerate(sizes)]
        )
        counts = [int(g.prod()) // 4 for g in grids["image_grid_thw"]]
        assert [c for _, c in row.image_positions] == counts
        expected = []
        for t in row.placeholder_ids:
            expected += [t] * (counts.pop(0) if t == vp.image_token_id else 1)
    assert row.prompt_ids == expected
    assert [row.prompt_ids[s : s + c] == [vp.image_token_id] * c for s, c in row.image_positions] == [True, True]
    assert row.placeholder_ids.count(vp.image_token_id) == 2


def test_the_prefix_key_covers_the_image(tmp_path: Path, tiny_vlm: Callable[[str], Path]) -> None:
    """Same image bytes and text: one key; another image with the same text: another key, even
    with the same size (the content hash is in the blocks the image covers)."""
    a, b = png(32, 32, 1), png(32, 32, 2)
    table = pa.table({"q": ["w5 w6", "w5 w6", "w5 w6"], "img": [a, a, b]})
    rows = prepared(spec_of(tmp_path, tiny_vlm("llava")), table)
    assert rows[0].prompt_ids == rows[2].prompt_ids  # same tokens: only the image tells them apart
    keys = [prompt_key(r.prompt_ids, 4, extras=r.extras()) for r in rows]
    assert keys[0] == keys[1] != keys[2]
    assert prompt_key(rows[0].prompt_ids, 4) == prompt_key(rows[2].prompt_ids, 4)  # (without the images)


def test_bad_images_are_error_rows(tmp_path: Path, tiny_vlm: Callable[[str], Path]) -> None:
    good = png(16, 16)
    (tmp_path / "ok.png").write_bytes(good)
    (tmp_path / "big.png").write_bytes(png(20, 20))
    table = pa.table(
        {
            "q": ["w5", "w5", "w5", "w5", "<image> w5"],
            "img": ["ok.png", "gone.png", "big.png", None, "ok.png"],
        }
    )
    from batchgen.inputs.image_cells import Folder

    spec = spec_of(tmp_path, tiny_vlm("llava"), max_image_pixels=300)
    preparer = RowPreparer(spec, None, 4096)
    labels = [f"in.parquet row {i}" for i in range(5)]
    rows = preparer.prepare(table, labels, labels, [Folder(str(tmp_path))] * 5)
    codes = [None, "invalid_image", "image_too_large", "missing_image", "invalid_image"]
    assert [r.error_code for r in rows] == codes
    assert rows[1].error_message.startswith("in.parquet row 1: column 'img': image 0 (")
    assert "gone.png" in rows[1].error_message
    assert "20x20 = 400 pixels, above input.max_image_pixels (300)" in rows[2].error_message
    assert rows[0].images[0].path == str(tmp_path / "ok.png") and rows[0].placeholder_ids is not None
    assert "2 image placeholder(s) for 1 image(s)" in rows[4].error_message


def _cli(job: Path, *command: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, [*command, str(job)])
    return result.exit_code, result.output


def test_bad_image_jobs_fail_before_any_work(
    tmp_path: Path, tiny_vlm: Callable[[str], Path], tiny_model_dir: Path
) -> None:
    write_parquet(tmp_path / "in.parquet", {"q": ["w5"], "img": [png(8, 8)], "n": [3]})
    vlm = tiny_vlm("llava")
    cases = [
        (image_job(tmp_path, vlm, image_column="picture"), 3, "no column 'picture' (input.image_column)"),
        (image_job(tmp_path, vlm, image_column="n"), 3, "(input.image_column) is int64; it must hold image bytes"),
        (image_job(tmp_path, tiny_model_dir), 2, "input.image_column needs a vision-language model"),
        (image_job(tmp_path, vlm, max_image_pixels=0), 2, "input.max_image_pixels"),
        (image_job(tmp_path, vlm, max_image_pixels="1000"), 2, "input.max_image_pixels"),
        ({**image_job(tmp_path, vlm), "engine": {"backend": "hf"}}, 2, "engine.backend hf does not read images"),
        ({**image_job(tmp_path, vlm), "task": "embed", "sampling": {}}, 2, "images are for task generate"),
    ]
    for i, (job, code, words) in enumerate(cases):
        got, text = _cli(write_job(tmp_path / f"job{i}.yaml", job), "run")
        assert (got, words in text) == (code, True), (i, text)
    assert not (tmp_path / "out").exists()


def test_estimate_counts_image_tokens_without_weights(tmp_path: Path, tiny_vlm: Callable[[str], Path]) -> None:
    """Qwen2-VL: tokens per image follow its size (8x8 pixels a token, at least 4)."""
    from batchgen.usage.estimate import estimate_job

    write_parquet(tmp_path / "in.parquet", {"q": ["w5 w6", "w5 w6"], "img": [png(64, 64), png(16, 16)]})
    spec = spec_of(tmp_path, tiny_vlm("qwen2_vl"))
    est = estimate_job(spec)
    rows = prepared(spec, pa.table({"q": ["w5 w6"] * 2, "img": [png(64, 64), png(16, 16)]}))
    assert [c for r in rows for _, c in r.image_positions] == [64, 4]
    assert est.input_tokens == sum(len(r.prompt_ids) for r in rows)
    assert est.ok_rows == 2


def test_messages_take_openai_image_parts(tmp_path: Path, tiny_vlm: Callable[[str], Path]) -> None:
    """A messages column's image_url parts (data URL, relative path) and image parts (bytes) give the
    prompt an image column gives for the same user turn; text-only messages still work."""
    import base64

    from batchgen.inputs.image_cells import Folder

    model = tiny_vlm("qwen2_vl")
    a, b = png(40, 24, 1), png(16, 48, 2)
    (tmp_path / "b.png").write_bytes(b)
    url = "data:image/png;base64," + base64.b64encode(a).decode()

    def turn(*parts: dict[str, object]) -> list[dict[str, object]]:
        return [{"role": "user", "content": list(parts)}]

    text = {"type": "text", "text": "w5 w6"}
    messages = [
        turn({"type": "image_url", "image_url": {"url": url}}, {"type": "image", "image": {"path": "b.png"}}, text),
        turn({"type": "image", "image": {"bytes": a}}, {"type": "image_url", "image_url": {"url": "b.png"}}, text),
        turn(text),
        turn({"type": "image_url", "image_url": {"url": "nowhere.png"}}, text),
        turn({"type": "audio", "text": "x"}),
    ]
    job = image_job(tmp_path, model)
    job["input"] = {"path": str(tmp_path / "in.parquet"), "messages_column": "messages"}
    spec = load_job(write_job(tmp_path / "chat.yaml", job))
    part = pa.struct(
        [
            ("type", pa.string()),
            ("text", pa.string()),
            ("image_url", pa.struct([("url", pa.string())])),
            ("image", pa.struct([("bytes", pa.binary()), ("path", pa.string())])),
        ]
    )
    message = pa.struct([("role", pa.string()), ("content", pa.list_(part))])
    table = pa.table({"messages": pa.array(messages, pa.list_(message))})
    labels = [f"row {i}" for i in range(len(messages))]
    rows = RowPreparer(spec, None, 4096).prepare(table, labels, labels, [Folder(str(tmp_path))] * len(messages))
    column_rows = prepared(spec_of(tmp_path, model), pa.table({"q": ["w5 w6"], "img": [[a, b]]}))
    assert rows[0].ok and rows[1].ok and rows[2].ok, [r.error_message for r in rows]
    assert rows[0].prompt_ids == rows[1].prompt_ids == column_rows[0].prompt_ids
    assert [i.content_hash for i in rows[0].images] == [i.content_hash for i in column_rows[0].images]
    assert not rows[2].images and len(rows[2].prompt_ids) < len(rows[0].prompt_ids)
    assert rows[3].error_code == "invalid_image" and "nowhere.png" in rows[3].error_message
    assert rows[4].error_code == "invalid_messages" and "message 0, part 0" in rows[4].error_message


def test_openai_batch_chat_requests_take_image_url_parts(
    tmp_path: Path, tiny_vlm: Callable[[str], Path], tiny_model_dir: Path
) -> None:
    """An OpenAI batch file's chat request with image_url parts is counted as the same user turn
    from an image column; for a text-only model it is that row's error, never the job's."""
    import base64
    import json

    from batchgen.usage.estimate import estimate_job

    a = png(40, 24, 1)
    (tmp_path / "a.png").write_bytes(a)
    url = "data:image/png;base64," + base64.b64encode(a).decode()

    def request(custom_id: str, image: str) -> str:
        parts = [{"type": "image_url", "image_url": {"url": image, "detail": "low"}}, {"type": "text", "text": "w5 w6"}]
        body = {"messages": [{"role": "user", "content": parts}], "max_tokens": 3}
        return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body})

    lines = [request("r0", url), request("r1", "a.png"), request("r2", "missing.png")]
    (tmp_path / "requests.jsonl").write_text("\n".join(lines) + "\n")
    model = tiny_vlm("qwen2_vl")
    job = image_job(tmp_path, model)
    job["input"] = {"path": str(tmp_path / "requests.jsonl"), "format": "openai_batch"}
    est = estimate_job(load_job(write_job(tmp_path / "batch.yaml", job)))
    (column_row,) = prepared(spec_of(tmp_path, model), pa.table({"q": ["w5 w6"], "img": [a]}))
    assert (est.ok_rows, est.input_tokens) == (2, 2 * len(column_row.prompt_ids))
    assert est.error_codes == {"invalid_image": 1}
    job["model"] = {"path": str(tiny_model_dir)}
    est = estimate_job(load_job(write_job(tmp_path / "text.yaml", job)))
    assert est.error_codes == {"invalid_messages": 3}
    assert "content parts (images) are read for a vision-language model only" in est.error_examples[0]


def test_a_datasets_image_feature_is_read_as_written(tmp_path: Path, tiny_vlm: Callable[[str], Path]) -> None:
    """`datasets`' Image feature (a {bytes, path} struct; a list of them with Sequence(Image())),
    from a saved dataset folder and from its Parquet export: the same prompts as raw bytes."""
    import datasets

    from batchgen.usage.estimate import estimate_job

    a, b = png(40, 24, 1), png(16, 48, 2)
    (tmp_path / "b.png").write_bytes(b)
    features = datasets.Features({"q": datasets.Value("string"), "img": datasets.Sequence(datasets.Image())})
    data = datasets.Dataset.from_dict({"q": ["w5", "w6"], "img": [[a], [str(tmp_path / "b.png"), a]]}, features)
    data.save_to_disk(str(tmp_path / "saved"))
    data.to_parquet(str(tmp_path / "in.parquet"))
    model = tiny_vlm("qwen2_vl")
    reference = prepared(spec_of(tmp_path, model), pa.table({"q": ["w5", "w6"], "img": [[a], [b, a]]}))
    expected = sum(len(r.prompt_ids) for r in reference)
    for where in ("saved", "in.parquet"):
        job = image_job(tmp_path, model)
        job["input"]["path"] = str(tmp_path / where)  # type: ignore[index]
        est = estimate_job(load_job(write_job(tmp_path / f"{where}.yaml", job)))
        assert (est.ok_rows, est.input_tokens) == (2, expected), where


def test_the_engine_is_handed_no_pixels_and_no_open_file(tmp_path: Path, tiny_vlm: Callable[[str], Path]) -> None:
    """A row's images reach the engine as LazyImages: size and hash, no pixels; a local file is
    kept as its path (no bytes, no handle), bytes in a cell as those bytes. 300 rows naming 300
    files open no file: /proc/self/fd counts the same before and after preparing them."""
    from batchgen.engine.vision.images import LazyImage

    for i in range(300):
        (tmp_path / f"p{i}.png").write_bytes(png(8 + i % 7, 8))
    fds = len(os.listdir("/proc/self/fd"))
    spec = spec_of(tmp_path, tiny_vlm("llava"))
    rows = prepared(spec, pa.table({"q": ["w5"] * 300, "img": [str(tmp_path / f"p{i}.png") for i in range(300)]}))
    prompts = [row.engine_prompt() for row in rows]
    assert len(os.listdir("/proc/self/fd")) == fds
    (row,) = prepared(spec, pa.table({"q": ["w5"], "img": [png(32, 32)]}))
    first, last = prompts[0]["multi_modal_data"]["image"][0], row.engine_prompt()["multi_modal_data"]["image"][0]  # type: ignore[index]
    assert isinstance(first, LazyImage) and first.path == str(tmp_path / "p0.png") and first.data == b""
    assert isinstance(last, LazyImage) and last.path == "" and (last.width, last.height) == (32, 32)
    assert rows[0].images is not None and rows[0].images[0].data == b""  # the row keeps no bytes either
    assert first.decode().size == (8, 8) and len(os.listdir("/proc/self/fd")) == fds  # decoded: closed again


def test_a_model_without_a_chat_template_gets_its_placeholders_then_the_text(
    tmp_path: Path, tiny_vlm: Callable[[str], Path]
) -> None:
    """As transformers' processor makes "<image>\\n<text>" for such a model (special tokens added)."""
    import json
    import shutil

    from transformers import AutoProcessor

    model = tmp_path / "plain-llava"
    shutil.copytree(tiny_vlm("llava"), model)
    (model / "chat_template.jinja").unlink()
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    (row,) = prepared(spec_of(tmp_path, model), pa.table({"q": ["w5 w6"], "img": [png(30, 30)]}))
    processor = AutoProcessor.from_pretrained(model)
    assert not processor.chat_template
    expected = processor(text=["<image>\nw5 w6"], images=[sample_image(30, 30)])["input_ids"][0]
    assert row.prompt_ids == list(expected)


def test_the_estimates_cache_replay_tells_images_apart(tmp_path: Path, tiny_vlm: Callable[[str], Path]) -> None:
    """Two images of one size have the same token ids: only their content keeps their blocks apart."""
    from batchgen.usage.estimate import prefix_cache_hits

    a, b = png(32, 32, 1), png(32, 32, 2)
    rows = prepared(spec_of(tmp_path, tiny_vlm("llava")), pa.table({"q": ["w5 w6"] * 3, "img": [a, b, a]}))
    prompts, extras = [r.prompt_ids for r in rows], [r.extras() for r in rows]
    assert prefix_cache_hits(prompts, 4, None, extras) == (len(prompts[0]) - 1) // 4 * 4  # the third: all of a
    assert prefix_cache_hits(prompts[:2], 4, None, extras[:2]) == 0
    assert prefix_cache_hits(prompts[:2], 4) > 0  # (the ids alone would share)


@pytest.mark.parametrize("family", ["llava", "llava_next", "gemma3", "qwen2_vl", "qwen2_5_vl"])
def test_the_jobs_expansion_is_the_engines(tmp_path: Path, tiny_vlm: Callable[[str], Path], family: str) -> None:
    """The job counts (input_tokens, estimate, keys) the prompt the engine builds at add time:
    engine/vision/prompts.expand_images over the same placeholder ids and images."""
    from batchgen.engine.vision.images import RequestImage
    from batchgen.engine.vision.prompts import expand_images

    sizes = [(40, 24), (64, 64), (17, 90)]
    table = pa.table({"q": ["w5 w6 w7"], "img": [[png(w, h, k) for k, (w, h) in enumerate(sizes)]]})
    preparer = RowPreparer(spec_of(tmp_path, tiny_vlm(family)), None, 1 << 20)
    (row,) = preparer.prepare(table, ["row 0"], ["0"])
    assert row.ok, row.error_message
    images = [RequestImage(k, None, i.width, i.height, i.content_hash) for k, i in enumerate(row.images)]
    engine = expand_images(preparer.vision.processor, row.placeholder_ids, images, "row 0")
    assert row.prompt_ids == engine.token_ids
    assert row.extras().image_positions == engine.extras.image_positions
    assert row.extras().image_hashes == engine.extras.image_hashes


def test_a_long_conversations_key_keeps_its_images(tmp_path: Path, tiny_vlm: Callable[[str], Path]) -> None:
    """The key pass cuts a long prompt's text; a conversation's image placeholders after the cut
    must not go with it (the row would key as no request, and never group)."""
    job = image_job(tmp_path, tiny_vlm("llava"))
    job["input"] = {"path": str(tmp_path / "in.parquet"), "messages_column": "messages"}
    spec = load_job(write_job(tmp_path / "chat.yaml", job))
    parts = [{"type": "text", "text": "w5 " * 40}, {"type": "image", "image": {"bytes": png(8, 8), "path": None}}]
    table = pa.table({"messages": [[{"role": "user", "content": parts}]]})
    ((ids, cut, row),) = RowPreparer(spec, None, 4096).prompt_ids(table, 50)
    assert ids is not None and not cut and len(row.images) == 1
