"""cpu/backend.native_wins: a bf16 model's decode path (the native kernel's bf16 twin over decode
rows, or the torch backend's gathered blocks) is measured once per machine and shape, and every
later process takes the stored choice (so the processes of one job attend alike)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from batchgen.engine.cpu import backend, native


def test_the_native_kernel_against_torch_is_measured_once_and_the_backend_follows_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bf16: the kernel's bf16 twin is timed against gathered blocks once per machine and shape and the
    stored answer is every later call's, and the backend's (kernel_attends); float32 always takes the
    kernel untimed; fp16 never (the kernel cannot read it)."""
    from transformers import LlamaConfig

    # why first: built (or found) in the machine's cache, not rebuilt in the temporary one
    assert native.load() is not None
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path))
    folder = tmp_path / "kernels" / "decode-native-vs-gather"
    assert backend.native_wins(torch.float32, 2, 2, 16) is True
    assert backend.native_wins(torch.float16, 2, 2, 16) is False
    assert not folder.exists()  # nothing timed, nothing stored
    choice = backend.native_wins(torch.bfloat16, 2, 2, 16)
    (stored,) = folder.iterdir()
    record = json.loads(stored.read_text())
    assert record["native"] is choice and min(record["native_s"], record["gather_s"]) > 0
    config = LlamaConfig(num_attention_heads=4, num_key_value_heads=2, hidden_size=64)  # KVH 2, G 2, D 16
    for wins in (True, False):  # as if another process had measured first
        stored.write_text(json.dumps({**record, "native": wins}))
        assert backend.native_wins(torch.bfloat16, 2, 2, 16) is wins
        assert backend.kernel_attends(config, 2, 16, torch.bfloat16) is wins
    assert backend.kernel_attends(config, 2, 16, torch.float32) is True
    assert backend.native_wins(torch.bfloat16, 2, 4, 16) in (True, False)  # another shape: its own file
    assert len(list(folder.iterdir())) == 2
