"""A tensor-parallel worker (ranks 1..N-1): loads its share of the model, then runs rank 0's steps.

Rank 0 alone schedules and samples; a worker runs the same steps over its shard (no sampler) so
the collectives meet. It exits when told, when its pipe closes (rank 0 gone), or with an error
when a step fails, which rank 0 sees as a dead rank.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import traceback
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from batchgen.engine.runner.model_runner import ModelRunner

logger = logging.getLogger(__name__)

EXIT_PARENT_GONE = 3  # the pipe to rank 0 closed without a stop message
EXIT_FAILED = 1  # a step (or the load) raised


def main(argv: list[str]) -> None:
    """The worker process's entry point: `python -m batchgen.engine.parallel.worker ARGS_JSON`,
    started by parallel/group with its end of the pipe as an inherited file descriptor."""
    args = json.loads(argv[0])
    rank = int(args["rank"])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # why: Ctrl-C reaches the whole group; rank 0 decides
    logging.basicConfig(level=os.environ.get("BATCHGEN_TP_LOG", "WARNING"))
    conn = Connection(int(args["fd"]))
    try:
        code = _serve(args, rank, conn)
    except BaseException:  # why: any failure must end this process with a message
        sys.stderr.write(f"batchgen tensor parallel rank {rank} failed:\n{traceback.format_exc()}")
        code = EXIT_FAILED
    sys.stderr.flush()
    os._exit(code)  # why _exit: no atexit work (threads of a broken group could block a clean exit)


def _serve(args: dict[str, Any], rank: int, conn: Connection) -> int:
    """Rank `rank`'s life: load its share (`args`: group.TensorParallelGroup._start's), then run
    what rank 0 sends until told to stop or its pipe closes."""
    from batchgen.engine.parallel.loading import Collectives, load_sharded_model
    from batchgen.engine.runner.model_runner import ModelRunner
    from batchgen.faults import fault_point

    device = torch.device(args["device"])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    conn.send(("ready",))  # why: rank 0 waits for this (watching the process) before its own rendezvous
    comm = Collectives(str(args["store"]), rank, int(args["world"]), device, float(args["timeout_s"]))
    model = load_sharded_model(str(args["path"]), comm, rank, device, getattr(torch, args["dtype"]))
    runner: ModelRunner | None = None
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return EXIT_PARENT_GONE
        kind = message[0]
        if kind == "stop":
            return 0
        if kind == "build":
            _, (spec, config, num_kv_blocks, _, run_dtype), kwargs = message  # on this rank's device
            runner = ModelRunner(model, spec, config, num_kv_blocks, device, run_dtype, **kwargs)
            continue
        if runner is None:
            raise RuntimeError(f"rank {rank}: {kind!r} before the runner was built")
        if kind not in ("execute", "apply", "drop_all"):
            raise RuntimeError(f"rank {rank}: unknown message {kind!r}")
        if kind == "execute":
            fault_point("tp_rank_step")
        getattr(runner, kind)(*message[1:])  # rank 0's runner call, on this rank's shard


if __name__ == "__main__":
    main(sys.argv[1:])
