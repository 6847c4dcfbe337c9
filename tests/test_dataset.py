"""Input files: discovery (keys relative to the input root, normalised paths, the output folder left out) and
streaming shards: a resumed run reads only some shards; each must get exactly its own rows."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen.inputs import dataset, reading


def test_reading_a_subset_of_shards_yields_exactly_their_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dataset, "READ_BATCH_ROWS", 7)  # batches that straddle shard edges
    path = tmp_path / "a.parquet"
    pq.write_table(pa.table({"x": list(range(100))}), path, row_group_size=30)
    files = reading.open_inputs(str(path), ["x"])
    shards = dataset.plan_shards(files, 10)
    wanted = [shards[i] for i in (0, 3, 4, 8, 9)]  # gaps: the committed parts a rerun skips
    got = [(s.index, t.column("x").to_pylist()) for s, t in reading.read_shards(files, wanted, ["x"])]
    assert got == [(s.index, list(range(s.start, s.stop))) for s in wanted]


@pytest.mark.parametrize(("wanted", "first_group"), [((8,), 2), ((6, 9), 2), ((5,), 1), ((2, 9), 0)])
def test_a_late_part_is_read_from_its_own_row_group(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, wanted: tuple[int, ...], first_group: int
) -> None:
    path = tmp_path / "a.parquet"
    pq.write_table(pa.table({"x": list(range(100))}), path, row_group_size=30)  # groups start 0, 30, 60, 90
    files = reading.open_inputs(str(path), ["x"])
    shards = [dataset.plan_shards(files, 10)[i] for i in wanted]
    read_groups: list[list[int]] = []
    real = pq.ParquetFile.iter_batches

    def spy(self: pq.ParquetFile, *args: object, row_groups: range, **kwargs: object) -> object:
        read_groups.append(list(row_groups))
        return real(self, *args, row_groups=row_groups, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(pq.ParquetFile, "iter_batches", spy)
    got = [t.column("x").to_pylist() for _, t in reading.read_shards(files, shards, ["x"])]
    assert got == [list(range(s.start, s.stop)) for s in shards]
    assert read_groups == [list(range(first_group, 4))]


def test_discovery_keys_are_relative_to_the_input_root_and_paths_normalised(tmp_path: Path) -> None:
    for name in ("x/part-0.parquet", "y/part-0.parquet", "out/part-000000.parquet"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table({"x": [1]}), tmp_path / name)
    spelled = str(tmp_path / "x" / "..")  # the folder, through a "..": paths come back normalised
    found = dataset.discover(spelled, exclude=tmp_path / "out")
    assert found == [
        (tmp_path / "x" / "part-0.parquet", "x/part-0.parquet"),
        (tmp_path / "y" / "part-0.parquet", "y/part-0.parquet"),
    ]
    assert [k for _, k in dataset.discover(str(tmp_path / "*" / "part-0.parquet"))] == [
        "x/part-0.parquet",
        "y/part-0.parquet",
    ]
    assert dataset.discover(str(tmp_path / "y" / "part-0.parquet")) == [
        (tmp_path / "y" / "part-0.parquet", "part-0.parquet")
    ]
    with pytest.raises(dataset.InputDataError, match=r"output folder .* is not read as input"):
        dataset.discover(str(tmp_path / "out"), exclude=tmp_path / "out")


def test_an_older_record_keyed_by_absolute_paths_is_named_as_such() -> None:
    from batchgen.outputs.fingerprint import describe_difference

    old = {"settings": {}, "model": "m", "inputs": {"/data/in/x.parquet": "aa"}}
    new = {"settings": {}, "model": "m", "inputs": {"x.parquet": "aa"}}
    assert describe_difference(old, new) == [
        "the record was made by an older batchgen that named input files by absolute path"
    ]
