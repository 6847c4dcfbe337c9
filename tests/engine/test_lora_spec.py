"""Adapter specs: what read_adapter learns from a PEFT folder, and what check_adapter refuses by name."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from batchgen.engine.lora.spec import AdapterRefused, check_adapter, read_adapter
from testkit.tiny_lora import save_tiny_adapter
from testkit.tiny_models import save_random_model, tiny_configs


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_random_model(tiny_configs()["llama"], tmp_path_factory.mktemp("lora-base"))


def test_read_adapter_modules_ranks_and_scaling(base: Path, tmp_path: Path) -> None:
    folder = save_tiny_adapter(
        base,
        tmp_path / "a",
        r=4,
        alpha=8,
        target_modules=("q_proj", "v_proj", "down_proj"),
        rank_pattern={"down_proj": 2},
        alpha_pattern={"v_proj": 3.0},
        layers_to_transform=[1],
    )
    spec = read_adapter("a", folder)
    assert spec.rank == 4 and spec.alpha == 8 and spec.scaling == 2.0 and spec.max_rank == 4
    by_module = {m.module: (m.rank, m.scaling, m.in_features, m.out_features) for m in spec.modules}
    assert by_module == {  # layer 0 is not transformed; down_proj's rank and v_proj's alpha by pattern
        "model.layers.1.mlp.down_proj": (2, 4.0, 128, 64),
        "model.layers.1.self_attn.q_proj": (4, 2.0, 64, 64),
        "model.layers.1.self_attn.v_proj": (4, 0.75, 64, 32),
    }
    check_adapter(spec, tiny_configs()["llama"], 4)
    rs = read_adapter("rs", save_tiny_adapter(base, tmp_path / "rs", r=4, alpha=8, use_rslora=True))
    assert rs.scaling == 8 / math.sqrt(4) and {m.scaling for m in rs.modules} == {4.0}


def test_content_hash_follows_the_files(base: Path, tmp_path: Path) -> None:
    a = save_tiny_adapter(base, tmp_path / "a", seed=1)
    shutil.copytree(a, tmp_path / "copy")
    b = save_tiny_adapter(base, tmp_path / "b", seed=2)
    h = read_adapter("a", a).content_hash
    assert read_adapter("other name", tmp_path / "copy").content_hash == h
    assert read_adapter("a", b).content_hash != h


def test_unreadable_folders_are_refused_by_name(base: Path, tmp_path: Path) -> None:
    with pytest.raises(AdapterRefused, match=r"adapter 'x': .*nowhere is not a folder"):
        read_adapter("x", tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(AdapterRefused, match=r"adapter 'e': cannot read .*adapter_config.json"):
        read_adapter("e", tmp_path / "empty")
    (tmp_path / "empty" / "adapter_config.json").write_text("{}")
    with pytest.raises(AdapterRefused, match=r"adapter 'e': .* has none of adapter_model.safetensors"):
        read_adapter("e", tmp_path / "empty")
    (tmp_path / "empty" / "adapter_model.safetensors").write_bytes(b"\x00\x01")
    with pytest.raises(AdapterRefused, match=r"adapter 'e': cannot read .*adapter_model.safetensors"):
        read_adapter("e", tmp_path / "empty")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"use_dora": True}, "use_dora=true is not supported"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"bias": "all"}, 'bias="all" is not supported'),
        ({"target_modules": ["embed_tokens"]}, "embedding targets"),
        ({"target_modules": ["lm_head"]}, "lm_head"),
    ],
)
def test_unsupported_peft_features_are_refused_by_name(
    base: Path, tmp_path: Path, options: dict[str, object], message: str
) -> None:
    spec = read_adapter("bad", save_tiny_adapter(base, tmp_path / "bad", **options))  # type: ignore[arg-type]
    with pytest.raises(AdapterRefused, match=rf"adapter 'bad' \(.*\): .*{message}"):
        check_adapter(spec, tiny_configs()["llama"], 16)


def test_rank_targets_and_unknown_options_are_checked(base: Path, tmp_path: Path) -> None:
    folder = save_tiny_adapter(base, tmp_path / "a", r=8)
    spec = read_adapter("a", folder)
    with pytest.raises(AdapterRefused, match="rank 8 is above max_lora_rank 4"):
        check_adapter(spec, tiny_configs()["llama"], 4)
    with pytest.raises(AdapterRefused, match=r"target module 'model.layers.0.self_attn.q_proj' is not in the model"):
        check_adapter(spec, tiny_configs()["phi3"], 8)  # phi3 fuses q, k and v into qkv_proj
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, "use_magic": True}))
    with pytest.raises(AdapterRefused, match="use_magic=true is a PEFT option batchgen does not know"):
        check_adapter(read_adapter("a", folder), tiny_configs()["llama"], 8)
    # PiSSA trains against residual base weights: unconverted, it cannot run on the original model
    (folder / "adapter_config.json").write_text(json.dumps({**config, "init_lora_weights": "pissa"}))
    with pytest.raises(AdapterRefused, match='init_lora_weights="pissa" is not supported'):
        check_adapter(read_adapter("a", folder), tiny_configs()["llama"], 8)
