"""Paths and URIs a job names: local paths, `file://`, and object-store URIs (`s3://`, `gs://`)
with their `storage_options`, checked when the job is loaded so a typo fails before any work;
and `display_uri`, the one redaction every message, log line and manifest shows a URI through.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from batchgen.errors import OutputError

REMOTE_SCHEMES = {"s3": "s3", "gs": "gcs", "gcs": "gcs"}  # URI scheme -> store
_TEXT, _FLAG, _SECONDS = (str,), (bool,), (int, float)
STORE_OPTIONS: dict[str, dict[str, tuple[type, ...]]] = {
    # pyarrow.fs.S3FileSystem / GcsFileSystem keyword arguments a job may set (the rest stay defaults).
    "s3": {
        "access_key": _TEXT,
        "secret_key": _TEXT,
        "session_token": _TEXT,
        "region": _TEXT,
        "endpoint_override": _TEXT,
        "scheme": _TEXT,
        "anonymous": _FLAG,
        "request_timeout": _SECONDS,
        "connect_timeout": _SECONDS,
        "force_virtual_addressing": _FLAG,
    },
    "gcs": {"anonymous": _FLAG, "endpoint_override": _TEXT, "scheme": _TEXT, "project_id": _TEXT},
}
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")


def uri_scheme(path: str | Path) -> str | None:
    """The lower-case scheme of a URI (`s3`, `file`, ...); None for a plain path."""
    match = _SCHEME.match(path) if isinstance(path, str) else None
    return match.group(1).lower() if match else None


def is_remote(path: str | Path) -> bool:
    """Whether `path` names an object store (`s3://`, `gs://`) rather than the local file system."""
    return uri_scheme(path) in REMOTE_SCHEMES


def local_path(path: str) -> str:
    """A `file://` URI as a plain path; any other path unchanged."""
    return urlsplit(path).path if uri_scheme(path) == "file" else path


def display_uri(uri: str | Path) -> str:
    """A path or URI as every message, log line and manifest shows it: the one redaction. A URI
    loses its query and fragment (`?access_key=..&secret_key=..` may carry credentials) and any
    user info (`s3://KEY:SECRET@bucket`); a plain local path is shown as it is (`?` is a file
    name character there)."""
    text = str(uri)
    scheme = _SCHEME.match(text)
    if scheme is None:
        return text
    rest = re.split(r"[?#]", text[scheme.end() :], maxsplit=1)[0]
    authority, slash, path = rest.partition("/")
    return f"{scheme.group(0)}{authority.rpartition('@')[2]}{slash}{path}".rstrip("/")


def check_storage_options(path: str | Path, options: Mapping[str, Any], where: str) -> dict[str, Any]:
    """`options` checked for the store `path` names (ValueError naming the key); normalized:
    an `endpoint_override` spelled with a scheme (`http://host:port`) is split into both."""
    scheme = uri_scheme(path)
    if scheme is not None and scheme != "file" and scheme not in REMOTE_SCHEMES:
        raise ValueError(f"{where}.path: unsupported URI scheme {scheme}:// (use s3://, gs://, file://, a local path)")
    if scheme in REMOTE_SCHEMES and not urlsplit(str(path)).netloc:
        raise ValueError(f"{where}.path: {display_uri(str(path))} names no bucket ({scheme}://BUCKET/PREFIX)")
    if scheme not in REMOTE_SCHEMES:
        if options:
            raise ValueError(f"{where}.storage_options: only for s3:// or gs:// paths, and {where}.path is local")
        return {}
    allowed = STORE_OPTIONS[REMOTE_SCHEMES[scheme]]
    out = dict(options)
    for key, value in options.items():
        if key not in allowed:
            raise ValueError(
                f"{where}.storage_options: unknown key {key!r} for {scheme}:// (known: {', '.join(sorted(allowed))})"
            )
        kinds = allowed[key]
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            expected = {_TEXT: "a string", _FLAG: "true or false", _SECONDS: "a number of seconds"}[kinds]
            raise ValueError(f"{where}.storage_options.{key}: must be {expected}")
    endpoint = out.get("endpoint_override")
    if endpoint is not None and "://" in endpoint:
        given, _, out["endpoint_override"] = endpoint.partition("://")
        if out.setdefault("scheme", given) != given:
            raise ValueError(f"{where}.storage_options: endpoint_override is {given}:// but scheme is {out['scheme']}")
    if out.get("scheme", "https") not in ("http", "https"):
        raise ValueError(f"{where}.storage_options.scheme: must be http or https")
    return out


def options_from_uri(uri: str, options: Mapping[str, Any] | None, where: str) -> tuple[str, dict[str, Any]]:
    """(the URI without its query, checked options): a query (`?endpoint_override=...&scheme=http`,
    handy for `report` and `finalize`) adds to `options`; "true"/"false" and numbers are converted."""
    merged = dict(options or {})
    for key, text in parse_qsl(urlsplit(uri).query, keep_blank_values=True):
        merged[key] = _query_value(text, STORE_OPTIONS.get(REMOTE_SCHEMES.get(uri_scheme(uri) or "", ""), {}).get(key))
    try:
        return display_uri(uri), check_storage_options(uri, merged, where)
    except ValueError as exc:
        raise OutputError(str(exc)) from None


def _query_value(text: str, kinds: tuple[type, ...] | None) -> Any:
    if kinds == _FLAG and text.lower() in ("true", "false"):
        return text.lower() == "true"
    if kinds == _SECONDS:
        try:
            return float(text)
        except ValueError:
            return text
    return text
