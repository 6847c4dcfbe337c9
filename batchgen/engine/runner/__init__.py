"""Running the model: the model runner and its step inputs, loading models,
sizing the KV pool, the compiled forward. It decides nothing: what runs is the scheduler's business."""
