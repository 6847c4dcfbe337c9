"""SamplingParams: what one request asks of the engine, validated where users type it.

This dataclass is the one definition of the sampling settings: the job file's `sampling` section
and its per-row columns are derived from it (batchgen/job/spec.py), so a field is added here once.
A field marked PYTHON_ONLY is vLLM's Python API only and no job-file key: `detokenize` (a job
writes text), `spaces_between_special_tokens` (no effect here, see the field) and
`structured_outputs` (the job file spells it `structured`): vLLM's StructuredOutputsParams, checked for
vLLM's shape (exactly one constraint) and mapped onto the `{kind: value}` spec (`to_spec`). Options
batchgen cannot honour are refused; `disable_any_whitespace` and `disable_additional_properties`
are accepted whatever they say (batchgen always does both).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1  # what torch.Generator.manual_seed accepts
MAX_LOGPROBS = 20  # top alternatives per token, as vLLM's default max_logprobs


class SettingError(ValueError):
    """A setting has a wrong type or value; `field` names it (for the job file's key and line)."""

    def __init__(self, owner: str, name: str, expected: str, value: Any) -> None:
        super().__init__(f"{owner}.{name} must be {expected}, got {value!r}")
        self.field = name
        self.expected = expected


SEED_EXPECTED = f"null or an integer that fits 64 bits ({SEED_MIN} .. {SEED_MAX})"


def is_seed(value: object) -> bool:
    """None (draws from the OS's entropy) or a 64-bit integer: a request's or an LLM's seed."""
    return value is None or (is_int(value) and SEED_MIN <= value <= SEED_MAX)  # type: ignore[operator]


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


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


# Field metadata of the settings that are not job-file keys (see the module docstring); a field may add
# a "job_note": what a job file does instead, told to a job that sets the key (job/errors).
PYTHON_ONLY = {"job": False}

# Below this temperature a request is greedy: logits / ~0 overflow float32 (vLLM's cut-off).
GREEDY_TEMPERATURE_EPS = 1e-5


@dataclass
class SamplingParams:
    """Per-request generation settings (vLLM names and defaults).

    temperature 0 (below 1e-5) means greedy; top_k 0 or -1 and top_p 1.0 disable those filters.
    `max_tokens` None means up to the context; 0 generates nothing (scoring with prompt_logprobs).
    `n` samples share one prefill; sample i of a seeded request draws with seed + i. `logprobs`
    and `prompt_logprobs` (K in 0..20) are taken from the raw logits, before any processing.
    Invalid values raise SettingError (a ValueError) naming the field.
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    n: int = 1
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # Logits processing (batchgen/engine/sampling/penalties.py, structured.py): vLLM's names and meanings.
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    bad_words: list[str] = field(default_factory=list)
    allowed_token_ids: list[int] | None = None
    structured: dict[str, Any] | None = None
    # vLLM's Python API. detokenize False: token ids only (text "", logprobs' decoded_token None);
    # stop strings need the text, so they are refused with it (as vLLM does).
    detokenize: bool = field(default=True, metadata=PYTHON_ONLY)
    # Accepted either way: text comes from the fast tokenizer's own decoder, which writes what it
    # writes between special tokens (as transformers' fast tokenizers and vLLM's fast detokenizer).
    spaces_between_special_tokens: bool = field(default=True, metadata=PYTHON_ONLY)
    # vLLM's spelling of `structured`: set, it becomes the equivalent `structured` spec.
    structured_outputs: StructuredOutputsParams | None = field(default=None, metadata=PYTHON_ONLY)

    def __post_init__(self) -> None:
        self._take_structured_outputs()
        self.stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        s = self
        checks = [
            (
                "max_tokens",
                s.max_tokens is None or (is_int(s.max_tokens) and s.max_tokens >= 0),
                "null (up to the context) or an integer >= 0",
            ),
            ("temperature", is_finite(s.temperature) and s.temperature >= 0.0, "a finite number >= 0"),
            ("top_p", is_finite(s.top_p) and 0.0 < s.top_p <= 1.0, "a number in (0, 1]"),
            ("top_k", is_int(s.top_k) and s.top_k >= 0, "0 (disabled), -1 (disabled) or an integer >= 1"),
            ("min_p", is_finite(s.min_p) and 0.0 <= s.min_p <= 1.0, "a number in [0, 1]"),
            (
                "min_tokens",
                is_int(s.min_tokens) and s.min_tokens >= 0 and (s.max_tokens is None or s.min_tokens <= s.max_tokens),
                f"an integer in [0, max_tokens={s.max_tokens}]",
            ),
            ("n", is_int(s.n) and s.n >= 1, "an integer >= 1"),
            ("seed", is_seed(s.seed), SEED_EXPECTED),
            ("stop", all(isinstance(x, str) and x for x in s.stop), "a list of non-empty strings"),
            ("stop_token_ids", all(is_int(t) and t >= 0 for t in s.stop_token_ids), "a list of non-negative token ids"),
        ]
        checks += [
            (name, v is None or (is_int(v) and 0 <= v <= MAX_LOGPROBS), f"null or an integer in [0, {MAX_LOGPROBS}]")
            for name, v in (("logprobs", s.logprobs), ("prompt_logprobs", s.prompt_logprobs))
        ]
        checks += [
            (f.name, isinstance(getattr(s, f.name), bool), "true or false")
            for f in fields(s)
            if f.type in ("bool", bool)
        ]
        if s.detokenize is False and s.stop:
            checks.append(("detokenize", False, "true when stop strings are set (they are matched in the text)"))
        checks += _feature_checks(s)
        for name, ok, expected in checks:
            if not ok:
                raise SettingError("SamplingParams", name, expected, getattr(self, name))

    def _take_structured_outputs(self) -> None:
        """vLLM's `structured_outputs` -> `structured` (a copy made by dataclasses.replace has both, equal)."""
        given = self.structured_outputs
        if given is None:
            return
        if not isinstance(given, StructuredOutputsParams):
            raise SettingError("SamplingParams", "structured_outputs", "null or a StructuredOutputsParams", given)
        spec = given.to_spec()
        if self.structured is not None and self.structured != spec:
            raise SettingError(
                "SamplingParams",
                "structured",
                f"null or {spec!r} when structured_outputs is set (they are one setting)",
                self.structured,
            )
        self.structured = spec

    @property
    def uses_logits_features(self) -> bool:
        """Any penalty, bias, bad word, allowed-ids list or structured output: the sampler must process logits."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or bool(self.logit_bias)
            or bool(self.bad_words)
            or self.allowed_token_ids is not None
            or self.structured is not None
        )

    @property
    def greedy(self) -> bool:
        """The one definition of greedy (engine sampler and hf backend): argmax of the raw logits."""
        return self.temperature < GREEDY_TEMPERATURE_EPS


def _feature_checks(s: SamplingParams) -> list[tuple[str, bool, str]]:
    """Shape checks of the logits-processing settings (vLLM's ranges); grammars compile later."""
    bias = s.logit_bias
    allowed = s.allowed_token_ids
    return [
        ("repetition_penalty", is_finite(s.repetition_penalty) and s.repetition_penalty > 0.0, "a number > 0"),
        *[
            (name, is_finite(v) and -2.0 <= v <= 2.0, "a number in [-2, 2]")
            for name, v in (("presence_penalty", s.presence_penalty), ("frequency_penalty", s.frequency_penalty))
        ],
        (
            "logit_bias",
            bias is None
            or (
                isinstance(bias, dict)
                and all(is_int(t) and t >= 0 and is_finite(b) and -100.0 <= b <= 100.0 for t, b in bias.items())
            ),
            "null or a mapping of token id (>= 0) to a bias in [-100, 100]",
        ),
        (
            "bad_words",
            isinstance(s.bad_words, list) and all(isinstance(w, str) and w.strip() for w in s.bad_words),
            "a list of non-empty strings",
        ),
        (
            "allowed_token_ids",
            allowed is None
            or (isinstance(allowed, list) and bool(allowed) and all(is_int(t) and t >= 0 for t in allowed)),
            "null or a non-empty list of non-negative token ids",
        ),
        ("structured", _structured_ok(s.structured), _STRUCTURED_EXPECTED),
    ]


_STRUCTURED_EXPECTED = (
    "null or a mapping with exactly one of json_schema (a schema mapping or JSON text), json_object (true), "
    "regex (text), choice (a list of strings), grammar (EBNF text)"
)


def _structured_ok(value: Any) -> bool:
    if value is None:
        return True
    if not isinstance(value, dict) or len(value) != 1:
        return False
    kind, spec = next(iter(value.items()))
    return {
        "json_schema": isinstance(spec, (dict, str)) and bool(spec),
        "json_object": spec is True,
        "regex": isinstance(spec, str) and bool(spec),
        "choice": isinstance(spec, list) and bool(spec) and all(isinstance(c, str) and c for c in spec),
        "grammar": isinstance(spec, str) and bool(spec.strip()),
    }.get(kind, False)
