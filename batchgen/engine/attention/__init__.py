"""Attention over the paged KV pool: one backend interface (plan a step, run a layer), the portable
torch backend, cascade attention, and the decode K/V sources the backends read."""
