"""`paradraft export`: a checkpoint vLLM loads as an EAGLE-3 or P-EAGLE speculator, plus the serve command."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import torch

from ..config import ExportConfig
from ..models.checkpoint import (
    CheckpointError,
    check_k,
    legacy_drafter,
    load_drafter,
    recorded_verifier,
    stream_export,
    write_drafter,
)
from ..models.registry import drafter_class
from ..outputs import claim_dir, output_lock, replace_dir
from ..utils import read_json
from ..verifier import load_verifier_config, resolve_verifier, verifier_tensor


def speculative_config(drafter_dir: str, algorithm: str, k: int) -> dict:
    """vLLM's --speculative-config for a drafter directory (vLLM runs every EAGLE-family drafter as "eagle3";
    the algorithm adds its own keys, e.g. P-EAGLE's parallel_drafting)."""
    return {"method": "eagle3", "model": str(drafter_dir), "num_speculative_tokens": k,
            **drafter_class(algorithm).speculative_config_keys()}


def serve_command(verifier_path: str, drafter_dir: str, algorithm: str, k: int) -> str:
    """The exact `vllm serve` command line."""
    spec = json.dumps(speculative_config(drafter_dir, algorithm, k))
    return f"vllm serve {shlex.quote(verifier_path)} --speculative-config {shlex.quote(spec)}"


GAIN_FLOOR = 0.01  # tokens per verifier pass: a draft position that adds less costs more than it brings


def validation_estimates(drafter_dir: str | Path) -> dict[int, float]:
    """{K: estimated acceptance length} from the held-out validation train recorded with the drafter
    (provenance.json "final" -> "val" -> "acceptance_length_by_k"); {} when none was recorded."""
    try:
        final = read_json(Path(drafter_dir) / "provenance.json").get("final") or {}
        by_k = (final.get("val") or {}).get("acceptance_length_by_k") or {}
        return {int(k): float(v) for k, v in by_k.items() if v is not None}
    except (OSError, ValueError, AttributeError, TypeError):
        return {}


def best_k(estimates: dict[int, float], limit: int | None) -> tuple[int | None, str]:
    """The K to serve: the smallest K whose estimated acceptance length is within GAIN_FLOOR of the best estimate
    (every further draft position adds under GAIN_FLOOR tokens per verifier pass while costing a verification row
    and draft work), and why."""
    est = {k: v for k, v in estimates.items() if limit is None or k <= limit}
    if not est:
        return None, "no held-out estimate recorded with the drafter; K is the one it records"
    top = max(est.values())
    k = min(k for k, v in est.items() if v >= top - GAIN_FLOOR)
    far = max(est)
    why = (f"held-out validation estimates acceptance length {est[k]:.3f} at K={k}" +
           (f" and {est[far]:.3f} at K={far}: each draft position past {k} adds under {GAIN_FLOOR} tokens per "
            f"verifier pass and costs a verification row" if far > k else ""))
    return k, why


def export(cfg: ExportConfig) -> Path:
    """Run `paradraft export`; returns the output directory."""
    claim_dir(cfg.output, "drafter", "--output", legacy=legacy_drafter)  # before any work
    if Path(cfg.output).resolve() == Path(cfg.drafter).resolve():
        raise CheckpointError(f"--output {cfg.output} is the drafter being exported; choose another --output")
    with output_lock(cfg.output, "--output"):  # a second export to the same output is refused, not raced
        return _export(cfg)


def _export(cfg: ExportConfig) -> Path:
    verifier_name = cfg.verifier or recorded_verifier(cfg.drafter)
    if not verifier_name:
        raise CheckpointError(f"{cfg.drafter} records no verifier; pass --verifier")
    # only the verifier's config is read (and its embedding, for a checkpoint that has none): export needs no more,
    # so a drafter for a 120B verifier exports on a laptop
    vcfg = load_verifier_config(verifier_name)
    # the draft layer's style is the draft config's model_type, and vLLM picks its draft model by that alone
    # (llama -> Eagle3LlamaForCausalLM, qwen3 -> Eagle3Qwen3ForCausalLM) whatever the verifier: a q/k-norm layer
    # (`train --draft-layer qwen3`, the reference trainer's P-EAGLE layer) serves a Llama verifier too, as `make
    # test-vllm` proves on the embedded SmolLM2
    updates = {"verifier": resolve_verifier(verifier_name),  # a path or id vLLM can open
               "verifier_architectures": list(vcfg.architectures or [])}
    extra = {"exported_from": str(Path(cfg.drafter).resolve())}
    estimates = validation_estimates(cfg.drafter)
    if estimates:  # kept with the export, so that a re-export chooses alike
        extra["final"] = {"val": {"acceptance_length_by_k": {str(k): v for k, v in estimates.items()}}}
    k, why = (cfg.num_speculative_tokens, "--num-speculative-tokens") if cfg.num_speculative_tokens else \
        best_k(estimates, None)
    dtype = getattr(torch, cfg.dtype)

    def embeddings():
        return verifier_tensor(verifier_name, "embed_tokens.weight")
    with replace_dir(cfg.output, "drafter", "--output") as tmp:
        # tensor by tensor (peak memory: one chunk, whatever the drafter's size); other layouts (the original
        # EAGLE-3 release) are small and go through the model
        dcfg = stream_export(cfg.drafter, tmp, dtype, verifier_config=vcfg, verifier_name=verifier_name,
                             force=cfg.force, embeddings=embeddings, updates=updates, k=k,
                             extra_provenance=extra)
        if dcfg is None:
            drafter = load_drafter(cfg.drafter, verifier_config=vcfg, verifier_name=verifier_name, force=cfg.force,
                                   embeddings=embeddings)
            for key, v in updates.items():
                setattr(drafter.cfg, key, v)
            if k:
                check_k(drafter, k)
                drafter.cfg.num_speculative_tokens = k
            write_drafter(drafter, tmp, extra, dtype)
            dcfg = drafter.cfg
    out = Path(cfg.output)
    k = dcfg.num_speculative_tokens
    print(f"[export] {dcfg.algorithm} drafter -> {out} ({cfg.dtype}); K={k} ({why})")
    print("[export] serve it with:")
    print("  " + serve_command(dcfg.verifier, str(out.resolve()), dcfg.algorithm, k))
    return out
