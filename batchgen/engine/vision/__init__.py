"""Images in, text out: the engine's room for vision-language models (processor loading, prompt
expansion at add time, the vision tower run per step, its encoder cache, and the splice of image
embeddings into the language model's input embeddings)."""
