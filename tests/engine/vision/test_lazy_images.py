"""Images named by a path hold no open file while their requests wait: chat()'s local image_url
parts and a caller's PIL images opened from files reach the engine as LazyImages (a path, a size,
a content hash), decoded, and their file opened, only in the step that first reaches their tokens."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from batchgen import LLM, SamplingParams
from batchgen.engine.api.outputs import RequestOutput
from batchgen.engine.vision.images import LazyImage, request_images
from testkit.tiny_vision import sample_image

N = 60


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def files(tmp_path: Path) -> list[Path]:
    paths = []
    for i in range(N):
        path = tmp_path / f"img{i}.{'png' if i % 2 else 'jpg'}"
        sample_image(20 + i % 9, 16 + i % 5, i).save(path)
        paths.append(path)
    return paths


def test_chat_with_many_path_images_opens_no_file_until_decoded(
    tiny_vlm: Callable[[str], Path], tmp_path: Path
) -> None:
    llm = LLM(str(tiny_vlm("llava")), device="cpu", dtype="float32", block_size=4, max_num_seqs=2)
    paths = files(tmp_path)
    before = open_fds()
    seen: list[int] = []

    def on_output(out: RequestOutput) -> None:
        seen.append(open_fds() - before)  # while the other requests wait

    conversations = [
        [
            {
                "role": "user",
                "content": [{"type": "image_url", "image_url": {"url": str(p)}}, {"type": "text", "text": "w5"}],
            }
        ]
        for p in paths
    ]
    outs = llm.chat(conversations, SamplingParams(max_tokens=2, temperature=0), on_output=on_output)
    assert all(o.error is None for o in outs)
    assert max(seen) <= 2  # not one per waiting image (60)
    # the same answers as the images given decoded, in memory
    decoded = [
        {"prompt": o.prompt, "multi_modal_data": {"image": LazyImage.from_path(p).decode()}}
        for o, p in zip(outs, paths)
    ]
    again = llm.generate(decoded, SamplingParams(max_tokens=2, temperature=0))
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outs]


def test_a_pil_image_opened_from_a_file_is_held_by_its_path(tmp_path: Path) -> None:
    from PIL import Image

    (path,) = files(tmp_path)[:1]
    image = Image.open(path)
    (held,) = request_images([image], "prompt 0")
    assert isinstance(held.image, LazyImage) and held.image.path == str(path)
    image.close()  # the caller's handle may go: the engine reads the file again when it decodes
    assert held.decode().size == image.size
    assert held.content_hash == request_images([LazyImage.from_path(path)], "p")[0].content_hash
