"""Money: prices per million tokens and the exact Decimal cost of token counts.

Costs are computed from integer token totals in one multiplication each, never by accumulating
per-row floats, so a group's cost and the total cost are exact and group costs sum to the total.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from decimal import Decimal, localcontext
from typing import Any

from batchgen.job.sections import PricingSection

PER_TOKENS = 1_000_000  # prices are per million tokens
_PRECISION = 60  # significant digits: exact for any realistic token count times any price


@dataclass(frozen=True)
class Prices:
    """Per-million-token prices; None means not given. Cached input tokens are billed at the
    input price when no cached_input price is given (what a provider without a discount does)."""

    input: Decimal | None = None
    cached_input: Decimal | None = None
    output: Decimal | None = None
    # LoRA adapters priced apart (pricing.lora): (adapter name, its prices; None where the job's apply)
    adapters: tuple[tuple[str, tuple[Decimal | None, Decimal | None, Decimal | None]], ...] = ()

    @classmethod
    def from_section(cls, section: PricingSection | None) -> Prices:
        if section is None:
            return cls()
        adapters = tuple((name, (p.input, p.cached_input, p.output)) for name, p in sorted(section.lora.items()))
        return cls(input=section.input, cached_input=section.cached_input, output=section.output, adapters=adapters)

    def for_adapter(self, name: str) -> Prices:
        """The prices of rows run with adapter `name` (the base model's: any name not priced apart)."""
        own = dict(self.adapters).get(name)
        base = replace(self, adapters=())
        return base if own is None else base.overridden(*own)

    def overridden(
        self, input: Decimal | None = None, cached_input: Decimal | None = None, output: Decimal | None = None
    ) -> Prices:
        """These prices with each given (not None) value replaced, e.g. from command-line flags."""
        given = (("input", input), ("cached_input", cached_input), ("output", output))
        changes: dict[str, Any] = {k: v for k, v in given if v is not None}
        return replace(self, **changes)

    @property
    def any_set(self) -> bool:
        own = any(p is not None for p in (self.input, self.cached_input, self.output))
        return own or any(p is not None for _, prices in self.adapters for p in prices)

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "input": money_text(self.input),
            "cached_input": money_text(self.cached_input),
            "output": money_text(self.output),
            "per_tokens": str(PER_TOKENS),
        }
        if self.adapters:
            out["lora"] = {name: self.for_adapter(name).as_json() for name, _ in self.adapters}
        return out


def per_million(tokens: int, price: Decimal) -> Decimal:
    with localcontext() as ctx:
        ctx.prec = _PRECISION
        return Decimal(tokens) * price / PER_TOKENS


def input_cost(prices: Prices, input_tokens: int, cached_tokens: int) -> Decimal | None:
    """Cost of the prompt tokens: uncached at the input price, cached at the cached_input price."""
    if prices.input is None:
        return None
    cached_price = prices.cached_input if prices.cached_input is not None else prices.input
    return per_million(input_tokens - cached_tokens, prices.input) + per_million(cached_tokens, cached_price)


def output_cost(prices: Prices, output_tokens: int) -> Decimal | None:
    return None if prices.output is None else per_million(output_tokens, prices.output)


def adapter_costs(prices: Prices, by_lora: dict[str, dict[str, int]]) -> tuple[Decimal | None, Decimal | None]:
    """(input cost, output cost) of usage split by LoRA adapter (Totals.by_lora), each adapter's
    tokens at its own prices (pricing.lora); exact, one multiplication per adapter and kind."""
    ins, outs = [], []
    for name, counts in by_lora.items():
        own = prices.for_adapter(name)
        ins.append(input_cost(own, counts["input"], counts["cached"]))
        outs.append(output_cost(own, counts["output"]))
    return add_costs(*ins), add_costs(*outs)


def add_costs(*costs: Decimal | None) -> Decimal | None:
    """The sum, or None when any part is unknown (a price was not given)."""
    if any(c is None for c in costs):
        return None
    with localcontext() as ctx:
        ctx.prec = _PRECISION
        return sum((c for c in costs if c is not None), Decimal(0))


def money_text(value: Decimal | None) -> str | None:
    """Exact plain notation for JSON and CSV ("0.0000001", never "1E-7"); None stays None."""
    if value is None:
        return None
    text = format(value, "f")
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return text or "0"


def money_display(value: Decimal | None, places: int = 6) -> str:
    """Rounded for a terminal table or a web page; '-' when unknown."""
    if value is None:
        return "-"
    return format(value.quantize(Decimal(1).scaleb(-places)), "f")


def estimate_adapter_costs(
    prices: Prices, by_lora: dict[str, dict[str, int]], cache_enabled: bool
) -> dict[str, Decimal | None]:
    """`estimate`'s cost figures with each adapter's rows at its own prices (pricing.lora):
    `by_lora` holds per adapter its input tokens, the tokens a prefix cache would serve
    (`shareable`, billed cached when `cache_enabled`) and its output ceiling (`output_max`). An
    adapter without a cached_input price has its cached tokens at its input price."""
    each = []
    for name, c in by_lora.items():
        own = prices.for_adapter(name)
        shared = c["shareable"] if cache_enabled else 0
        plain = input_cost(own, c["input"], 0)
        each.append((plain, input_cost(own, c["input"], shared), output_cost(own, c["output_max"])))
    plain, billed, out_max = (add_costs(*column) for column in zip(*each))
    every = [prices, *(prices.for_adapter(name) for name, _ in prices.adapters)]
    return {
        "input": plain,
        "input_with_cache": billed if any(p.cached_input is not None for p in every) else None,
        "output_min": None if out_max is None else Decimal(0),
        "output_max": out_max,
        "total_min": billed,
        "total_max": add_costs(billed, out_max),
    }
