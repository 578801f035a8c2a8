"""GPT-OSS: attention sinks, alternating sliding-window and full attention, q/k/v biases, half-dimension rotary
(yarn), experts with a router whose block returns (hidden, router scores). The fast runner reads all of these from
the modules (`sinks`, `sliding_window`, the rotary's output width, the MLP's tuple)."""

from ..adapters import register

register("gpt_oss", moe=True)
