"""SamplingParams: what one request asks of the engine, validated where users type it."""

from __future__ import annotations

from dataclasses import dataclass, field

# Below this temperature a request is greedy: logits / ~0 overflow float32 (vLLM's cut-off).
GREEDY_TEMPERATURE_EPS = 1e-5


@dataclass
class SamplingParams:
    """Per-request generation settings (vLLM names and defaults).

    temperature 0 (below 1e-5) means greedy; top_k 0 or -1 and top_p 1.0 disable those filters.
    Invalid values raise ValueError naming the field.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        checks = [
            ("max_tokens", isinstance(self.max_tokens, int) and self.max_tokens >= 1, "an integer >= 1"),
            ("temperature", self.temperature >= 0.0, ">= 0"),
            ("top_p", 0.0 < self.top_p <= 1.0, "in (0, 1]"),
            ("top_k", isinstance(self.top_k, int) and self.top_k >= 0, "0 (disabled), -1 (disabled) or >= 1"),
            ("min_p", 0.0 <= self.min_p <= 1.0, "in [0, 1]"),
            ("min_tokens", isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens,
             "an integer in [0, max_tokens]"),
            ("seed", self.seed is None or isinstance(self.seed, int), "an integer or None"),
            ("stop", all(isinstance(s, str) and s for s in self.stop), "a list of non-empty strings"),
            ("stop_token_ids", all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
             "a list of non-negative token ids"),
        ]
        for name, ok, expected in checks:
            if not ok:
                raise ValueError(f"SamplingParams.{name} must be {expected}, got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        """The one definition of greedy (engine sampler and hf backend): argmax of the raw logits."""
        return self.temperature < GREEDY_TEMPERATURE_EPS
