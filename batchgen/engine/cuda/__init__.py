"""What only runs on a CUDA device: decode steps replayed from CUDA graphs, device memory probes."""
