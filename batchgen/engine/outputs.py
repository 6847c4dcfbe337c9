"""RequestOutput: what the engine (or any backend) returns for one request."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestOutput:
    """One finished request. `finish_reason` is "stop", "length" or "error" (then `error` says why).

    `stop_reason` is the matched stop string, the stop token id (EOS included), or None.
    `num_output_tokens` counts every generated token, including the ones of a stop string that
    was cut from `text`.
    """

    request_id: int
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = "error"
    stop_reason: str | int | None = None
    num_cached_tokens: int = 0
    error: str | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids)
