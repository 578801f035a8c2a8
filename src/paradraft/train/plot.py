"""PNG of training loss and per-depth accuracy over steps (written at the end of training)."""

from __future__ import annotations

import json
from pathlib import Path

from ..utils import atomic_path


def plot_metrics(metrics_path: str | Path, out_png: str | Path) -> Path:
    """Plot metrics.jsonl -> PNG (loss on the left, accuracy per depth on the right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(x) for x in Path(metrics_path).read_text().splitlines() if x.strip()]
    if not rows:
        raise ValueError(f"{metrics_path} holds no metrics")
    steps = [r["step"] for r in rows]

    def num(x):  # metrics.jsonl writes non-finite values (e.g. a depth with no elements) as null
        return float("nan") if x is None else x

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.plot(steps, [num(r["loss"]) for r in rows], lw=1)
    ax1.set_xlabel("step")
    ax1.set_ylabel("loss (KL)")
    ax1.set_title("training loss")
    depths = len(rows[-1]["acc"])
    for d in range(depths):
        ax2.plot(steps, [num(r["acc"][d]) if d < len(r["acc"]) else float("nan") for r in rows], lw=1,
                 label=f"depth {d}")
    val = [(r["step"], r["val"]) for r in rows if r.get("val")]
    if val:
        ax2.scatter([s for s, _ in val], [num(v["acc"][0]) for _, v in val], marker="x", color="k", label="val depth 0")
    ax2.set_xlabel("step")
    ax2.set_ylabel("accuracy (drafter argmax == verifier argmax)")
    ax2.set_ylim(0, 1)
    ax2.legend(fontsize=7, ncol=2)
    ax2.set_title("per-depth training accuracy")
    fig.tight_layout()
    out_png = Path(out_png)
    with atomic_path(out_png) as tmp:
        fig.savefig(tmp, dpi=110, format="png", metadata={"Software": "paradraft train"})
    plt.close(fig)
    return out_png
