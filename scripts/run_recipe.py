"""Run a recipe: a YAML list of paradraft commands with their flags (see recipes/). Finished steps are reused."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

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
    log_path = Path(run_dir) / "recipe_log.json"
    log = json.loads(log_path.read_text()) if log_path.is_file() else []  # steps of earlier (stopped) runs too
    for i, step in enumerate(recipe["steps"], 1):
        step = dict(step)
        name = step.pop("command")
        cls, fn, _ = COMMANDS[name]
        cfg = C.build_config(cls, None, {k.replace("-", "_"): _fill(v, run_dir) for k, v in step.items()})
        if name == "train":
            out = Path(cfg.output)
            if (out / "model.safetensors").is_file():
                print(f"[recipe] step {i} ({name} {cfg.algorithm}): {out} is trained; reusing it")
                continue
            cfg.resume = (out / "checkpoints").is_dir()
        print(f"[recipe] step {i}/{len(recipe['steps'])}: {name}  (elapsed {time.time() - t0:.0f} s)", flush=True)
        ts = time.time()
        fn(cfg)
        log.append({"step": i, "command": name, "output": getattr(cfg, "output", None), "seconds": time.time() - ts,
                    "finished": time.strftime("%Y-%m-%d %H:%M:%S")})
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_path.write_text(json.dumps(log, indent=2) + "\n")  # per-step wall times (a reused step takes ~0 s)
    print(f"[recipe] done in {time.time() - t0:.0f} s -> {run_dir} (step times: {log_path})")


if __name__ == "__main__":
    main(sys.argv[1])
