"""Build the LoRA demo's data: two tiny PEFT adapters of the demo model and an input naming them.

One responsibility: `sample_data/lora/storyteller` (rank 8 on q_proj, v_proj) and
`sample_data/lora/terse` (rank 4 on the attention projections and up_proj), drawn with fixed seeds
by peft itself (testkit/tiny_lora: peft's own folders, B non-zero so the adapters change the
text), and `sample_data/lora_prompts.parquet`: the first short prompts of prompts.parquet with an
`adapter` column that mixes both adapter names, nulls and empty strings (the base model). They
are random adapters, not trained ones: the demo shows the plumbing (rows, usage, the `lora`
column), not better stories. `jobs/lora.yaml` runs them.

    python scripts/make_lora_sample.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from testkit.tiny_lora import save_tiny_adapter  # noqa: E402

SAMPLE = REPO / "sample_data"
ADAPTERS = {
    "storyteller": {"r": 8, "alpha": 16, "target_modules": ("q_proj", "v_proj"), "seed": 1},
    "terse": {
        "r": 4,
        "alpha": 8,
        "target_modules": ("q_proj", "k_proj", "v_proj", "o_proj", "up_proj"),
        "seed": 2,
    },
}
ROWS = 24
CYCLE = ["storyteller", "terse", None, "storyteller", "", "terse"]  # names, base (null), base (empty)
SCALE = 0.08  # B ~ N(0, SCALE^2): the text changes, and stays words


def build_adapter(name: str, settings: dict[str, object]) -> Path:
    folder = SAMPLE / "lora" / name
    save_tiny_adapter(SAMPLE / "demo-model", folder, scale=SCALE, **settings)  # type: ignore[arg-type]
    (folder / "README.md").unlink(missing_ok=True)  # peft's empty model card
    config_path = folder / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config["base_model_name_or_path"] = "sample_data/demo-model"  # not this machine's absolute path
    if isinstance(config.get("target_modules"), list):  # peft keeps a set: its order varies run to run
        config["target_modules"] = sorted(config["target_modules"])
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return folder


def build_input() -> Path:
    table = pq.read_table(SAMPLE / "prompts.parquet")
    table = table.filter(pc.equal(table.column("category"), "opening")).slice(0, ROWS)
    adapters = [CYCLE[i % len(CYCLE)] for i in range(table.num_rows)]
    out = pa.table({"id": table.column("id"), "prompt": table.column("prompt"), "adapter": adapters})
    path = SAMPLE / "lora_prompts.parquet"
    pq.write_table(out, path)
    return path


def main() -> None:
    for name, settings in ADAPTERS.items():
        print(f"wrote {build_adapter(name, settings)}")
    print(f"wrote {build_input()}")


if __name__ == "__main__":
    main()
