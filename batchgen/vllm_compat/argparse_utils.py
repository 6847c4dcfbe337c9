"""vLLM's `FlexibleArgumentParser` (`vllm.utils` and `vllm.utils.argparse_utils`): the parser its
offline example scripts build, `EngineArgs.add_cli_args` fills and `LLM(**vars(args))` reads.

What it adds to argparse, as vLLM's does: a long option may be spelled with underscores
(`--max_model_len 64` is `--max-model-len 64`), with the value after a space or an `=`.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any


def _dashed(arg: str) -> str:
    """`--max_model_len=64` -> `--max-model-len=64`; values and short options are left as they are."""
    if not arg.startswith("--"):
        return arg
    name, sep, value = arg.partition("=")
    return name.replace("_", "-") + sep + value


class FlexibleArgumentParser(argparse.ArgumentParser):
    """argparse.ArgumentParser that also takes `--snake_case` spellings of its long options."""

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: Any = None
    ) -> tuple[argparse.Namespace, list[str]]:
        import sys

        given = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args([_dashed(a) for a in given], namespace)


__all__ = ["FlexibleArgumentParser"]
