"""An older batchgen output left inside an input folder is not input: its part files are skipped
(each such folder logged), whether the input is a local folder, a glob or an object-store prefix.
Apart from dataset.py, so that the local listing there and the object listing (objects.py) both
use it without importing each other."""

from __future__ import annotations

import logging
from typing import Any

from batchgen.storage.base import PART_NAME
from batchgen.storage.uris import display_uri

log = logging.getLogger(__name__)


def nested_output_parts(keys: list[str], records: list[str]) -> dict[str, list[str]]:
    """Of `keys` (input files, "/"-separated paths below the input's root), the committed parts of
    batchgen outputs nested below that root, by folder: a folder holding a `_JOB.json` (listed in
    `records`, paths below the same root). Why: an older run's output left inside an input folder
    would be read as input. The root itself is left alone: an input.path that names an output folder
    reads it on purpose. `_SUCCESS` alone proves nothing (Spark and Hadoop write one too)."""
    folders = {r.rpartition("/")[0] for r in records if r.rpartition("/")[2] == "_JOB.json" and "/" in r}
    found: dict[str, list[str]] = {}
    for key in keys:
        folder, _, name = key.rpartition("/")
        if folder in folders and PART_NAME.fullmatch(name):
            found.setdefault(folder, []).append(key)
    return found


def skip_nested_outputs(files: list[tuple[Any, str]], records: list[str], root: str) -> list[tuple[Any, str]]:
    """`files` ((path, key) pairs) less the parts of batchgen outputs nested below `root` (see
    nested_output_parts), each such folder logged."""
    nested = nested_output_parts([key for _, key in files], records)
    for folder, keys in nested.items():
        log.warning(
            "input.path: %s/%s holds a batchgen output (_JOB.json): its %d part file(s) are not read as input "
            "(name that folder in input.path to read them)",
            display_uri(root),
            folder,
            len(keys),
        )
    skipped = {key for keys in nested.values() for key in keys}
    return [(path, key) for path, key in files if key not in skipped]
