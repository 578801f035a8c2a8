"""Speculative decoding: the sampling rule, the acceptance rule, the verifier runner and the engine."""
