"""Data: sources, chat templates and loss masks, prepared datasets, regeneration, draft vocabulary."""
