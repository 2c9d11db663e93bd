"""Building blocks shared by all models: paged attention, KV cache, rotary, norms, sampler."""
