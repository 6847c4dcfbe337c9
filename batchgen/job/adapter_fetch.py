"""Object-store LoRA adapters (`model.lora.NAME: s3://...`): fetched to a local, content-addressed
cache, and fetched again only when the store's objects changed.

Why a module of its own: job/adapters reads and checks folders; getting a remote folder onto local
disk (once, safely under concurrent workers) is a separate concern. Each fetch lands in
`<cache>/lora/<sha256 of its files>`, through a temp folder renamed into place, so a worker never
sees a half-written folder and a changed adapter never reuses an old copy. Beside it, a note per
remote folder (`<cache>/lora/remote/<hash of the URI and its options>.json`) keeps the listing its
copy was fetched under: each file's size and modification time, what the store's listing gives
(pyarrow.fs; no ETag). A run whose listing equals the note's uses the cached copy without a GET.
Why a listing is trusted only once it has settled (its newest file at least SETTLE_S old when
listed): object stores stamp times in whole seconds, so an object replaced by one of the same
size within the second it was written would list alike; one replaced after a settled listing
cannot.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs

from batchgen.errors import ModelError
from batchgen.storage.retry import with_retries
from batchgen.storage.uris import display_uri

log = logging.getLogger(__name__)
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin")
CACHE_ENV = "BATCHGEN_CACHE"  # where object-store adapters are fetched to (default ~/.cache/batchgen)
SETTLE_S = 2.0  # a listing whose newest file is younger than this is not noted (see the docstring)

Listing = dict[str, list[int]]  # file name -> [size, mtime_ns]


def fetch_adapter(name: str, uri: str) -> Path:
    """The local copy of the object-store adapter folder `uri` (options in its query or the store's
    environment): the cached one when the store lists the same files as when it was fetched."""
    from batchgen.storage.objectstore import ObjectStorage
    from batchgen.storage.uris import options_from_uri

    where = f"model.lora.{name} {display_uri(uri)}"
    clean, options = options_from_uri(uri, None, f"model.lora.{name}")
    store = ObjectStorage(clean, options)
    listed_at = time.time()  # before the listing: the settle test errs on the safe side
    try:
        listing = _listing(store)
    except OSError as exc:
        raise ModelError(f"{where}: cannot list the adapter folder: {exc}") from exc
    if "adapter_config.json" not in listing:
        raise ModelError(f"{where}: no adapter_config.json there (a PEFT adapter folder)")
    root = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "batchgen") / "lora"
    place = json.dumps([clean, options], sort_keys=True, default=str).encode()  # the bucket, key and endpoint
    note = root / "remote" / f"{hashlib.sha256(place).hexdigest()[:32]}.json"
    cached = _noted_copy(note, listing, root)
    if cached is not None:
        log.info("%s: unchanged in the store, using %s", where, cached)
        return cached
    final = _fetch(store, sorted(listing), root, where)
    newest = max(mtime for _, mtime in listing.values()) / 1e9
    if listed_at - newest >= SETTLE_S:
        _write_note(note, {"listing": listing, "folder": final.name})
    log.info("%s: fetched to %s", where, final)
    return final


def _listing(store: Any) -> Listing:
    """The adapter files the store lists under the folder, with their sizes and modification times."""
    selector = pafs.FileSelector(store.base, recursive=False, allow_not_found=True)
    infos = with_retries(lambda: store.fs.get_file_info(selector), store.where, "list", store.policy)
    return {
        i.base_name: [int(i.size or 0), int(i.mtime_ns or 0)]
        for i in infos
        if i.type == pafs.FileType.File and i.base_name in ADAPTER_FILES
    }


def _noted_copy(note: Path, listing: Listing, root: Path) -> Path | None:
    """The cached folder the note names, when the note's listing is this one and the folder is whole."""
    try:
        noted = json.loads(note.read_text())
    except (OSError, ValueError):
        return None
    folder = root / str(noted.get("folder", ""))
    if noted.get("listing") != listing or any(0 in stamp for stamp in listing.values()):
        return None
    if not noted.get("folder") or not all((folder / file).is_file() for file in listing):
        return None
    return folder


def _fetch(store: Any, files: list[str], root: Path, where: str) -> Path:
    """Every file into a temp folder, then renamed to `<root>/<sha256 of the files>` (kept if
    another process got there first)."""
    root.mkdir(parents=True, exist_ok=True)
    temp = Path(tempfile.mkdtemp(prefix=".fetch-", dir=root))
    digest = hashlib.sha256()
    try:
        for file in files:
            data = store.read_bytes(file)
            digest.update(file.encode() + b"\0" + hashlib.sha256(data).digest())
            (temp / file).write_bytes(data)
        final = root / digest.hexdigest()[:32]
        try:
            temp.rename(final)
        except OSError:  # another process fetched the same content first: its copy stands
            shutil.rmtree(temp, ignore_errors=True)
    except OSError as exc:
        shutil.rmtree(temp, ignore_errors=True)
        raise ModelError(f"{where}: cannot fetch the adapter: {exc}") from exc
    return final


def _write_note(note: Path, body: dict[str, Any]) -> None:
    """The note, replaced whole (a reader sees the old one or the new one)."""
    note.parent.mkdir(parents=True, exist_ok=True)
    temp = note.with_name(f".{note.name}.{os.getpid()}.tmp")
    temp.write_text(json.dumps(body, sort_keys=True))
    os.replace(temp, note)
