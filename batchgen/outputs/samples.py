"""The result columns that depend on the job's `n`, `logprobs` and `prompt_logprobs`.

Column types follow the job, never the data: with `n: 1` the per-sample columns are scalars as
always; with `n > 1` `generated_text`, `finish_reason` and `stop_reason` are lists of n (sample
order) and `sample_output_tokens` lists each sample's output tokens, while `input_tokens`,
`cached_tokens` and `output_tokens` stay scalar (output_tokens sums the samples: the bill).
`logprobs` / `cumulative_logprob` exist when the job sets `sampling.logprobs` (or reads an OpenAI
batch file, whose requests ask for their own k: null where a request asks none), `prompt_logprobs`
when it sets `sampling.prompt_logprobs`; they are null on error rows. `reasoning_text` (per sample)
and `reasoning_tokens` (summed over samples, 0 on error rows) exist with `output.reasoning: auto`.
`lora` (the adapter each row names; null: the base model) exists when the job has `model.lora`;
its field is marked as batchgen's (outputs/adapter_field), so no carried input column is read as it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import pyarrow as pa

from batchgen.engine.api.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from batchgen.engine.api.params import MAX_LOGPROBS
from batchgen.job.spec import JobSpec
from batchgen.outputs.adapter_field import adapter_field
from batchgen.outputs.reasoning import ReasoningSplitter, Split

PER_SAMPLE = ("generated_text", "finish_reason", "stop_reason")
ALTERNATIVE = pa.struct([("token_id", pa.int64()), ("token", pa.string()), ("logprob", pa.float64())])
TOKEN_LOGPROB = pa.struct(
    [
        ("token_id", pa.int64()),  # the generated (or prompt) token
        ("token", pa.string()),
        ("logprob", pa.float64()),
        ("rank", pa.int64()),  # 1-based rank in the raw distribution
        ("top", pa.list_(ALTERNATIVE)),  # the K most likely tokens, best first
    ]
)


@dataclass(frozen=True)
class ColumnPlan:
    """What the job asks for that shapes its result columns."""

    n: int = 1
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    reasoning: bool = False  # output.reasoning auto: the reasoning columns exist
    splitter: ReasoningSplitter | None = None  # known once the tokenizer is (None: nothing to split)
    pooled: tuple[pa.Field, ...] = ()  # a pooling task's own columns (outputs/pooled)
    lora: bool = False  # the job has LoRA adapters (model.lora): the `lora` column exists

    @classmethod
    def of(cls, spec: JobSpec) -> ColumnPlan:
        from batchgen.outputs.pooled import pooled_fields

        s = spec.sampling
        reasoning = spec.output.reasoning == "auto"
        pooled = tuple(pooled_fields(spec))
        logprobs = s.logprobs
        if logprobs is None and spec.input.format == "openai_batch" and spec.task == "generate":
            logprobs = MAX_LOGPROBS  # why: any request line may ask for them (each row keeps its own k)
        lora = bool(spec.model.lora)
        return cls(s.n, logprobs, s.prompt_logprobs, reasoning=reasoning, pooled=pooled, lora=lora)

    def with_tokenizer(self, tokenizer: Any) -> ColumnPlan:
        """This plan with the reasoning splitter of `tokenizer` (when the job splits reasoning)."""
        if not self.reasoning or self.splitter is not None:
            return self
        return replace(self, splitter=ReasoningSplitter.of(tokenizer))

    def extra_fields(self) -> list[pa.Field]:
        """Columns beyond the base ones, in output order."""
        fields: list[pa.Field] = []
        if self.n > 1:
            fields.append(pa.field("sample_output_tokens", pa.list_(pa.int64())))
        if self.logprobs is not None:
            per = pa.list_(TOKEN_LOGPROB)
            fields.append(pa.field("cumulative_logprob", self._per_sample(pa.float64())))
            fields.append(pa.field("logprobs", self._per_sample(per)))
        if self.prompt_logprobs is not None:
            fields.append(pa.field("prompt_logprobs", pa.list_(TOKEN_LOGPROB)))
        if self.reasoning:
            fields.append(pa.field("reasoning_text", self._per_sample(pa.string())))
            fields.append(pa.field("reasoning_tokens", pa.int64()))
        if self.lora:  # the adapter the row names (null: the base model); its value comes from the row
            fields.append(adapter_field())  # marked as batchgen's: readers never take a user's `lora` for it
        return fields + list(self.pooled)

    def fields(self, base: list[pa.Field]) -> list[pa.Field]:
        """The job's result columns: `base` with per-sample columns as lists when n > 1, then the extras."""
        shaped = [pa.field(f.name, self._per_sample(f.type)) if f.name in PER_SAMPLE else f for f in base]
        return shaped + self.extra_fields()

    def _per_sample(self, kind: pa.DataType) -> pa.DataType:
        return pa.list_(kind) if self.n > 1 else kind

    def values(self, out: RequestOutput | None, logprobs: int | None = None) -> dict[str, Any]:
        """Per-sample and extra column values of one row (`out` None: an error row); `logprobs`:
        the row's own top K (an OpenAI request's), else the job's."""
        if out is None:
            values: dict[str, Any] = {f.name: None for f in self.extra_fields()}
            values.update(generated_text=None, stop_reason=None)
            values["finish_reason"] = ["error"] * self.n if self.n > 1 else "error"
            if self.reasoning:
                values["reasoning_tokens"] = 0
            return values
        samples = out.outputs
        splits = [self._split(s, out.prompt_token_ids) for s in samples]
        columns: dict[str, list[Any]] = {
            "generated_text": [sp.text for sp in splits],
            "reasoning_text": [sp.reasoning for sp in splits],
            "finish_reason": [s.finish_reason for s in samples],
            "stop_reason": [None if s.stop_reason is None else str(s.stop_reason) for s in samples],
            "sample_output_tokens": [len(s.token_ids) for s in samples],
            "cumulative_logprob": [s.cumulative_logprob for s in samples],
            "logprobs": [self._sample_logprobs(s, logprobs) for s in samples],
        }
        values = {name: (v if self.n > 1 or name == "sample_output_tokens" else v[0]) for name, v in columns.items()}
        values["reasoning_tokens"] = sum(sp.reasoning_tokens for sp in splits)
        if self.prompt_logprobs is not None:
            values["prompt_logprobs"] = _prompt_structs(out, self.prompt_logprobs)
        wanted = set(PER_SAMPLE) | {f.name for f in self.extra_fields()}
        return {k: v for k, v in values.items() if k in wanted}

    def _split(self, sample: CompletionOutput, prompt_ids: list[int]) -> Split:
        if self.splitter is None:
            return Split(None, sample.text, 0)
        return self.splitter.split(sample.token_ids, sample.text, prompt_ids)

    def _sample_logprobs(self, sample: CompletionOutput, k: int | None) -> list[dict[str, Any]] | None:
        if sample.logprobs is None or self.logprobs is None:
            return None
        k = self.logprobs if k is None else k
        return [_struct(token, entry, k) for token, entry in zip(sample.token_ids, sample.logprobs)]


def _prompt_structs(out: RequestOutput, k: int) -> list[dict[str, Any] | None] | None:
    if out.prompt_logprobs is None:
        return None
    return [
        None if entry is None else _struct(token, entry, k)
        for token, entry in zip(out.prompt_token_ids, out.prompt_logprobs)
    ]


def _struct(token: int, entry: PositionLogprobs, k: int) -> dict[str, Any]:
    """One position as a TOKEN_LOGPROB value: the token's own logprob and the top K by rank."""
    own = entry[token]
    ranked = sorted(entry.items(), key=lambda item: (item[1].rank or 0, item[0]))
    top = [
        {"token_id": tid, "token": lp.decoded_token, "logprob": lp.logprob}
        for tid, lp in ranked
        if tid != token or (own.rank or 0) <= k
    ][:k]
    return {"token_id": token, "token": own.decoded_token, "logprob": own.logprob, "rank": own.rank, "top": top}
