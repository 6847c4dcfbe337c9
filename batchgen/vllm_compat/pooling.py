"""vLLM's pooling calls: `LLM.embed`, `LLM.classify` and `LLM.score` with vLLM's signatures and
output shapes (batchgen adds `num_cached_tokens` and `error`, then `outputs` is None, as its
RequestOutput does). Prompts (text, token ids, vLLM's prompt dicts) become token ids; each row too
long or empty is that row's error; the engine's PoolingModel (engine/pooling) computes the rest.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from batchgen.engine.api.prompts import PromptInput, encode_prompt, outside_vocabulary
from batchgen.engine.pooling.config import PoolingParams, RowResult
from batchgen.engine.pooling.hf_runner import Encoded
from batchgen.engine.pooling.model import PoolingModel


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ClassificationOutput:
    probs: list[float]
    label: str | None = None  # config.id2label of the most probable class (batchgen's addition)

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ScoringOutput:
    score: float


T = TypeVar("T")


@dataclass
class PoolingRequestOutput(Generic[T]):
    request_id: str
    outputs: T | None
    prompt_token_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    finished: bool = True
    error: str | None = None


EmbeddingRequestOutput = PoolingRequestOutput[EmbeddingOutput]
ClassificationRequestOutput = PoolingRequestOutput[ClassificationOutput]
ScoringRequestOutput = PoolingRequestOutput[ScoringOutput]


def encode_pair(tokenizer: Any, first: str, second: str) -> Encoded:
    """A (query, document) pair as the tokenizer joins two texts (BERT: [CLS] a [SEP] b [SEP] and segment ids)."""
    enc = tokenizer(first, second)
    types = enc.get("token_type_ids")
    return Encoded(list(enc["input_ids"]), list(types) if types is not None else None)


def refuse_lora(lora_request: object) -> None:
    if lora_request is not None:
        raise NotImplementedError(
            "lora_request: LoRA adapters serve generation only, not pooling (embed, classify, score)"
        )


def truncate(encoded: Encoded, keep: int | None) -> Encoded:
    """The last `keep` tokens (vLLM's truncate_prompt_tokens: left truncation); None keeps all."""
    if keep is None or len(encoded.input_ids) <= keep:
        return encoded
    if keep < 1:
        raise ValueError(f"truncate_prompt_tokens must be null or >= 1, got {keep}")
    types = encoded.token_type_ids[-keep:] if encoded.token_type_ids is not None else None
    return Encoded(encoded.input_ids[-keep:], types)


def _items(prompts: object) -> list[object]:
    return [prompts] if isinstance(prompts, (str, dict)) else list(prompts)  # type: ignore[call-overload]


def _checked(inputs: list[Encoded], max_model_len: int, vocab_size: int) -> tuple[list[int], list[str | None]]:
    """Indices that may run, and each input's refusal (empty, longer than the context, or an id past
    the embedding table, which would crash the whole batch's forward)."""
    errors: list[str | None] = []
    for i, e in enumerate(inputs):
        vocab = outside_vocabulary(e.input_ids, vocab_size)
        if not e.input_ids:
            errors.append(f"request {i}: prompt has no tokens")
        elif len(e.input_ids) > max_model_len:
            errors.append(f"request {i}: prompt has {len(e.input_ids)} tokens; the model's context is {max_model_len}")
        elif vocab is not None:
            errors.append(f"request {i}: {vocab}")
        else:
            errors.append(None)
    return [i for i, e in enumerate(errors) if e is None], errors


def _run(inputs: list[Encoded], max_model_len: int, model: PoolingModel, call: Any) -> list[RowResult]:
    ok, errors = _checked(inputs, max_model_len, model.vocab_size)
    results = [RowResult(None, error=e) for e in errors]
    for i, r in zip(ok, call([inputs[i] for i in ok])):
        results[i] = r
    return results


def _embed(
    model: PoolingModel,
    tokenizer: Any,
    max_model_len: int,
    prompts: object,
    params: PoolingParams | None,
    keep: int | None = None,
) -> list[EmbeddingRequestOutput]:
    inputs = [truncate(Encoded(encode_prompt(tokenizer, i, p)[0]), keep) for i, p in enumerate(_items(prompts))]
    results = _run(inputs, max_model_len, model, lambda batch: model.embed(batch, params))
    return [
        _output(i, e, r, None if r.values is None else EmbeddingOutput(r.values.tolist()))
        for i, (e, r) in enumerate(zip(inputs, results))
    ]


def _classify(
    model: PoolingModel, tokenizer: Any, max_model_len: int, prompts: object, keep: int | None = None
) -> list[ClassificationRequestOutput]:
    inputs = [truncate(Encoded(encode_prompt(tokenizer, i, p)[0]), keep) for i, p in enumerate(_items(prompts))]
    results = _run(inputs, max_model_len, model, model.classify)
    outputs = []
    for i, (e, r) in enumerate(zip(inputs, results)):
        value = None if r.values is None else ClassificationOutput(r.values.tolist(), model.label_of(r.values))
        outputs.append(_output(i, e, r, value))
    return outputs


def _score(
    model: PoolingModel,
    tokenizer: Any,
    max_model_len: int,
    data_1: str | Sequence[str],
    data_2: str | Sequence[str],
    keep: int | None = None,
) -> list[ScoringRequestOutput]:
    """vLLM's pairing: one text against many (either side), or N against N."""
    left = [data_1] if isinstance(data_1, str) else list(data_1)
    right = [data_2] if isinstance(data_2, str) else list(data_2)
    if len(left) == 1:
        left = left * len(right)
    elif len(right) == 1:
        right = right * len(left)
    if len(left) != len(right):
        raise ValueError(f"score: {len(left)} texts in data_1 against {len(right)} in data_2 (1:N, N:1 or N:N)")
    if model.classifier:
        inputs = [truncate(encode_pair(tokenizer, a, b), keep) for a, b in zip(left, right)]
        results = _run(inputs, max_model_len, model, model.score)
    else:
        one = [truncate(Encoded(encode_prompt(tokenizer, 0, a)[0]), keep) for a in left]
        two = [truncate(Encoded(encode_prompt(tokenizer, 0, b)[0]), keep) for b in right]
        pairs = list(zip(one, two))
        inputs = [Encoded(a.input_ids + b.input_ids) for a, b in pairs]  # only for the usage counts
        _, errors = _checked([e for pair in pairs for e in pair], max_model_len, model.vocab_size)
        results = [RowResult(None, error=errors[2 * i] or errors[2 * i + 1]) for i in range(len(pairs))]
        good = [i for i in range(len(pairs)) if results[i].error is None]
        for i, r in zip(good, model.score([], [pairs[i] for i in good])):
            results[i] = r
    return [
        _output(i, e, r, None if r.values is None else ScoringOutput(float(r.values)))
        for i, (e, r) in enumerate(zip(inputs, results))
    ]


def _output(index: int, encoded: Encoded, result: RowResult, value: Any) -> PoolingRequestOutput[Any]:
    return PoolingRequestOutput(
        request_id=str(index),
        outputs=value,
        prompt_token_ids=encoded.input_ids,
        num_cached_tokens=result.cached_tokens,
        error=result.error,
    )


class PoolingMethods:
    tokenizer: Any
    max_model_len: int

    def pooling_model(self) -> PoolingModel:
        raise NotImplementedError

    def embed(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        pooling_params: PoolingParams | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = False,
        lora_request: object = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt, in order (vLLM's `LLM.embed`): `.outputs.embedding`.
        `truncate_prompt_tokens=k` keeps each prompt's last k tokens (vLLM's left truncation)."""
        refuse_lora(lora_request)
        model, k = self.pooling_model(), truncate_prompt_tokens
        return _embed(model, self.tokenizer, self.max_model_len, prompts, pooling_params, k)

    def classify(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = False,
        lora_request: object = None,
    ) -> list[ClassificationRequestOutput]:
        """Class probabilities per prompt (vLLM's `LLM.classify`): `.outputs.probs` (and `.label`)."""
        refuse_lora(lora_request)
        model, k = self.pooling_model(), truncate_prompt_tokens
        return _classify(model, self.tokenizer, self.max_model_len, prompts, k)

    def score(
        self,
        data_1: str | Sequence[str],
        data_2: str | Sequence[str],
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = False,
        lora_request: object = None,
    ) -> list[ScoringRequestOutput]:
        """A score per (data_1, data_2) pair, 1:N, N:1 or N:N (vLLM's `LLM.score`): a cross-encoder's
        sigmoid, or the cosine of two embeddings for an embedding model."""
        refuse_lora(lora_request)
        model, k = self.pooling_model(), truncate_prompt_tokens
        return _score(model, self.tokenizer, self.max_model_len, data_1, data_2, k)
