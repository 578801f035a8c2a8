"""Run a recipe: a YAML list of paradraft commands with their flags (see recipes/), through paradraft's one
pipeline (paradraft.pipeline.run_steps): each step reuses its output when it is already complete."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import yaml

from paradraft import config as C
from paradraft.cli import COMMANDS
from paradraft.errors import PAUSED_EXIT, Paused, UserError
from paradraft.pipeline import run_steps


def _fill(v, run_dir):
    if isinstance(v, str):
        return v.replace("{run_dir}", run_dir)
    if isinstance(v, list):
        return [_fill(x, run_dir) for x in v]
    return v


def load(path: str) -> tuple[str, list]:
    """The recipe's run directory and its steps as (command, config): every flag checked, nothing run."""
    if not Path(path).is_file():
        raise C.ConfigError(f"recipe {path} not found")
    recipe = yaml.safe_load(Path(path).read_text())
    if not isinstance(recipe, dict) or not isinstance(recipe.get("steps"), list):
        raise C.ConfigError(f"recipe {path} must be a mapping with a list of steps (see recipes/)")
    run_dir = recipe.get("run_dir", "runs/recipe")
    steps = []
    for i, step in enumerate(recipe["steps"], 1):
        step = dict(step)
        name = step.pop("command", None)
        if name not in COMMANDS:
            raise C.ConfigError(f"{path}: step {i} has command {name!r}; known: {', '.join(COMMANDS)}")
        cls = COMMANDS[name][0]
        flags = {k.replace("-", "_"): _fill(v, run_dir) for k, v in step.items()}
        try:
            steps.append((name, C.build_config(cls, None, flags)))
        except C.ConfigError as e:
            raise C.ConfigError(f"{path}: step {i} ({name}): {e}") from None
    return run_dir, steps


def main(path: str, check: bool = False) -> None:
    run_dir, steps = load(path)
    if check:
        print(f"[recipe] {path}: {len(steps)} steps, flags valid: " + ", ".join(n for n, _ in steps))
        return
    t0 = time.time()
    log_path = Path(run_dir) / "recipe_log.json"
    log = json.loads(log_path.read_text()) if log_path.is_file() else []  # steps of earlier (stopped) runs too
    for i, step in enumerate(steps, 1):  # each step decides reuse itself (a finished step takes ~0 s)
        print(f"[recipe] step {i}/{len(steps)}: {step[0]}  (elapsed {time.time() - t0:.0f} s)", flush=True)
        new: list = []
        try:
            run_steps([step], log=new)
        except Paused as e:  # a train step at its --time-limit: the same recipe command continues it
            print(f"[recipe] paused at step {i}/{len(steps)} after {time.time() - t0:.0f} s: {e}\n"
                  f"[recipe] run the same command again to continue", flush=True)
            sys.exit(PAUSED_EXIT)
        log.extend(dict(r, step=i) for r in new)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_path.write_text(json.dumps(log, indent=2) + "\n")  # per-step wall times
    print(f"[recipe] done in {time.time() - t0:.0f} s -> {run_dir} (step times: {log_path})")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("recipe", help="a recipe YAML (recipes/)")
    ap.add_argument("--check", action="store_true", help="check every step's flags, run nothing")
    a = ap.parse_args()
    try:
        main(a.recipe, a.check)
    except UserError as e:  # one line, as the paradraft commands print it
        sys.exit(f"run_recipe: error: {e}")
