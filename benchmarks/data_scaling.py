"""How much data does a drafter need? Held-out acceptance against trained tokens, one curve per drafter shape.

One online training run per drafter (P-EAGLE at 1, 2 and 4 layers, EAGLE-3), one pass over ShareGPT conversations
with their original answers (nothing on disk but the prepared tokens), constant learning rate after warmup so a
checkpoint after N trained tokens is a drafter trained on N tokens. At log-spaced milestones (a factor 2 apart)
it records the held-out acceptance-length estimate and per-depth accuracy (validation inside training), and the
acceptance length `paradraft bench` measures on held-out prompts (greedy, float32, K=7), with the training time.

  python benchmarks/data_scaling.py [--work runs/scaling] [--samples 700] [--milestones 4] [--base-step 16]
        [--configs peagle-1 peagle-2 peagle-4 eagle3] [--loss-decay D] [--output benchmarks/results/data_scaling.json]
        [--plot docs/data-scaling.png]

It prints the markdown table of BENCHMARKS.md at the end (also: `--table-only`, from --output, running nothing).

Rerunning continues: finished configs are kept (rows in --output), an interrupted training run resumes.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import yaml
from safetensors.torch import load_file

from paradraft.bench.run import bench
from paradraft.config import BenchConfig, PrepareConfig, TrainConfig
from paradraft.data.prepare import prepare
from paradraft.models.checkpoint import load_drafter, save_drafter
from paradraft.train.trainer import train

CONFIGS = {"peagle-1": ("peagle", 1), "peagle-2": ("peagle", 2), "peagle-4": ("peagle", 4), "eagle3": ("eagle3", 1)}


def drafter_at(run: Path, step: int, out: Path) -> Path:
    """A drafter directory with the weights of the run's step checkpoint (the final drafter gives the config)."""
    model = load_drafter(run)
    sd = load_file(str(run / "checkpoints" / f"step-{step:07d}" / "model.safetensors"))
    model.load_state_dict(sd)
    return save_drafter(model, out)


def measure(drafter: Path, data: Path, prompts: int, tokens: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        out = bench(BenchConfig(drafter=[str(drafter)], dataset="sharegpt-val", data=str(data), num_prompts=prompts,
                                max_new_tokens=tokens, num_speculative_tokens=[7], repeats=1, prompt_lookup=False,
                                dtype="float32", output=str(Path(d) / "b.json")))
    r = [x for x in out["results"] if x["method"] != "plain"][0]
    return {"acceptance_length": r["acceptance_length"], "per_position_acceptance": r["per_position_acceptance"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default="runs/scaling")
    ap.add_argument("--samples", type=int, default=700)
    ap.add_argument("--milestones", type=int, default=4)
    ap.add_argument("--base-step", type=int, default=16, help="first milestone (steps); then x2 each")
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--val-samples", type=int, default=10_000, help="held-out conversations validated")
    ap.add_argument("--loss-decay", type=float, default=None,
                    help="train --loss-decay (default: the algorithm's; rows before 2026-12-02 used 1 for P-EAGLE)")
    ap.add_argument("--bench-prompts", type=int, default=6)
    ap.add_argument("--bench-tokens", type=int, default=96)
    ap.add_argument("--output", default="benchmarks/results/data_scaling.json")
    ap.add_argument("--plot", default="docs/data-scaling.png")
    ap.add_argument("--table-only", action="store_true", help="print the table and plot from --output, run nothing")
    ap.add_argument("--also", nargs="+", default=[], metavar="JSON",
                    help="with --table-only: the rows of other runs' --output files, drawn as their own dashed lines")
    a = ap.parse_args()
    if a.table_only:
        rows = json.loads(Path(a.output).read_text())["rows"]
        plot(rows, a.plot, {Path(f).stem: json.loads(Path(f).read_text())["rows"] for f in a.also})
        print(table(rows))
        return
    work = Path(a.work)
    data = work / "data"
    if not (data / "manifest.json").is_file():
        prepare(PrepareConfig(data=["sharegpt"], output=str(data), seq_length=1024, max_samples=a.samples,
                              val_fraction=0.04))
    steps = [a.base_step * 2 ** i for i in range(a.milestones)]
    out_path = Path(a.output)
    rows = json.loads(out_path.read_text())["rows"] if out_path.is_file() else []
    done = {r["config"] for r in rows}
    for name in a.configs:
        if name in done:
            continue
        algo, layers = CONFIGS[name]
        run = work / name
        t0 = time.time()
        vals = validated(run)  # {step: val} of an earlier (interrupted) run of this script
        for s in steps:  # one segment per milestone: validated, checkpointed and kept only there
            if s in vals:
                continue
            cfg = TrainConfig(algorithm=algo, num_layers=layers, data=str(data), online=True, output=str(run),
                              max_steps=s, batch_tokens=2048, lr=1e-3, warmup_steps=min(10, steps[0]),
                              lr_schedule="constant", num_depths=8, loss_decay=a.loss_decay,
                              save_every=10 ** 9, keep_checkpoints=10 ** 6,
                              val_every=0, val_samples=a.val_samples, resume=(run / "checkpoints").is_dir())
            vals[s] = train(cfg)["val"]
            (run / "milestones.json").write_text(json.dumps({str(k): v for k, v in vals.items()}))
        secs = time.time() - t0
        metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        by_step = {m["step"]: m for m in metrics}
        decay = yaml.safe_load((run / "train_config.yaml").read_text())["loss_decay"]  # as the run resolved it
        for s in steps:
            m = by_step[s]
            v = vals[s]
            drafter = drafter_at(run, s, work / f"{name}-step{s}")
            meas = measure(drafter, data, a.bench_prompts, a.bench_tokens)
            rows.append({"config": name, "algorithm": algo, "layers": layers, "step": s,
                         "trained_tokens": m["trained_tokens"], "loss_decay": decay,
                         "train_seconds": sum(x["step_s"] for x in metrics if x["step"] <= s),
                         "run_seconds_total": secs, "val_acceptance_length_k7": v["acceptance_length_estimate"],
                         "val_acc": v["acc"], "val_conditional_acc": v["conditional_acc"],
                         "measured_k7": meas})
            print(json.dumps(rows[-1]), flush=True)
        write(out_path, a, rows)
    write(out_path, a, rows)
    plot(rows, a.plot)
    print(table(rows))


def table(rows: list) -> str:
    """The BENCHMARKS.md table: one line per (drafter shape, milestone)."""
    out = ["| drafter | trained tokens | train s | estimate (K=7) | measured AL (K=7) | measured per position 1 / 2 "
           "| depth-0 acc | depth 1 / 3 / 5 acc |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name in CONFIGS:
        for r in sorted((r for r in rows if r["config"] == name), key=lambda r: r["trained_tokens"]):
            acc, pp = r["val_acc"], r["measured_k7"]["per_position_acceptance"]
            deeper = " / ".join(f"{100 * acc[d]:.1f}" if d < len(acc) else "-" for d in (1, 3, 5))  # EAGLE-3: ttt
            out.append(f"| {name} | {r['trained_tokens']:,} | {r['train_seconds']:.0f} | "
                       f"{r['val_acceptance_length_k7']:.3f} | {r['measured_k7']['acceptance_length']:.3f} | "
                       f"{pp[0]:.3f} / {pp[1]:.3f} | {100 * acc[0]:.1f}% | {deeper} |")
    return "\n".join(out)


def validated(run: Path) -> dict:
    """{step: held-out validation} of the run's saved checkpoints: validations logged in metrics.jsonl (val_every)
    and those that ended a segment (milestones.json)."""
    vals = {}
    if (run / "metrics.jsonl").is_file():
        vals = {m["step"]: m["val"] for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
                if "val" in m}
    if (run / "milestones.json").is_file():
        vals.update({int(k): v for k, v in json.loads((run / "milestones.json").read_text()).items()})
    return {s: v for s, v in vals.items() if (run / "checkpoints" / f"step-{s:07d}").is_dir()}


def write(path: Path, a, rows: list) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"benchmark": "data_scaling", "date": time.strftime("%Y-%m-%d"),
                                "samples": a.samples, "rows": rows}, indent=2) + "\n")


def plot(rows: list, path: str, also: dict[str, list] | None = None) -> None:
    """Measured and estimated acceptance against trained tokens, a line per drafter shape; `also` {run name: rows}
    adds other runs (another draw of conversations and held-out split) as dashed lines labelled with the run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    runs = [("", rows, "-")] + [(f" ({run})", rs, "--") for run, rs in (also or {}).items()]
    for suffix, run_rows, style in runs:
        for name in CONFIGS:
            rs = sorted((r for r in run_rows if r["config"] == name), key=lambda r: r["trained_tokens"])
            if not rs:
                continue
            x = [r["trained_tokens"] for r in rs]
            a1.plot(x, [r["measured_k7"]["acceptance_length"] for r in rs], style, marker="o", label=name + suffix)
            a2.plot(x, [r["val_acceptance_length_k7"] for r in rs], style, marker="o", label=name + suffix)
    top = max(r["trained_tokens"] for r in rows)
    ticks = {r["trained_tokens"] for r in rows}  # the milestones (the same data order); other runs' beyond them
    for t in sorted(r["trained_tokens"] for _, rs, _ in runs[1:] for r in rs if r["trained_tokens"] > 1.3 * top):
        if all(abs(t / u - 1) > 0.3 for u in ticks):  # one label where two runs' milestones nearly coincide
            ticks.add(t)
    for ax, title in ((a1, "measured acceptance length (K=7, held-out prompts)"),
                      (a2, "held-out acceptance-length estimate (K=7)")):
        ax.set_xscale("log")
        ax.set_xticks(sorted(ticks))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x / 1000:.0f}k"))
        ax.xaxis.set_minor_formatter(FuncFormatter(lambda x, _: ""))
        ax.set_xlabel("trained tokens (one pass, original ShareGPT answers)")
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=8)
    fig.suptitle("SmolLM2-135M drafters: acceptance against training data")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
