"""StructuredOutputsParams: vLLM's structured-output request object, mapped onto `SamplingParams.structured`.

Checks vLLM's shape (exactly one constraint) and names the `{kind: value}` spec it stands for
(`to_spec`). Options batchgen cannot honour are refused; `disable_any_whitespace` and
`disable_additional_properties` are accepted whatever they say (batchgen always does both).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# vLLM's constraint fields -> batchgen's spec kinds (SamplingParams.structured)
_KINDS = {
    "json": "json_schema",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
    "json_object": "json_object",
}


class StructuredOutputsError(ValueError):
    """A StructuredOutputsParams batchgen cannot run; the message names the field."""


@dataclass
class StructuredOutputsParams:
    """Exactly one of `json` (a schema), `regex`, `choice`, `grammar` (xgrammar's EBNF) or
    `json_object`; compiled when the request is added or the job file validated."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        given = [name for name in _KINDS if getattr(self, name) is not None]
        if self.structural_tag is not None:
            raise StructuredOutputsError(
                "StructuredOutputsParams.structural_tag is not supported by batchgen: constrain the whole "
                "output with json, regex, choice or grammar instead"
            )
        if len(given) != 1:
            raise StructuredOutputsError(
                f"StructuredOutputsParams needs exactly one of {', '.join(_KINDS)}, got {given or 'none'}"
            )
        if self.whitespace_pattern is not None:
            raise StructuredOutputsError(
                "StructuredOutputsParams.whitespace_pattern is not supported by batchgen: JSON is always "
                "generated without free whitespace (as disable_any_whitespace=True)"
            )
        if self.json_object is not None and self.json_object is not True:
            raise StructuredOutputsError(f"StructuredOutputsParams.json_object must be True, got {self.json_object!r}")
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                raise StructuredOutputsError(
                    f"StructuredOutputsParams.{name} must be true or false, got {getattr(self, name)!r}"
                )

    def to_spec(self) -> dict[str, Any]:
        """The equivalent `SamplingParams.structured` spec, e.g. {"json_schema": {...}}."""
        name = next(n for n in _KINDS if getattr(self, n) is not None)
        return {_KINDS[name]: getattr(self, name)}
