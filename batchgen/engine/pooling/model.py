"""PoolingModel: one model set up for embed, classify or score, over the engine (decoders) or
transformers' forward (encoders); one RowResult per input, in order. Score: a classification head
through a sigmoid, else the cosine of the two embeddings (vLLM's rule). `task="auto"` is read from
the folder's architectures as vLLM resolves it: a sentence-transformers folder embeds; else the
first architecture with a known class-name suffix decides (a bare `*Model` embeds); no match generates.

On the engine (pool_on_engine), nothing is sampled or detokenized: a pooling prompt is a
max_tokens 0 sequence of the LLM's own scheduler, so admission, chunking and preemption are
generation's rules, and the runner's packed forward (`pool_forward`) returns hidden states that
feed its PoolAccumulator; it ends in the step whose chunk completes its prompt (the batch's
`ends`). Only last-token pooling reuses a cached prefix (mean and CLS need the prefix positions'
hidden states, which the cache does not hold). A decoder classifier's head (`score`) is read
from the folder's safetensors (the engine loads the model as a causal LM, which leaves it out).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from transformers import AutoConfig, PretrainedConfig

from batchgen.engine.api.params import SamplingParams
from batchgen.engine.core.sequence import RequestExtras, Sequence
from batchgen.engine.loop.engine import Engine
from batchgen.engine.pooling.config import PoolingConfig, PoolingParams, RowResult, resolve_pooling
from batchgen.engine.pooling.hf_runner import Encoded, HFPoolingRunner, is_encoder
from batchgen.engine.pooling.poolers import PoolAccumulator, cosine, finish_embeddings, head_probs

TASKS = ("generate", "embed", "classify", "score")
_SCORED = SamplingParams(max_tokens=0)  # the scheduler ends it, unsampled, when its prompt is computed
HEAD = "score"  # a decoder classifier's head in the checkpoint

# class-name suffix -> task, tried in this order (the earlier, more specific suffixes win over "Model")
_SUFFIX_TASKS: tuple[tuple[str, str], ...] = (
    ("ForCausalLM", "generate"),
    ("ForConditionalGeneration", "generate"),
    ("ChatModel", "generate"),
    ("LMHeadModel", "generate"),
    ("ForTextEncoding", "embed"),
    ("EmbeddingModel", "embed"),
    ("ForSequenceClassification", "classify"),
    ("ClassificationModel", "classify"),
    ("ForRewardModeling", "embed"),
    ("RewardModel", "embed"),
    ("Model", "embed"),
)


def task_of_architectures(architectures: list[str]) -> str:
    """The task of the first architecture with a known suffix; "generate" when none has one."""
    found = (task for name in architectures for suffix, task in _SUFFIX_TASKS if name.endswith(suffix))
    return next(found, "generate")


def auto_task(path: str | Path) -> str:
    """The task `task="auto"` means for the model folder `path` (see the module docstring)."""
    if (Path(path) / "modules.json").is_file():  # sentence-transformers: even a *ForCausalLM embeds
        return "embed"
    architectures = getattr(AutoConfig.from_pretrained(path), "architectures", None) or []
    return task_of_architectures(list(architectures))


def resolve_task(path: str | Path, task: str) -> str:
    """LLM's task: "auto" as auto_task says, "pooling" (vLLM's runner="pooling") the folder's
    pooling task (classify for a classifier, else embed), any other name as given."""
    if task == "auto":
        return auto_task(path)
    if task == "pooling":
        found = auto_task(path)
        return "embed" if found == "generate" else found
    return task


def reads_head(config: PretrainedConfig, task: str) -> bool:
    """Whether `task` reads the model's sequence-classification head: classify, or score on a
    classifier (a cross-encoder, reward model, ...)."""
    architectures = getattr(config, "architectures", None) or []
    classifier = any(name.endswith("ForSequenceClassification") for name in architectures)
    return task == "classify" or (task == "score" and classifier)


def runs_on_engine(path: str | Path, task: str) -> bool:
    """Whether `task` on this model runs through batchgen's engine: all but an encoder's pooling."""
    return task == "generate" or not is_encoder(AutoConfig.from_pretrained(path))


def pool_on_engine(
    engine: Engine, prompts: list[list[int]], method: str, on_step: Callable[[], None] | None = None
) -> list[RowResult]:
    """Pooled hidden states [H] float32 of every prompt, in the given order (callers order by length),
    through `engine`'s scheduler and runner. `on_step` runs after every forward (the job runner stops
    there on a signal)."""
    scheduler = engine.scheduler
    results = [RowResult(None, error="not run")] * len(prompts)
    pooled: dict[int, tuple[int, PoolAccumulator]] = {}
    extras = RequestExtras(uncached=method != "last")
    for index, prompt in enumerate(prompts):
        seq = Sequence(scheduler.new_seq_id(), list(prompt), _SCORED, extras=extras)
        why = scheduler.check_fits(seq)
        if why is not None:
            results[index] = RowResult(None, error=why)
            continue
        scheduler.add(seq)
        pooled[seq.seq_id] = (index, PoolAccumulator(method, seq.num_tokens))
    try:
        while scheduler.has_unfinished():
            batch = scheduler.schedule()
            hidden, ends = engine.runner.pool_forward(batch)  # [T, H], each chunk's end in the packed row
            for chunk, end in zip(batch.chunks, ends):
                pooled[chunk.seq_id][1].add(chunk.start, hidden[end - chunk.num_tokens : end])
            for seq_id in batch.ends:
                index, acc = pooled.pop(seq_id)
                cached = scheduler.get(seq_id).num_cached_tokens
                results[index] = RowResult(acc.result().cpu(), cached)  # [H] float32 on the host
                scheduler.finish(seq_id)
            if on_step is not None:
                on_step()
    except BaseException:
        # why everything: a failed forward may have left blocks registered with K/V never written
        engine.abort_all()
        raise
    engine.runner.apply(scheduler.take_update())  # the last finished sequences have no next step
    return results


class PoolingModel:
    def __init__(
        self,
        task: str,
        pooling: PoolingConfig,
        engine: Engine | None = None,
        hf: HFPoolingRunner | None = None,
        head: torch.nn.Linear | None = None,
        id2label: dict[int, str] | None = None,
    ) -> None:
        """`engine`: an LLM's engine, which pools a decoder model; `head`: a decoder classifier's head
        over its last-token hidden states."""
        self.task, self.pooling, self.engine, self.hf, self.head = task, pooling, engine, hf, head
        self.classifier = head is not None or (hf is not None and hf.kind == "classify")
        table = engine.vocab_size if engine is not None else hf.model.get_input_embeddings().num_embeddings if hf else 0
        self.vocab_size = int(table)  # the embedding table's rows: callers refuse an input with an id past it
        self.on_step: Callable[[], None] | None = None  # after every forward (the job runner's stop point)
        self.id2label = {int(k): str(v) for k, v in (id2label or {}).items()}

    @classmethod
    def build(
        cls,
        path: str | Path,
        task: str,
        device: torch.device,
        dtype: torch.dtype,
        budget: int,
        engine: Engine | None = None,
        pooler_config: dict[str, Any] | None = None,
    ) -> PoolingModel:
        """`engine`: the LLM's engine for a decoder model (runs_on_engine); else transformers."""
        options = dict(pooler_config or {})
        method = options.pop("pooling_type", None)
        normalize = options.pop("normalize", None)
        if options:
            raise TypeError(f"pooler_config: unknown key(s) {sorted(options)} (known: pooling_type, normalize)")
        config = AutoConfig.from_pretrained(path)
        pooling = resolve_pooling(
            path,
            engine is not None or not is_encoder(config),
            method.lower() if isinstance(method, str) else None,
            normalize,
        )
        wants_head = reads_head(config, task)
        labels = getattr(config, "id2label", None) if wants_head else None
        if engine is not None and wants_head:
            head = load_score_head(path, device, dtype)
            return cls(task, PoolingConfig("last", False), engine=engine, head=head, id2label=labels)
        if engine is not None:
            return cls(task, pooling, engine=engine)
        kind = "classify" if wants_head else "embed"
        return cls(task, pooling, hf=HFPoolingRunner(path, kind, device, dtype, budget), id2label=labels)

    def embed(self, inputs: list[Encoded], params: PoolingParams | None = None) -> list[RowResult]:
        """Each input's embedding [D] float32: pooled, truncated to `dimensions`, normalized."""
        config = self.pooling
        if params is not None:
            normalize = config.normalize if params.normalize is None else params.normalize
            config = PoolingConfig(config.method, normalize, params.dimensions or config.dimensions)
        if self.engine is not None:
            results = pool_on_engine(self.engine, [e.input_ids for e in inputs], config.method, self.on_step)
        elif self.hf is not None and not self.classifier:
            results = [RowResult(v) for v in self.hf.run(inputs, config.method, self.on_step)]
        else:
            raise ValueError("this model has a classification head: use classify or score, not embed")
        for r in results:
            if r.values is not None:
                r.values = finish_embeddings(r.values[None], config)[0]
        return results

    def classify(self, inputs: list[Encoded]) -> list[RowResult]:
        """Each input's class probabilities [C] (softmax; sigmoid for one label); on the engine, a
        decoder classifier's head over each input's last-token hidden state."""
        if not self.classifier:
            raise ValueError(
                "classify needs a model with a sequence-classification head (architectures *ForSequenceClassification)"
            )
        if self.hf is not None:
            return [RowResult(head_probs(logits[None])[0]) for logits in self.hf.run(inputs, on_step=self.on_step)]
        if self.engine is None or self.head is None:
            raise RuntimeError("no engine classifier set up")
        results = pool_on_engine(self.engine, [e.input_ids for e in inputs], "last", self.on_step)
        weight = self.head.weight
        for r in results:
            if r.values is not None:
                with torch.inference_mode():
                    logits = self.head(r.values.to(device=weight.device, dtype=weight.dtype)[None])  # [1, C]
                r.values = head_probs(logits)[0].cpu()
        return results

    def score(self, inputs: list[Encoded], pairs: list[tuple[Encoded, Encoded]] | None = None) -> list[RowResult]:
        """Classifier models: the single-label head's sigmoid of each input (a row, or a pair
        tokenized together). Embedding models: the cosine of each pair's two embeddings."""
        if self.classifier:
            results = self.classify(inputs)
            for r in results:
                if r.values is not None and r.values.numel() != 1:
                    raise ValueError(f"score needs a single-label head; this model has {r.values.numel()} labels")
                r.values = r.values[0] if r.values is not None else None
            return results
        if pairs is None:
            raise ValueError("an embedding model scores (query, document) pairs only (cosine similarity)")
        left = self.embed([a for a, _ in pairs])
        right = self.embed([b for _, b in pairs])
        out: list[RowResult] = []
        for a, b in zip(left, right):
            if a.values is None or b.values is None:
                out.append(RowResult(None, error=a.error or b.error))
            else:
                out.append(RowResult(cosine(a.values[None], b.values[None])[0], a.cached_tokens + b.cached_tokens))
        return out

    def label_of(self, probs: torch.Tensor) -> str:
        best = int(probs.argmax())
        return self.id2label.get(best, str(best))


def prefix_cache_applies(path: str | Path, task: str, pooling_type: str | None) -> bool:
    """Whether a pooling task's rows can be served from the prefix cache: decoder models on the
    engine with last-token pooling (embeddings, classifier heads; see pool_on_engine); never mean
    or CLS pooling, nor encoders."""
    config = AutoConfig.from_pretrained(path)
    if task == "generate" or is_encoder(config):
        return False
    if reads_head(config, task):
        return True  # a decoder classifier's head reads the last token's hidden state
    return resolve_pooling(path, True, pooling_type).method == "last"


def load_score_head(path: str | Path, device: torch.device, dtype: torch.dtype) -> torch.nn.Linear:
    """The `score` linear layer of the checkpoint in `path` (weight [num_labels, hidden], bias if any)."""
    folder = Path(path)
    tensors: dict[str, torch.Tensor] = {}
    files = sorted(folder.glob("*.safetensors"))
    for file in files:
        with safe_open(str(file), "pt") as handle:
            for key in handle.keys():  # noqa: SIM118 - safe_open handles are not mappings
                if key in (f"{HEAD}.weight", f"{HEAD}.bias"):
                    tensors[key.removeprefix(f"{HEAD}.")] = handle.get_tensor(key)
    if "weight" not in tensors:
        found = ", ".join(f.name for f in files) or "no .safetensors files"
        raise ValueError(f"{folder}: no classification head `{HEAD}.weight` found ({found})")
    labels, hidden = tensors["weight"].shape
    head = torch.nn.Linear(hidden, labels, bias="bias" in tensors)
    head.load_state_dict(tensors)
    return head.to(device=device, dtype=dtype).eval()
