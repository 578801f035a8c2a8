"""Run a recipe: a YAML list of paradraft commands with their flags (see recipes/), through paradraft's one
pipeline (paradraft.pipeline.run_steps): each step reuses its output when it is already complete."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import yaml

from paradraft import config as C
from paradraft.cli import COMMANDS
from paradraft.pipeline import run_steps


def _fill(v, run_dir):
    if isinstance(v, str):
        return v.replace("{run_dir}", run_dir)
    if isinstance(v, list):
        return [_fill(x, run_dir) for x in v]
    return v


def main(path: str) -> None:
    recipe = yaml.safe_load(open(path))
    run_dir = recipe.get("run_dir", "runs/recipe")
    t0 = time.time()
    log_path = Path(run_dir) / "recipe_log.json"
    log = json.loads(log_path.read_text()) if log_path.is_file() else []  # steps of earlier (stopped) runs too
    steps = []
    for step in recipe["steps"]:
        step = dict(step)
        name = step.pop("command")
        cls = COMMANDS[name][0]
        flags = {k.replace("-", "_"): _fill(v, run_dir) for k, v in step.items()}
        steps.append((name, C.build_config(cls, None, flags)))
    for i, step in enumerate(steps, 1):  # each step decides reuse itself (a finished step takes ~0 s)
        print(f"[recipe] step {i}/{len(steps)}: {step[0]}  (elapsed {time.time() - t0:.0f} s)", flush=True)
        new: list = []
        run_steps([step], log=new)
        log.extend(dict(r, step=i) for r in new)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_path.write_text(json.dumps(log, indent=2) + "\n")  # per-step wall times
    print(f"[recipe] done in {time.time() - t0:.0f} s -> {run_dir} (step times: {log_path})")


if __name__ == "__main__":
    main(sys.argv[1])
