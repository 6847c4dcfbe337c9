"""What only runs on a CUDA device: decode steps replayed from CUDA graphs, and the GPU's Platform
(its answers to the device questions, its memory probe)."""
