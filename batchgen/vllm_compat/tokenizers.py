"""vLLM's `get_tokenizer` (`vllm.tokenizers`, formerly `vllm.transformers_utils.tokenizer`).

Clients load the tokenizer themselves with it to count and encode tokens (lm-evaluation-harness
does), so it must load the same tokenizer as `LLM(tokenizer=...)`: batchgen's loader, local files
only, fast tokenizers only. vLLM's keywords are checked as LLM's are: neutral values accepted.
"""

from __future__ import annotations

from typing import Any

from batchgen.engine.runner.tokenizer import load_tokenizer
from batchgen.vllm_compat.keywords import adapt_vllm_keywords


def get_tokenizer(
    tokenizer_name: str,
    *args: Any,
    tokenizer_mode: str = "auto",
    trust_remote_code: bool = False,
    revision: str | None = None,
    download_dir: str | None = None,
    **kwargs: Any,
) -> Any:
    """The fast tokenizer in `tokenizer_name` (a folder, or a name in the local cache); `kwargs` go to
    AutoTokenizer.from_pretrained (e.g. add_bos_token)."""
    if args:
        raise TypeError(f"get_tokenizer takes the tokenizer name and keywords only, got {len(args)} more arguments")
    adapt_vllm_keywords(
        {
            "tokenizer_mode": tokenizer_mode,
            "trust_remote_code": trust_remote_code,
            "tokenizer_revision": revision,
            "download_dir": download_dir,
        }
    )
    return load_tokenizer(tokenizer_name, tokenizer_name, **kwargs)
