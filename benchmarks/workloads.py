"""The benchmark's workloads: seeded, token-level, identical for every system that runs them.

(a) mixed: prompt lengths drawn from 16-512 tokens, output lengths from 16-256, EOS ignored,
    so every request asks for exactly its `max_tokens` (real traffic has varied output lengths,
    and a static batch pays for its longest row).
(b) shared_prefix: 80% of every prompt is one preamble (400 of 500 tokens), short outputs;
    prefix caching on vs off.
(c) sample: the sample dataset's prompts (sample_data/prompts.parquet), greedy, stop "\n\n",
    max_tokens 128, EOS honoured, as the example job runs them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[1]
SAMPLE_PROMPTS = REPO / "sample_data" / "prompts.parquet"


@dataclass
class Request:
    prompt_ids: list[int]
    max_tokens: int
    stop: list[str] = field(default_factory=list)


@dataclass
class Workload:
    name: str
    description: str
    requests: list[Request]
    ignore_eos: bool

    @property
    def prompt_tokens(self) -> int:
        return sum(len(r.prompt_ids) for r in self.requests)

    @property
    def max_prompt_len(self) -> int:
        return max(len(r.prompt_ids) for r in self.requests)

    @property
    def max_total_len(self) -> int:
        return max(len(r.prompt_ids) + r.max_tokens for r in self.requests)


def _random_ids(rng: random.Random, n: int, vocab: int, avoid: set[int]) -> list[int]:
    ids: list[int] = []
    while len(ids) < n:
        t = rng.randrange(vocab)
        if t not in avoid:
            ids.append(t)
    return ids


def mixed(n: int, vocab: int, special: set[int], seed: int = 0, max_out: int = 256) -> Workload:
    """(a): random-token prompts of 16-512 tokens, 16-`max_out` output tokens each, EOS ignored."""
    rng = random.Random(seed)
    requests = [
        Request(_random_ids(rng, rng.randint(16, 512), vocab, special), rng.randint(16, max_out)) for _ in range(n)
    ]
    desc = f"{n} requests, prompts 16-512 tokens, outputs 16-{max_out} tokens (per request, EOS ignored)"
    return Workload("a_mixed", desc, requests, ignore_eos=True)


def shared_prefix(n: int, vocab: int, special: set[int], seed: int = 1) -> Workload:
    """(b): one 400-token preamble + 100 own tokens per prompt (80% shared), 16-64 output tokens."""
    rng = random.Random(seed)
    preamble = _random_ids(rng, 400, vocab, special)
    requests = [Request(preamble + _random_ids(rng, 100, vocab, special), rng.randint(16, 64)) for _ in range(n)]
    desc = f"{n} requests, 400-token shared preamble + 100 own tokens, outputs 16-64 tokens (EOS ignored)"
    return Workload("b_shared_prefix", desc, requests, ignore_eos=True)


def sample_dataset(n: int, tokenizer: Any, path: Path = SAMPLE_PROMPTS) -> Workload | None:
    """(c): the first `n` sample prompts, stop "\\n\\n", max_tokens 128, EOS honoured; None if absent."""
    if not path.is_file():
        return None
    prompts = pq.read_table(path, columns=["prompt"]).column("prompt").to_pylist()[:n]
    encoded = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    requests = [Request(list(ids), 128, ["\n\n"]) for ids in encoded]
    desc = f"{len(requests)} sample prompts ({path.name}), greedy, stop '\\n\\n', max_tokens 128, EOS honoured"
    return Workload("c_sample", desc, requests, ignore_eos=False)
