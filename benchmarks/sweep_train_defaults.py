"""A sweep of drafter training settings on the embedded verifier: which levers measure best.

Each setting changes one thing (or a named set of things) of a base, trains for the same number of steps on the same
prepared data / hidden states, and is scored on the held-out split by per-depth accuracy, the conditional acceptance
and the acceptance-length estimate (paradraft.models.loss.acceptance_estimate) at K=3/5/7; with --bench-prompts N
also by the acceptance length `paradraft bench` measures on N held-out prompts (greedy, float32, K=3 and 7).

  python benchmarks/sweep_train_defaults.py --data DIR --hidden-states DIR [--base recipe|quickstart]
         [--steps N] [--only NAME ...] [--bench-prompts N] [--output JSON]

Rows are appended to --output after every setting (a stopped sweep keeps what it measured); --only reruns
named settings and keeps the others' rows.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from paradraft.bench.run import bench  # imported before the sweep starts: every setting runs the same code
from paradraft.config import BenchConfig, QuickstartConfig, TrainConfig, config_to_dict
from paradraft.models.common import DraftModel
from paradraft.quickstart import quickstart_steps
from paradraft.train.trainer import train

BASES = {
    # the base of issue #5's sweep: the reference recipe's data, 100 steps
    "recipe": dict(algorithm="peagle", batch_tokens=2048, lr=1e-3, warmup_steps=10, num_depths=8, val_samples=32,
                   init_norm="verifier", num_layers=1, loss_decay=1.0),
    # `make demo`'s train step, taken from paradraft.quickstart itself (3 depths since 2026-12-02; rows before
    # 2026-12-04 ran a copy with 7 depths: each results file records the base_flags it ran), every held-out sample
    # scored
    "quickstart": {**{k: v for k, v in config_to_dict(dict(quickstart_steps(QuickstartConfig()))["train"]).items()
                      if k not in ("data", "hidden_states", "output", "max_steps", "save_every")},
                   "val_samples": 10_000},
}

# speculators 0.9.0's optimiser: Muon + AdamW at 1e-3, weight decay 0.01, AdamW beta2 0.999, linear decay after 1
# warmup step (at the quickstart's 3 depths)
REFERENCE_OPTIMISER = {"num_depths": 3, "optimizer": "muon", "weight_decay": 0.01, "adam_beta2": 0.999,
                       "lr_schedule": "linear", "warmup_steps": 1}
# every speculators 0.9.0 P-EAGLE default paradraft has: its optimiser, its Qwen3-style layer, norm before residual,
# N(0, 1) mask_hidden, frozen lm_head with trainable embeddings, 8 depths with ~its element-mean weighting (0.7^d),
# out-of-vocabulary targets; scored at K=3 like the rest
REFERENCE_ALL = {**REFERENCE_OPTIMISER, "num_depths": 8, "draft_layer": "qwen3", "norm_before_residual": True,
                 "mask_hidden_init": "unit", "freeze_lm_head": True, "train_embeddings": True, "loss_decay": 0.7,
                 "train_out_of_vocab": True}


# P-EAGLE's own values before its defaults became the reference's optimiser and layer (2026-12-04): what a group
# left out of REFERENCE_ALL goes back to
BEFORE_REFERENCE = {**DraftModel.train_defaults, "norm_before_residual": False}


def reference_all_but(*keys: str) -> dict:
    """REFERENCE_ALL with `keys` left at paradraft's earlier values (BEFORE_REFERENCE), else the base's."""
    return {**{k: v for k, v in REFERENCE_ALL.items() if k not in keys},
            **{k: BEFORE_REFERENCE[k] for k in keys if k in BEFORE_REFERENCE}}


SETTINGS = {
    "base": {},
    "norm init ones": {"init_norm": "ones"},
    "norm init verifier": {"init_norm": "verifier"},
    "lr 3e-4": {"lr": 3e-4},
    "lr 3e-3": {"lr": 3e-3},
    "depth decay 0.8": {"loss_decay": 0.8},
    "deeper depths weighted 1.25^d": {"loss_decay": 1.25},
    "2 draft layers": {"num_layers": 2},
    "4 draft layers": {"num_layers": 4},
    "trainable embeddings": {"train_embeddings": True},
    "norm before residual": {"norm_before_residual": True},
    "linear lr decay": {"lr_schedule": "linear"},
    "mask_hidden zero init": {"mask_hidden_init": "zero"},
    "mask_hidden unit init": {"mask_hidden_init": "unit"},
    # speculators' one mean over all elements weights depth d by the share COD keeps, ~0.7^d (depth 0: 31%)
    "depth decay 0.7": {"loss_decay": 0.7},
    "depth decay 0.5": {"loss_decay": 0.5},
    # speculators keeps the drafter's lm_head at the verifier's rows: fewer weights to fit on little data
    "frozen lm_head": {"freeze_lm_head": True},
    # ... and trains the whole embedding matrix instead (its P-EAGLE trainable set)
    "frozen lm_head, trainable embeddings": {"freeze_lm_head": True, "train_embeddings": True},
    # speculators' optimiser: Muon over the layer matrices (its lr on AdamW's scale), AdamW over the rest
    "muon": {"optimizer": "muon"},
    "muon, 3x lr on the matrices": {"optimizer": "muon", "muon_lr": 3e-3},
    # every speculators P-EAGLE default paradraft can serve (not its Qwen3-style layer): Muon at 1e-3 with AdamW at
    # 1e-4 (its --lr) and weight decay, linear decay, norm before residual, N(0, 1) mask_hidden, frozen lm_head and
    # trainable embeddings, its element-mean weighting (~0.7^d)
    "speculators' defaults, all": {"optimizer": "muon", "muon_lr": 1e-3, "lr": 1e-4, "weight_decay": 0.01,
                                   "lr_schedule": "linear", "norm_before_residual": True, "mask_hidden_init": "unit",
                                   "freeze_lm_head": True, "train_embeddings": True, "loss_decay": 0.7},
    # speculators' P-EAGLE draft layer: Qwen3-style, q/k RMSNorm per head (paradraft's engine runs it for a Llama
    # verifier; `export` writes q/k-norm layers only for Qwen3-family verifiers)
    "qwen3-style draft layer": {"draft_layer": "qwen3"},
    "qwen3-style draft layer, seed 1": {"draft_layer": "qwen3", "seed": 1},
    "hidden noise 0.1": {"hidden_noise": 0.1},
    "hidden noise 0.3": {"hidden_noise": 0.3},
    "2x steps": {"__steps_factor": 2},
    # the same base with another seed (init, data order, COD sampling): the noise floor every row above sits on
    "seed 1": {"seed": 1},
    "seed 2": {"seed": 2},
    "muon, seed 1": {"optimizer": "muon", "seed": 1},
    # only the depths the quickstart's K=3 drafts read (COD's elements per anchor 1 + 0.7 + 0.49 instead of ~3.4)
    "3 depths": {"num_depths": 3},
    "3 depths, seed 1": {"num_depths": 3, "seed": 1},
    "3 depths, seed 2": {"num_depths": 3, "seed": 2},
    # ... with depth 0 weighted as the reference trainer's element mean and 512-anchor cap weigh it (~54%)
    "3 depths, decay 0.5": {"num_depths": 3, "loss_decay": 0.5},
    "3 depths, decay 0.5, seed 1": {"num_depths": 3, "loss_decay": 0.5, "seed": 1},
    "3 depths, decay 0.5, seed 2": {"num_depths": 3, "loss_decay": 0.5, "seed": 2},
    # speculators 0.9.0's optimiser as it ships (the "all" row above gave its AdamW 1e-4): Muon and AdamW both at
    # 1e-3, AdamW weight decay 0.01 and beta2 0.999 (torch's), Muon weight decay 0.1, 1% warmup, linear decay to 0
    "3 depths, reference optimiser": dict(REFERENCE_OPTIMISER),
    "3 depths, reference optimiser, seed 1": {**REFERENCE_OPTIMISER, "seed": 1},
    "3 depths, reference optimiser, seed 2": {**REFERENCE_OPTIMISER, "seed": 2},
    "3 depths, adam beta2 0.999": {"num_depths": 3, "adam_beta2": 0.999},
    "3 depths, adam beta2 0.999, seed 1": {"num_depths": 3, "adam_beta2": 0.999, "seed": 1},
    "3 depths, adam beta2 0.999, seed 2": {"num_depths": 3, "adam_beta2": 0.999, "seed": 2},
    # ... and as `train`'s default weights them (depth 0: 72% of the loss over 3 depths)
    "3 depths, decay 0.3": {"num_depths": 3, "loss_decay": 0.3},
    # the reference's wall time for its 120 steps buys paradraft about twice the steps (cosine over all of them)
    "3 depths, 2x steps": {"num_depths": 3, "__steps_factor": 2},
    # the reference's loss also trains positions whose verifier argmax is outside the draft vocabulary (10% here)
    "3 depths, out-of-vocab trained": {"num_depths": 3, "train_out_of_vocab": True},
    "3 depths, out-of-vocab trained, seed 1": {"num_depths": 3, "train_out_of_vocab": True, "seed": 1},
    "3 depths, out-of-vocab trained, seed 2": {"num_depths": 3, "train_out_of_vocab": True, "seed": 2},
    # the reference's init: fc and draft-layer matrices N(0, its verifier's initializer_range = 0.02)
    "3 depths, init N(0, 0.02)": {"num_depths": 3, "init_std": 0.02},
    "3 depths, init N(0, 0.02), seed 1": {"num_depths": 3, "init_std": 0.02, "seed": 1},
    "3 depths, init N(0, 0.02), seed 2": {"num_depths": 3, "init_std": 0.02, "seed": 2},
    "reference defaults (0.9.0), all": REFERENCE_ALL,
    "reference defaults (0.9.0), all, seed 1": {**REFERENCE_ALL, "seed": 1},
    "reference defaults (0.9.0), all, seed 2": {**REFERENCE_ALL, "seed": 2},
    "reference defaults (0.9.0), all, its init": {**REFERENCE_ALL, "init_std": 0.02},
    # ... less one group of them at a time (that group at the quickstart's own values)
    "reference defaults, all but its optimiser": reference_all_but("optimizer", "weight_decay", "adam_beta2",
                                                                   "lr_schedule", "warmup_steps"),
    "reference defaults, all but its 8 depths": reference_all_but("num_depths", "loss_decay"),
    "reference defaults, all but its layer": reference_all_but("draft_layer", "norm_before_residual"),
    "reference defaults, all but its trained set": reference_all_but("mask_hidden_init", "freeze_lm_head",
                                                                     "train_embeddings", "train_out_of_vocab"),
    # the two groups that carry its lead, servable (Llama-style layer): its optimiser and norm before residual
    "3 depths, reference optimiser, norm before residual": {**REFERENCE_OPTIMISER, "norm_before_residual": True,
                                                            "draft_layer": "llama"},
    # ... and with its Qwen3-style layer (q/k norms), which carries the rest of its lead
    "3 depths, reference optimiser, its layer": {**REFERENCE_OPTIMISER, "norm_before_residual": True,
                                                 "draft_layer": "qwen3"},
    "3 depths, reference optimiser, its layer, seed 1": {**REFERENCE_OPTIMISER, "norm_before_residual": True,
                                                         "draft_layer": "qwen3", "seed": 1},
    "3 depths, reference optimiser, its layer, seed 2": {**REFERENCE_OPTIMISER, "norm_before_residual": True,
                                                         "draft_layer": "qwen3", "seed": 2},
    "reference defaults, all but its qwen3 layer": reference_all_but("draft_layer"),
    "reference defaults, all but norm before residual": reference_all_but("norm_before_residual"),
    # what vLLM serves for a Llama verifier (its Llama-style layer), at the quickstart's 3 depths
    "reference defaults, llama layer, 3 depths": reference_all_but("draft_layer", "num_depths", "loss_decay"),
    "reference defaults, llama layer, 3 depths, seed 1": {**reference_all_but("draft_layer", "num_depths",
                                                                              "loss_decay"), "seed": 1},
    "reference defaults, llama layer, 3 depths, seed 2": {**reference_all_but("draft_layer", "num_depths",
                                                                              "loss_decay"), "seed": 2},
    # speculators' P-EAGLE trainer defaults that paradraft can serve in vLLM (its Qwen3-style draft layer for a
    # Llama verifier is not one vLLM's Llama EAGLE-3 model loads)
    "speculators defaults (norm before residual, linear lr)": {"norm_before_residual": True,
                                                               "lr_schedule": "linear"},
}


def measure(drafter: str, data: str, prompts: int) -> dict:
    """Acceptance length and per-position acceptance measured by `paradraft bench` (greedy, float32)."""
    with tempfile.TemporaryDirectory() as d:
        out = bench(BenchConfig(drafter=[drafter], dataset="sharegpt-val", data=data, num_prompts=prompts,
                                max_new_tokens=96, num_speculative_tokens=[3, 7], repeats=1, prompt_lookup=False,
                                dtype="float32", output=str(Path(d) / "bench.json")))
    return {f"k{r['k']}": {"acceptance_length": r["acceptance_length"],
                           "per_position_acceptance": r["per_position_acceptance"]}
            for r in out["results"] if r["method"] != "plain"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--hidden-states", required=True)
    ap.add_argument("--base", choices=sorted(BASES), default="recipe")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--bench-prompts", type=int, default=0, help="also measure acceptance on this many prompts")
    ap.add_argument("--output", default="benchmarks/results/sweep_train_defaults.json")
    ap.add_argument("--only", nargs="*", choices=sorted(SETTINGS), help="run only these settings")
    a = ap.parse_args()
    old = json.loads(Path(a.output).read_text())["rows"] if a.only and Path(a.output).is_file() else []
    rows = [r for r in old if r["setting"] not in a.only] if a.only else []  # --only adds to an earlier sweep
    for name, over in SETTINGS.items():
        if a.only and name not in a.only:
            continue
        over = dict(over)
        steps = a.steps * over.pop("__steps_factor", 1)
        with tempfile.TemporaryDirectory() as d:
            kw = dict(BASES[a.base], data=a.data, hidden_states=a.hidden_states, output=d, max_steps=steps,
                      save_every=10_000)
            kw.update(over)
            t0 = time.time()
            final = train(TrainConfig(**kw))
            secs = time.time() - t0
            v = final["val"]
            row = {"setting": name, "overrides": over, "steps": steps, "seconds": secs,
                   "val_acceptance_length_k7": v["acceptance_length_estimate"],
                   "val_acceptance_length_by_k": v.get("acceptance_length_by_k"),
                   "val_acc_depth0": v["acc"][0], "val_acc": v["acc"], "val_conditional_acc": v.get("conditional_acc")}
            if a.bench_prompts:
                row["measured"] = measure(d, a.data, a.bench_prompts)
            rows.append(row)
        print(json.dumps(row), flush=True)
        write(a, rows)


def write(a, rows) -> None:
    out = {"benchmark": "sweep_train_defaults", "date": time.strftime("%Y-%m-%d"), "steps": a.steps, "base": a.base,
           "base_flags": BASES[a.base], "data": a.data, "rows": rows}
    Path(a.output).parent.mkdir(parents=True, exist_ok=True)
    Path(a.output).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
