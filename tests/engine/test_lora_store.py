"""The host store of adapter weights: scaling folded into B, bounded by max_cpu_loras, read again
from the folder when dropped, refused when the folder's files changed meanwhile."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from batchgen.engine.lora.spec import AdapterRefused, read_adapter
from batchgen.engine.lora.store import AdapterStore
from testkit.tiny_lora import save_tiny_adapter
from testkit.tiny_models import save_random_model, tiny_configs


def test_store_bounds_reloads_and_refuses_changed_files(tmp_path: Path) -> None:
    base = save_random_model(tiny_configs()["llama"], tmp_path / "base")
    a = read_adapter("a", save_tiny_adapter(base, tmp_path / "a", r=4, alpha=6, seed=1))
    b = read_adapter("b", save_tiny_adapter(base, tmp_path / "b", r=2, seed=2))
    store = AdapterStore(1, torch.float32)
    store.add(a)
    module = "model.layers.0.self_attn.q_proj"
    raw = load_file(str(tmp_path / "a" / "adapter_model.safetensors"))
    lora_a, lora_b = store.weights(a.content_hash)[module]
    assert torch.equal(lora_a, raw[f"base_model.model.{module}.lora_A.weight"])
    assert torch.allclose(lora_b, raw[f"base_model.model.{module}.lora_B.weight"] * 1.5)  # alpha 6 / r 4
    store.add(b)
    assert store.num_held == 1
    again = store.weights(a.content_hash)[module]  # dropped for b: read again from the folder
    assert torch.equal(again[0], lora_a) and torch.equal(again[1], lora_b) and store.num_held == 1
    store.weights(b.content_hash)
    retrained = save_tiny_adapter(base, tmp_path / "a2", r=4, alpha=6, seed=3)  # same shapes, other weights
    shutil.copy(retrained / "adapter_model.safetensors", tmp_path / "a" / "adapter_model.safetensors")
    with pytest.raises(AdapterRefused, match=r"adapter 'a': the files in .* changed while it was in use"):
        store.weights(a.content_hash)
