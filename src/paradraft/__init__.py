"""paradraft: P-EAGLE parallel drafting for lossless speculative decoding."""

import os as _os

__version__ = "0.2.0"

# torch's CPU kernels (oneDNN) keep one compiled primitive per distinct tensor shape, up to 1,024 of them by default.
# Training packs of varying length make new shapes at every step, so that cache alone grew an offline training run
# by about 35 MB of resident memory a step on an AMX CPU (bf16 autocast): 19 GB at the end of the reference recipe's
# 600 steps, where two runs side by side were killed for memory (BENCHMARKS.md, "memory: oneDNN's primitive cache"
# under "Training throughput and memory"). 64 primitives keep the
# shapes that repeat (decoding's projections) at the same speed. Read by oneDNN when it first runs, so it is set
# here, before paradraft runs anything; a value already in the environment wins.
ONEDNN_CACHE_ENV = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"
ONEDNN_CACHE_SET_HERE = ONEDNN_CACHE_ENV not in _os.environ  # then vLLM's workers get their own default back
_os.environ.setdefault(ONEDNN_CACHE_ENV, "64")
