"""A decoder classifier's head (`score`, as transformers' *ForSequenceClassification decoders
name it) read from the model folder's safetensors, so that classify and score on a decoder run
through batchgen's engine: the engine computes the last token's hidden state (packed varlen
forwards, prefix reuse) and this head turns it into logits, as transformers' own forward does
at the last real token.

Why read apart: the engine loads the folder as a causal LM (its attention bound to ours), which
leaves the classification head out.
"""

from __future__ import annotations

from pathlib import Path

import torch

HEAD = "score"


def load_score_head(path: str | Path, device: torch.device, dtype: torch.dtype) -> torch.nn.Linear:
    """The `score` linear layer of the checkpoint in `path` (weight [num_labels, hidden], bias if any)."""
    from safetensors import safe_open

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
