"""From logits to tokens: the per-row sampling state, the step's draw, the sampler, penalties and
bans, logprobs, structured output, stop checks. The model runner owns the state and the sampler."""
