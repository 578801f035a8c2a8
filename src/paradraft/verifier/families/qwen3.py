"""Qwen3 (q/k RMSNorm per head; draft layers follow it) and Qwen3-MoE (the same attention, experts through
Hugging Face's own sparse MoE block). Qwen3's vocabulary is padded: adapters size everything to the embedding rows."""

from ..adapters import register

register("qwen3", flavour="qwen3")
register("qwen3_moe", flavour="qwen3", moe=True)
