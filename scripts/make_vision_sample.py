"""Build sample_data/vision/, the input of jobs/vision.yaml: a few Pillow-drawn images of different
sizes and formats (PNG, JPEG), a table of questions about them (several per image, one image used
by two groups of rows, one row whose image file is broken), and the tiny vision-language model the
job runs.

Why a random-weight model: no machine that builds this project can download a VLM, and a model
that answers sensibly is far too big for the repository. The tiny LLaVA of testkit/tiny_vision
(built from its config, saved with its processor, 0.6 MB) exercises every step a real checkpoint
goes through (processor, chat template, placeholder expansion, vision tower, prefix cache), so the
demo shows the job's mechanics, usage and errors; its answers are word salad. Its tokenizer knows
the words "w2".."w254" only, so the questions are written in those words (any other word reads as
<unk>, which works, but would make every question of the same length look alike).

    python scripts/make_vision_sample.py            # writes sample_data/vision/
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image, ImageDraw

REPO = Path(__file__).resolve().parent.parent
# name -> (size, format, background, what is drawn)
IMAGES = {
    "red_square.png": ((64, 64), "PNG", (220, 40, 40), "square"),
    "blue_wide.jpg": ((96, 32), "JPEG", (40, 60, 200), "stripes"),
    "green_tall.png": ((24, 80), "PNG", (30, 160, 60), "circle"),
    "sunset.jpg": ((48, 36), "JPEG", (250, 150, 40), "circle"),
}
COPY = "red_square_copy.png"  # the same bytes as red_square.png under another name: one image, one cache entry
BROKEN = "broken.png"  # the first bytes of a PNG, cut: its header reads, its pixels do not decode
QUESTIONS = ["w10 w11 w12 w13", "w20 w21 w22", "w30 w31 w32 w33 w34", "w40 w41"]


def draw(size: tuple[int, int], background: tuple[int, int, int], shape: str) -> Image.Image:
    """A deterministic picture: a background and one shape (no randomness, so bytes never change)."""
    image = Image.new("RGB", size, background)
    pen = ImageDraw.Draw(image)
    w, h = size
    if shape == "square":
        pen.rectangle([w // 4, h // 4, 3 * w // 4, 3 * h // 4], fill=(255, 255, 255))
    elif shape == "stripes":
        for x in range(0, w, 8):
            pen.line([x, 0, x, h], fill=(255, 255, 0), width=3)
    else:
        r = min(w, h) // 3
        pen.ellipse([w // 2 - r, h // 2 - r, w // 2 + r, h // 2 + r], fill=(255, 255, 255))
    return image


def make_images(folder: Path) -> list[str]:
    """The images under `folder` (and the broken one); their names, relative to `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, (size, fmt, background, shape) in IMAGES.items():
        draw(size, background, shape).save(folder / name, format=fmt)
    whole = (folder / "red_square.png").read_bytes()
    (folder / COPY).write_bytes(whole)
    (folder / BROKEN).write_bytes(whole[: len(whole) // 2])
    return [*IMAGES, COPY, BROKEN]


def make_table(images: list[str], prefix: str = "images/") -> pa.Table:
    """Rows `id`, `image` (a path relative to the table's file) and `question`: every question about
    each image, question by question (so one image's rows lie apart in the input and the prefix plan
    brings them together), then the broken image once."""
    rows = [(name, q) for q in QUESTIONS for name in images if name != BROKEN] + [(BROKEN, QUESTIONS[0])]
    return pa.table(
        {
            "id": [f"q{i:03d}" for i in range(len(rows))],
            "image": [prefix + name for name, _ in rows],
            "question": [q for _, q in rows],
        }
    )


def make_sample(out: Path, with_model: bool = True) -> Path:
    """sample_data/vision (or `out`): images/, questions.parquet and (with_model) tiny-llava/."""
    names = make_images(out / "images")
    pq.write_table(make_table(names), out / "questions.parquet")
    if with_model:
        sys.path.insert(0, str(REPO))
        from testkit.tiny_vision import save_tiny_vlm

        save_tiny_vlm("llava", out / "tiny-llava")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "sample_data" / "vision")
    parser.add_argument("--no-model", action="store_true", help="images and table only")
    args = parser.parse_args()
    make_sample(args.out, with_model=not args.no_model)


if __name__ == "__main__":
    main()
