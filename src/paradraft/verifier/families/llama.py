"""Llama and the families whose layers are Llama's for the fast runner (Mistral, Qwen2)."""

from ..adapters import register

register("llama", "mistral", "qwen2")
