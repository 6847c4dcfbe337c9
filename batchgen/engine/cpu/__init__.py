"""The CPU fast path: native kernels (C/C++ sources in csrc/, built on the machine that runs them),
the decode rows they attend over, the CPU attention backend, the thread governor and host facts.
Each kernel is used only where it was measured faster than torch."""
