"""Pooling jobs (embed, classify, score): pooling config resolution, poolers, and the runners of
pooling batches (decoder models through batchgen's engine, everything else through transformers)."""
