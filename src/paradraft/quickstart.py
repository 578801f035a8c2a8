"""`paradraft quickstart` (what `make demo` runs): the workflow on the embedded verifier, reusing finished steps."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from .config import DEFAULT_VERIFIER, PrepareConfig, VocabConfig, opt


@dataclasses.dataclass
class QuickstartConfig:
    """`paradraft quickstart`: the whole workflow on the embedded verifier, artifacts under --output."""

    output: str = opt("runs/quickstart", help="run directory", short="-o")
    verifier: str = opt(DEFAULT_VERIFIER, help="verifier")
    data: list[str] = opt(factory=lambda: ["sharegpt"], help="data source (repeatable)")
    num_samples: int = opt(2000, help="conversations to prepare")
    seq_length: int = opt(1024, help="tokens per sample")
    draft_vocab_size: int = opt(8192, help="draft vocabulary size")
    seed: int = opt(0, help="seed")


def quickstart(cfg: QuickstartConfig) -> None:
    """Run the steps in order; each step reuses its output when it is already complete."""
    run = Path(cfg.output)
    data_dir = run / "data"
    from .data.prepare import prepare
    from .data.vocab import vocab

    print(f"[quickstart] 1/2 prepare {cfg.num_samples} conversations from {cfg.data} -> {data_dir}")
    prepare(PrepareConfig(data=list(cfg.data), output=str(data_dir), verifier=cfg.verifier,
                          seq_length=cfg.seq_length, max_samples=cfg.num_samples, seed=cfg.seed, preview=1))
    vocab_path = run / "vocab.safetensors"
    print(f"[quickstart] 2/2 draft vocabulary of {cfg.draft_vocab_size} -> {vocab_path}")
    vocab(VocabConfig(data=[str(data_dir)], output=str(vocab_path), size=cfg.draft_vocab_size))
    print(f"[quickstart] done: artifacts in {run}/")
