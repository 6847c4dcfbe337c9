"""The correctness policy for reduced precision (bf16, fp16): what "the engine agrees with transformers"
means when neither is exact, checked the same way by the CPU tests and the prepared GPU check.

Why a policy and not token-exact parity: in bf16 two correct implementations round differently
(summation order, fused kernels), so where the model itself is nearly undecided their top tokens
may differ. What must still hold, against transformers in the same dtype on the same weights:
- teacher-forced prompt logprobs: the top-1 token agrees at >= 97% of the positions where
  transformers' top-2 margin exceeds CLEAR_MARGIN nats, and the median |logprob difference| of the
  prompt's tokens is <= 0.05;
- greedy generation: equal token for token up to the first position where transformers' own top-2
  margin is within NOISE nats (a near-tie either side may break); a divergence before any such
  position is a failure, and every verdict names both positions, so none is hidden.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

CLEAR_MARGIN = 0.1  # nats: positions whose top-2 margin exceeds this count for top-1 agreement
NOISE = 0.1  # nats: a top-2 margin at or below this is a near-tie that bf16 rounding may break
MIN_TOP1_AGREEMENT = 0.97
MAX_MEDIAN_DIFF = 0.05


@dataclass(frozen=True)
class PromptVerdict:
    """Teacher-forced agreement over the prompts' positions."""

    positions: int
    clear: int  # positions where transformers' top-2 margin > CLEAR_MARGIN
    top1_agree: int  # of those, where the engine's top-1 equals transformers'
    median_diff: float  # median |engine - transformers| logprob of the prompt's own tokens

    @property
    def agreement(self) -> float:
        return self.top1_agree / self.clear if self.clear else 1.0

    @property
    def ok(self) -> bool:
        return self.agreement >= MIN_TOP1_AGREEMENT and self.median_diff <= MAX_MEDIAN_DIFF

    def line(self) -> str:
        return (
            f"prompt logprobs: top-1 agrees at {self.top1_agree}/{self.clear} clear positions ({self.agreement:.1%}, "
            f"need {MIN_TOP1_AGREEMENT:.0%}), median |diff| {self.median_diff:.4f} (need <= {MAX_MEDIAN_DIFF}) "
            f"over {self.positions} positions"
        )


@dataclass(frozen=True)
class GreedyVerdict:
    """One prompt's greedy tokens against transformers': where they first differ and where
    transformers' own margin first fell within NOISE (None: nowhere in the compared span)."""

    compared: int
    first_divergence: int | None
    first_near_tie: int | None

    @property
    def ok(self) -> bool:
        if self.first_divergence is None:
            return True
        return self.first_near_tie is not None and self.first_near_tie <= self.first_divergence

    def line(self) -> str:
        tie = "none" if self.first_near_tie is None else str(self.first_near_tie)
        if self.first_divergence is None:
            return f"greedy: equal over {self.compared} tokens (first near-tie: {tie})"
        verdict = "after a near-tie: allowed" if self.ok else "BEFORE any near-tie: a failure"
        return (
            f"greedy: first differs at token {self.first_divergence} of {self.compared}, near-tie at {tie} ({verdict})"
        )


def top2_margins(logits: torch.Tensor) -> torch.Tensor:
    """[N, V] logits -> [N] top-1 minus top-2 log-probability (nats), in float32."""
    top = torch.log_softmax(logits.float(), dim=-1).topk(2, dim=-1).values  # [N, 2]
    return top[:, 0] - top[:, 1]


def check_prompt_logprobs(
    reference_logits: Sequence[torch.Tensor], prompts: Sequence[Sequence[int]], engine: Sequence[Sequence[Any]]
) -> PromptVerdict:
    """`reference_logits[i]`: transformers' [len(prompt), V] logits over prompt i; `engine[i]`: the
    engine's prompt_logprobs for it (None, then per token a {token id: Logprob} holding the prompt's
    token and the top-1, as vLLM returns with prompt_logprobs >= 1)."""
    positions = clear = agree = 0
    diffs: list[float] = []
    for logits, prompt, theirs in zip(reference_logits, prompts, engine):
        ref = torch.log_softmax(logits.float(), dim=-1)  # [T, V]
        margins = top2_margins(logits)
        for t in range(1, len(prompt)):
            row: Mapping[int, Any] = theirs[t]
            positions += 1
            diffs.append(abs(row[prompt[t]].logprob - float(ref[t - 1, prompt[t]])))
            if float(margins[t - 1]) > CLEAR_MARGIN:
                clear += 1
                top1 = next(tok for tok, lp in row.items() if lp.rank == 1)
                agree += int(top1 == int(ref[t - 1].argmax()))
    return PromptVerdict(positions, clear, agree, statistics.median(diffs) if diffs else 0.0)


def check_greedy(
    engine_tokens: Sequence[int], reference_tokens: Sequence[int], reference_margins: Sequence[float]
) -> GreedyVerdict:
    """One prompt: the engine's greedy tokens, transformers' greedy tokens and its top-2 margin at each
    of its generated positions (top2_margins over generate's scores)."""
    n = min(len(engine_tokens), len(reference_tokens))
    divergence = next((i for i in range(n) if engine_tokens[i] != reference_tokens[i]), None)
    if divergence is None and len(engine_tokens) != len(reference_tokens):
        divergence = n  # one stopped (EOS) where the other went on
    tie = next((i for i, m in enumerate(reference_margins[: n + 1]) if m <= NOISE), None)
    return GreedyVerdict(n, divergence, tie)


@dataclass
class Reference:
    """transformers in the reduced dtype: each prompt's logits [T, V], greedy tokens and their top-2 margins."""

    logits: list[torch.Tensor] = field(default_factory=list)
    tokens: list[list[int]] = field(default_factory=list)
    margins: list[list[float]] = field(default_factory=list)


def reference(model: Any, prompts: Sequence[Sequence[int]], max_tokens: int, eos_id: int) -> Reference:
    """transformers' forward and greedy `generate` of `model` (loaded in the dtype under test, on its
    device), one unpadded prompt at a time."""
    ref = Reference()
    device = next(model.parameters()).device
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([list(prompt)], device=device)
            ref.logits.append(model(ids).logits[0].float().cpu())  # [T, V]
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_tokens,
                eos_token_id=eos_id, pad_token_id=eos_id, output_scores=True, return_dict_in_generate=True,
            )  # fmt: skip
            ref.tokens.append(out.sequences[0, len(prompt) :].tolist())
            ref.margins.append(top2_margins(torch.cat(out.scores)).tolist())
    return ref


def judge(ref: Reference, prompts: Sequence[Sequence[int]], outputs: Sequence[Any]) -> dict[str, Any]:
    """The engine's RequestOutputs (greedy, prompt_logprobs >= 1, for `prompts`) under the policy:
    {"ok", "prompt": PromptVerdict's line, "greedy": one line per prompt, "failures": [...]}."""
    prompt = check_prompt_logprobs(ref.logits, prompts, [o.prompt_logprobs for o in outputs])
    greedy = [check_greedy(o.outputs[0].token_ids, t, m) for o, t, m in zip(outputs, ref.tokens, ref.margins)]
    failures = ([prompt.line()] if not prompt.ok else []) + [
        f"prompt {i} ({len(prompts[i])} tokens): {g.line()}" for i, g in enumerate(greedy) if not g.ok
    ]
    return {
        "ok": not failures,
        "clear_positions": prompt.clear,
        "prompt": prompt.line(),
        "greedy": [g.line() for g in greedy],
        "failures": failures,
    }
