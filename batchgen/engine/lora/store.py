"""AdapterStore: the host-side copies of adapters' weights, by content hash, LRU-bounded.

Why a store apart from the device slots: many more adapters may be in use by a job than fit on the
device (`max_loras`), and reading a folder again for each slot load would be slow; `max_cpu_loras`
bounds how many stay in host memory. An adapter dropped from the store is read again from its
folder when a slot needs it, and refused if its files changed meanwhile (its content hash is its
identity in the prefix cache: other weights under the same hash would serve wrong blocks).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from pathlib import Path

import torch

from batchgen.engine.lora.spec import AdapterRefused, AdapterSpec, read_adapter, weight_key

logger = logging.getLogger(__name__)

# module -> (A [rank, in], B * scaling [out, rank])
AdapterWeights = dict[str, tuple[torch.Tensor, torch.Tensor]]


def load_weights(spec: AdapterSpec, dtype: torch.dtype) -> AdapterWeights:
    """The adapter's A and B (scaling folded into B) per module, in `dtype` on the host."""
    path = Path(spec.weight_file)
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(path))
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # why so broad: any failure to read the file is the adapter's
        raise AdapterRefused(f"adapter {spec.name!r}: cannot read {path}: {exc}") from exc
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in state.items():
        parsed = weight_key(key)
        if parsed is not None:
            pairs.setdefault(parsed[0], {})[parsed[1]] = tensor
    weights: AdapterWeights = {}
    for m in spec.modules:
        a, b = pairs[m.module]["A"], pairs[m.module]["B"]
        # why float64 for the product: the scaling is folded once, rounded once
        weights[m.module] = (a.to(dtype), (b.double() * m.scaling).to(dtype))
    return weights


class AdapterStore:
    """Specs of every adapter registered, and the weights of the last `capacity` used."""

    def __init__(self, capacity: int, dtype: torch.dtype) -> None:
        self.capacity = capacity
        self.dtype = dtype
        self.specs: dict[bytes, AdapterSpec] = {}
        self._weights: OrderedDict[bytes, AdapterWeights] = OrderedDict()

    def add(self, spec: AdapterSpec) -> None:
        """Register `spec` and read its weights now unless they are held (AdapterRefused when they
        cannot be read). Same content hash, same weights: a folder used again is not read again."""
        self.specs[spec.content_hash] = spec
        if spec.content_hash in self._weights:
            self._weights.move_to_end(spec.content_hash)
            return
        self._keep(spec.content_hash, load_weights(spec, self.dtype))

    def weights(self, content_hash: bytes) -> AdapterWeights:
        """The weights of a registered adapter, read again from its folder if they were dropped."""
        held = self._weights.get(content_hash)
        if held is not None:
            self._weights.move_to_end(content_hash)
            return held
        spec = self.specs[content_hash]
        if read_adapter(spec.name, spec.path).content_hash != content_hash:
            raise AdapterRefused(f"adapter {spec.name!r}: the files in {spec.path} changed while it was in use")
        logger.info("adapter %r: read again from %s (max_cpu_loras %d)", spec.name, spec.path, self.capacity)
        weights = load_weights(spec, self.dtype)
        self._keep(content_hash, weights)
        return weights

    def _keep(self, content_hash: bytes, weights: AdapterWeights) -> None:
        self._weights[content_hash] = weights
        self._weights.move_to_end(content_hash)
        while len(self._weights) > self.capacity:
            self._weights.popitem(last=False)

    @property
    def num_held(self) -> int:
        return len(self._weights)
