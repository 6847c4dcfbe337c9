"""The tokenizer an LLM runs with: the model folder's own, another one named by path, or an object.

A string is loaded from local files only (nothing is downloaded). Every tokenizer must be a fast
one (the stop checks detokenize with its Rust backend), checked at construction.
"""

from __future__ import annotations

import os
from typing import Any

from transformers import AutoTokenizer

from batchgen.engine.sampling.stopping import backend_tokenizer


def load_tokenizer(tokenizer: Any, model: str, **options: Any) -> Any:
    """`tokenizer` None: the model folder's; a str or path: that folder (or local cache name); else the
    object itself. `options` go to AutoTokenizer.from_pretrained (e.g. add_bos_token)."""
    if tokenizer is None or isinstance(tokenizer, (str, os.PathLike)):
        source = str(model if tokenizer is None else tokenizer)
        try:
            loaded = AutoTokenizer.from_pretrained(source, local_files_only=True, **options)
        except (OSError, ValueError) as exc:
            raise OSError(f"cannot load the tokenizer from {source!r} (a local folder or cached name): {exc}") from exc
    else:
        loaded = tokenizer
    try:
        backend_tokenizer(loaded)
    except TypeError as exc:
        raise TypeError(f"tokenizer {tokenizer!r}: {exc}; pass a fast tokenizer or its folder") from None
    return loaded
