"""The tensor-parallel sharding plan: which architectures can be split over N ranks, each rank's
model config, and which rows or columns of each checkpoint tensor a rank holds.

Megatron-style rules (column-parallel q/k/v and gate/up, row-parallel o/down, vocab-split head,
KV heads replicated below N), pure arithmetic, so a refusal comes before any process or weight.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

from transformers import PretrainedConfig

from batchgen.engine.runner.model_limits import UnsupportedModelError

# model_type -> its attention/MLP projection names follow the Llama layout (q/k/v/o, gate/up/down,
# or Phi-3's fused qkv_proj / gate_up_proj) or GPT-NeoX's (query_key_value per head, dense,
# dense_h_to_4h / dense_4h_to_h), and every per-head norm in it is over head_dim only.
# Why a list, not a guess: a model whose norm spans all heads (OLMo 2's q_norm over H * D) would
# run sharded without an error and produce wrong text; only layouts the tests check are accepted.
SHARDABLE = frozenset({"llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text", "gpt_neox"})
WHY_NOT = {
    "gpt2": "its fused c_attn projection (Conv1D) has no sharding plan yet",
    "olmo2": "its q_norm/k_norm normalise over all heads at once, which a head split would change",
}

ROW = frozenset({"o_proj", "down_proj", "dense", "dense_4h_to_h"})  # input columns split; outputs all-reduced
HEAD = "lm_head"


@dataclass(frozen=True)
class ShardPlan:
    """One rank's share: heads, KV heads, MLP width and vocabulary rows."""

    rank: int
    world: int
    num_heads: int  # all query heads (H)
    num_kv_heads: int  # all KV heads (KVH)
    head_dim: int  # D
    intermediate: int  # I
    vocab: int  # the LM head's rows (V)

    @property
    def heads(self) -> range:
        """This rank's query heads."""
        per = self.num_heads // self.world
        return range(self.rank * per, (self.rank + 1) * per)

    @property
    def kv_heads(self) -> range:
        """This rank's KV heads: a 1/N share, or (KVH < N) the one its query heads read, replicated."""
        if self.num_kv_heads >= self.world:
            per = self.num_kv_heads // self.world
            return range(self.rank * per, (self.rank + 1) * per)
        first = self.heads.start // (self.num_heads // self.num_kv_heads)
        return range(first, first + 1)

    @property
    def vocab_shard(self) -> int:
        """Rows of the head per rank: the vocabulary split evenly, the last share padded."""
        return math.ceil(self.vocab / self.world)

    def rows(self, name: str, full_rows: int) -> list[tuple[int, int]]:
        """The [start, end) row ranges of tensor `name`'s dim 0 this rank holds, in order (several
        for a fused projection); [(0, full_rows)] for a replicated tensor."""
        kind = name.split(".")[-2] if "." in name else name
        d, inter = self.head_dim, self.intermediate // self.world
        q = (self.heads.start * d, self.heads.stop * d)
        kv = (self.kv_heads.start * d, self.kv_heads.stop * d)
        mlp = (self.rank * inter, (self.rank + 1) * inter)
        single = {"q_proj": q, "k_proj": kv, "v_proj": kv, "gate_proj": mlp, "up_proj": mlp, "dense_h_to_4h": mlp}
        if kind in single:
            return [single[kind]]
        if kind == "query_key_value":  # [H * 3D]: each head's q, k and v rows together
            return [(self.heads.start * 3 * d, self.heads.stop * 3 * d)]
        if kind == "qkv_proj":
            k0, v0 = self.num_heads * d, (self.num_heads + self.num_kv_heads) * d
            return [q, (k0 + kv[0], k0 + kv[1]), (v0 + kv[0], v0 + kv[1])]
        if kind == "gate_up_proj":
            return [mlp, (self.intermediate + mlp[0], self.intermediate + mlp[1])]
        if kind == HEAD and name.endswith(".weight"):
            start = self.rank * self.vocab_shard
            return [(min(start, full_rows), min(start + self.vocab_shard, full_rows))]
        return [(0, full_rows)]

    def columns(self, name: str) -> tuple[int, int] | None:
        """The [start, end) columns (dim 1) of a row-parallel weight this rank holds; None: all."""
        kind = name.split(".")[-2] if "." in name else ""
        if not name.endswith(".weight"):
            return None
        if kind in ("o_proj", "dense"):
            return (self.heads.start * self.head_dim, self.heads.stop * self.head_dim)
        if kind in ("down_proj", "dense_4h_to_h"):
            inter = self.intermediate // self.world
            return (self.rank * inter, (self.rank + 1) * inter)
        return None

    def zero_bias(self, name: str) -> bool:
        """A row-parallel bias is added once to the all-reduced sum: rank 0 keeps it, others zero it."""
        kind = name.split(".")[-2] if "." in name else ""
        return kind in ROW and name.endswith(".bias") and self.rank != 0


def shard_plan(config: PretrainedConfig, rank: int, world: int) -> ShardPlan:
    """The plan of `rank` of `world`, or an UnsupportedModelError naming why the model cannot be split."""
    text = config.get_text_config()
    model_type = str(getattr(text, "model_type", "?"))
    prefix = f"tensor_parallel_size {world}: {type(config).__name__} ({model_type})"
    if model_type not in SHARDABLE:
        why = WHY_NOT.get(model_type, "it has no tensor-parallel sharding plan")
        raise UnsupportedModelError(f"{prefix} cannot be split: {why}; supported: {', '.join(sorted(SHARDABLE))}")
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    intermediate = int(text.intermediate_size)
    checks = [
        (heads % world == 0, f"{heads} attention heads are not divisible by {world}"),
        (kv_heads % world == 0 or world % kv_heads == 0, f"{kv_heads} KV heads do not divide {world} nor it them"),
        (intermediate % world == 0, f"intermediate_size {intermediate} is not divisible by {world}"),
    ]
    for ok, why in checks:
        if not ok:
            raise UnsupportedModelError(f"{prefix} cannot be split: {why}")
    vocab = int(text.vocab_size)
    return ShardPlan(rank, world, heads, kv_heads, head_dim, intermediate, vocab)


def rank_config(config: PretrainedConfig, plan: ShardPlan) -> PretrainedConfig:
    """Each rank's config: its share of heads, KV heads and MLP width (head_dim pinned: some
    architectures derive it from the head count)."""
    out = copy.deepcopy(config)
    text = out.get_text_config()
    text.num_attention_heads = len(plan.heads)
    text.num_key_value_heads = len(plan.kv_heads)
    text.intermediate_size = plan.intermediate // plan.world
    text.head_dim = plan.head_dim
    return out
