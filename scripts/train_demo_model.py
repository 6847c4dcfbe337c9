"""Train the tiny demo model (byte-level BPE tokenizer + small Llama) on the TinyStories corpus.

One responsibility: turn ../shared/corpus/ into sample_data/demo-model/ (weights, tokenizer,
generation config, TRAINING.md). The corpus text itself never enters the repository.

    python scripts/train_demo_model.py --corpus ../shared/corpus --out sample_data/demo-model
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

REPO = Path(__file__).resolve().parent.parent
EOS = "<|endoftext|>"
TRAIN_FILES = ("tinystories_v1_train_first2MiB.txt", "tinystories_v2_train_first10k_lines.txt")
HELDOUT_FILE = "tinystories_hf_validation_first1000.txt"
MOJIBAKE = ("â€", "Ã", "Â")
# Roles are plain text, not special tokens: the demo model was never tuned on chat, the template
# only has to render so that `messages` jobs run end to end.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] | capitalize }}: {{ message['content'] | trim }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)
OPENINGS = (
    "Once upon a time, there was a little dog named Max.",
    "Lily and her mom went to the park on a sunny day.",
    "Tom had a red ball. He liked to play with it every day.",
)


@dataclass
class TrainSettings:
    """Hyper-parameters recorded verbatim in TRAINING.md."""

    steps: int = 1200
    batch_size: int = 8
    seq_len: int = 512
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 60
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 1234
    vocab_size: int = 4096
    threads: int = 2


def read_stories(path: Path, drop_last: bool) -> list[str]:
    """Split one corpus file on the EOS marker; normalise paragraphs to single newlines."""
    pieces = path.read_text(encoding="utf-8").split(EOS)
    if drop_last:
        pieces = pieces[:-1]  # why: the last piece of a truncated file is cut off mid-story
    stories = []
    for piece in pieces:
        lines = [line.strip() for line in piece.strip().splitlines()]
        text = "\n".join(line for line in lines if line)
        if text:
            stories.append(text)
    return stories


def load_corpus(corpus: Path) -> tuple[list[str], list[str]]:
    """Return (train stories, held-out stories); held-out = the clean validation stories."""
    train = [s for name in TRAIN_FILES for s in read_stories(corpus / name, drop_last=True)]
    heldout = read_stories(corpus / HELDOUT_FILE, drop_last=False)
    heldout = [s for s in heldout if not any(bad in s for bad in MOJIBAKE)]
    return train, heldout


def train_tokenizer(stories: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE with EOS as the only special token (id 0), wrapped for transformers."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(stories, trainer=trainer)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, pad_token=EOS, unk_token=None)
    wrapped.chat_template = CHAT_TEMPLATE
    wrapped.model_max_length = 1024
    return wrapped


def demo_config(vocab_size: int, eos_id: int) -> LlamaConfig:
    """The demo model's shape: a small Llama with grouped-query attention (8 query heads share 4 K/V
    heads). benchmarks/bench_models.py builds its random stand-in from this too."""
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        dtype="float32",
    )


def build_model(vocab_size: int, eos_id: int) -> LlamaForCausalLM:
    return LlamaForCausalLM(demo_config(vocab_size, eos_id))


def pack(stories: list[str], tok: PreTrainedTokenizerFast) -> torch.Tensor:
    """One long token stream: EOS, story, EOS, story, ... EOS."""
    eos = tok.eos_token_id
    ids = [eos]
    # why: the backend tokenizer skips the model_max_length warning for long stories
    for encoded in tok.backend_tokenizer.encode_batch(stories, add_special_tokens=False):
        ids.extend(encoded.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def lr_at(step: int, s: TrainSettings) -> float:
    """Linear warmup then cosine decay to min_lr_ratio * lr."""
    if step < s.warmup_steps:
        return s.lr * (step + 1) / s.warmup_steps
    progress = (step - s.warmup_steps) / max(1, s.steps - s.warmup_steps)
    return s.lr * (s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def heldout_loss(model: LlamaForCausalLM, stream: torch.Tensor, seq_len: int, limit: int = 0) -> float:
    """Mean cross-entropy per predicted token over non-overlapping windows of the held-out stream."""
    model.eval()
    n_windows = (len(stream) - 1) // seq_len
    if limit:
        n_windows = min(n_windows, limit)
    total, count = 0.0, 0
    for start in range(0, n_windows, 8):
        rows = range(start, min(start + 8, n_windows))
        batch = torch.stack([stream[i * seq_len : (i + 1) * seq_len + 1] for i in rows])  # [b, seq_len + 1]
        logits = model(input_ids=batch[:, :-1]).logits  # [b, seq_len, vocab]
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten(), reduction="sum")
        total, count = total + loss.item(), count + batch[:, 1:].numel()
    model.train()
    return total / count


def train(model: LlamaForCausalLM, stream: torch.Tensor, val: torch.Tensor, s: TrainSettings) -> list[str]:
    """AdamW on random packed windows; returns the progress log lines."""
    gen = torch.Generator().manual_seed(s.seed)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": s.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=s.lr,
        betas=(0.9, 0.95),
        fused=False,
    )
    log: list[str] = []
    start = time.time()
    model.train()
    for step in range(s.steps):
        offsets = torch.randint(0, len(stream) - s.seq_len - 1, (s.batch_size,), generator=gen)
        batch = torch.stack([stream[o : o + s.seq_len + 1] for o in offsets.tolist()])  # [b, seq_len+1]
        for group in opt.param_groups:
            group["lr"] = lr_at(step, s)
        logits = model(input_ids=batch[:, :-1]).logits  # [b, seq_len, vocab]
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), s.grad_clip)
        opt.step()
        if step % 50 == 0 or step == s.steps - 1:
            line = f"step {step} loss {loss.item():.3f} lr {lr_at(step, s):.2e} {time.time() - start:.0f}s"
            if step % 250 == 0 or step == s.steps - 1:
                line += f" heldout {heldout_loss(model, val, s.seq_len, limit=16):.3f}"
            print(line, flush=True)
            log.append(line)
    return log


def continuations(model: LlamaForCausalLM, tok: PreTrainedTokenizerFast, seed: int) -> list[dict[str, Any]]:
    """Sampled continuations of fixed story openings, with whether they ended in EOS."""
    model.eval()
    out = []
    for i, opening in enumerate(OPENINGS):
        torch.manual_seed(seed + i)
        ids = tok(opening, return_tensors="pt", add_special_tokens=False)["input_ids"]
        gen = model.generate(
            ids,
            max_new_tokens=200,
            do_sample=True,
            temperature=0.7,
            top_p=0.9,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.eos_token_id,
        )[0, ids.shape[1] :]
        ended = bool(len(gen) and gen[-1].item() == tok.eos_token_id)
        text = tok.decode(gen, skip_special_tokens=True)
        out.append({"opening": opening, "text": text, "new_tokens": len(gen), "eos": ended})
    return out


def report_head(facts: dict[str, Any]) -> list[str]:
    """TRAINING.md up to the training settings: model, tokenizer, data, cost."""
    s = facts["settings"]
    tokens_seen = s["steps"] * s["batch_size"] * s["seq_len"]
    return [
        "# Demo model: how it was trained",
        "",
        "A tiny Llama trained from scratch by `scripts/train_demo_model.py` so that the quickstart,",
        "tests and benchmarks have a real model that runs on a CPU. It writes simple children's stories.",
        "",
        "## Model and tokenizer",
        f"- LlamaForCausalLM, {facts['params']:,} parameters (embeddings tied with the LM head), float32.",
        "- hidden 256, 4 layers, 8 attention heads, 4 key/value heads (grouped-query attention),",
        "  head_dim 32, intermediate 688, max_position_embeddings 1024, default RoPE.",
        f"- Byte-level BPE tokenizer trained on the training stories, vocab {facts['vocab']},"
        f" `{EOS}` = id {facts['eos_id']} is EOS (and BOS/pad); no BOS is added when encoding.",
        "- Chat template: `Role: content` lines, then `Assistant:` for add_generation_prompt.",
        "",
        "## Data",
        f"- Training: {facts['n_train']:,} complete stories ({facts['train_tokens']:,} tokens) from"
        f" `{TRAIN_FILES[0]}` and `{TRAIN_FILES[1]}`.",
        f"- Held out: {facts['n_heldout']:,} stories of `{HELDOUT_FILE}` (those with upstream mojibake"
        f" dropped), {facts['heldout_tokens']:,} tokens. Never trained on.",
        "- Stories are packed into one stream with EOS between them; tinyshakespeare is not used.",
        "",
        "## Training",
        "```",
        json.dumps(s, indent=2),
        "```",
        f"- AdamW (betas 0.9/0.95), linear warmup then cosine decay, grad-norm clip, random packed"
        f" {s['seq_len']}-token windows, torch {torch.__version__}, {s['threads']} CPU threads.",
        f"- Tokens seen: {tokens_seen:,}. Wall time: {facts['wall_s'] / 60:.1f} min"
        " (tokenizer + training + evaluation) on a 2-core CPU shared with other jobs,",
        "  so it varies from run to run; the seconds column of the log shows the pace.",
    ]


def write_report(out: Path, facts: dict[str, Any], samples: list[dict[str, Any]], log: list[str]) -> None:
    """TRAINING.md: settings and cost, held-out loss, samples, log, provenance and licence."""
    loss = facts["heldout_loss"]
    lines = report_head(facts) + [
        "",
        f"## Held-out loss: {loss:.3f} nats/token (perplexity {math.exp(loss):.1f})",
        "Mean cross-entropy per predicted token over non-overlapping 512-token windows of the packed",
        "held-out stream.",
        "",
        "## Sample continuations (temperature 0.7, top-p 0.9, seeded, up to 200 new tokens)",
    ]
    for sample in samples:
        lines += [
            "",
            f"**{sample['opening']}** {sample['text'].strip()}",
            "",
            f"_({sample['new_tokens']} new tokens, ended with EOS: {sample['eos']})_",
        ]
    lines += [
        "",
        "## Training log",
        "",
        "`heldout` here is a quick estimate on the first 16 held-out windows.",
        "",
        "```",
        *log,
        "```",
        "",
        "## Provenance and licence",
        "The corpus is TinyStories (Eldan & Li, 2023, arXiv:2305.07759,"
        " huggingface.co/datasets/roneneldan/TinyStories), licensed CDLA-Sharing-1.0",
        "(https://cdla.dev/sharing-1-0/). The copies used are described in `shared/corpus/SOURCE.md`.",
        "CDLA-Sharing-1.0 does not cover the results of training on the data, so these weights are",
        "not covered by it; they are released with this repository.",
        "",
    ]
    (out / "TRAINING.md").write_text("\n".join(lines), encoding="utf-8")


def save(model: LlamaForCausalLM, tok: PreTrainedTokenizerFast, out: Path) -> None:
    """safetensors weights, tokenizer files and a generation config whose EOS is `<|endoftext|>`."""
    out.mkdir(parents=True, exist_ok=True)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.bos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.eos_token_id
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)


def main() -> None:
    """Parse settings; train tokenizer and model; evaluate; save the folder and TRAINING.md."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", type=Path, default=REPO.parent / "shared" / "corpus")
    parser.add_argument("--out", type=Path, default=REPO / "sample_data" / "demo-model")
    for name, value in asdict(TrainSettings()).items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    args = parser.parse_args()
    s = TrainSettings(**{k: getattr(args, k) for k in asdict(TrainSettings())})
    begin = time.time()
    torch.set_num_threads(s.threads)
    torch.manual_seed(s.seed)
    train_stories, heldout = load_corpus(args.corpus)
    tok = train_tokenizer(train_stories, s.vocab_size)
    stream, val = pack(train_stories, tok), pack(heldout, tok)
    print(f"train {len(train_stories)} stories {len(stream)} tokens; heldout {len(heldout)} / {len(val)}")
    model = build_model(len(tok), tok.eos_token_id)
    log = train(model, stream, val, s)
    facts = {
        "settings": asdict(s),
        "params": sum(p.numel() for p in model.parameters()),
        "vocab": len(tok),
        "eos_id": tok.eos_token_id,
        "n_train": len(train_stories),
        "train_tokens": len(stream),
        "n_heldout": len(heldout),
        "heldout_tokens": len(val),
        "heldout_loss": heldout_loss(model, val, s.seq_len),
    }
    samples = continuations(model, tok, s.seed)
    save(model, tok, args.out)
    facts["wall_s"] = time.time() - begin
    write_report(args.out, facts, samples, log)
    print(json.dumps({k: v for k, v in facts.items() if k != "settings"}, indent=2))
    for sample in samples:
        print(f"--- {sample['opening']} {sample['text']}")


if __name__ == "__main__":
    main()
