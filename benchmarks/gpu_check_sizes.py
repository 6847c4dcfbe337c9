"""How big each section of benchmarks/gpu_check.py runs, and how long it should take.

FULL is the GPU run, SMOKE the CPU run the test suite makes (tiny sizes, the same code paths).

Time on an H200 (estimate_s; budget_s caps each section, no section starts after 330 s, and a
watchdog ends the run at 360 s). How the estimates were made, 2026-12-03, without a GPU:

The tiny-model sections (env, parity, triton, compiled, graphs, syncs) are bound by Python and
kernel launches, not arithmetic: a step of a 2-layer, 64-wide model is ~100 small kernels on a
GPU and ~100 small ops on the CPU, each a few microseconds of dispatch, so their CPU times at the
FULL counts, on one thread, stand in for the GPU's. Compiling is host work on both (dynamo's
tracing, inductor's lowering), with Triton building the kernels on the GPU where gcc does here.
The 1B parts are sized from FLOPs, bytes and per-step overheads. Measured on this project's
2-core CPU machine (load ~4 from other work, so about 2x slower than idle):
  - transformers `generate` over the 48 parity prompts one at a time (~360 forwards): 2.1-2.7 s
    per architecture on one thread (40-48 s with two OpenMP threads on the busy machine, which
    is why --smoke pins one);
  - the eager engine on them: pressure 150 steps 0.8-1.5 s, relaxed 18 steps 0.2 s, graphs 34
    steps 0.2-0.3 s (CPU time); loading an engine 0.1 s;
  - compiling the tiny Llama: 48 s with inductor's cache cold (32 s of it gcc), 12 s warm, 2.8 s
    for a second engine of the same graph in one process; the graph path's recompile at one row
    1-20 s (warm / cold);
  - compiling a 16-layer Llama of the same width, cold: 137 s (81 s gcc, 7.6 s tracing): the host
    work grows ~3.5x from 2 to 16 layers;
  - the smoke run (warm cache): 43 s wall, 27 s CPU; env 2.9, parity 5.8, compiled 12.4 (of it
    compiling 11.1), graphs 1.2, syncs 3.4, throughput 6.7 s.
Estimates (seconds):
  env         10  CUDA's start ~3, three short profiled runs of a tiny model, saves
  parity      30  9 x (reference 2.5 + engine runs ~1.2 + saves and loads ~0.7)
  bf16         5  2 x (transformers bf16: 8 forwards + 8 x 16 greedy steps ~1.2, engine ~0.8, loads of
                  the parity section's saved models ~0.4)
  triton      75  9 x engine runs ~1.5 (references reused) + Triton's JIT, ~1-2 s per new kernel
                  specialization while its cache is cold
  compiled    30  2 x (a compile: ~8 host, this CPU's 16 s of non-gcc work at ~2x, + 5-10 of Triton
                  kernel builds in parallel) + 150-step runs
  graphs      15  2 x (a second engine of the same graph ~3 + the graph path's recompiles, static
                  inputs at storage offset 0 and one row, ~5-10 each with kernels cached + <= 10
                  captures) + runs
  syncs       10  2 configs x 7 features x 2 runs of ~11 steps, profiled; the compiled engine is the
                  graphs section's
  tp          25  only with 2+ GPUs (one GPU: skipped at once, saying so): 2 archs x (a worker
                  process's start, imports and NCCL's ~8 + a pressure run ~3)
  throughput 130  save 2.5 GB of bf16 ~8; generate: load 3, two batch sizes ~32 measured (prefill 131k
                  tokens = 3e14 FLOPs, < 1 s; 128 decode steps a batch at 5-10 ms, launch-bound),
                  shared prefix 3; eager engine: load and memory profile 5, two runs of ~150 steps
                  at ~25 ms (a 256-row gather + SDPA a layer, Python per row) 8, shared prefix 6;
                  compiled engine 85: load 5, a cold 16-layer compile ~30 (the CPU's 56 s of host
                  work at ~2x + kernel builds), two recompiles ~40, ~30 captures 5, two runs 5
  in all     305 (+25 with 2+ GPUs: 330, the cap) + ~10 of imports and CUDA's start: about 5.3 minutes
The first GPU run's JSON says how far off each is: every section's "seconds", the compile and
warm-up seconds of each engine. The first H200 run (2026-12-04, torch 2.11, one GPU) took env 12.7,
parity 27.8, bf16 3.9, triton 41.6 (cut after 4 of 9 architectures: ~10 s each while Triton's
JIT cache is cold), compiled 29.7, graphs 9.9, syncs 9.5; the FULL figures below take those in.
The second (the whole run, 268.8 s): triton 49.3 for all 9, throughput 104.3 with its compiled
variant cut for budget (generate at three batch sizes took 63 s of it): batch 64 is dropped (256
was generate's best by far) and the section may take 180 s.
"""

from __future__ import annotations

import dataclasses

from benchmarks.gpu_check_common import Sizes

BIG_1B = dict(  # Llama-3.2-1B's shape: ~1.24B parameters
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=32768,
    tie_word_embeddings=True,
    rope_theta=500000.0,
)
ALL_ARCHS = ["llama", "gemma2", "mistral", "qwen2", "gemma3", "gpt2", "qwen3", "phi3", "gpt_neox"]  # by coverage
SECTION_NAMES = ["env", "parity", "bf16", "triton", "compiled", "graphs", "syncs", "tp", "throughput"]

FULL = Sizes(
    device="cuda",
    archs=ALL_ARCHS,
    triton_archs=ALL_ARCHS,
    triton_settings=["pressure", "relaxed"],
    compiled_archs=["gemma2", "llama"],  # gemma2 first: soft-capping, sliding window and GQA at once
    compiled_setting="pressure",  # preemption (a pool too small for decode graphs: bucket x 16 blocks)
    graphs_setting="graphs",
    parity_prompts=24,
    parity_settings=["pressure", "relaxed"],
    bf16_archs=["llama", "gemma3"],  # gemma3: GQA, sliding window and its own norms under bf16
    big=BIG_1B,
    big_dtype="bfloat16",
    n_prompts=256,
    prompt_lens=(256, 768),
    out_tokens=128,
    hf_batches=[256, 128],  # the second H200 run: 2,426 / 1,806 / 1,039 tok/s at 256 / 128 / 64 (64 cut: 31 s)
    shared_prefix=400,
    sync_requests=8,
    sync_steps=8,
    estimate_s={  # seconds on an H200: the module docstring says how each was made
        "env": 10,
        "parity": 30,  # first H200 run (2026-12-04): 27.8
        "bf16": 5,  # 2 x (reference: 8 forwards + 8 x 16 greedy steps ~1.2, engine ~0.8, loads ~0.4)
        "triton": 75,  # first H200 run: 4 of 9 architectures in 41.6 s, Triton's JIT cache cold
        "compiled": 30,  # first H200 run: 29.7
        "graphs": 15,  # first H200 run: 9.9 (the compiled section's kernels cached)
        "syncs": 10,
        "tp": 25,  # 2+ GPUs only (else skipped at once): 2 x (worker start ~8 + a pressure run ~3)
        "throughput": 130,
        "throughput.compiled": 85,  # the compiled variant within it (its load, compile, warm-up, run)
    },
    budget_s={
        "env": 15,
        "parity": 50,
        "bf16": 10,
        "triton": 90,
        "compiled": 45,
        "graphs": 30,
        "syncs": 20,
        "tp": 35,
        "throughput": 180,  # the second H200 run cut its compiled variant at 104 s of 150
    },
    total_cap_s=330,
    hard_cap_s=360,
)
SMOKE = Sizes(
    device="cpu",
    archs=["llama", "gemma2"],  # gemma2: soft-capping, checked against transformers' eager attention
    triton_archs=["llama"],  # the Triton interpreter runs every program instance in Python: slow
    triton_settings=["pressure"],
    compiled_archs=["llama"],
    compiled_setting="graphs",  # why one setting: one compile for both sections (tests/engine covers pressure)
    graphs_setting="graphs",
    parity_prompts=3,
    bf16_archs=["llama"],
    bf16_prompts=3,
    bf16_tokens=6,
    # the tiny parity Llama's graph in float32: the compiled variant reuses the compiled sections' work
    big=dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    ),
    big_dtype="float32",
    parity_settings=["pressure", "relaxed"],
    n_prompts=6,
    prompt_lens=(16, 40),
    out_tokens=5,
    hf_batches=[6],
    shared_prefix=24,
    sync_requests=3,
    sync_steps=2,
    graph_sync_features=("greedy", "all"),  # "all": every other feature's path at once; eager runs each alone
    estimate_s={  # seconds on this project's 2-core CPU machine, idle, inductor's disk cache warm
        "env": 4,
        "parity": 5,
        "bf16": 3,
        "triton": 10,
        "compiled": 12,
        "graphs": 15,
        "syncs": 4,
        "tp": 15,  # gloo: 2 x (a worker process's start ~6 + a run)
        "throughput": 8,
        "throughput.compiled": 5,
    },
    # why generous: on a busy CI machine a cut would hide the code it is there to keep alive
    budget_s=dict.fromkeys(SECTION_NAMES, 600.0),
    total_cap_s=3600,
    hard_cap_s=3600,
    engine={"max_num_batched_tokens": 96, "max_num_seqs": 8},
    graph_backend="triton",
    graph_standin=True,
)


def for_gpus(sizes: Sizes, count: int) -> Sizes:
    """`sizes` as the plan of a machine with `count` CUDA devices: with fewer than two the tp section is
    skipped at once, so its estimate reserves nothing there (the other sections' budgets keep their slack)."""
    if sizes.device != "cuda" or count >= 2:
        return sizes
    return dataclasses.replace(sizes, estimate_s={**sizes.estimate_s, "tp": 0.0})
