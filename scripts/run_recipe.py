"""Run a recipe: a YAML list of paradraft commands with their flags (see recipes/). Finished steps are reused."""

from __future__ import annotations

import sys
import time

import yaml

from paradraft import config as C
from paradraft.cli import COMMANDS


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
    for i, step in enumerate(recipe["steps"], 1):
        step = dict(step)
        name = step.pop("command")
        cls, fn, _ = COMMANDS[name]
        cfg = C.build_config(cls, None, {k.replace("-", "_"): _fill(v, run_dir) for k, v in step.items()})
        if name == "train":
            from pathlib import Path

            out = Path(cfg.output)
            if (out / "model.safetensors").is_file():
                print(f"[recipe] step {i} ({name} {cfg.algorithm}): {out} is trained; reusing it")
                continue
            cfg.resume = (out / "checkpoints").is_dir()
        print(f"[recipe] step {i}/{len(recipe['steps'])}: {name}  (elapsed {time.time() - t0:.0f} s)", flush=True)
        fn(cfg)
    print(f"[recipe] done in {time.time() - t0:.0f} s -> {run_dir}")


if __name__ == "__main__":
    main(sys.argv[1])
