"""`paradraft export`: a checkpoint vLLM loads as an EAGLE-3 or P-EAGLE speculator, plus the serve command."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import torch

from ..config import ExportConfig
from ..models.checkpoint import CheckpointError, legacy_drafter, load_drafter, recorded_verifier, save_drafter
from ..models.registry import drafter_class
from ..outputs import claim_dir, output_lock
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
    drafter = load_drafter(cfg.drafter, verifier_config=vcfg, verifier_name=verifier_name, force=cfg.force,
                           embeddings=lambda: verifier_tensor(verifier_name, "embed_tokens.weight"))
    drafter.cfg.verifier = resolve_verifier(verifier_name)  # a path or id vLLM can open
    drafter.cfg.verifier_architectures = list(vcfg.architectures or [])
    if cfg.num_speculative_tokens:
        limit = drafter.max_draft_tokens()
        if limit is not None and cfg.num_speculative_tokens > limit:
            raise CheckpointError(f"--num-speculative-tokens {cfg.num_speculative_tokens}: the drafter was trained "
                                  f"on {limit} depths, so vLLM would draft untrained positions; at most {limit}")
        drafter.cfg.num_speculative_tokens = cfg.num_speculative_tokens
    out = save_drafter(drafter, cfg.output, dtype=getattr(torch, cfg.dtype),
                       extra_provenance={"exported_from": str(Path(cfg.drafter).resolve())})
    k = drafter.cfg.num_speculative_tokens
    print(f"[export] {drafter.cfg.algorithm} drafter -> {out} ({cfg.dtype}); serve it with:")
    print("  " + serve_command(drafter.cfg.verifier, str(Path(out).resolve()), drafter.cfg.algorithm, k))
    return out
