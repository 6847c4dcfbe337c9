"""Input objects on an object store: an object, every `.parquet` object under a prefix, or a glob
(`*`, `?`, `[..]` within a name, `**` across folders), with Python glob semantics on "/"-separated
keys. Apart from storage/objectstore.py, which writes outputs: this module only lists inputs."""

from __future__ import annotations

import fnmatch

import pyarrow.fs as pafs

from batchgen.inputs.nested_outputs import skip_nested_outputs
from batchgen.storage.uris import uri_scheme


def discover_objects(
    fs: pafs.FileSystem, pattern: str, uri: str, exclude: str | None, suffixes: tuple[str, ...] = (".parquet",)
) -> list[tuple[str, str]]:
    """(path in `fs`, key) of an object, the objects ending in `suffixes` under a prefix (recursively), or a
    glob's objects (`*`, `?`, `[..]` within a name, `**` across folders); keys are relative to the
    prefix (or the glob's leading parts without a wildcard, or the object's own folder)."""
    info = fs.get_file_info(pattern)
    if info.type == pafs.FileType.File:
        return [(pattern, info.base_name)]
    if info.type == pafs.FileType.Directory:
        root = pattern
        listing = _files_under(fs, root)
        found = [p for p in listing if p.endswith(suffixes) and not p.rsplit("/", 1)[-1].startswith(".")]
    else:
        segments = pattern.split("/")
        fixed = next((i for i, s in enumerate(segments) if _has_magic(s)), len(segments))
        root = "/".join(segments[:fixed])
        listing = _files_under(fs, root)
        found = [p for p in listing if _glob_match(segments[fixed:], p[len(root) + 1 :].split("/"))]
    if exclude is not None:
        found = [p for p in found if not p.startswith(exclude.rstrip("/") + "/")]
    records = [p[len(root) + 1 :] for p in listing if p.endswith("/_JOB.json")]
    return skip_nested_outputs(sorted((p, p[len(root) + 1 :]) for p in found), records, f"{uri_scheme(uri)}://{root}")


def _files_under(fs: pafs.FileSystem, root: str) -> list[str]:
    if not root:
        return []
    selector = pafs.FileSelector(root, recursive=True, allow_not_found=True)
    return [i.path for i in fs.get_file_info(selector) if i.type == pafs.FileType.File]


def _has_magic(segment: str) -> bool:
    return any(c in segment for c in "*?[")


def _glob_match(pattern: list[str], parts: list[str]) -> bool:
    """Python glob semantics on "/"-separated keys: `**` spans zero or more folders, and a wildcard
    matches no hidden name (one starting with ".")."""
    if not pattern:
        return not parts
    if pattern[0] == "**":
        spans = range(next((i for i, p in enumerate(parts) if p.startswith(".")), len(parts)) + 1)
        return any(_glob_match(pattern[1:], parts[i:]) for i in spans)
    if not parts or (parts[0].startswith(".") and not pattern[0].startswith(".")):
        return False
    return fnmatch.fnmatchcase(parts[0], pattern[0]) and _glob_match(pattern[1:], parts[1:])
