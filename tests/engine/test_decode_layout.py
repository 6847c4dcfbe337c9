"""decode_layout: a bf16 model's key layout is measured once per machine and shape, and every later
process takes the stored choice (so the processes of one job attend alike); float32 is never timed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from batchgen.engine.cpu import decode_layout, native


def test_the_first_measurement_is_stored_and_every_later_call_takes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path))
    assert decode_layout.keys_transposed(torch.float32, 2, 2, 16) is True
    assert not (tmp_path / "kernels" / "decode-layout").exists()  # float32: nothing timed, nothing stored
    choice = decode_layout.keys_transposed(torch.bfloat16, 2, 2, 16)
    (stored,) = (tmp_path / "kernels" / "decode-layout").iterdir()
    record = json.loads(stored.read_text())
    assert record["transposed"] is choice and record["batched_s"] > 0 and record["sdpa_s"] > 0
    stored.write_text(json.dumps({**record, "transposed": not choice}))  # as if another process measured first
    assert decode_layout.keys_transposed(torch.bfloat16, 2, 2, 16) is (not choice)
    assert decode_layout.keys_transposed(torch.bfloat16, 2, 4, 16) in (True, False)  # another shape: its own file
    assert len(list((tmp_path / "kernels" / "decode-layout").iterdir())) == 2
