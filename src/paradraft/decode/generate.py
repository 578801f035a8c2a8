"""`paradraft generate`: prompts in, JSONL out, through the speculative decoding engine."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from ..config import GenerateConfig
from ..data.template import encode_prompt, stop_token_ids
from ..errors import UserError
from ..models.checkpoint import load_drafter
from ..outputs import claim_file, output_lock
from ..utils import engine_dtype, resolve_device, write_text_atomic
from ..verifier import load_verifier
from .engine import Engine, GenerationConfig, compile_wanted


class PromptError(UserError, ValueError):
    """A prompts file that cannot be used."""


def read_prompts(path: str | Path) -> list[dict]:
    """Prompts JSONL: one object per line with `id` and either `prompt` (a user turn) or `messages`."""
    out = []
    path = Path(path)
    if not path.is_file():
        raise PromptError(f"--prompts {path}: no such file")
    if path.is_dir():
        raise PromptError(f"--prompts {path}: is a directory; give a JSONL file")
    with open(path, encoding="utf-8-sig", errors="surrogateescape") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            if any("\ud800" <= ch <= "\udfff" for ch in line):
                raise PromptError(f"{path}:{n}: not UTF-8 text")
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise PromptError(f"{path}:{n}: not JSON ({e.msg})") from None
            if not isinstance(rec, dict) or not (isinstance(rec.get("prompt"), str) or
                                                 isinstance(rec.get("messages"), list)):
                raise PromptError(f"{path}:{n}: needs 'prompt' (string) or 'messages' (list)")
            rec.setdefault("id", str(n))
            out.append(rec)
    if not out:
        raise PromptError(f"{path} holds no prompts")
    return out


def load_engine(verifier_name: str, drafter: str | None, dtype: str, force: bool = False, max_len: int = 4096,
                device: str = "auto", compile: str = "off", new_tokens: int | None = None):
    """(engine, tokenizer) ready to generate on `device` (utils.resolve_device); `dtype` may be `auto`
    (utils.engine_dtype on that device); `compile` by engine.compile_wanted for a run of `new_tokens`."""
    device = resolve_device(device)
    dtype = engine_dtype(dtype, device=device)
    model, tok = load_verifier(verifier_name, dtype=dtype, device=device)
    d = None
    if drafter:
        d = load_drafter(drafter, verifier=model, verifier_name=verifier_name, force=force, device=device)
        d = d.to(getattr(torch, dtype))
    return Engine(model, d, max_len=max_len, max_len_flag="--max-len",
                  compile=compile_wanted(compile, device, new_tokens)), tok


def generate(cfg: GenerateConfig) -> list[dict]:
    """Run `paradraft generate`."""
    if not cfg.output:
        return _generate(cfg)
    claim_file(cfg.output, "generate", "--output")  # fail before generating, not after
    with output_lock(cfg.output, "--output"):
        return _generate(cfg)


@torch.inference_mode()  # scoped, not a global switch
def _generate(cfg: GenerateConfig) -> list[dict]:
    recs = [{"id": "0", "prompt": cfg.prompt}] if cfg.prompt is not None else read_prompts(cfg.prompts)
    engine, tok = load_engine(cfg.verifier, cfg.drafter, cfg.dtype, cfg.force, cfg.max_len, cfg.device, cfg.compile,
                              new_tokens=len(recs) * cfg.max_new_tokens)
    eos = stop_token_ids(tok)
    k = cfg.num_speculative_tokens or (engine.drafter.cfg.num_speculative_tokens if engine.drafter else 1)
    g = GenerationConfig(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
                         top_k=cfg.top_k, num_speculative_tokens=k, seed=cfg.seed,
                         eos_token_ids=eos)
    results = []
    stream = cfg.stream and cfg.batch_size == 1
    for s in range(0, len(recs), cfg.batch_size):
        batch = recs[s:s + cfg.batch_size]
        ids = [encode_prompt(tok, r) for r in batch]

        def on_tokens(row, new):
            sys.stdout.write(tok.decode(new, skip_special_tokens=True))
            sys.stdout.flush()
        t0 = time.perf_counter()
        outs = engine.generate(ids, g, on_tokens=on_tokens if stream else None)
        dt = time.perf_counter() - t0
        if stream:
            sys.stdout.write("\n")
        for r, o in zip(batch, outs):
            results.append({"id": r["id"], "prompt": r.get("prompt", r.get("messages")),
                            "text": tok.decode(o.token_ids, skip_special_tokens=True), "token_ids": o.token_ids,
                            "num_new_tokens": len(o.token_ids), "num_verifier_passes": o.num_verifier_passes,
                            "accepted_per_pass": o.accepted_per_pass, "time_s": round(dt, 4)})
    if cfg.output:
        write_text_atomic(cfg.output, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in results))
    n_tok = sum(r["num_new_tokens"] for r in results)
    passes = sum(r["num_verifier_passes"] for r in results)
    secs = sum(r["time_s"] for r in results[:: max(1, cfg.batch_size)])
    if engine.compiled:
        print(f"[generate] compiling the engine's steps took {engine.compile_s:.1f} s of that (torch.compile; "
              "--compile off skips it)", file=sys.stderr)
    print(f"[generate] {len(results)} prompts, {n_tok} tokens, {n_tok / max(1, passes):.2f} tokens per verifier pass, "
          f"{n_tok / max(1e-9, secs):.1f} tokens/s" + (f" -> {cfg.output}" if cfg.output else ""))
    if not cfg.output and not stream:
        for r in results:
            print(f"--- {r['id']}\n{r['text']}")
    return results
