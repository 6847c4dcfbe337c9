"""Where a job value came from, and pydantic's errors as lines that say so.

Why apart from spec.py: an error must point where the user can fix it: the file's line, or the
`--set` that brought the value (never a line of a file that is fine on its own), and say what
YAML did behind their back (an unquoted `no` read as false).
"""

from __future__ import annotations

import difflib
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from batchgen.job.parsing import ParsedYaml, at_or_below

ErrorKeys = set[tuple[str, str]]  # (dotted key, message) of each error


@dataclass
class Origins:
    """The job file's key lines and the --set overrides, by dotted key."""

    path: Path
    parsed: ParsedYaml
    overrides: dict[str, str] = field(default_factory=dict)  # dotted key -> "--set key=value"

    def where(self, dotted: str) -> str:
        """`job.yaml:12`, `job.yaml (--set key=value)`, or `job.yaml` for a key at its default."""
        origin = self.override_of(dotted)
        if origin is not None:
            return f"{self.path} ({origin})"
        line = self.line_of(dotted)
        return f"{self.path}:{line}" if line else str(self.path)

    def override_of(self, dotted: str) -> str | None:
        """The last --set of this key or of a section above it."""
        found = [o for key, o in self.overrides.items() if at_or_below(dotted, key)]
        return found[-1] if found else None

    def overrides_below(self, dotted: str) -> list[str]:
        return [o for key, o in self.overrides.items() if not dotted or key.startswith(dotted + ".")]

    def line_of(self, dotted: str) -> int | None:
        """The line of the key, else of the nearest section above it that the file has."""
        parts = dotted.split(".")
        while parts:
            line = self.parsed.lines.get(".".join(parts))
            if line is not None:
                return line
            parts.pop()
        return None


def describe(exc: ValidationError, origins: Origins, file_errors: Callable[[], ErrorKeys], schema: type) -> str:
    """One line per error. An error the --set values cause (it is not there without them) names
    the --set; `file_errors` gives the errors of the file alone, asked only when that is unclear."""
    problems = []
    for err in exc.errors():
        dotted = ".".join(str(p) for p in err["loc"])
        where = origins.where(dotted)
        below = origins.overrides_below(dotted) if origins.override_of(dotted) is None else []
        if below and (dotted, err["msg"]) not in file_errors():
            where = f"{origins.path} ({', '.join(below)})"  # a section the --set changed, or a key it misspelt
        problems.append(f"{where}: {dotted}: {_message(err, schema)}{_bool_hint(err, dotted, origins.parsed)}")
    return "invalid job file:\n  " + "\n  ".join(problems)


def error_keys(exc: ValidationError) -> ErrorKeys:
    return {(".".join(str(p) for p in err["loc"]), err["msg"]) for err in exc.errors()}


def _message(err: ErrorDetails, schema: type) -> str:
    if err["type"] == "extra_forbidden":
        name = str(err["loc"][-1])
        note = getattr(_section_at(schema, err["loc"][:-1]), "not_job_keys", {}).get(name)
        if note is not None:  # an engine / sampling setting of the Python API only
            return f"not a job key: {note}"
        close = difflib.get_close_matches(name, _known_keys(schema, err["loc"][:-1]), n=1, cutoff=0.6)
        return "unknown key" + (f" (did you mean {close[0]}?)" if close else "")
    if err["type"] == "model_type":  # why: pydantic names our internal class (SamplingSection)
        return f"must be a section of key: value lines, got {type(err['input']).__name__} {err['input']!r}"
    return err["msg"].removeprefix("Value error, ")


def _section_at(schema: type, loc: tuple[int | str, ...]) -> type[BaseModel] | None:
    """The pydantic model of the section at `loc` (None: not a section)."""
    model: type | None = schema
    for part in loc:
        info = model.model_fields.get(str(part)) if model is not None and issubclass(model, BaseModel) else None
        model = _model_in(info.annotation) if info is not None else None
    return model if model is not None and issubclass(model, BaseModel) else None


def _known_keys(schema: type, loc: tuple[int | str, ...]) -> list[str]:
    model = _section_at(schema, loc)
    if model is None:
        return []
    return [name for name in model.model_fields if name != "source"]  # source: set by load_job


def _model_in(annotation: Any) -> type | None:
    """The pydantic model in an annotation (`PricingSection | None` -> PricingSection)."""
    for candidate in (annotation, *typing.get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _bool_hint(err: ErrorDetails, dotted: str, parsed: ParsedYaml) -> str:
    """YAML 1.1 reads an unquoted yes/no/on/off as a boolean; say so where such a value fails."""
    if err["type"] == "extra_forbidden" or "." not in dotted:  # why not a whole section: its keys may be meant
        return ""
    for key, (line, word) in parsed.bool_words.items():
        if at_or_below(key, dotted):
            at = f" (line {line})" if line else ""
            return f' (YAML 1.1 reads an unquoted {word}{at} as a boolean: quote it, "{word}")'
    return ""
