"""The package as users install it: a wheel built from the repo, installed into a fresh venv.

Why: Ray nodes, container images and Airflow workers install a wheel, not the checkout. A wheel
that lacked the C++ operators' sources (only csrc/*.c were package data) silently ran without the
attention front and the native linears; this builds the wheel, checks its file list, installs it
into a new venv (its dependencies from this one's site-packages, so nothing is downloaded) and
builds every kernel and runs a job from there.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # builds (a wheel, a venv, the kernels) in tens of seconds

REPO = Path(__file__).resolve().parents[1]
CSRC = REPO / "batchgen" / "engine" / "cpu" / "csrc"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A wheel built from a copy of the files git tracks (and the ones it would add): an in-tree build
    reuses build/ and *.egg-info, which could hold files that a clean checkout's wheel lacks."""
    tree, out = tmp_path_factory.mktemp("tree"), tmp_path_factory.mktemp("wheel")
    git = ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"]
    listed = subprocess.run(git, cwd=REPO, capture_output=True, text=True, check=True).stdout
    for name in filter(None, listed.split("\0")):
        if (REPO / name).is_file():
            (tree / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, tree / name)
    pip = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(tree)]
    subprocess.run(pip, check=True, capture_output=True, text=True)
    (built,) = out.glob("batchgen-*.whl")
    return built


def test_the_wheel_carries_every_kernel_source(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = sorted(p.name for p in CSRC.iterdir() if p.suffix in (".c", ".cpp", ".h"))
    assert sources, "no kernel sources found in the checkout"
    missing = [name for name in sources if f"batchgen/engine/cpu/csrc/{name}" not in names]
    assert not missing, f"the wheel lacks {missing}"
    assert "batchgen/cli.py" in names and any(n.endswith("entry_points.txt") for n in names)


def test_the_wheel_ships_no_test_helpers(wheel: Path) -> None:
    """The tiny-model builders (testkit/) serve tests and benchmarks; users install none of them."""
    names = zipfile.ZipFile(wheel).namelist()
    assert (REPO / "testkit" / "tiny_models.py").is_file(), "the check looks for what the checkout has"
    strays = [n for n in names if n.split("/")[0] in ("testkit", "tests", "benchmarks") or "/testing/" in n]
    assert not strays, f"the wheel carries test helpers: {strays}"
    assert "batchgen/faults.py" in names  # the fault points are a feature, not a test helper


def test_a_job_runs_from_a_wheel_in_a_fresh_venv_with_every_kernel(wheel: Path, tmp_path: Path) -> None:
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    fresh_site = Path(
        subprocess.run(
            [python, "-c", "import site; print(site.getsitepackages()[0])"], capture_output=True, text=True
        ).stdout.strip()
    )
    # the dependencies come from this venv (a .pth line adds the folder but runs none of its .pth files,
    # so this checkout's editable install is not seen); batchgen itself only from the wheel
    (fresh_site / "deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(fresh_site)
    entry = env_dir / "bin" / "batchgen"
    entry.write_text(f"#!{python}\nimport sys\nfrom batchgen.cli import main\nsys.exit(main())\n")
    entry.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    where = subprocess.run([python, "-c", "import batchgen; print(batchgen.__file__)"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert where.startswith(str(fresh_site)), where

    doctor = subprocess.run(
        [entry, "doctor", "--build", "--json"], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert doctor.returncode == 0, doctor.stderr
    states = {k["name"]: k for k in json.loads(doctor.stdout)["kernels"]}
    assert all(k["state"] in ("built", "cached") for k in states.values()), states

    job = tmp_path / "job.yaml"
    model, prompts = REPO / "sample_data" / "demo-model", REPO / "sample_data" / "prompts.parquet"
    job.write_text(
        f"model: {{path: {model}}}\ninput: {{path: {prompts}, limit: 3}}\n"
        f"output: {{path: {tmp_path / 'out'}}}\nsampling: {{max_tokens: 8}}\n"
    )
    done = subprocess.run([entry, "run", str(job)], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "unavailable" not in done.stderr, done.stderr
    assert (tmp_path / "out" / "_SUCCESS").is_file()
