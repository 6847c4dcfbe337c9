"""Build sample_data/prompts.parquet, the demo batch job's input, from TinyStories openings.

One responsibility: a deterministic (seeded) prompt table with columns `id`, `prompt`,
`category`. Most rows share a few-shot preamble, as real batch jobs do, so the prefix cache has
something to reuse. Every prompt stays under MAX_PROMPT_TOKENS of the demo tokenizer so that
prompt + 128 new tokens fits in 512.

    python scripts/make_sample_data.py --corpus ../shared/corpus
"""

from __future__ import annotations

import argparse
import random
import re
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from transformers import AutoTokenizer, PreTrainedTokenizerBase

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_demo_model import REPO, load_corpus

MAX_PROMPT_TOKENS = 350
MIN_OPENING_WORDS = 5
INSTRUCTION = "Write a story like the one above. It begins:"
# category -> (share of rows, (min, max) opening sentences, number of example stories)
CATEGORIES = {
    "opening": (0.40, (1, 4), 0),
    "fewshot": (0.35, (1, 2), 1),
    "fewshot_long": (0.25, (1, 3), 2),
}
SENTENCE_END = re.compile(r'(?<=[.!?])\s+|(?<=[.!?]["”])\s+')


def opening(story: str, sentences: int) -> str:
    """The first `sentences` sentences of a story (at least MIN_OPENING_WORDS words), line breaks kept."""
    cuts = [m.start() for m in SENTENCE_END.finditer(story)][sentences - 1 :]
    for cut in cuts:
        if len(story[:cut].split()) >= MIN_OPENING_WORDS:
            return story[:cut].strip()
    return story.strip()


def preamble(examples: list[str]) -> str:
    """The shared few-shot prefix: example stories, then the instruction."""
    parts = [f"Story {i + 1}:\n{story}" for i, story in enumerate(examples)]
    return "\n\n".join(parts) + f"\n\n{INSTRUCTION}\n"


def pick_examples(stories: list[str], tok: PreTrainedTokenizerBase) -> list[str]:
    """Three short example stories that start properly (fixed by position in the held-out list)."""
    short = [s for s in stories if 80 <= n_tokens(tok, s) <= 120 and s.startswith("Once upon a time")]
    return short[:3]


def n_tokens(tok: PreTrainedTokenizerBase, text: str) -> int:
    """Token count as the engine will see it (no special tokens are added by this tokenizer)."""
    # why: the backend tokenizer does not warn about texts longer than model_max_length
    return len(tok.backend_tokenizer.encode(text, add_special_tokens=False).ids)


def make_prompt(
    story: str, category: str, prefixes: dict[str, str], rng: random.Random, tok: PreTrainedTokenizerBase
) -> str | None:
    """One prompt for one story; shortens the opening until it fits, None if it never does."""
    _, (low, high), _ = CATEGORIES[category]
    for sentences in range(rng.randint(low, high), 0, -1):
        prompt = prefixes[category] + opening(story, sentences)
        if n_tokens(tok, prompt) <= MAX_PROMPT_TOKENS:
            return prompt
    return None


def build_rows(
    stories: list[str], prefixes: dict[str, str], rows: int, seed: int, tok: PreTrainedTokenizerBase
) -> list[dict[str, str]]:
    """Draw categories by share, stories in a seeded order; ids are unique and zero-padded."""
    rng = random.Random(seed)
    order = stories[:]
    rng.shuffle(order)
    names = list(CATEGORIES)
    weights = [CATEGORIES[name][0] for name in names]
    out: list[dict[str, str]] = []
    i = 0
    while len(out) < rows:
        category = rng.choices(names, weights)[0]
        prompt = make_prompt(order[i % len(order)], category, prefixes, rng, tok)
        i += 1
        if prompt is not None:
            out.append({"id": f"story-{len(out):05d}", "prompt": prompt, "category": category})
    return out


def write_table(rows: list[dict[str, str]], path: Path) -> None:
    """Plain string columns; fixed row group so the file is byte-for-byte reproducible."""
    schema = pa.schema([("id", pa.string()), ("prompt", pa.string()), ("category", pa.string())])
    table = pa.Table.from_pylist(rows, schema=schema)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path, row_group_size=1000, compression="zstd")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", type=Path, default=REPO.parent / "shared" / "corpus")
    parser.add_argument("--model", type=Path, default=REPO / "sample_data" / "demo-model")
    parser.add_argument("--out", type=Path, default=REPO / "sample_data" / "prompts.parquet")
    parser.add_argument("--rows", type=int, default=2400)
    parser.add_argument("--seed", type=int, default=20240601)
    args = parser.parse_args()
    tok = AutoTokenizer.from_pretrained(args.model)
    train, heldout = load_corpus(args.corpus)
    examples = pick_examples(heldout, tok)
    prefixes = {"opening": "", "fewshot": preamble(examples[:1]), "fewshot_long": preamble(examples[1:3])}
    pool = [s for s in heldout if s not in examples] + train
    rows = build_rows(pool, prefixes, args.rows, args.seed, tok)
    write_table(rows, args.out)
    counts = {name: sum(r["category"] == name for r in rows) for name in CATEGORIES}
    lengths = sorted(n_tokens(tok, r["prompt"]) for r in rows)
    print(f"wrote {len(rows)} rows to {args.out}: {counts}")
    print(f"prompt tokens: min {lengths[0]} median {lengths[len(lengths) // 2]} max {lengths[-1]}")
    for name, prefix in prefixes.items():
        print(f"{name} shared prefix: {n_tokens(tok, prefix)} tokens")


if __name__ == "__main__":
    main()
