"""vLLM's `EngineArgs` (`vllm.engine.arg_utils`, `from vllm import EngineArgs`): every engine argument of
the vLLM release we mirror, with its default, and `add_cli_args` that declares them as options.

vLLM's example scripts run `EngineArgs.add_cli_args(parser)`, set their own defaults, parse, and
pass `LLM(**vars(args))` (or `LLM(**asdict(EngineArgs.from_cli_args(args)))`): every field reaches
LLM as a keyword, which maps the ones batchgen uses and refuses the others unless at vLLM's
default (arg_rules). The fields and defaults: engine_table.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
from typing import Any

from batchgen.vllm_compat.engine_table import ENGINE_ARGS


def _json_or_text(text: str) -> Any:
    """A JSON value (a mapping, a list, a number) when the text is one, else the text."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


_TYPES: dict[str, Any] = {"int": int, "float": float, "str": str, "json": _json_or_text}


def _field(default: Any) -> Any:
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: json.loads(json.dumps(default)))
    return dataclasses.field(default=default)


def add_cli_args(parser: Any) -> Any:
    """Declare every engine argument on `parser` (an ArgumentParser or an argument group) at its
    default; returns the parser, as vLLM's does."""
    for name, flags, kind, default in ENGINE_ARGS:
        if kind == "bool":
            parser.add_argument(*flags, dest=name, action=argparse.BooleanOptionalAction, default=default)
        else:
            parser.add_argument(*flags, dest=name, type=_TYPES[kind], default=copy.deepcopy(default))
    return parser


def from_cli_args(cls: type, args: argparse.Namespace) -> Any:
    """An EngineArgs of the parsed namespace's engine arguments (its other attributes left out)."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in vars(args).items() if k in names})


EngineArgs: Any = dataclasses.make_dataclass(
    "EngineArgs",
    [(name, Any, _field(default)) for name, _, _, default in ENGINE_ARGS],
    namespace={"add_cli_args": staticmethod(add_cli_args), "from_cli_args": classmethod(from_cli_args)},
)
EngineArgs.__module__ = __name__
EngineArgs.__doc__ = "vLLM's engine arguments at their defaults; `LLM(**dataclasses.asdict(args))` builds an engine."

__all__ = ["EngineArgs"]
