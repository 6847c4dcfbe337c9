"""Structured output with xgrammar: `SamplingParams.structured` -> a grammar -> a token mask per step.

Why xgrammar: vLLM's backend, on the CPU, a grammar compiled once so a step's mask costs
microseconds per row. `check_structured` finds a spec that cannot compile before any model work;
`GrammarCache` shares compiled grammars by canonical spec text. JSON has no free whitespace (a
small model could emit blanks forever), and `_json_schema_grammar` keeps raw control characters
out of `maxLength` strings so every output parses. Optional: `pip install 'batchgen[structured]'`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import torch


class StructuredError(ValueError):
    """A structured-output spec that cannot become a grammar (or xgrammar is missing)."""


def load_xgrammar() -> Any:
    """The xgrammar module, or StructuredError saying how to install it."""
    try:
        import xgrammar
    except ImportError as exc:
        raise StructuredError(
            f"structured output needs the optional dependency xgrammar: pip install 'batchgen[structured]' ({exc})"
        ) from None
    return xgrammar


def _schema_text(schema: dict[str, Any] | str) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise StructuredError(f"json_schema is not valid JSON: {exc}") from None
    if not isinstance(schema, dict):
        raise StructuredError(f"json_schema must be a JSON object, got {type(schema).__name__}")
    return json.dumps(schema)


# xgrammar's character class for a length-bounded JSON string, and the one JSON allows (no U+0000..U+001F)
_LOOSE_CHARS = r"[^\"\\\r\n]"
_JSON_CHARS = r"[^\0-\x1f\"\\]"


def _json_schema_grammar(xgr: Any, schema: dict[str, Any] | str) -> Any:
    grammar = xgr.Grammar.from_json_schema(_schema_text(schema), any_whitespace=False)
    text = str(grammar)
    if _LOOSE_CHARS not in text:
        return grammar
    return xgr.Grammar.from_ebnf(text.replace(_LOOSE_CHARS, _JSON_CHARS))


def _choice_regex(choices: list[str]) -> str:
    """One alternative per choice, every regex metacharacter escaped."""
    special = set("\\^$.|?*+()[]{}/")
    return "|".join("".join("\\" + ch if ch in special else ch for ch in c) for c in choices)


def build_grammar(spec: dict[str, Any]) -> Any:
    """xgrammar.Grammar for a spec (`{kind: value}`, shape checked by SamplingParams); StructuredError if not."""
    xgr = load_xgrammar()
    kind, value = next(iter(spec.items()))
    try:
        if kind == "json_schema":
            return _json_schema_grammar(xgr, value)
        if kind == "json_object":  # as vLLM compiles it: any object (not any JSON value), no free blanks
            return _json_schema_grammar(xgr, {"type": "object"})
        if kind == "regex":
            return xgr.Grammar.from_regex(value)
        if kind == "choice":
            return xgr.Grammar.from_regex(_choice_regex(value))
        if kind == "grammar":
            return xgr.Grammar.from_ebnf(value)
    except RuntimeError as exc:
        # xgrammar's message starts with "[time] /path/file.cc:line: "; keep what follows
        detail = str(exc).strip().split(": ", 1)[-1] if ".cc:" in str(exc) else str(exc).strip()
        raise StructuredError(f"{kind} does not compile: {detail}") from None
    raise StructuredError(f"unknown structured output kind {kind!r}")


def check_structured(spec: dict[str, Any]) -> str | None:
    """Why `spec` cannot be used (missing xgrammar, or a grammar that does not compile), or None."""
    try:
        build_grammar(spec)
    except StructuredError as exc:
        return str(exc)
    return None


class GrammarCache:
    """Compiles specs against one tokenizer and logits width; compiled grammars cached by spec text."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int]) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_ids = sorted(set(stop_token_ids))
        self._compiler: Any = None
        self._compiled: dict[str, Any] = {}

    def matcher(self, spec: dict[str, Any]) -> Any:
        """A fresh GrammarMatcher for one request; StructuredError when the spec cannot compile."""
        return load_xgrammar().GrammarMatcher(self.compiled(spec))

    def compiled(self, spec: dict[str, Any]) -> Any:
        """The spec's compiled grammar (compiled once, then cached); StructuredError when it cannot compile."""
        xgr = load_xgrammar()
        key = json.dumps(spec, sort_keys=True, separators=(",", ":"))  # same schema, same key, in any order
        compiled = self._compiled.get(key)
        if compiled is None:
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(
                    self._tokenizer, vocab_size=self._vocab_size, stop_token_ids=self._stop_ids or None
                )
                self._compiler = xgr.GrammarCompiler(info)
            try:
                compiled = self._compiler.compile_grammar(build_grammar(spec))
            except RuntimeError as exc:
                raise StructuredError(f"structured output does not compile: {exc}") from None
            self._compiled[key] = compiled
        return compiled


_BATCH: Any = None  # one xgrammar.BatchGrammarMatcher (a thread pool) per process, made on first use


def fill_bitmask(matchers: list[Any], vocab_size: int) -> torch.Tensor:
    """On the host: each matcher's allowed next tokens -> one bitmask [len(matchers), ceil(V / 32)] int32.

    Filled before the forward, so it rides in the step's one upload.
    """
    global _BATCH
    xgr = load_xgrammar()
    bitmask = xgr.allocate_token_bitmask(len(matchers), vocab_size)  # [k, ceil(V / 32)] int32
    if len(matchers) == 1:
        matchers[0].fill_next_token_bitmask(bitmask, 0)
    else:
        if _BATCH is None:
            _BATCH = xgr.BatchGrammarMatcher()
        _BATCH.batch_fill_next_token_bitmask(matchers, bitmask)
    return bitmask


def apply_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place: every token a row's grammar forbids gets -inf; row rows[j] is masked by bitmask[j].

    A row left with no finite logit gets the grammar's tokens back at 0: the grammar wins over min_tokens.
    """
    xgr = load_xgrammar()
    vocab = logits.shape[-1]
    sub = logits[rows]  # [k, V] a copy
    xgr.apply_token_bitmask_inplace(sub, bitmask, vocab_size=vocab)
    dead = torch.isneginf(sub).all(dim=-1)  # [k]
    # why unconditionally, not behind `dead.any()`: that test would be a host sync per step on CUDA
    allowed = torch.zeros_like(sub)
    xgr.apply_token_bitmask_inplace(allowed, bitmask, vocab_size=vocab)
    logits[rows] = torch.where(dead[:, None], allowed, sub)
