"""The `hf` backend: transformers `generate` on static left-padded batches.

It is the reference every benchmark compares against, and a fallback for models the native
engine refuses. Stop strings, per-row max_tokens and usage are applied by replaying each row's
generated tokens through the engine's own StopChecker, so both backends share one stop semantics.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import torch
from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

from batchgen.backends.base import EnginePrompt, OnOutput
from batchgen.backends.weights import weight_errors_as_model_errors
from batchgen.engine.api.outputs import CompletionOutput, RequestOutput
from batchgen.engine.api.params import SamplingParams
from batchgen.engine.core.scheduler_output import NewSequence
from batchgen.engine.llm import make_sampler
from batchgen.engine.runner.models import resolve_device, resolve_dtype, resolve_max_model_len
from batchgen.engine.sampling.batch import SamplingBatch
from batchgen.engine.sampling.penalties import bad_word_token_ids
from batchgen.engine.sampling.sampler import Sampler, draw_now
from batchgen.engine.sampling.stopping import StopChecker
from batchgen.engine.staging.transfers import Transfers
from batchgen.errors import ModelError
from batchgen.job.spec import HF_UNSUPPORTED, JobSpec

log = logging.getLogger(__name__)

# Settings that must be equal inside one static batch (max_tokens is not: rows are cut on replay;
# seed is not: each seeded row draws from its own generator, see _SeededDraw).
_BATCH_KEY = ("temperature", "top_p", "top_k", "min_p", "ignore_eos", "min_tokens", "stop_token_ids")
# Logits features generate supports natively (the others are refused at job load: job.HF_UNSUPPORTED).
_FEATURE_KEY = ("repetition_penalty", "logit_bias", "bad_words")
_DEFAULTS = SamplingParams()


class HFBackend:
    name = "hf"

    def __init__(self, spec: JobSpec, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.batch_size = spec.engine.batch_size
        try:
            self.device = resolve_device(spec.model.device)
        except ValueError as exc:  # a DeviceError: exit 4, naming the devices on this machine
            raise ModelError(str(exc)) from exc
        dtype = resolve_dtype(spec.model.dtype, self.device, str(spec.model.path))
        self.runtime = {"device": self.device.type, "dtype": str(dtype).removeprefix("torch.")}
        try:
            with weight_errors_as_model_errors(spec.model.path):
                self.model = AutoModelForCausalLM.from_pretrained(spec.model.path, dtype=dtype).to(self.device)  # type: ignore[arg-type]
            self.max_model_len = resolve_max_model_len(self.model.config, spec.engine.max_model_len)
        except (OSError, ValueError) as exc:
            raise ModelError(f"model.path {spec.model.path}: cannot load the model: {exc}") from exc
        self.model.eval()
        # the model runner's sampler (logits features and EOS ids included) for the seeded rows
        self.sampler, eos, _ = make_sampler(self.model, tokenizer, None, self.device)
        self.eos_ids = set(eos)
        pad = tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else min(self.eos_ids, default=0)

    def resolved(self) -> dict[str, str]:
        return dict(self.runtime)

    def generate(
        self,
        prompts: Sequence[EnginePrompt],
        params: list[SamplingParams],
        on_output: OnOutput | None = None,
        adapters: list[str | None] | None = None,
    ) -> list[RequestOutput]:
        if any(not isinstance(p, list) for p in prompts):  # why: a job with images is refused on hf at load
            raise ValueError("engine.backend hf does not read images; use engine.backend native")
        return self._generate([p for p in prompts if isinstance(p, list)], params, on_output, adapters)

    def _generate(
        self,
        prompts: list[list[int]],
        params: list[SamplingParams],
        on_output: OnOutput | None = None,
        adapters: list[str | None] | None = None,
    ) -> list[RequestOutput]:
        if adapters is not None and any(adapters):  # why: the job file refuses model.lora with hf at load
            raise ValueError("model.lora: engine.backend hf serves the base weights only; use engine.backend native")
        for p in params:  # why: the job file refuses these at load; a library caller learns it here
            for name in HF_UNSUPPORTED:
                if getattr(p, name) != getattr(_DEFAULTS, name):
                    raise ValueError(f"sampling.{name}: engine.backend hf does not support this setting")
        params = [self._resolve_max_tokens(ids, p) for ids, p in zip(prompts, params)]
        groups: dict[tuple, list[int]] = {}
        results: list[RequestOutput | None] = [None] * len(prompts)
        for i, p in enumerate(params):
            if p.max_tokens == 0:  # nothing to generate: an empty "length" completion, no model call
                results[i] = self._replay(prompts[i], [], p)
                results[i].request_id = str(i)  # type: ignore[union-attr]
                if on_output is not None:
                    on_output(results[i])  # type: ignore[arg-type]
                continue
            key = (*(str(getattr(p, name)) for name in (*_BATCH_KEY, *_FEATURE_KEY)), p.seed is None)
            groups.setdefault(key, []).append(i)
        for indices in groups.values():
            for start in range(0, len(indices), self.batch_size):
                batch = indices[start : start + self.batch_size]
                outs = self._run_batch([prompts[i] for i in batch], [params[i] for i in batch])
                for i, out in zip(batch, outs):
                    out.request_id = str(i)
                    results[i] = out
                    if on_output is not None:
                        on_output(out)
        return [r for r in results if r is not None]

    def _resolve_max_tokens(self, prompt: list[int], p: SamplingParams) -> SamplingParams:
        """max_tokens None: up to the context, as the native engine does."""
        if p.max_tokens is not None:
            return p
        room = max(1, self.max_model_len - len(prompt))
        return dataclasses.replace(p, max_tokens=room, min_tokens=min(p.min_tokens, room))

    @torch.inference_mode()
    def _run_batch(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[RequestOutput]:
        width = max(len(p) for p in prompts)
        # Left padding: every row's next token is generated at the same position index.
        input_ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)  # [B, width]
        mask = torch.zeros((len(prompts), width), dtype=torch.long)  # [B, width]
        for b, ids in enumerate(prompts):
            input_ids[b, width - len(ids) :] = torch.tensor(ids)
            mask[b, width - len(ids) :] = 1
        p = params[0]
        seeded = p.seed is not None and not p.greedy  # the batch key puts seeded rows together
        kwargs = self._generate_kwargs(p, max(q.max_tokens or 0 for q in params), seeded)  # resolved: never None
        draw = _SeededDraw(self.sampler, prompts, params) if seeded else None
        if draw is not None:  # why greedy decoding: the processor leaves one finite logit per row, its own draw
            kwargs.update(do_sample=False, logits_processor=LogitsProcessorList([draw]))
        try:
            generated = self.model.generate(
                input_ids=input_ids.to(self.device),
                attention_mask=mask.to(self.device),
                **kwargs,
            )[:, width:].tolist()  # [B, new_tokens]
        finally:
            if draw is not None and draw.rows is not None:
                draw.rows.clear()  # the sampler's penalty slots and rows go back
        return [self._replay(ids, new, q) for ids, new, q in zip(prompts, generated, params)]

    def _generate_kwargs(self, p: SamplingParams, max_new_tokens: int, seeded: bool) -> dict[str, Any]:
        """generate's arguments; `seeded`: the engine's sampler draws (_SeededDraw) and applies the
        sampling settings, penalties, bias, bad words and min_tokens itself, as the native engine does."""
        stop_ids = sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_ids))
        kwargs: dict[str, Any] = {
            "max_new_tokens": max_new_tokens,
            "eos_token_id": stop_ids or None,
            "pad_token_id": self.pad_id,
            "do_sample": not p.greedy,
        }
        if seeded:
            return kwargs
        kwargs["min_new_tokens"] = p.min_tokens or None
        kwargs.update(self._feature_kwargs(p))
        if not p.greedy:
            kwargs.update(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k or None, min_p=p.min_p or None)
        return kwargs

    def _feature_kwargs(self, p: SamplingParams) -> dict[str, Any]:
        """repetition_penalty, logit_bias and bad_words as generate's own processors (same semantics as native)."""
        kwargs: dict[str, Any] = {}
        if p.repetition_penalty != 1.0:
            kwargs["repetition_penalty"] = p.repetition_penalty
        if p.logit_bias:
            kwargs["sequence_bias"] = {(int(t),): float(b) for t, b in p.logit_bias.items()}
        if p.bad_words:
            kwargs["bad_words_ids"] = [list(ids) for ids in bad_word_token_ids(self.tokenizer, p.bad_words)]
        return kwargs

    def _replay(self, prompt: list[int], new_tokens: list[int], p: SamplingParams) -> RequestOutput:
        # Why the prompt: primed with it, a Metaspace (SentencePiece) decoder keeps the completion's
        # leading space, as the native engine's checker does; unprimed the text would lose it.
        checker = StopChecker(self.tokenizer, p, self.eos_ids, prompt_token_ids=prompt)
        taken: list[int] = []
        for token in new_tokens:
            taken.append(token)
            if checker.append(token):
                break
        sample = CompletionOutput(
            index=0,
            text=checker.text,
            token_ids=taken,
            finish_reason=checker.finish_reason or "length",
            stop_reason=checker.stop_reason,
        )
        return RequestOutput(request_id="0", prompt=None, prompt_token_ids=prompt, outputs=[sample])


class _SeededDraw(LogitsProcessor):
    """Seeded rows draw with the native engine's sampler, each from its own generator.

    Why: transformers samples every row of a batch from torch's one global generator, so a row's
    tokens would depend on the rows beside it. Here each row is a row of the model runner's own
    sampling state (a SamplingBatch over the engine's sampler and its logits features: a generator
    seeded with the row's seed, its penalties, bias, bad words and min_tokens), the draw is made on
    the raw logits by the same path as an engine step's, and every other logit is set to -inf so
    that transformers' greedy step takes exactly that token.
    """

    def __init__(self, sampler: Sampler, prompts: list[list[int]], params: list[SamplingParams]) -> None:
        self.sampler = sampler
        self.rows: SamplingBatch | None = None  # made on the logits' device, at the first draw
        self.new = [NewSequence(b, tuple(ids), p) for b, (ids, p) in enumerate(zip(prompts, params))]

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        # scores: [B, V]
        new = []
        if self.rows is None:
            self.rows = SamplingBatch(scores.device, self.sampler.features, Transfers(scores.device))
            new = self.new
        seq_ids = list(range(len(self.new)))
        tokens = torch.tensor(draw_now(self.sampler, self.rows, scores, seq_ids, new))  # [B]
        chosen = torch.full_like(scores, float("-inf"))
        return chosen.scatter_(1, tokens[:, None].to(scores.device), 0.0)  # type: ignore[return-value]
