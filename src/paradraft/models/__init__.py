"""Draft models: the shared EAGLE-3 style drafter, P-EAGLE parallel drafting, the attention mask rule."""
