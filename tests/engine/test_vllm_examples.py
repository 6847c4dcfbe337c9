"""vLLM's offline example scripts' call pattern on batchgen: `EngineArgs.add_cli_args` on a
`FlexibleArgumentParser`, parse `--model <folder>` (and the script's own defaults), then
`LLM(**vars(args))` and generate / chat / embed / classify / score, after `vllm_compat.install()`.
Results are checked against batchgen's own LLM built directly; engine arguments batchgen does not
use parse at vLLM's defaults and are refused with any other value."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from batchgen import LLM
from batchgen.engine.api.params import SamplingParams
from testkit.pooling_models import save_llama_classifier
from tests.conftest import build_tokenizer

PROMPTS = ["once upon a time", "the little cat", "a dog who liked"]


@pytest.fixture
def vllm() -> Iterator[Any]:
    from batchgen import vllm_compat

    vllm_compat.install()
    import vllm  # type: ignore[import-not-found]

    yield vllm
    vllm_compat.uninstall()


@pytest.fixture(scope="module")
def classifier_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_llama_classifier(tmp_path_factory.mktemp("cls"), build_tokenizer(), num_labels=3)


def _args(vllm: Any, argv: list[str], **defaults: Any) -> dict[str, Any]:
    """The scripts' parse: engine arguments on vLLM's parser, the script's defaults, then argv."""
    from vllm.utils.argparse_utils import FlexibleArgumentParser  # type: ignore[import-not-found]

    parser = vllm.EngineArgs.add_cli_args(FlexibleArgumentParser())
    parser.set_defaults(**defaults)
    return vars(parser.parse_args(argv))


def test_the_scripts_imports_resolve(vllm: Any) -> None:
    import vllm.pooling_params  # type: ignore[import-not-found]
    from vllm import EngineArgs, PoolingParams  # type: ignore[import-not-found]
    from vllm.config import AttentionConfig  # type: ignore[import-not-found]
    from vllm.engine.arg_utils import EngineArgs as FromArgUtils  # type: ignore[import-not-found]
    from vllm.platforms import current_platform  # type: ignore[import-not-found]
    from vllm.utils import FlexibleArgumentParser  # type: ignore[import-not-found]
    from vllm.utils.argparse_utils import FlexibleArgumentParser as FromArgparseUtils  # type: ignore[import-not-found]
    from vllm.v1.attention.backends.registry import AttentionBackendEnum  # type: ignore[import-not-found]

    assert FromArgUtils is EngineArgs and FlexibleArgumentParser is FromArgparseUtils
    assert vllm.pooling_params.PoolingParams is PoolingParams and PoolingParams(dimensions=8).dimensions == 8
    assert importlib.metadata.version("vllm") == "0.34.0"
    assert current_platform.is_cpu() is (not torch.cuda.is_available())
    assert AttentionConfig(backend=AttentionBackendEnum.FLEX_ATTENTION).backend.name == "FLEX_ATTENTION"


def test_engine_args_parse_at_their_defaults(vllm: Any) -> None:
    parsed = _args(vllm, ["--model", "/m", "--max_model_len=64", "-tp", "1", "--enforce-eager"])
    defaults = dataclasses.asdict(vllm.EngineArgs())
    assert set(parsed) == set(defaults) and len(parsed) > 200  # every engine argument of the release
    changed = {k for k in parsed if parsed[k] != defaults[k]}
    assert changed == {"model", "max_model_len", "enforce_eager"}
    assert parsed["max_model_len"] == 64 and parsed["enforce_eager"] is True  # snake_case spelling too
    assert dataclasses.asdict(vllm.EngineArgs.from_cli_args(argparse_namespace(parsed))) == parsed


def argparse_namespace(values: dict[str, Any]) -> Any:
    import argparse

    return argparse.Namespace(**values, an_example_option=1)  # a script's own option is left out


def test_generate_and_chat_as_the_scripts_do(vllm: Any, tiny_model_dir: Path) -> None:
    args = _args(vllm, ["--model", str(tiny_model_dir), "--max-model-len", "200", "--seed", "3"])
    llm = vllm.LLM(**args)
    params = llm.get_default_sampling_params()
    params.max_tokens, params.temperature = 6, 0.0
    direct = LLM(str(tiny_model_dir), device="cpu", max_model_len=200)
    expected = [o.outputs[0].token_ids for o in direct.generate(PROMPTS, params)]
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)] == expected
    conversation = [{"role": "user", "content": "the cat"}, {"role": "assistant", "content": "once upon"}]
    template = "{% for m in messages %}[{{ m.role }}|{{ m.content }}|{{ mood }}]{% endfor %}"
    template += "{% if add_generation_prompt %}[assistant|{% endif %}"
    out = llm.chat(
        [conversation],
        params,
        use_tqdm=False,
        chat_template=template,
        chat_template_kwargs={"mood": "sunny"},
        add_generation_prompt=False,
        continue_final_message=True,
    )
    assert out[0].prompt == "[user|the cat|sunny][assistant|once upon"  # continued, not closed
    assert len(out[0].outputs[0].token_ids) == 6
    with pytest.raises(TypeError, match="pass them by name"):
        llm.chat(conversation, params, chat_template_kwargs={"add_generation_prompt": False})


def test_runner_and_convert_choose_the_pooling_task(vllm: Any, tiny_model_dir: Path, classifier_dir: Path) -> None:
    classify = vllm.LLM(**_args(vllm, ["--model", str(classifier_dir)], runner="pooling", enforce_eager=True))
    assert classify.task == "classify"
    direct = LLM(str(classifier_dir), device="cpu", task="classify")
    assert [o.outputs.probs for o in classify.classify(PROMPTS)] == [o.outputs.probs for o in direct.classify(PROMPTS)]
    embed = vllm.LLM(**_args(vllm, ["--model", str(tiny_model_dir), "--runner", "pooling"]))
    assert embed.task == "embed"  # a causal LM under the pooling runner embeds, as in vLLM
    vectors = [o.outputs.embedding for o in embed.embed(PROMPTS)]
    reference = LLM(str(tiny_model_dir), device="cpu", task="embed").embed(PROMPTS)
    assert vectors == [o.outputs.embedding for o in reference]
    assert vllm.LLM(**_args(vllm, ["--model", str(classifier_dir), "--convert", "embed"])).task == "embed"
    with pytest.raises(ValueError, match="contradicts runner='generate'"):
        vllm.LLM(**_args(vllm, ["--model", str(classifier_dir), "--runner", "generate"], task="classify"))


def test_score_as_the_script_does(vllm: Any, tmp_path: Path) -> None:
    reward = save_llama_classifier(tmp_path / "reward", build_tokenizer(), num_labels=1)
    llm = vllm.LLM(**_args(vllm, ["--model", str(reward)], runner="pooling", enforce_eager=True))
    scores = [o.outputs.score for o in llm.score("the cat", ["a dog", "the sun"])]
    direct = LLM(str(reward), device="cpu", task="score").score("the cat", ["a dog", "the sun"])
    assert scores == [o.outputs.score for o in direct] and all(0.0 < s < 1.0 for s in scores)


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--kv-transfer-config", '{"kv_connector": "x"}'], "LLM(kv_transfer_config="),
        (["--enable-sleep-mode"], "LLM(enable_sleep_mode=True)"),
        (["--num-gpu-blocks-override", "8", "--speculative-config", '{"method": "ngram"}'], "speculative_config"),
        (["--enable-lora", "--tensor-parallel-size", "2"], "enable_lora must be false with tensor_parallel_size > 1"),
        (["-q", "fp8"], "LLM(quantization='fp8')"),
    ],
)
def test_an_unused_engine_argument_off_its_default_is_refused(vllm: Any, argv: list[str], says: str) -> None:
    with pytest.raises(ValueError) as info:
        vllm.LLM(**_args(vllm, ["--model", "/no/such/model", *argv]))
    assert says in str(info.value)


def test_generation_config_auto_reads_the_folder(vllm: Any, tiny_model_dir: Path, tmp_path: Path) -> None:
    folder = Path(shutil.copytree(tiny_model_dir, tmp_path / "model"))
    config = json.loads((folder / "generation_config.json").read_text())
    config.update(temperature=0.3, top_k=5, max_new_tokens=7)
    (folder / "generation_config.json").write_text(json.dumps(config))
    auto = vllm.LLM(**_args(vllm, ["--model", str(folder)]))  # vLLM's default: "auto"
    params = auto.get_default_sampling_params()
    assert (params.temperature, params.top_k, params.max_tokens) == (0.3, 5, 7)
    assert len(auto.generate(PROMPTS[:1])[0].outputs[0].token_ids) <= 7  # generate(None) uses them
    plain = vllm.LLM(**_args(vllm, ["--model", str(folder), "--generation-config", "vllm"]))
    assert plain.get_default_sampling_params() == SamplingParams()
    assert LLM(str(folder), device="cpu").get_default_sampling_params() == SamplingParams()  # LLM()'s own default
