"""paradraft: P-EAGLE parallel drafting for lossless speculative decoding."""

__version__ = "0.1.0"
