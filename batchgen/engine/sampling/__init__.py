"""From logits to tokens: the sampler, penalties and bans, logprobs, structured output, stop checks."""
