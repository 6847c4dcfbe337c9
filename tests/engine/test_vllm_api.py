"""vLLM's API as clients call it: constructor keywords, seed, tokenizer paths, what clients read back,
SamplingParams' detokenize / spaces_between_special_tokens / structured_outputs, and `import vllm`."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from batchgen import LLM, SamplingParams, StructuredOutputsParams
from batchgen.engine.api.params import SettingError, StructuredOutputsError

# What lm-evaluation-harness 0.4.13's vLLM backend passes to LLM(...) by default (besides model).
LM_EVAL_KEYWORDS: dict[str, Any] = {
    "revision": None,
    "dtype": "auto",
    "tokenizer": None,
    "tokenizer_mode": "auto",
    "tokenizer_revision": None,
    "trust_remote_code": False,
    "tensor_parallel_size": 1,
    "max_model_len": None,
    "max_num_seqs": None,
    "quantization": None,
    "seed": 1234,
    "enable_lora": False,
    "max_lora_rank": 16,
}
EAGER = {"device": "cpu", "enforce_eager": True}


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> LLM:
    return LLM(str(tiny_model_dir), **EAGER, seed=7, block_size=8, num_kv_blocks=64)


def test_lm_eval_keywords_construct_an_llm(tiny_model_dir: Path) -> None:
    llm = LLM(str(tiny_model_dir), **LM_EVAL_KEYWORDS, device="cpu", enforce_eager=True, swap_space=4)
    assert llm.config.compile is False  # enforce_eager: no compile, no CUDA graphs
    out = llm.generate("once upon a time", SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3


def test_lora_with_tensor_parallel_is_refused_before_loading() -> None:
    with pytest.raises(ValueError, match=r"EngineConfig.enable_lora must be false with tensor_parallel_size > 1"):
        LLM("/no/such/model", device="cpu", enable_lora=True, tensor_parallel_size=2)


@pytest.mark.parametrize(
    ("name", "value", "says"),
    [
        ("trust_remote_code", True, "built-in architectures"),
        ("revision", "main", "local model folder"),
        ("tokenizer_revision", "v2", "tokenizer="),
        ("tokenizer_mode", "slow", "fast (Rust) tokenizer"),
        ("quantization", "awq", "dtype"),
        ("kv_cache_dtype", "fp8", "model's dtype"),
        ("pipeline_parallel_size", 2, "tensor_parallel_size only"),
        ("cpu_offload_gb", 4, "on the device"),
        ("skip_tokenizer_init", True, "detokenize=False"),
        ("max_logprobs", 50, "at most 20"),
        ("runner", "sideways", "must be one of"),
        ("convert", "reward", "must be one of"),
        ("generation_config", "/some/folder", "generation_config.json"),
        ("kv_transfer_config", {"kv_connector": "x"}, "vLLM's default"),
        ("task", "reward", "must be one of"),
        ("swap_space", -1, "accepted: a number >= 0"),
    ],
)
def test_a_non_neutral_vllm_keyword_is_refused_before_loading(name: str, value: Any, says: str) -> None:
    # why a missing folder: the refusal must come before any file is read
    with pytest.raises(ValueError, match=f"LLM\\({name}=") as info:
        LLM("/no/such/model", device="cpu", **{name: value})
    assert says in str(info.value)


@pytest.mark.parametrize("size", [0, "2", 1.5])
def test_a_bad_tensor_parallel_size_is_refused_before_loading(size: Any) -> None:
    """tensor_parallel_size goes to EngineConfig (engine/parallel runs N > 1): a bad value names it."""
    with pytest.raises((ValueError, SettingError), match="tensor_parallel_size"):
        LLM("/no/such/model", device="cpu", tensor_parallel_size=size)


def test_mapped_keywords(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="contradict"):
        LLM("/no/such/model", device="cpu", enforce_eager=True, compile=True)
    with pytest.raises(SettingError, match=r"LLM\.seed"):
        LLM("/no/such/model", device="cpu", seed=1.5)
    with pytest.raises(TypeError, match="unknown engine setting"):
        LLM("/no/such/model", device="cpu", not_a_vllm_keyword=1)
    llm = LLM(str(tiny_model_dir), **EAGER, num_gpu_blocks_override=40, max_model_len=100, dtype="half")
    config = llm.llm_engine.model_config
    assert llm.config.num_kv_blocks == 40 and config.dtype == torch.float16  # vLLM's "half"
    assert config.max_model_len == llm.max_model_len == 100  # what lm-eval reads as the context length
    assert llm.llm_engine.get_model_config() is config and config.get_vocab_size() == len(llm.tokenizer)
    assert llm.get_tokenizer() is llm.tokenizer is llm.llm_engine.get_tokenizer()


def _sampled(llm: LLM, params: SamplingParams) -> list[list[int]]:
    prompts = ["once upon a time", "the little cat", "a dog who liked"]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def test_llm_seed_repeats_unseeded_sampling(tiny_model_dir: Path) -> None:
    unseeded = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    seeded = dataclasses.replace(unseeded, seed=3)
    runs = {}
    for seed in (7, 7, 8):
        llm = LLM(str(tiny_model_dir), **EAGER, seed=seed)
        runs.setdefault(seed, []).append((_sampled(llm, unseeded), _sampled(llm, seeded)))
    (a_free, a_seeded), (b_free, b_seeded) = runs[7]
    (c_free, c_seeded) = runs[8][0]
    assert a_free == b_free  # same LLM seed: the same draws for requests without a seed
    assert a_free != c_free  # another LLM seed: other draws
    assert a_seeded == b_seeded == c_seeded  # a request's own seed wins whatever the LLM's


def test_tokenizer_given_as_a_path(tiny_model_dir: Path, llm: LLM, tmp_path: Path) -> None:
    llm.tokenizer.save_pretrained(tmp_path / "tok")
    other = LLM(str(tiny_model_dir), **EAGER, tokenizer=str(tmp_path / "tok"))
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, stop=["cat"])
    assert [o.outputs[0].text for o in other.generate(["the little dog"], params)] == [
        o.outputs[0].text for o in llm.generate(["the little dog"], params)
    ]
    assert other.llm_engine.model_config.tokenizer == str(tmp_path / "tok")
    with pytest.raises(OSError, match="/no/such/tokenizer"):
        LLM(str(tiny_model_dir), **EAGER, tokenizer="/no/such/tokenizer")


def test_detokenize_false_gives_token_ids_only(llm: LLM) -> None:
    base = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    with_text = llm.generate("once upon a time", base)[0]
    ids_only = llm.generate("once upon a time", dataclasses.replace(base, detokenize=False))[0]
    assert ids_only.outputs[0].token_ids == with_text.outputs[0].token_ids
    assert with_text.outputs[0].text and ids_only.outputs[0].text == ""
    got = [{t: lp.logprob for t, lp in e.items()} for e in ids_only.outputs[0].logprobs or []]
    assert got == [{t: lp.logprob for t, lp in e.items()} for e in with_text.outputs[0].logprobs or []]
    entries = [*(ids_only.outputs[0].logprobs or []), *(e for e in ids_only.prompt_logprobs or [] if e)]
    assert entries and all(lp.decoded_token is None for e in entries for lp in e.values())
    assert all(lp.decoded_token for e in with_text.outputs[0].logprobs or [] for lp in e.values())
    with pytest.raises(SettingError, match="detokenize must be true when stop strings are set"):
        SamplingParams(detokenize=False, stop=["."])


def test_spaces_between_special_tokens_is_accepted(llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, skip_special_tokens=False)
    eos = llm.tokenizer.eos_token_id
    prompt = {"prompt_token_ids": [eos, *llm.tokenizer("the cat")["input_ids"]]}
    texts = [
        llm.generate(prompt, dataclasses.replace(params, spaces_between_special_tokens=flag))[0].outputs[0].text
        for flag in (True, False)
    ]
    assert texts[0] == texts[1]  # the fast tokenizer's decoder decides, as in transformers
    with pytest.raises(SettingError, match="spaces_between_special_tokens"):
        SamplingParams(spaces_between_special_tokens="no")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("given", "spec"),
    [
        (StructuredOutputsParams(choice=["yes", "no"]), {"choice": ["yes", "no"]}),
        (StructuredOutputsParams(regex="[a-c]{3}"), {"regex": "[a-c]{3}"}),
        (StructuredOutputsParams(grammar='root ::= "cat" | "dog"'), {"grammar": 'root ::= "cat" | "dog"'}),
        (StructuredOutputsParams(json_object=True), {"json_object": True}),
    ],
)
def test_structured_outputs_is_the_structured_spec(llm: LLM, given: StructuredOutputsParams, spec: dict) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=12, structured_outputs=given)
    assert params.structured == spec
    ours = llm.generate(["the little cat"], params)[0].outputs[0]
    same = llm.generate(["the little cat"], SamplingParams(temperature=0.0, max_tokens=12, structured=spec))
    assert ours.text == same[0].outputs[0].text
    if "choice" in spec:
        assert ours.text in spec["choice"]


def test_structured_outputs_json_schema(llm: LLM) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    params = SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=StructuredOutputsParams(json=schema))
    out = llm.generate("the cat", params)[0].outputs[0]
    if out.finish_reason == "stop":
        assert isinstance(json.loads(out.text)["n"], int)
    assert out.text.startswith('{"n":')


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({}, "exactly one of"),
        ({"regex": "a", "choice": ["a"]}, "exactly one of"),
        ({"regex": "a", "whitespace_pattern": " "}, "without free whitespace"),
        ({"structural_tag": "{}"}, "structural_tag is not supported"),
        ({"json_object": False}, "json_object must be True"),
    ],
)
def test_structured_outputs_refusals(kwargs: dict[str, Any], says: str) -> None:
    with pytest.raises(StructuredOutputsError, match=says):
        StructuredOutputsParams(**kwargs)


def test_structured_outputs_and_structured_are_one_setting() -> None:
    with pytest.raises(SettingError, match="structured"):
        SamplingParams(structured={"regex": "b"}, structured_outputs=StructuredOutputsParams(regex="a"))
    with pytest.raises(SettingError, match="structured_outputs"):
        SamplingParams(structured_outputs={"regex": "a"})  # type: ignore[arg-type]


@pytest.fixture
def vllm_alias() -> Any:
    from batchgen import vllm_compat

    vllm_compat.install()
    yield vllm_compat
    vllm_compat.uninstall()


def test_import_vllm_resolves_to_batchgen(vllm_alias: Any, tiny_model_dir: Path) -> None:
    from vllm import LLM as VLLM_LLM  # type: ignore[import-not-found]
    from vllm import SamplingParams as VLLMSamplingParams
    from vllm.sampling_params import StructuredOutputsParams as VLLMStructured  # type: ignore[import-not-found]
    from vllm.tokenizers import get_tokenizer  # type: ignore[import-not-found]

    assert VLLM_LLM is LLM and VLLMSamplingParams is SamplingParams and VLLMStructured is StructuredOutputsParams
    assert importlib.metadata.version("vllm") == vllm_alias.VLLM_API_VERSION
    # a script in the shape of vLLM's structured-outputs offline example
    llm = VLLM_LLM(str(tiny_model_dir), **EAGER, max_model_len=100)
    guided = VLLMSamplingParams(temperature=0.0, structured_outputs=VLLMStructured(choice=["Positive", "Negative"]))
    assert llm.generate("the cat is", guided)[0].outputs[0].text in ("Positive", "Negative")
    tokenizer = get_tokenizer(str(tiny_model_dir), tokenizer_mode="auto", trust_remote_code=False, revision=None)
    assert tokenizer("the cat")["input_ids"] == llm.get_tokenizer()("the cat")["input_ids"]
    with pytest.raises(ValueError, match="trust_remote_code=True"):
        get_tokenizer(str(tiny_model_dir), trust_remote_code=True)


def test_uninstall_removes_every_alias(monkeypatch: pytest.MonkeyPatch) -> None:
    from batchgen import vllm_compat

    vllm_compat.install()
    vllm_compat.uninstall()
    assert not any(name == "vllm" or name.startswith("vllm.") for name in sys.modules)
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("vllm")
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))  # a real vLLM already imported
    with pytest.raises(RuntimeError, match="real vllm"):
        vllm_compat.install()
