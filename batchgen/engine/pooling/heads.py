"""A decoder classifier's head (`score`) read from the folder's safetensors: the engine loads the
model as a causal LM, which leaves the head out, and this head turns its last-token hidden state
into logits, as transformers' forward does.
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
