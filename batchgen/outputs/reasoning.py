"""`output.reasoning: auto`: a reasoning model's thinking (`<think>...</think>`, or the tokenizer's
own markers) split from its answer into `reasoning_text`, with its own `reasoning_tokens` count.

The split is decided on token ids, never on re-tokenized text: the markers are single tokens of the
vocabulary (that is how `auto` knows a model reasons), and `reasoning_tokens` counts the generated
tokens up to and including the end marker. Where the thinking stops:
- the end marker among the generated tokens: everything before it is reasoning, the rest the answer;
- no end marker, but a thinking block was opened (a start marker generated, or the chat template
  ended the prompt inside one, as DeepSeek-R1's does): the output hit max_tokens while thinking, so
  it is all reasoning and the answer is empty;
- neither: no reasoning, the whole text is the answer (reasoning_text null, 0 reasoning tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# (start, end) marker pairs of reasoning models' vocabularies, tried in order.
MARKERS = (("<think>", "</think>"), ("<seed:think>", "</seed:think>"), ("<|START_THINKING|>", "<|END_THINKING|>"))


@dataclass(frozen=True)
class Split:
    reasoning: str | None  # None: the sample did not reason
    text: str  # the answer
    reasoning_tokens: int


@dataclass(frozen=True)
class ReasoningSplitter:
    start: str
    end: str
    start_id: int
    end_id: int
    tokenizer: Any

    @classmethod
    def of(cls, tokenizer: Any) -> ReasoningSplitter | None:
        """The splitter for a tokenizer whose vocabulary holds a marker pair as single tokens; else None."""
        vocab = tokenizer.get_vocab()
        for start, end in MARKERS:
            if start in vocab and end in vocab:
                return cls(start, end, vocab[start], vocab[end], tokenizer)
        return None

    def split(self, token_ids: list[int], text: str, prompt_ids: list[int]) -> Split:
        """One sample's split (see the module doc): `text` as the engine decoded it."""
        ids = list(token_ids)
        if self.end_id in ids:
            end = ids.index(self.end_id)
            reasoning, answer = self._cut(ids, end, text)
            return Split(reasoning, answer, end + 1)
        if self.start_id in ids or self._prompt_opens(list(prompt_ids)):
            return Split(self._strip_start(text).strip(), "", len(ids))
        return Split(None, text, 0)

    def _prompt_opens(self, prompt_ids: list[int]) -> bool:
        """The prompt ends inside a thinking block: its last start marker comes after its last end marker."""
        last_start = max((i for i, t in enumerate(prompt_ids) if t == self.start_id), default=-1)
        last_end = max((i for i, t in enumerate(prompt_ids) if t == self.end_id), default=-1)
        return last_start > last_end

    def _cut(self, ids: list[int], end: int, text: str) -> tuple[str, str]:
        """(reasoning, answer) of a sample whose end marker is generated token `end`."""
        if self.end in text:  # markers are plain added tokens: they are in the decoded text
            before, after = text.split(self.end, 1)
        else:  # markers are special tokens the detokenizer skipped: decode both sides apart
            before = self.tokenizer.decode(ids[:end], skip_special_tokens=True)
            after = self.tokenizer.decode(ids[end + 1 :], skip_special_tokens=True)
            if text.startswith(before):  # the engine's text (stop strings already cut) wins
                after = text[len(before) :]
        return self._strip_start(before).strip(), after.lstrip()

    def _strip_start(self, text: str) -> str:
        head = text.lstrip()
        return head[len(self.start) :] if head.startswith(self.start) else text
