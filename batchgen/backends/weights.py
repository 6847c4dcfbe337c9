"""A model folder's weight files, as a model problem: a truncated or corrupt checkpoint is exit 4
naming the file ("weights cannot be loaded"), never an internal error with a traceback.

Why a check of our own before transformers reads them: its loader raises the bare reader error
(`SafetensorError: invalid header length`) without saying which file; opening each safetensors
file's header first costs a few KB of reading and names the file.
"""

from __future__ import annotations

import json
import pickle
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from safetensors import SafetensorError, safe_open

from batchgen.errors import ModelError

# What transformers' loaders raise for an unreadable checkpoint: safetensors' reader, and torch's
# unpickler for a `.bin` checkpoint (a cut file ends early, a corrupt one fails to unpickle).
WEIGHT_READ_ERRORS: tuple[type[BaseException], ...] = (SafetensorError, pickle.UnpicklingError, EOFError)


# The checkpoint transformers loads from a folder: one file, or the shards an index lists.
_CHECKPOINTS = (
    ("model.safetensors", "model.safetensors.index.json"),
    ("pytorch_model.bin", "pytorch_model.bin.index.json"),
)


def checkpoint_files(folder: Path) -> list[Path]:
    """The weight files transformers would read from `folder` (safetensors first, as it does);
    [] when there are none (its own error says so). A ModelError when an index cannot be read."""
    for single, index in _CHECKPOINTS:
        if (folder / index).is_file():
            try:
                names = sorted(set(json.loads((folder / index).read_text(encoding="utf-8"))["weight_map"].values()))
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
                why = f"{index} is unreadable: {exc}"
                raise ModelError(f"model.path {folder}: weights cannot be loaded: {why}") from exc
            return [folder / name for name in names]
        if (folder / single).is_file():
            return [folder / single]
    return []


def check_weight_files(folder: Path) -> None:
    """Each checkpoint file is there and whole as far as its own header or directory can tell
    (a safetensors header and the length it promises; a torch zip archive's central directory),
    without reading the weights; a ModelError naming the first file that is not."""
    for path in checkpoint_files(folder):
        problem = _safetensors_problem(path) if path.suffix == ".safetensors" else _torch_zip_problem(path)
        if problem is not None:
            raise ModelError(f"model.path {folder}: weights cannot be loaded from {path.name}: {problem}")


def _safetensors_problem(path: Path) -> str | None:
    try:
        with safe_open(str(path), framework="numpy"):  # reads the header and checks the file's length
            return None
    except (SafetensorError, OSError) as exc:
        return str(exc)


def _torch_zip_problem(path: Path) -> str | None:
    """torch.save writes a zip archive; a cut one has lost its central directory (at the end). A
    file in the older pickle format is left to torch's loader (see WEIGHT_READ_ERRORS)."""
    try:
        with path.open("rb") as fh:
            if fh.read(2) != b"PK":
                return None if path.stat().st_size else "the file is empty"
        with zipfile.ZipFile(path):
            return None
    except (zipfile.BadZipFile, OSError) as exc:
        return f"not a whole torch checkpoint ({exc})"


@contextmanager
def weight_errors_as_model_errors(folder: Path) -> Iterator[None]:
    """Checks the folder's weight files first (check_weight_files); inside, a checkpoint that still
    fails to read (what those checks cannot see: a `.bin` file's pickle) becomes a ModelError naming
    the folder."""
    check_weight_files(folder)
    try:
        yield
    except WEIGHT_READ_ERRORS as exc:
        raise ModelError(f"model.path {folder}: weights cannot be loaded: {type(exc).__name__}: {exc}") from exc
