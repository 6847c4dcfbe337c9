"""An image column's cells (batchgen/inputs/image_cells): every accepted shape reads to the same
bytes, size and content hash, nothing is decoded, and each bad cell is a CellError naming the image."""

from __future__ import annotations

import base64
from io import BytesIO
from pathlib import Path

import pytest
from PIL import Image

from batchgen.inputs.image_cells import CellError, Folder, ImageReader


def png(width: int, height: int, color: tuple[int, int, int] = (200, 30, 30)) -> bytes:
    out = BytesIO()
    Image.new("RGB", (width, height), color).save(out, format="PNG")
    return out.getvalue()


def reader(max_pixels: int | None = None) -> ImageReader:
    return ImageReader(max_pixels, {}, None)


def test_every_cell_shape_reads_the_same_image(tmp_path: Path) -> None:
    data = png(30, 20)
    (tmp_path / "pics").mkdir()
    (tmp_path / "pics" / "a.png").write_bytes(data)
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    folder = Folder(str(tmp_path))
    shapes = [
        data,  # bytes
        "pics/a.png",  # relative to the input file's folder
        str(tmp_path / "pics" / "a.png"),  # absolute
        f"file://{tmp_path}/pics/a.png",
        url,
        {"bytes": data, "path": "ignored.png"},  # datasets' Image feature: the bytes win
        {"bytes": None, "path": "pics/a.png"},
    ]
    read = [reader().read_cell(cell, folder) for cell in shapes]
    assert all(len(images) == 1 for images in read)
    pixels = [i[0].open().decode().tobytes() for i in read]  # a file kept as its path reads the same
    assert {(p, i[0].width, i[0].height, i[0].content_hash) for p, i in zip(pixels, read)} == {
        (pixels[0], 30, 20, read[0][0].content_hash)
    }
    assert [bool(i[0].path) for i in read] == [False, True, True, True, False, False, True]


def test_a_list_holds_several_images_in_order(tmp_path: Path) -> None:
    a, b = png(8, 8), png(16, 4, (0, 0, 255))
    images = reader().read_cell([a, {"bytes": b, "path": None}], None)
    assert [(i.width, i.height) for i in images] == [(8, 8), (16, 4)]
    assert images[0].content_hash != images[1].content_hash


def test_an_image_is_opened_lazily(tmp_path: Path) -> None:
    image = reader().read_cell(png(12, 9), None)[0]
    handle = image.open().open()  # the engine's LazyImage, then the PIL image it decodes from
    assert handle.size == (12, 9)
    assert handle._im is None  # header read, no pixel decoded yet (Pillow keeps the core image here)
    handle.load()
    assert handle.getpixel((0, 0)) == (200, 30, 30)


@pytest.mark.parametrize(
    ("cell", "code", "words"),
    [
        (b"not an image at all", "invalid_image", "image 0 (bytes): not a readable image"),
        ("missing.png", "invalid_image", "missing.png): cannot be read"),
        ("data:text/plain;base64,aGk=", "invalid_image", "data:image/<type>;base64"),
        ("http://example.com/a.png", "invalid_image", "unsupported URI scheme"),
        (None, "missing_image", "null or empty"),
        ([], "missing_image", "null or empty"),
        ({"bytes": None, "path": None}, "missing_image", "image 0: null"),
    ],
)
def test_a_bad_cell_names_the_image(tmp_path: Path, cell: object, code: str, words: str) -> None:
    with pytest.raises(CellError) as err:
        reader().read_cell(cell, Folder(str(tmp_path)))
    assert err.value.code == code
    assert words in str(err.value)


def test_the_second_image_of_a_list_is_named(tmp_path: Path) -> None:
    with pytest.raises(CellError, match=r"image 1 \(bytes\)"):
        reader().read_cell([png(4, 4), b"\x89PNG broken"], None)


def test_images_above_the_pixel_limit_are_refused() -> None:
    assert reader(max_pixels=600).read_cell(png(30, 20), None)[0].width == 30
    with pytest.raises(CellError) as err:
        reader(max_pixels=599).read_cell(png(30, 20), None)
    assert err.value.code == "image_too_large"
    assert "30x20 = 600 pixels, above input.max_image_pixels (599)" in str(err.value)


def test_the_default_limit_is_pillows_decompression_bomb_guard() -> None:
    assert reader().max_pixels == Image.MAX_IMAGE_PIXELS


def test_one_tables_rows_naming_one_location_share_its_image(tmp_path: Path) -> None:
    """Read, parsed and hashed once per table (forget_locations starts the next): the rows hold one
    copy of the bytes, and an object store is asked once."""
    (tmp_path / "a.png").write_bytes(png(6, 6))
    r, folder = reader(), Folder(str(tmp_path))
    first = r.image(0, "a.png", folder)
    assert r.image(0, {"bytes": None, "path": "a.png"}, folder) is first
    (tmp_path / "a.png").unlink()
    assert r.read_cell(["a.png"], folder)[0] is first
    r.forget_locations()
    with pytest.raises(CellError, match="cannot be read"):
        r.image(0, "a.png", folder)
