"""The decoding engine: one positional KV cache, the AR and self-speculative loops, verification and sampling, stats."""
