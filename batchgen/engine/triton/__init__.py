"""The Triton attention backend ("triton"): one paged attention kernel that reads K/V straight from
the pool through block tables for every chunk of a step (prefill chunks and decodes in one launch
per layer), the kernel that stores a step's K/V in the pool, the step metadata both read, and the
backend that plans a step and runs a layer with them. Nothing here imports triton until a backend
is made (engine/platforms.make_backend), so the package imports on machines without it.
"""
