"""Export drafters to the checkpoint format vLLM serves, and import other layouts."""
