"""vLLM's import paths over batchgen: run a script or harness written for vLLM's offline API on our engine.

`install()` makes `import vllm` (and the submodules clients import: `vllm.sampling_params`,
`vllm.pooling_params`, `vllm.inputs`, `vllm.outputs`, `vllm.lora.request`, `vllm.tokenizers`,
`vllm.transformers_utils.tokenizer`, `vllm.entrypoints.chat_utils`, and what vLLM's offline
example scripts import: `vllm.engine.arg_utils.EngineArgs`, `vllm.utils(.argparse_utils)
.FlexibleArgumentParser`, `vllm.platforms`, `vllm.config.AttentionConfig`) resolve to these modules, and
answers `importlib.metadata.version("vllm")` with VLLM_API_VERSION, the vLLM release whose
offline API this mirrors (clients such as lm-evaluation-harness choose code paths by it).
Nothing here fakes the engine: `LLM` is batchgen's own. `uninstall()` removes every alias.
Without `install()`, `from batchgen.vllm_compat import LLM, SamplingParams, ...` works as well.
"""

from __future__ import annotations

from batchgen.engine.api.outputs import CompletionOutput, Logprob, RequestOutput
from batchgen.engine.api.params import SamplingParams, StructuredOutputsParams
from batchgen.engine.pooling.config import PoolingParams
from batchgen.vllm_compat.alias import VLLM_API_VERSION, install, uninstall
from batchgen.vllm_compat.engine_args import EngineArgs
from batchgen.vllm_compat.inputs import TextPrompt, TokensPrompt
from batchgen.vllm_compat.llm import LLM
from batchgen.vllm_compat.lora import LoRARequest
from batchgen.vllm_compat.pooling import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    ScoringRequestOutput,
)

__version__ = VLLM_API_VERSION
__all__ = [
    "LLM",
    "VLLM_API_VERSION",
    "ClassificationRequestOutput",
    "CompletionOutput",
    "EmbeddingRequestOutput",
    "EngineArgs",
    "LoRARequest",
    "Logprob",
    "PoolingParams",
    "PoolingRequestOutput",
    "RequestOutput",
    "SamplingParams",
    "ScoringRequestOutput",
    "StructuredOutputsParams",
    "TextPrompt",
    "TokensPrompt",
    "install",
    "uninstall",
]
