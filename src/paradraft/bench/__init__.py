"""Benchmarks: acceptance length, per-position acceptance, tokens/s, speedup, plots."""
