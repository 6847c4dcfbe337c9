"""Which parts a run of a job takes: its output's layout (outputs/plan_file), decided before the
record is claimed, and the parts of one static shard.

Why apart from the runner: the decision reads the old record, the stored plan and, for a new
grouped output, makes the plan (a pass over the prompts with the tokenizer); `estimate` makes
the same plan to say what the prefix cache will save.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from batchgen.inputs.dataset import InputFile
from batchgen.inputs.grouping import grouped, plan_cut
from batchgen.inputs.key_sort import Cut
from batchgen.inputs.prepare import load_tokenizer
from batchgen.inputs.sharding import ShardSpec
from batchgen.job.adapters import read_adapters
from batchgen.job.spec import JobSpec
from batchgen.outputs.plan_file import Layout, contiguous, grouped_layout, read_plan
from batchgen.outputs.state import OutputState

log = logging.getLogger(__name__)
SMALL_BLOCK_SIZE = 16  # keys' block size when engine.block_size is left to the device (see key_block_size)


def key_block_size(spec: JobSpec) -> int:
    """The block size row keys are hashed at: engine.block_size, else 16 (a CUDA default of 256
    tokens shares fewer, coarser blocks; rows grouped by 16-token blocks are grouped for it too)."""
    return spec.engine.block_size or SMALL_BLOCK_SIZE


def make_cut(spec: JobSpec, files: list[InputFile]) -> Cut:
    """The job's prefix plan, computed (a pure function of input, job, tokenizer and adapters)."""
    adapters = read_adapters(spec)
    hashes = {n: s.content_hash for n, s in adapters.specs.items()} if adapters is not None else None
    return plan_cut(spec, files, load_tokenizer(spec.model.path), key_block_size(spec), hashes)


def decide_layout(spec: JobSpec, files: list[InputFile], state: OutputState, job_id: str, fresh: bool) -> Layout:
    """The layout of this run: an output made before prefix plans resumes as it was made, one
    made since by the layout its record names; a new one gets contiguous parts (`grouping:
    none`, no prefix cache: see grouped) or the plan (the stored one, else computed).
    `fresh`: the output is being replaced (--overwrite), so nothing in it counts."""
    old = None if fresh else state.read_record()
    mode = "auto" if grouped(spec) else "none"
    if old is not None and old.get("id") == job_id:
        if "grouping" not in old:
            log.info("an output made before prefix plans: its parts stay in input order, as they were made")
            return contiguous(spec, files, input_row=False)
        # why the record's: a setting outside the fingerprint (enable_prefix_caching) may have
        # changed since; the parts must stay the ones this output was started with
        mode = old["grouping"].get("mode", mode)
    if mode == "none":
        return contiguous(spec, files, input_row=True)
    cut = None if fresh else read_plan(state.storage, job_id)
    if cut is not None:
        return grouped_layout(cut, stored=True)
    return grouped_layout(make_cut(spec, files), stored=False)


def shard_owns(layout: Layout, shard: ShardSpec | None) -> Callable[[int], bool] | None:
    """Whether this static shard owns part p: in a grouped output the plan's consecutive runs
    (a group's parts together); else part p % N; None: not a shard run (every part)."""
    if shard is None:
        return None
    if not layout.grouped:
        return shard.owns
    owner = layout.owner(shard.count)
    return lambda p: owner.get(p) == shard.index
