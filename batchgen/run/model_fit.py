"""Whether the model folder can serve the job, read from its config alone (no weights, no torch),
so `validate` says it and `run` refuses before any work.

Two kinds of misfit, two exit codes (README "Exit codes"): a job value the model cannot take
(`pooling.dimensions` beyond the hidden size, an `engine.tensor_parallel_size` the model's heads
or MLP do not divide, or its architecture has no plan for) is a job-file error, exit 2, naming the
key; a folder that cannot serve the task (no sequence-classification head for classify or row
scores, a head of 3 labels for a single score, a sentence-transformers module batchgen does not
apply) is a model error, exit 4.
"""

from __future__ import annotations

from typing import Any

from batchgen.errors import JobFileError, ModelError
from batchgen.job.spec import JobSpec


def check_model_fit(spec: JobSpec, config: Any) -> None:
    """Raise the JobFileError or ModelError a run would meet only once it loads the model."""
    _check_parallel(spec, config)
    if spec.task != "generate":
        _check_pooling(spec, config)


def _check_parallel(spec: JobSpec, config: Any) -> None:
    from batchgen.engine.parallel.plan import shard_plan  # why lazy: transformers' config classes only
    from batchgen.engine.runner.model_limits import UnsupportedModelError

    world = spec.engine.tensor_parallel_size
    if world <= 1:
        return
    try:
        shard_plan(config, 0, world)
    except UnsupportedModelError as exc:
        where = spec.where("engine.tensor_parallel_size")
        raise JobFileError(f"{where}: engine.{exc} (model.path {spec.model.path})") from None


def head_labels(config: Any) -> int | None:
    """The number of labels of the folder's sequence-classification head; None: it has none."""
    architectures = getattr(config, "architectures", None) or []
    if not any(str(name).endswith("ForSequenceClassification") for name in architectures):
        return None
    return int(config.num_labels)


def _check_pooling(spec: JobSpec, config: Any) -> None:
    from batchgen.engine.pooling.config import PoolingConfigError, resolve_pooling

    path, pooling = spec.model.path, spec.pooling
    labels = head_labels(config)
    if spec.task == "classify" and labels is None:
        raise ModelError(
            f"model.path {path}: task classify needs a sequence-classification head (architectures "
            f"{getattr(config, 'architectures', None)}); an embedding model embeds (task: embed)"
        )
    if spec.task == "score" and labels is None and pooling is not None and pooling.score == "row":
        raise ModelError(
            f"model.path {path}: pooling.score row needs a sequence-classification head "
            "(a reward model or cross-encoder); an embedding model scores pairs only (pooling.score: pair)"
        )
    if spec.task == "score" and labels not in (None, 1):
        raise ModelError(
            f"model.path {path}: task score needs a single-label head; this model's head has {labels} labels "
            "(use task: classify for its class probabilities)"
        )
    dimensions = pooling.dimensions if pooling is not None else None
    hidden = getattr(config.get_text_config(), "hidden_size", None)
    if spec.task == "embed" and dimensions is not None and isinstance(hidden, int) and dimensions > hidden:
        raise JobFileError(
            f"{spec.where('pooling.dimensions')}: pooling.dimensions {dimensions} exceeds the model's hidden size "
            f"{hidden} (model.path {path})"
        )
    method = pooling.pooling_type if pooling is not None else None
    try:  # the folder's sentence-transformers modules, as the run resolves them (is_decoder: any; not read)
        resolve_pooling(path, True, method, pooling.normalize if pooling is not None else None)
    except PoolingConfigError as exc:
        raise ModelError(f"model.path {path}: {exc}") from None
