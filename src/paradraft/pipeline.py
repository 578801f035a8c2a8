"""One pipeline: workflow steps chained in order, for the quickstart, the recipes, the vLLM interop script and
the tests. Each step decides reuse itself (prepare and extract by the identity they record, regenerate by the
ids already written, train by its run identity, bench by its result identity); the pipeline only says that it
owns its outputs, so a step may continue or replace what an earlier run of the pipeline left there.
"""

from __future__ import annotations

import time

from .bench.run import bench
from .data.hidden_states import extract
from .data.prepare import prepare
from .data.vocab import vocab
from .decode.generate import generate
from .export.vllm import export
from .regenerate import regenerate
from .train.trainer import can_resume, finished_run, train

# each step, called with its config and (optionally) a verifier and tokenizer already in memory
STEPS = {
    "regenerate": lambda cfg, v, t: regenerate(cfg),
    "prepare": lambda cfg, v, t: prepare(cfg, tokenizer=t),
    "vocab": lambda cfg, v, t: vocab(cfg),
    "extract": lambda cfg, v, t: extract(cfg, model=v, tokenizer=t),
    "train": lambda cfg, v, t: train(cfg, verifier=v, tokenizer=t),
    "generate": lambda cfg, v, t: generate(cfg),
    "bench": lambda cfg, v, t: bench(cfg),
    "export": lambda cfg, v, t: export(cfg),
}


def owned(name: str, cfg) -> None:
    """Let a step continue or replace an output the pipeline made before (never anything else: the output
    rules of each command still apply)."""
    if name in ("prepare", "extract"):
        cfg.overwrite = True  # replaces only a dataset / hidden states the command wrote
    elif name == "train" and finished_run(cfg) is None:  # a finished run of these flags is reused by train itself
        cfg.resume = can_resume(cfg)  # an interrupted run of these flags continues,
        cfg.overwrite = not cfg.resume  # a run of other flags is replaced
    elif name == "bench":
        cfg.reuse = True


def run_steps(steps: list[tuple[str, object]], log: list | None = None, verifier=None, tokenizer=None) -> list:
    """Run (command name, config) steps in order, the pipeline owning their outputs; returns each step's result.
    `log` (a list) receives {step, command, output, seconds} per step. `verifier` / `tokenizer`: objects already
    in memory (a tiny test model) for the steps that take them, instead of loading the configs' verifier."""
    results = []
    for i, (name, cfg) in enumerate(steps, 1):
        owned(name, cfg)
        t0 = time.time()
        results.append(STEPS[name](cfg, verifier, tokenizer))
        if log is not None:
            log.append({"step": i, "command": name, "output": getattr(cfg, "output", None),
                        "seconds": round(time.time() - t0, 2), "finished": time.strftime("%Y-%m-%d %H:%M:%S")})
    return results
