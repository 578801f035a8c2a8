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
    dtype = getattr(torch, cfg.dtype)

    def embeddings():
        return verifier_tensor(verifier_name, "embed_tokens.weight")
    with replace_dir(cfg.output, "drafter", "--output") as tmp:
        # tensor by tensor (peak memory: one chunk, whatever the drafter's size); other layouts (the original
        # EAGLE-3 release) are small and go through the model
        dcfg = stream_export(cfg.drafter, tmp, dtype, verifier_config=vcfg, verifier_name=verifier_name,
                             force=cfg.force, embeddings=embeddings, updates=updates, k=cfg.num_speculative_tokens,
                             extra_provenance=extra)
        if dcfg is None:
            drafter = load_drafter(cfg.drafter, verifier_config=vcfg, verifier_name=verifier_name, force=cfg.force,
                                   embeddings=embeddings)
            for key, v in updates.items():
                setattr(drafter.cfg, key, v)
            if cfg.num_speculative_tokens:
                check_k(drafter, cfg.num_speculative_tokens)
                drafter.cfg.num_speculative_tokens = cfg.num_speculative_tokens
            write_drafter(drafter, tmp, extra, dtype)
            dcfg = drafter.cfg
    out = Path(cfg.output)
    k = dcfg.num_speculative_tokens
    print(f"[export] {dcfg.algorithm} drafter -> {out} ({cfg.dtype}); serve it with:")
    print("  " + serve_command(dcfg.verifier, str(out.resolve()), dcfg.algorithm, k))
    return out
