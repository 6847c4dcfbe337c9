"""StopChecker: one request's incremental detokenization and stop conditions.

Per token, in vLLM's order: below `min_tokens` nothing stops; EOS (unless `ignore_eos`) stops
with `stop_reason` None, a `stop_token_ids` id with that id; a completed stop string stops (cut,
or kept with `include_stop_str_in_output`); else `max_tokens` gives "length".

Detokenization: tokenizers' `DecodeStream` (whole characters only), primed with the prompt's end
so a Metaspace decoder keeps the completion's leading space (as vLLM): `text` is
decode(prompt + output) minus decode(prompt). No `clean_up_tokenization_spaces`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from collections.abc import Sequence as SequenceOf
from typing import Any

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from batchgen.engine.api.params import SamplingParams

logger = logging.getLogger(__name__)

REPLACEMENT_CHAR = "\ufffd"
# Context tokens kept for decoding: enough for a decoder to see a word boundary before new text.
_CONTEXT_TOKENS = 8


def backend_tokenizer(tokenizer: Any) -> Tokenizer:
    """The Rust `tokenizers.Tokenizer` behind a transformers fast tokenizer (or itself)."""
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
    if not isinstance(backend, Tokenizer):
        raise TypeError(
            f"StopChecker needs a fast tokenizer (tokenizers.Tokenizer behind it), got {type(tokenizer).__name__}"
        )
    return backend


class StopChecker:
    """Detokenizes one request's output token by token and decides when it is finished."""

    def __init__(
        self,
        tokenizer: Any,
        params: SamplingParams,
        eos_token_ids: Iterable[int],
        prompt_token_ids: SequenceOf[int] | None = None,
    ) -> None:
        self._backend = backend_tokenizer(tokenizer)
        self._params = params
        self._skip_special = params.skip_special_tokens
        self._eos: frozenset[int] = frozenset() if params.ignore_eos else frozenset(eos_token_ids)
        self._stop_ids: frozenset[int] = frozenset(params.stop_token_ids)
        self._stops: tuple[str, ...] = tuple(params.stop)
        self.text = ""  # output text so far (whole characters only); final once `finish_reason` is set
        self.num_output_tokens = 0  # every token appended, including an EOS or the tokens of a cut stop string
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        # ids given to the stream that produced no text yet, and the ids just before them
        self._pending: list[int] = []
        # detokenize False (vLLM's token-ids-only request): no text, so no stream and no stop strings
        self._detokenize = params.detokenize
        self._context: list[int] = self._prime_ids(prompt_token_ids or []) if self._detokenize else []
        self._stream: DecodeStream | None = (
            DecodeStream(ids=self._context, skip_special_tokens=self._skip_special) if self._detokenize else None
        )

    def append(self, token_id: int) -> bool:
        """Take the next generated token; True when the request is finished (then call no more)."""
        if self.finish_reason is not None:
            raise RuntimeError(f"StopChecker.append({token_id}) after the request finished ({self.finish_reason})")
        self.num_output_tokens += 1
        checks_on = self.num_output_tokens >= self._params.min_tokens
        if checks_on and token_id in self._eos:
            return self._finish("stop", None)  # EOS text never enters `text`; stop_reason None (vLLM)
        if checks_on and token_id in self._stop_ids:
            if self._params.include_stop_str_in_output:
                self.text += self._step(token_id)
            return self._finish("stop", token_id)
        new_text = self._step(token_id)
        self.text += new_text
        if checks_on and new_text and self._stops and self._match_stop_string(len(new_text)):
            return True
        limit = self._params.max_tokens
        if limit is not None and self.num_output_tokens >= limit:  # None: the engine stops at the context
            return self._finish("length", None)
        return False

    def finish_now(self) -> bool:
        """End the request with "stop" and no stop reason (a structured output's grammar is complete)."""
        return self._finish("stop", None)

    def _finish(self, reason: str, stop_reason: int | None) -> bool:
        """Flush text held back for an incomplete character, then record why the request ended."""
        tail = self._flush()
        self.text += tail
        # why: text held back by an incomplete character was never searched for stop strings
        if tail and self._match_stop_string(len(tail)):
            return True
        self.finish_reason, self.stop_reason = reason, stop_reason
        return True

    def _match_stop_string(self, num_new_chars: int) -> bool:
        """Find a stop string ending inside the last `num_new_chars` characters; cut and finish.
        Of several, the one completed first (smallest end, then start) wins, whatever the tokenization."""
        text = self.text
        best: tuple[int, int, str] | None = None
        for stop in self._stops:
            start = text.find(stop, max(0, len(text) - num_new_chars - len(stop) + 1))
            if start >= 0 and (best is None or (start + len(stop), start) < best[:2]):
                best = (start + len(stop), start, stop)
        if best is None:
            return False
        end, start, stop = best
        self.text = text[:end] if self._params.include_stop_str_in_output else text[:start]
        self._pending.clear()
        self.finish_reason, self.stop_reason = "stop", stop
        return True

    def _step(self, token_id: int) -> str:
        """New complete text for `token_id` ('' while a character is incomplete, or without detokenize)."""
        if not self._detokenize:
            return ""
        if self._stream is not None:
            try:
                chunk = self._stream.step(self._backend, token_id)
            except Exception as err:  # raised when a decoder rewrites earlier text (byte fallback + Strip: Llama 2)
                logger.debug("DecodeStream failed at token %d (%s); decoding it with context", token_id, err)
                self._stream = None
            else:
                if chunk is None:
                    self._pending.append(token_id)
                    return ""
                self._advance_context(token_id)
                return chunk
        # the stream's rule by hand, until the text is whole again and a fresh stream can take over
        chunk = self._decode_with_context([*self._pending, token_id])
        if not chunk or chunk.endswith(REPLACEMENT_CHAR):
            self._pending.append(token_id)
            return ""
        self._advance_context(token_id)
        self._stream = DecodeStream(ids=self._context, skip_special_tokens=self._skip_special)
        return chunk

    def _advance_context(self, token_id: int) -> None:
        """Everything given to the stream so far has been emitted: it becomes context."""
        if self._pending:
            self._context = [*self._context, *self._pending, token_id][-_CONTEXT_TOKENS:]
            self._pending = []
            return
        context = self._context  # why in place: this runs for every token of every sequence
        context.append(token_id)
        if len(context) > _CONTEXT_TOKENS:
            del context[0]

    def _flush(self) -> str:
        """Text of the held-back ids, incomplete characters as U+FFFD (as tokenizer.decode does)."""
        if not self._pending:
            return ""
        tail = self._decode_with_context(self._pending)
        self._pending = []
        return tail

    def _decode_with_context(self, ids: list[int]) -> str:
        """decode(context + ids) minus decode(context): the text `ids` add after the context."""
        base = self._backend.decode(self._context, skip_special_tokens=self._skip_special)
        full = self._backend.decode([*self._context, *ids], skip_special_tokens=self._skip_special)
        if full.startswith(base):
            return full[len(base) :]
        return self._backend.decode(ids, skip_special_tokens=self._skip_special)

    def _prime_ids(self, prompt_token_ids: SequenceOf[int]) -> list[int]:
        """The prompt's last few ids, when they decode to whole characters; else none (a primer
        ending mid-character would glue the output's first bytes to it)."""
        ids = [int(t) for t in prompt_token_ids[-_CONTEXT_TOKENS:]]
        if not ids:
            return []
        text = self._backend.decode(ids, skip_special_tokens=self._skip_special)
        return [] if text.endswith(REPLACEMENT_CHAR) else ids
