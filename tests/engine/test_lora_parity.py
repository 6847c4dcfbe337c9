"""LoRA parity: rows of different adapters (and of the base model) in one batch each get exactly
transformers' greedy tokens on peft's merged model for their adapter (float32), logprobs within
1e-4, under prefix caching, chunked prefill, preemption and more adapters than slots; a block
computed under one adapter is never served to another's rows or the base's."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from batchgen import LLM, LoRARequest
from batchgen.engine.api.params import SamplingParams
from testkit.tiny_lora import merged_model, save_tiny_adapter
from testkit.tiny_models import EOS_ID, VOCAB

# per architecture: three adapters of different ranks, targets and PEFT options
_LLAMA_LIKE = [
    dict(r=4, alpha=8, target_modules=("q_proj", "v_proj")),
    dict(r=8, alpha=16, target_modules=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
         rank_pattern={"down_proj": 2}, alpha_pattern={"k_proj": 4}),
    dict(r=2, alpha=4, target_modules=("o_proj", "down_proj"), use_rslora=True, layers_to_transform=[1]),
]  # fmt: skip
ADAPTERS: dict[str, list[dict[str, Any]]] = {
    "llama": _LLAMA_LIKE,
    "qwen2": _LLAMA_LIKE,
    "qwen3": _LLAMA_LIKE,
    "mistral": _LLAMA_LIKE,
    "gemma2": _LLAMA_LIKE,
    "gpt2": [  # transformers' Conv1D projections (weights stored [in, out]; peft's fan_in_fan_out)
        dict(r=4, alpha=8, target_modules=("c_attn",), fan_in_fan_out=True),
        dict(r=8, alpha=16, target_modules=("c_attn", "c_proj", "c_fc"), fan_in_fan_out=True,
             rank_pattern={"c_fc": 2}),
        dict(r=2, alpha=4, target_modules=("c_proj",), fan_in_fan_out=True, use_rslora=True),
    ],
    "phi3": [  # fused projections: peft targets them by their own names
        dict(r=4, alpha=8, target_modules=("qkv_proj",)),
        dict(r=8, alpha=16, target_modules=("qkv_proj", "o_proj", "gate_up_proj", "down_proj"),
             rank_pattern={"o_proj": 3}),
        dict(r=2, alpha=4, target_modules=("gate_up_proj",), use_rslora=True),
    ],
}  # fmt: skip
PRESSURE = dict(block_size=16, max_num_batched_tokens=64, max_num_seqs=8, num_kv_blocks=10)


def _prompts() -> tuple[list[list[int]], list[int | None]]:
    """13 prompts and each one's adapter (index into the arch's adapters, None: the base model);
    rows 0-3 share a 40-token prefix across adapters, rows 4-5 one within adapter 0."""
    rng = random.Random(7)

    def words(n: int) -> list[int]:
        return [rng.randrange(2, VOCAB) for _ in range(n)]

    shared, own = words(40), words(36)
    prompts = [shared + words(n) for n in (3, 8, 1, 12)] + [own + words(n) for n in (5, 9)]
    prompts += [words(n) for n in (1, 17, 30, 44, 7, 20, 90)]  # 90: several 64-token chunks
    adapters: list[int | None] = [0, 1, 2, None, 0, 0, 1, None, 2, 0, 1, 2, 1]
    return prompts, adapters


PROMPTS, ADAPTER_OF = _prompts()
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def lora_case(tiny_model: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Any]:
    """case(arch) -> (base folder, adapter folders, reference tokens and logprobs per row)."""
    built: dict[str, Any] = {}

    def get(arch: str) -> Any:
        if arch not in built:
            base = tiny_model(arch)
            folder = tmp_path_factory.mktemp(f"lora-{arch}")
            adapters = [save_tiny_adapter(base, folder / f"a{i}", seed=i, **o) for i, o in enumerate(ADAPTERS[arch])]
            built[arch] = (base, adapters, _reference(base, adapters))
        return built[arch]

    return get


def _reference(base: Path, adapters: list[Path]) -> list[tuple[list[int], list[float]]]:
    """Per row: greedy tokens of its adapter's merged model (unpadded, one prompt at a time) and
    each token's logprob from a forward over prompt + tokens."""
    rows: list[tuple[list[int], list[float]]] = [([], [])] * len(PROMPTS)
    for which in [None, *range(len(adapters))]:
        model = merged_model(base, None if which is None else adapters[which])
        with torch.inference_mode():
            for i, prompt in enumerate(PROMPTS):
                if ADAPTER_OF[i] != which:
                    continue
                ids = torch.tensor([prompt])
                out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                     max_new_tokens=MAX_TOKENS, eos_token_id=EOS_ID, pad_token_id=EOS_ID)  # fmt: skip
                tokens = out[0, len(prompt) :].tolist()
                logits = model(out[:, :-1]).logits[0, len(prompt) - 1 :].float().log_softmax(-1)
                rows[i] = (tokens, logits.gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist())
    return rows


def _requests(adapters: list[Path]) -> list[LoRARequest | None]:
    return [None if a is None else LoRARequest(f"a{a}", a + 1, str(adapters[a])) for a in ADAPTER_OF]


def _check(llm: LLM, adapters: list[Path], reference: list[tuple[list[int], list[float]]]) -> None:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, lora_request=_requests(adapters))
    for i, (out, (tokens, logprobs)) in enumerate(zip(outputs, reference)):
        assert out.error is None, out.error
        got = out.outputs[0]
        assert got.token_ids == tokens, f"row {i} (adapter {ADAPTER_OF[i]})"
        got_lp = [next(iter(e.values())).logprob for e in got.logprobs or []]
        assert got_lp == pytest.approx(logprobs[: len(got_lp)], abs=1e-4), f"row {i}"


@pytest.mark.parametrize("arch", list(ADAPTERS))
def test_lora_parity_mixed_batch_under_pressure(arch: str, lora_case: Callable[[str], Any]) -> None:
    """Prefix caching, 64-token steps (chunked prefill), a 24-block pool (preemption), and three
    adapters over two slots (loads on demand, LRU), all in one run."""
    base, adapters, reference = lora_case(arch)
    llm = LLM(str(base), device="cpu", dtype="float32", compile=False, enable_lora=True, max_loras=2,
              max_lora_rank=8, **PRESSURE)  # fmt: skip
    _check(llm, adapters, reference)
    assert llm.stats["preemptions"] > 0 and llm.stats["cached_tokens"] > 0, dict(llm.stats)
    # max_cpu_loras defaults to max_loras: one of the three was dropped from host memory and read again
    assert llm._lora is not None and llm._lora.store.num_held == 2
    # the adapters' differ from the base model's tokens: the test would see a missed update
    assert len({tuple(reference[i][0]) for i in range(4)}) == 4


def test_prefix_cache_never_crosses_adapters(lora_case: Callable[[str], Any]) -> None:
    """A prefix computed under adapter 0 serves adapter 0's later rows, never adapter 1's or the base's."""
    base, adapters, _ = lora_case("llama")
    llm = LLM(str(base), device="cpu", dtype="float32", compile=False, enable_lora=True, max_loras=2,
              max_lora_rank=8, block_size=16)  # fmt: skip
    prefix = PROMPTS[4][:36]
    params = SamplingParams(max_tokens=2, temperature=0.0)
    first = LoRARequest("a0", 1, str(adapters[0]))
    llm.generate([{"prompt_token_ids": prefix + [5]}], params, lora_request=first)
    other = LoRARequest("a1", 2, str(adapters[1]))
    same_name_other_folder = LoRARequest("a0", 1, str(adapters[1]))  # a reused name: its content decides
    requests = [first, other, None, same_name_other_folder]
    outs = llm.generate([{"prompt_token_ids": prefix + [9]}] * 4, params, lora_request=requests)
    assert [o.num_cached_tokens for o in outs] == [32, 0, 0, 32]  # two full blocks of the prefix
