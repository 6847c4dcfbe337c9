"""batchgen's own inference engine."""
