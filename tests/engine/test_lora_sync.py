"""LoRA costs no sync: each step still uploads once (the per-token slots ride in it) and reads at
most once, with the engine's Transfers copying as on a GPU and the slots' buffers counted as device
memory (the harness of tests/engine/test_one_sync.py). Loading an adapter's weights into a slot is
a direct copy of weights, made only when an adapter enters a slot, and sanctioned as such."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from batchgen import LLM, LoRARequest
from batchgen.engine.api.params import SamplingParams
from testkit.tiny_lora import save_tiny_adapter
from tests.engine.sync_counter import SyncCounter
from tests.engine.test_one_sync import PROMPTS, _gpu_like

PARAMS = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0)


def _llm(path: Path) -> LLM:
    return LLM(str(path), device="cpu", dtype="float32", block_size=4, compile=False, max_num_seqs=16,
               enable_lora=True, max_loras=1)  # fmt: skip


def _extras(llm: LLM, adapters: list[Path | None]) -> list[Any]:
    """Each request's extras, its adapter read into the host store (file reading: before counting)."""
    assert llm._lora is not None
    return llm._lora.resolve([None if a is None else LoRARequest(a.name, 1, str(a)) for a in adapters])[0]


def _run(llm: LLM, extras: list[Any]) -> tuple[list[list[int]], list[tuple[int, int]]]:
    """Each request's tokens, and (uploads, reads) of every step."""
    engine, counts = llm.engine, llm.engine.runner.transfers.counts
    ids = [engine.add_request(llm.tokenizer(p)["input_ids"], PARAMS, None, e) for p, e in zip(PROMPTS, extras)]
    outputs: dict[str, Any] = {}
    steps = []
    while engine.has_unfinished():
        before = (counts.uploads, counts.reads)
        for out in engine.step():
            outputs[out.request_id] = out
        after = (counts.uploads, counts.reads)
        steps.append((after[0] - before[0], after[1] - before[1]))
    return [outputs[str(i)].outputs[0].token_ids for i in ids], steps


def test_lora_steps_upload_once_and_read_once(tiny_model_dir: Path, tmp_path: Path) -> None:
    first = save_tiny_adapter(tiny_model_dir, tmp_path / "first", r=4)
    second = save_tiny_adapter(tiny_model_dir, tmp_path / "second", r=2, seed=5, target_modules=("o_proj",))
    adapters = [first, None, second]
    reference = _llm(tiny_model_dir)
    want, _ = _run(reference, _extras(reference, adapters))
    llm, counter = _llm(tiny_model_dir), SyncCounter()
    extras = _extras(llm, adapters)
    _gpu_like(llm, counter)
    slots = llm.engine.runner.lora
    assert slots is not None
    counter.mark([slots.mask, slots.column_slot, slots.token_slots])
    counter.mark([(layer.lora_a, layer.lora_b) for layer in slots.layers.values()])
    loads: list[int] = []
    load = counter.sanction(slots.load)
    slots.load = lambda pairs: (loads.append(len(pairs)), load(pairs))  # type: ignore[method-assign]
    with counter:
        got, steps = _run(llm, extras)
    assert not counter.events, "\n".join(map(str, counter.events))
    assert all(uploads == 1 and reads == 1 for uploads, reads in steps), steps
    assert got == want and len(loads) == 2  # one slot: the second adapter loads when the first is done
