"""`paradraft bench`: plain decoding, every drafter at every K, and HF prompt lookup, on the same prompts.

Metrics (one definition, here):
  acceptance_length       tokens emitted per verifier pass in the speculative loop = mean(accepted) + 1
                          (the +1 is the verifier's own bonus / correction token); 1 <= AL <= K + 1
  per_position_acceptance [K]: fraction of verifier passes in which draft position i (1-based) was accepted
  tokens_per_s            new tokens / wall time (prefill included), median over --repeats (interleaved runs)
  speedup                 median of speedup_per_repeat (1.0 for plain decoding)
  speedup_per_repeat      [repeats]: each repeat's tokens/s over the plain run of the same repeat (the spread says
                          how noisy the machine was; runs are interleaved, so slow phases hit both sides)
  draft_fraction          drafting time / (drafting + verifying) in the speculative loop
  passes, wall_s          verifier forward passes (prefills not counted) and wall time of one repeat (medians)
  output_digest           fingerprint of the generated token ids (first repeat): equal digests = identical outputs,
                          across methods and across engines (--engine paradraft | vllm)
"""

from __future__ import annotations

import contextlib
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from .. import kernels
from ..config import BenchConfig, config_to_dict
from ..data.prepare import PreparedDataset
from ..data.sources import read_humaneval
from ..data.template import encode_prompt, stop_token_ids
from ..decode.engine import Engine, GenerationConfig, GenerationError, compile_wanted
from ..decode.generate import read_prompts
from ..errors import DataError
from ..models.checkpoint import load_drafter, recorded_k
from ..outputs import PNG_MARK, claim_file, output_lock
from ..utils import atomic_path, engine_dtype, fingerprint, read_json, resolve_device, sha256_file, write_json
from ..verifier import load_tokenizer, load_verifier, load_verifier_config
from ..vllm_driver import find_vllm_python
from .metrics import engine_len, median_speedup, speedup_per_repeat, tokens_per_s
from .vllm import bench_vllm


def load_prompts(dataset: str, num_prompts: int, tok, data: str | None = None,
                 val_context: str = "first", max_tokens: int | None = None) -> list[list[int]]:
    """Token ids of the benchmark prompts (chat template applied, generation prompt appended): `dataset` is
    humaneval, sharegpt-val (the held-out split of the prepared `data`: each sample up to its first assistant turn,
    or with `val_context` "last" up to its last one, then its last `max_tokens` tokens: what the verifier's context
    holds beside the answer) or a prompts JSONL file."""
    if dataset == "humaneval":
        recs = [{"prompt": r["messages"][0]["content"]} for r in read_humaneval()]
        return [encode_prompt(tok, r) for r in recs[:num_prompts]]
    if dataset == "sharegpt-val":
        ds = PreparedDataset(data)
        out = []
        for i in ds.indices("val"):
            ids, mask = ds.sample(int(i))
            if val_context == "last":  # the start of the last trained run: the whole context before that turn
                starts = np.flatnonzero(mask[1:] & ~mask[:-1]) + 1
                first = int(starts[-1]) if len(starts) else 0
            else:
                first = int(np.argmax(mask)) if mask.any() else 0
            if first > 0:  # system + user turn(s) (and answers) + assistant header
                out.append(ids[:first][-max_tokens:].tolist() if max_tokens else ids[:first].tolist())
            if len(out) >= num_prompts:
                break
        if not out:
            raise DataError(f"--data {data} has no validation samples to use as prompts (prepare it with "
                            f"--val-fraction > 0)")
        return out
    return [encode_prompt(tok, r) for r in read_prompts(dataset)[:num_prompts]]


def _prompt_room(cfg: BenchConfig, verifier_config) -> int | None:
    """With --val-context last: the most prompt tokens the verifier's context holds beside the answer and its drafts
    (`engine_len`: both engines are given the same prompts); else None (prompts as they are)."""
    ctx = getattr(verifier_config, "max_position_embeddings", None)
    if cfg.val_context != "last" or not ctx:
        return None
    room = ctx - engine_len(0, cfg.max_new_tokens, max(cfg.num_speculative_tokens))
    return room if room > 0 else None


def bench_identity(cfg: BenchConfig) -> str:
    """What a result was measured on: the flags (less where it is written), the prompts' source and every
    drafter's weights and config."""
    kept = {k: v for k, v in config_to_dict(cfg).items() if k not in ("output", "plot", "reuse")}
    for key, default in (("val_context", "first"), ("compile", "auto")):  # added later: results measured before
        if kept.get(key) == default:  # them keep their identity
            del kept[key]
    inputs = {"drafters": [[sha256_file(Path(d) / "model.safetensors") if (Path(d) / "model.safetensors").is_file()
                            else None, fingerprint(read_json(Path(d) / "config.json"))] for d in cfg.drafter
                           if (Path(d) / "config.json").is_file()]}
    if cfg.dataset == "sharegpt-val":
        inputs["data"] = PreparedDataset(cfg.data).manifest.get("identity")
    elif Path(cfg.dataset).is_file():
        inputs["prompts"] = sha256_file(cfg.dataset)
    return fingerprint({"config": kept, "inputs": inputs})


CONTEXT_BUCKETS = (0, 512, 1024, 2048, 4096, 8192, 16384, 32768)  # prompt tokens: [edge, next edge)


def context_bucket(n: int) -> str:
    """The prompt-length bucket of a prompt of n tokens, e.g. '2048-4095' or '32768+'."""
    lo = max(e for e in CONTEXT_BUCKETS if e <= n)
    i = CONTEXT_BUCKETS.index(lo)
    return f"{lo}+" if i == len(CONTEXT_BUCKETS) - 1 else f"{lo}-{CONTEXT_BUCKETS[i + 1] - 1}"


def acceptance_by_context(runs: list[dict]) -> dict:
    """{bucket: {"prompts", "passes", "acceptance_length"}} over the repeats' per-prompt records
    ([prompt tokens, accepted drafts, verifier passes] each), buckets of prompt tokens in order."""
    acc: dict[str, list[int]] = {}
    for r in runs:
        for n, accepted, passes in r.get("by_prompt") or []:
            a = acc.setdefault(context_bucket(n), [0, 0, 0])
            a[0] += 1
            a[1] += accepted
            a[2] += passes
    order = [context_bucket(e) for e in CONTEXT_BUCKETS]
    return {b: {"prompts": acc[b][0] // max(1, len(runs)), "passes": acc[b][2],
                "acceptance_length": 1.0 + acc[b][1] / acc[b][2] if acc[b][2] else 1.0}
            for b in order if b in acc}


def _summ(results, wall: float, prompts=None) -> dict:
    toks = sum(len(r.token_ids) for r in results)
    acc = [a for r in results for a in r.accepted_per_pass]
    K = max([0] + acc)
    draft = sum(r.draft_s for r in results)
    verify = sum(r.verify_s for r in results)
    return {"tokens": toks, "wall_s": wall, "passes": len(acc),
            "acceptance_length": (float(np.mean(acc)) + 1) if acc else 1.0,
            "accepted": acc, "draft_s": draft, "verify_s": verify, "K_seen": K,
            "by_prompt": [[len(p), int(sum(r.accepted_per_pass)), len(r.accepted_per_pass)]
                          for p, r in zip(prompts, results)] if prompts is not None else None,
            "output_digest": fingerprint([list(map(int, r.token_ids)) for r in results])}


def _run_engine(engine: Engine, prompts, g: GenerationConfig) -> dict:
    t0 = time.perf_counter()
    res = [engine.generate([p], g)[0] for p in prompts]
    return _summ(res, time.perf_counter() - t0, prompts)


def _run_prompt_lookup(model, prompts, g: GenerationConfig, k: int, pad_id) -> dict:
    calls = {"n": 0}
    real = model.forward

    def counted(*a, **kw):
        calls["n"] += 1
        return real(*a, **kw)
    model.forward = counted
    toks = 0
    t0 = time.perf_counter()
    try:
        for p in prompts:
            ids = torch.tensor([p], device=model.device)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=g.max_new_tokens,
                                 do_sample=False, prompt_lookup_num_tokens=k, eos_token_id=g.eos_token_ids,
                                 pad_token_id=pad_id)
            toks += out.shape[1] - len(p)
    finally:
        del model.forward
    wall = time.perf_counter() - t0
    passes = max(1, calls["n"] - len(prompts))  # minus the prefills
    return {"tokens": toks, "wall_s": wall, "passes": passes, "acceptance_length": (toks - len(prompts)) / passes,
            "accepted": None, "draft_s": 0.0, "verify_s": 0.0}


def bench(cfg: BenchConfig) -> dict:
    """Run `paradraft bench`; returns the results dict (also written to cfg.output). With --reuse, results of
    this exact benchmark already in --output (same identity) are shown instead of measured again."""
    claim_file(cfg.output, "bench", "--output")  # before the work, not after it
    if cfg.plot:
        if Path(cfg.plot).expanduser().resolve() == Path(cfg.output).expanduser().resolve():
            raise GenerationError(f"--plot {cfg.plot} is --output too; give the plot its own path")
        claim_file(cfg.plot, "plot", "--plot")
    with contextlib.ExitStack() as locks:  # one bench per output file at a time
        locks.enter_context(output_lock(cfg.output, "--output"))
        if cfg.plot:
            locks.enter_context(output_lock(cfg.plot, "--plot"))
        return _bench(cfg)


@torch.inference_mode()  # scoped: a global grad switch would leak into whatever runs next (e.g. training)
def _bench(cfg: BenchConfig) -> dict:
    if cfg.engine == "vllm":
        find_vllm_python(cfg.vllm_python)  # before the work: a missing vLLM is a one-line error
    if cfg.engine == "paradraft":
        cfg.device = resolve_device(cfg.device)  # before the work; recorded resolved, as the dtype is
    cfg.dtype = engine_dtype(cfg.dtype, cfg.engine, cfg.device)  # recorded resolved: results say what they ran in
    if not cfg.num_speculative_tokens:  # the K each drafter was trained and recorded for (resolved: recorded too)
        cfg.num_speculative_tokens = sorted({recorded_k(p) for p in cfg.drafter}) or [3]
    identity = bench_identity(cfg)
    if cfg.reuse and Path(cfg.output).is_file():
        try:
            old = read_json(cfg.output)
        except ValueError:
            old = {}
        if old.get("identity") == identity:
            print(f"[bench] {cfg.output} already holds this benchmark (same flags, prompts and drafters); reusing it")
            redefined = _paired_speedups(old)
            if redefined:  # written before speedup was the median of the paired repeats: the file says it now
                write_json(cfg.output, old)
            print(format_table(old))
            if cfg.plot and (redefined or not Path(cfg.plot).is_file()):
                plot_results(old, cfg.plot)
            return old
    if cfg.engine == "vllm":
        tok = load_tokenizer(cfg.verifier)
        prompts = load_prompts(cfg.dataset, cfg.num_prompts, tok, cfg.data, cfg.val_context,
                               _prompt_room(cfg, load_verifier_config(cfg.verifier)))
        out_dir = Path(cfg.output).resolve().parent
        out_dir.mkdir(parents=True, exist_ok=True)
        logs = Path(tempfile.mkdtemp(prefix=".paradraft-vllm-logs-", dir=out_dir))  # ours: removed on success
        results, extra = bench_vllm(cfg, prompts, stop_token_ids(tok), logs)
        shutil.rmtree(logs)
        return _finish(cfg, identity, prompts, results, threads=None, extra={"engine": "vllm", **extra})
    model, tok = load_verifier(cfg.verifier, dtype=cfg.dtype, device=cfg.device)
    prompts = load_prompts(cfg.dataset, cfg.num_prompts, tok, cfg.data, cfg.val_context,
                           _prompt_room(cfg, model.config))
    eos = stop_token_ids(tok)
    drafters = []
    for path in cfg.drafter:
        d = load_drafter(path, verifier=model, verifier_name=cfg.verifier, force=cfg.force, device=cfg.device)
        d = d.to(getattr(torch, cfg.dtype))
        limit = d.max_draft_tokens()
        if limit is not None and max(cfg.num_speculative_tokens) > limit:
            raise GenerationError(f"--num-speculative-tokens {max(cfg.num_speculative_tokens)}: the drafter "
                                  f"{path} was trained on {limit} depths; benchmark K <= {limit}")
        drafters.append((path, d))
    methods = [("plain", None, None, 0)]
    for path, d in drafters:
        for k in cfg.num_speculative_tokens:
            methods.append((d.cfg.algorithm, path, d, k))
    if cfg.prompt_lookup and cfg.temperature <= 0:
        methods += [("prompt_lookup", None, None, k) for k in cfg.num_speculative_tokens]
    # room for the longest prompt and its answer (long-context prompt files), at least the 8192 it always had, at
    # most the verifier's context: a prompt beyond it is the engine's one-line error
    max_len = max(8192, engine_len(max(len(p) for p in prompts), cfg.max_new_tokens, max(cfg.num_speculative_tokens)))
    max_len = min(max_len, getattr(model.config, "max_position_embeddings", None) or max_len)
    compiled = compile_wanted(cfg.compile, cfg.device)
    engines = {None: Engine(model, max_len=max_len, compile=compiled)}
    for path, d in drafters:
        engines[path] = Engine(model, d, max_len=max_len, compile=compiled)
    runs: dict[tuple, list[dict]] = {(m, p, k): [] for m, p, _, k in methods}
    # warm-up, untimed: first calls, and every compiled step kind (decoding; verifying each K) before any timing
    for m, path, _d, k in methods:
        if m != "prompt_lookup" and (m == "plain" or compiled):
            _run_engine(engines[path], prompts[:1], GenerationConfig(max_new_tokens=8, eos_token_ids=eos,
                                                                     num_speculative_tokens=max(1, k)))
    compile_s = sum(e.compile_s for e in engines.values())
    if compiled:
        print(f"[bench] compiled the engine's steps in {compile_s:.1f} s (torch.compile; not timed)", file=sys.stderr)
    bar = tqdm(total=cfg.repeats * len(methods), desc="bench", unit="run", disable=None)
    for rep in range(cfg.repeats):  # interleaved: every method once per repeat
        for m, path, _d, k in methods:
            g = GenerationConfig(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
                                 num_speculative_tokens=max(1, k), seed=cfg.seed + rep, eos_token_ids=eos)
            if m == "prompt_lookup":
                runs[(m, path, k)].append(_run_prompt_lookup(model, prompts, g, k, tok.pad_token_id))
            else:
                runs[(m, path, k)].append(_run_engine(engines[path], prompts, g))
            bar.update(1)
    bar.close()
    plain_rs = runs[("plain", None, 0)]
    results = []
    for m, path, _d, k in methods:
        rs = runs[(m, path, k)]
        tps, per = tokens_per_s(rs), speedup_per_repeat(rs, plain_rs)
        acc = [a for r in rs for a in (r["accepted"] or [])]
        per_pos = [float(np.mean([a >= i for a in acc])) for i in range(1, k + 1)] if acc else None
        ds, vs = sum(r["draft_s"] for r in rs), sum(r["verify_s"] for r in rs)
        results.append({
            "method": m, "drafter": path, "k": k,
            "acceptance_length": float(np.mean([r["acceptance_length"] for r in rs])) if m != "plain" else 1.0,
            "per_position_acceptance": per_pos, "tokens_per_s": tps, "speedup": median_speedup(per),
            "acceptance_by_context": acceptance_by_context(rs) if m not in ("plain", "prompt_lookup") else None,
            "speedup_per_repeat": per,
            "draft_fraction": ds / (ds + vs) if ds + vs > 0 and m != "plain" else None,
            "tokens": int(np.median([r["tokens"] for r in rs])),
            "output_digest": rs[0].get("output_digest"),
            "passes": int(np.median([r["passes"] for r in rs])) if m != "plain" else int(np.median(
                [r["tokens"] for r in rs])),
            "wall_s": float(np.median([r["wall_s"] for r in rs])),
        })
    return _finish(cfg, identity, prompts, results, threads=torch.get_num_threads(),
                   extra={"engine": "paradraft", "compiled": compiled, "compile_s": round(compile_s, 2),
                          "kernel": kernels.status() if cfg.device == "cpu" else None})


def _paired_speedups(out: dict) -> bool:
    """Set each row's `speedup` from its `speedup_per_repeat` (results written before 2026-12-03 hold the ratio of
    two medians there); whether any row changed."""
    changed = False
    for r in out.get("results", []):
        if r.get("speedup_per_repeat"):
            new = median_speedup(r["speedup_per_repeat"])
            changed |= new != r.get("speedup")
            r["speedup"] = new
    return changed


def _finish(cfg: BenchConfig, identity: str, prompts, results: list, threads, extra: dict) -> dict:
    """Write, print and plot a benchmark's results (either engine: one schema)."""
    out = {"date": time.strftime("%Y-%m-%d %H:%M"), "verifier": cfg.verifier, "dataset": cfg.dataset,
           "num_prompts": len(prompts), "max_new_tokens": cfg.max_new_tokens, "temperature": cfg.temperature,
           "dtype": cfg.dtype, "device": cfg.device, "repeats": cfg.repeats, "threads": threads,
           "identity": identity, **extra,
           "results": results}
    write_json(cfg.output, out)
    print(format_table(out))
    if cfg.plot:
        plot_results(out, cfg.plot)
    print(f"[bench] -> {cfg.output}" + (f", {cfg.plot}" if cfg.plot else ""))
    return out


def drafter_labels(out: dict) -> dict[str, str]:
    """Short, distinct names of the drafters of a result: the last path part, or more parts where names collide
    (runs/a/peagle and runs/b/peagle -> a/peagle, b/peagle)."""
    paths = sorted({r["drafter"] for r in out["results"] if r["drafter"]})
    for depth in range(1, 1 + max([len(Path(p).parts) for p in paths] + [1])):
        labels = {p: "/".join(Path(p).parts[-depth:]) for p in paths}
        if len(set(labels.values())) == len(paths):
            return labels
    return {p: p for p in paths}


def format_table(out: dict) -> str:
    """Markdown table of bench results."""
    lines = [f"{out['dataset']}, {out['num_prompts']} prompts, {out['max_new_tokens']} new tokens, "
             f"T={out['temperature']}, {out['dtype']}, engine {out.get('engine', 'paradraft')}",
             "| method | drafter | K | acceptance length | tokens/s | speedup | draft time | per-position acceptance |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    names = drafter_labels(out)
    for r in out["results"]:
        pp = " ".join(f"{x:.2f}" for x in r["per_position_acceptance"]) if r["per_position_acceptance"] else "-"
        df = f"{r['draft_fraction']:.0%}" if r["draft_fraction"] is not None else "-"
        name = names[r["drafter"]] if r["drafter"] else "-"
        lines.append(f"| {r['method']} | {name} | {r['k']} | {r['acceptance_length']:.2f} | {r['tokens_per_s']:.1f} | "
                     f"{r['speedup']:.2f}x | {df} | {pp} |")
    by = [r for r in out["results"] if r.get("acceptance_by_context")]
    buckets = [b for b in dict.fromkeys(k for r in by for k in r["acceptance_by_context"])]
    if len(buckets) > 1:  # prompts of several lengths: acceptance length by prompt tokens (prompts in each)
        lines += ["", "acceptance length by prompt tokens (prompts)",
                  "| method | drafter | K | " + " | ".join(buckets) + " |", "| --- " * (3 + len(buckets)) + "|"]
        for r in by:
            cells = [f"{r['acceptance_by_context'][b]['acceptance_length']:.2f} "
                     f"({r['acceptance_by_context'][b]['prompts']})" if b in r["acceptance_by_context"] else "-"
                     for b in buckets]
            lines.append(f"| {r['method']} | {names[r['drafter']]} | {r['k']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_results(out: dict, path: str | Path) -> Path:
    """PNG: speedup (left) and acceptance length (right) against K, one line per method/drafter."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    series: dict[str, list] = {}
    names = drafter_labels(out)
    for r in out["results"]:
        if r["method"] == "plain":
            continue
        label = r["method"] + (f" ({names[r['drafter']]})" if r["drafter"] else "")
        series.setdefault(label, []).append(r)
    for label, rs in series.items():
        rs = sorted(rs, key=lambda r: r["k"])
        a1.plot([r["k"] for r in rs], [r["speedup"] for r in rs], marker="o", label=label)
        a2.plot([r["k"] for r in rs], [r["acceptance_length"] for r in rs], marker="o", label=label)
    ks = sorted({r["k"] for r in out["results"] if r["method"] != "plain"})
    a1.set_xticks(ks)
    a2.set_xticks(ks)
    a1.axhline(1.0, color="gray", ls="--", lw=1, label="plain decoding")
    # acceptance length is >= 1 (plain decoding): the axis starts there, so a 0.01 difference does not fill it
    top = max([r["acceptance_length"] for r in out["results"] if r["method"] != "plain"], default=1.0)
    a2.set_ylim(1.0, max(1.1, top * 1.05))
    a1.set_xlabel("K (draft tokens per verifier pass)")
    a1.set_ylabel("speedup over plain decoding")
    a2.set_xlabel("K")
    a2.set_ylabel("acceptance length (tokens per verifier pass)")
    a1.legend(fontsize=8)
    a2.legend(fontsize=8)
    engine = f", {out['engine']}'s engine" if out.get("engine") else ""
    fig.suptitle(f"{out['verifier']} on {out['dataset']}, T={out['temperature']}{engine}")
    fig.tight_layout()
    with atomic_path(path) as tmp:  # the PNG marker makes it recognisable as paradraft's (outputs.claim_file)
        fig.savefig(tmp, dpi=110, format="png", metadata={"Software": f"{PNG_MARK} bench"})
    plt.close(fig)
    return Path(path)
