"""Drafter checkpoints in the speculators / vLLM format: `config.json` + `model.safetensors` (+ provenance.json).

config.json keys vLLM reads: speculators_model_type (the registered algorithm), architectures, transformer_layer_config
(the draft layer's HF config; num_hidden_layers = draft layers, vocab_size = verifier vocab), draft_vocab_size,
target_hidden_size, norm_before_residual, eagle_aux_hidden_state_layer_ids, mask_token_id (peagle), and
speculators_config {algorithm, proposal_methods [{proposal_type greedy, speculative_tokens K}],
default_proposal_method, verifier {name_or_path, architectures}}. paradraft adds its own full config under
"paradraft" for an exact reload.

Weights: fc.weight, layers.N.*, norm.weight, lm_head.weight, d2t, t2d, embed_tokens.weight (always written: a
P-EAGLE drafter's trained mask row lives there, and vLLM would otherwise share the verifier's), mask_hidden [1, 3Hv].
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import struct
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from .. import __version__
from ..errors import UserError
from ..outputs import claim_dir, output_lock, replace_dir, safetensors_header
from ..utils import atomic_path, read_json, save_tensors, write_json
from ..verifier import default_aux_layers
from .common import DraftConfig, DraftModel
from .registry import algorithms, drafter_class


class CheckpointError(UserError, ValueError):
    """A checkpoint that cannot be read, or does not fit the verifier."""


def nonfinite_tensors(state_dict: dict[str, torch.Tensor]) -> list[str]:
    """Names of the floating-point tensors holding NaN or infinity (a diverged training run)."""
    return [k for k, v in state_dict.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]


def check_finite(state_dict: dict[str, torch.Tensor], what: str) -> None:
    """THE rule that no drafter with non-finite weights is ever saved, exported or loaded (CheckpointError)."""
    bad = nonfinite_tensors(state_dict)
    if bad:
        raise CheckpointError(f"{what}: weights hold NaN or infinity ({', '.join(bad[:4])}"
                              f"{', ...' if len(bad) > 4 else ''}); training diverged: train it again with a lower "
                              f"`paradraft train --lr`")


POSITIVE_INTS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                 "num_layers", "max_position_embeddings", "vocab_size", "draft_vocab_size", "num_speculative_tokens")


def config_problems(cfg: DraftConfig) -> list[str]:
    """Every value of a drafter config that no drafter can have (a hand-edited or corrupt config.json)."""
    def whole(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    bad = [f"{k} {getattr(cfg, k)!r} (a whole number >= 1)" for k in POSITIVE_INTS
           if not whole(getattr(cfg, k)) or getattr(cfg, k) < 1]
    for k in ("target_hidden_size", "num_depths"):
        v = getattr(cfg, k)
        if v is not None and (not whole(v) or v < 1):
            bad.append(f"{k} {v!r} (a whole number >= 1)")
    if bad:
        return bad
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        bad.append(f"num_attention_heads {cfg.num_attention_heads} is not a multiple of num_key_value_heads "
                   f"{cfg.num_key_value_heads}")
    if cfg.draft_vocab_size > cfg.vocab_size:
        bad.append(f"draft_vocab_size {cfg.draft_vocab_size} exceeds vocab_size {cfg.vocab_size}")
    if not isinstance(cfg.rms_norm_eps, (int, float)) or isinstance(cfg.rms_norm_eps, bool) or \
            not 0 < cfg.rms_norm_eps < 1:
        bad.append(f"rms_norm_eps {cfg.rms_norm_eps!r} (a number in (0, 1))")
    if not isinstance(cfg.aux_layer_ids, list) or not all(whole(i) and i >= 0 for i in cfg.aux_layer_ids) or \
            len(cfg.aux_layer_ids) not in (0, 3):
        bad.append(f"eagle_aux_hidden_state_layer_ids {cfg.aux_layer_ids!r} (3 layer ids >= 0)")
    if cfg.mask_token_id is not None and (not whole(cfg.mask_token_id) or not 0 <= cfg.mask_token_id < cfg.vocab_size):
        bad.append(f"mask_token_id {cfg.mask_token_id!r} (a token id below vocab_size {cfg.vocab_size})")
    if not isinstance(cfg.rope_parameters, dict):
        bad.append(f"rope parameters {cfg.rope_parameters!r} (a mapping)")
    return bad


def build_drafter(cfg: DraftConfig) -> DraftModel:
    """An untrained drafter of cfg.algorithm (any registered algorithm)."""
    return drafter_class(cfg.algorithm)(cfg)


def speculators_config(model: DraftModel) -> dict:
    """The config.json dict vLLM reads: the shared keys, then the algorithm's own (`config_keys`)."""
    cfg = model.cfg
    layer = cfg.hf_layer_config().to_dict()
    layer.pop("transformers_version", None)
    layer["rope_theta"] = cfg.rope_parameters.get("rope_theta")  # for readers that predate rope_parameters
    layer["architectures"] = ["LlamaForCausalLM" if cfg.flavour == "llama" else "Qwen3ForCausalLM"]
    out = {
        "architectures": [drafter_class(cfg.algorithm).architecture],
        "speculators_model_type": cfg.algorithm,
        "speculators_version": "0.6.0",
        "transformer_layer_config": layer,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.verifier_hidden,
        "norm_before_residual": cfg.norm_before_residual,
        "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
        "speculators_config": {
            "algorithm": cfg.algorithm,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": cfg.num_speculative_tokens,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": cfg.verifier, "architectures": list(cfg.verifier_architectures)},
        },
        "torch_dtype": "float32",
        "paradraft": cfg.to_dict(),
    }
    out.update(model.config_keys())
    return out


def _git_sha() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                              cwd=Path(__file__).resolve().parent).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def provenance(extra: dict | None = None) -> dict:
    """Command, versions and git SHA of the run that wrote a checkpoint."""
    import transformers

    return {"command": " ".join(sys.argv), "paradraft": __version__, "torch": torch.__version__,
            "transformers": transformers.__version__, "python": sys.version.split()[0], "git_sha": _git_sha(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), **(extra or {})}


def drafter_state_dict(model: DraftModel, dtype: torch.dtype | None = None,
                       state_dict: dict | None = None) -> dict[str, torch.Tensor]:
    """Weights under the names vLLM reads (the P-EAGLE mask row folded into embed_tokens.weight)."""
    sd = {k: v.detach().cpu() for k, v in (state_dict or model.state_dict()).items() if not k.startswith("rotary.")}
    sd = model.checkpoint_state_dict(sd)
    out = {}
    for k, v in sd.items():
        v = v.contiguous()
        out[k] = v.to(dtype) if dtype is not None and v.is_floating_point() else v
    return out


def write_drafter(model: DraftModel, directory: str | Path, extra_provenance: dict | None = None,
                  dtype: torch.dtype | None = None, state_dict: dict | None = None) -> None:
    """Write config.json + model.safetensors + provenance.json into an existing directory (config.json last)."""
    directory = Path(directory)
    cfg = speculators_config(model)
    if dtype is not None:
        cfg["torch_dtype"] = str(dtype).replace("torch.", "")
    weights = drafter_state_dict(model, dtype, state_dict)
    check_finite(weights, f"drafter for {directory}")
    save_tensors(weights, directory / "model.safetensors", metadata={"format": "pt"})
    write_json(directory / "provenance.json", provenance(extra_provenance))
    write_json(directory / "config.json", cfg)


def legacy_drafter(path: Path) -> bool:
    """A drafter paradraft wrote before output markers existed (its provenance names paradraft)."""
    try:
        return "paradraft" in read_json(path / "provenance.json")
    except (OSError, ValueError):
        return False


def save_drafter(model: DraftModel, path: str | Path, extra_provenance: dict | None = None,
                 dtype: torch.dtype | None = None, state_dict: dict | None = None, flag: str = "--output") -> Path:
    """Write a drafter checkpoint to `path` in one rename. `path` must be new, empty, or a drafter paradraft wrote
    (holding nothing else); anything else is refused naming `flag`."""
    path = Path(path)
    claim_dir(path, "drafter", flag, legacy=legacy_drafter)
    with output_lock(path, flag, reentrant=True), replace_dir(path, "drafter", flag) as tmp:
        write_drafter(model, tmp, extra_provenance, dtype, state_dict)
    return path


# DraftConfig fields that config.json also states at the top level, where vLLM reads them
TOP_LEVEL_FIELDS = ("algorithm", "flavour", "hidden_size", "intermediate_size", "num_attention_heads",
                    "num_key_value_heads", "head_dim", "num_layers", "rms_norm_eps", "max_position_embeddings",
                    "vocab_size", "draft_vocab_size", "aux_layer_ids", "verifier_hidden", "norm_before_residual",
                    "mask_token_id", "num_speculative_tokens", "verifier")


def config_from_speculators(cfg_json: dict) -> DraftConfig:
    """DraftConfig from a speculators-format config.json (ours or another tool's).

    The top-level keys are what vLLM serves, so they are what paradraft runs. paradraft's own section
    ("paradraft") adds what the top level does not state (e.g. the P-EAGLE depths trained); where both state a
    value they must agree, or the checkpoint is refused naming every key that differs.
    """
    cfg = _top_level_config(cfg_json)
    if "paradraft" not in cfg_json:
        return cfg
    section = cfg_json["paradraft"]
    if not isinstance(section, dict):
        raise CheckpointError("config.json: the 'paradraft' section is not a mapping")
    names = {f.name for f in dataclasses.fields(DraftConfig)}
    unknown = sorted(set(section) - names)
    if unknown:
        raise CheckpointError(f"config.json: unknown keys in the 'paradraft' section: {', '.join(unknown)} "
                              f"(written by a newer paradraft?)")
    own = DraftConfig(**section)
    differ = [f"{k} (top level {getattr(cfg, k)!r}, paradraft section {getattr(own, k)!r})"
              for k in TOP_LEVEL_FIELDS if getattr(cfg, k) != getattr(own, k)]
    if differ:
        raise CheckpointError("config.json: the keys vLLM reads disagree with paradraft's own section: "
                              + "; ".join(differ) + "; make them equal (vLLM serves the top-level values)")
    own.verifier_architectures = cfg.verifier_architectures or own.verifier_architectures
    return own


def _top_level_config(cfg_json: dict) -> DraftConfig:
    algo = cfg_json.get("speculators_model_type")
    if algo not in algorithms():
        raise CheckpointError(f"config.json: speculators_model_type {algo!r} is not one of {algorithms()}")
    layer = cfg_json.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise CheckpointError("config.json: transformer_layer_config is missing")
    missing = [k for k in ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size") if k not in layer]
    if missing:
        raise CheckpointError(f"config.json: transformer_layer_config lacks {', '.join(missing)}")
    spec = cfg_json.get("speculators_config") or {}
    methods = spec.get("proposal_methods") or [{}]
    H = layer["hidden_size"]
    heads = layer["num_attention_heads"]
    rope = layer.get("rope_parameters") or {"rope_type": "default", "rope_theta": layer.get("rope_theta", 10000.0)}
    if layer.get("rope_scaling"):
        rope = {**layer["rope_scaling"], "rope_theta": layer.get("rope_theta", 10000.0)}
        rope["rope_type"] = rope.get("rope_type") or rope.get("type", "default")
    ids = cfg_json.get("eagle_aux_hidden_state_layer_ids")
    target_hidden = cfg_json.get("target_hidden_size")
    return DraftConfig(
        algorithm=algo, flavour="qwen3" if layer.get("model_type") == "qwen3" else "llama", hidden_size=H,
        intermediate_size=layer["intermediate_size"], num_attention_heads=heads,
        num_key_value_heads=layer.get("num_key_value_heads") or heads, head_dim=layer.get("head_dim") or H // heads,
        num_layers=layer.get("num_hidden_layers", 1), rms_norm_eps=layer.get("rms_norm_eps", 1e-6),
        rope_parameters=dict(rope), max_position_embeddings=layer.get("max_position_embeddings", 8192),
        vocab_size=layer["vocab_size"], draft_vocab_size=cfg_json.get("draft_vocab_size") or layer["vocab_size"],
        aux_layer_ids=list(ids) if ids else [],
        target_hidden_size=target_hidden if target_hidden not in (None, H) else None,
        norm_before_residual=cfg_json.get("norm_before_residual", drafter_class(algo).default_norm_before_residual),
        mask_token_id=cfg_json.get("mask_token_id"),
        num_speculative_tokens=methods[0].get("speculative_tokens", 7),
        verifier=(spec.get("verifier") or {}).get("name_or_path", ""),
        verifier_architectures=list((spec.get("verifier") or {}).get("architectures") or []))


def config_from_original_eagle3(cfg_json: dict) -> DraftConfig:
    """DraftConfig from the original EAGLE-3 layout (`LlamaForCausalLMEagle3`, a flat Llama config)."""
    H, heads = cfg_json["hidden_size"], cfg_json["num_attention_heads"]
    rope = cfg_json.get("rope_parameters") or {"rope_type": "default",
                                               "rope_theta": cfg_json.get("rope_theta", 10000.0)}
    if cfg_json.get("rope_scaling"):
        rope = {**cfg_json["rope_scaling"], "rope_theta": cfg_json.get("rope_theta", 10000.0)}
        rope["rope_type"] = rope.get("rope_type") or rope.get("type", "default")
    ids = (cfg_json.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") \
        or cfg_json.get("eagle_aux_hidden_state_layer_ids")
    return DraftConfig(
        algorithm="eagle3", flavour="llama", hidden_size=H, intermediate_size=cfg_json["intermediate_size"],
        num_attention_heads=heads, num_key_value_heads=cfg_json.get("num_key_value_heads") or heads,
        head_dim=cfg_json.get("head_dim") or H // heads, num_layers=cfg_json.get("num_hidden_layers", 1),
        rms_norm_eps=cfg_json.get("rms_norm_eps", 1e-6), rope_parameters=dict(rope),
        max_position_embeddings=cfg_json.get("max_position_embeddings", 8192), vocab_size=cfg_json["vocab_size"],
        draft_vocab_size=cfg_json.get("draft_vocab_size") or cfg_json["vocab_size"],
        aux_layer_ids=list(ids) if ids else [], target_hidden_size=cfg_json.get("target_hidden_size"),
        norm_before_residual=cfg_json.get("norm_before_residual", False))


def _is_original_eagle3(cfg_json: dict, keys) -> bool:
    return "LlamaForCausalLMEagle3" in (cfg_json.get("architectures") or []) or any(k.startswith("midlayer.")
                                                                                     for k in keys)


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    if (path / "model.safetensors").is_file():
        f = path / "model.safetensors"
        try:
            return load_file(str(f))
        except Exception as e:  # SafetensorError: truncated or not safetensors at all
            raise CheckpointError(f"{f} cannot be read ({e}); the file is truncated or corrupt") from None
    if (path / "pytorch_model.bin").is_file():  # the original EAGLE-3 releases
        f = path / "pytorch_model.bin"
        try:
            return torch.load(f, map_location="cpu", weights_only=True)
        except Exception as e:  # UnpicklingError, EOFError, RuntimeError: not a torch state dict
            raise CheckpointError(f"{f} cannot be read as a state dict ({type(e).__name__}); it is corrupt") from None
    raise CheckpointError(f"{path} is not a drafter checkpoint (needs config.json and model.safetensors)")


def _config_json(path: Path) -> dict:
    """A drafter directory's config.json as a dict (CheckpointError naming the file otherwise)."""
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path} is not a drafter checkpoint (needs config.json and model.safetensors)")
    try:
        cfg_json = read_json(path / "config.json")
    except ValueError as e:
        raise CheckpointError(f"{path / 'config.json'} is not valid JSON ({e})") from None
    if not isinstance(cfg_json, dict):
        raise CheckpointError(f"{path / 'config.json'} does not hold a JSON object")
    return cfg_json


def _parse_config(path: Path, cfg_json: dict, original: bool) -> DraftConfig:
    """The DraftConfig a config.json describes (the original EAGLE-3 layout or speculators'), checked for values
    no drafter can have."""
    try:
        cfg = config_from_original_eagle3(cfg_json) if original else config_from_speculators(cfg_json)
    except CheckpointError as e:
        raise CheckpointError(f"{path}: {e}") from None
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{path / 'config.json'}: missing or malformed key ({type(e).__name__}: {e})") from None
    problems = config_problems(cfg)
    if problems:
        raise CheckpointError(f"{path / 'config.json'}: impossible values: " + "; ".join(problems))
    return cfg


def load_drafter(path: str | Path, verifier=None, verifier_name: str | None = None, force: bool = False,
                 device: str = "cpu", allow_missing_embeddings: bool = False, verifier_config=None,
                 embeddings=None) -> DraftModel:
    """Load a drafter (paradraft / speculators format, or the original EAGLE-3 layout).

    With `verifier` (a loaded model) or `verifier_config` (its Hugging Face config alone) given, check it fits. A
    checkpoint without embed_tokens.weight takes the verifier's: from `verifier`, or from `embeddings()` (a callable
    that reads that one tensor, so that no more of a large verifier is materialised than the drafter uses).
    Anything unreadable or inconsistent is a CheckpointError naming the file.
    """
    path = Path(path)
    cfg_json = _config_json(path)
    sd = _read_weights(path)
    check_finite(sd, str(path / "model.safetensors"))
    original = _is_original_eagle3(cfg_json, sd.keys())
    if original:
        sd = {("layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k): v for k, v in sd.items()}
    cfg = _parse_config(path, cfg_json, original)
    vcfg = verifier.config if verifier is not None else verifier_config
    if vcfg is not None:
        check_compatible(cfg, vcfg, verifier_name, force)
        if not cfg.aux_layer_ids:
            cfg.aux_layer_ids = default_aux_layers(vcfg.num_hidden_layers)
    if "embed_tokens.weight" not in sd:
        if verifier is not None:
            sd["embed_tokens.weight"] = verifier.get_input_embeddings().weight.detach().float()
        elif embeddings is not None:
            sd["embed_tokens.weight"] = embeddings().float()
        elif allow_missing_embeddings:
            sd["embed_tokens.weight"] = torch.zeros(cfg.vocab_size, cfg.hidden_size)
        else:
            raise CheckpointError(f"{path} has no embed_tokens.weight; load it with its verifier")
    sd = {k: v for k, v in sd.items() if not k.startswith("rotary.")}
    try:
        sd = drafter_class(cfg.algorithm).state_dict_from_checkpoint(sd, cfg)
    except ValueError as e:
        raise CheckpointError(f"{path}: {e}") from None
    try:
        model = build_drafter(cfg)
    except (RuntimeError, ValueError, TypeError, KeyError, ZeroDivisionError) as e:  # values no layer can take
        raise CheckpointError(f"{path / 'config.json'}: describes a drafter that cannot be built "
                              f"({type(e).__name__}: {e})") from None
    if cfg.draft_vocab_size == cfg.vocab_size:
        sd.setdefault("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        sd.setdefault("t2d", torch.ones(cfg.vocab_size, dtype=torch.bool))
    try:
        missing, unexpected = model.load_state_dict({k: v for k, v in sd.items()}, strict=False)
    except RuntimeError as e:  # shape mismatches: weights of another architecture than config.json states
        raise CheckpointError(f"{path}: weights do not match config.json: {str(e).splitlines()[-1].strip()}") from None
    missing = [m for m in missing if not m.startswith("rotary.")]
    if missing or unexpected:
        raise CheckpointError(f"{path}: weights do not match the config: missing {missing}, unexpected {unexpected}")
    model.d2t = model.d2t.long()
    model.t2d = model.t2d.bool()
    return model.to(device).float()


def recorded_verifier(path: str | Path) -> str:
    """The verifier a drafter checkpoint records (config.json alone; "" when it records none)."""
    cfg = _config_json(Path(path))
    spec = cfg.get("speculators_config")
    name = ((spec or {}).get("verifier") or {}).get("name_or_path") if isinstance(spec, dict) else None
    if not name and isinstance(cfg.get("paradraft"), dict):
        name = cfg["paradraft"].get("verifier")
    return name if isinstance(name, str) else ""


def recorded_k(path: str | Path) -> int:
    """The K a drafter checkpoint records for serving (config.json, read alone); CheckpointError if unreadable."""
    cfg = _config_json(Path(path))
    try:
        k = cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"]
    except (KeyError, IndexError, TypeError):
        raise CheckpointError(f"{Path(path) / 'config.json'}: records no K (speculators_config.proposal_methods[0]."
                              f"speculative_tokens); give --num-speculative-tokens") from None
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise CheckpointError(f"{Path(path) / 'config.json'}: its recorded K {k!r} is not a whole number >= 1")
    return k


def check_compatible(cfg: DraftConfig, vcfg, verifier_name: str | None = None, force: bool = False) -> None:
    """Raise CheckpointError listing every way the drafter does not fit this verifier."""
    problems = []
    if cfg.verifier_hidden != vcfg.hidden_size:
        problems.append(f"hidden size: drafter expects {cfg.verifier_hidden}, verifier has {vcfg.hidden_size}")
    if cfg.vocab_size != vcfg.vocab_size:
        problems.append(f"vocabulary: drafter has {cfg.vocab_size} tokens, verifier has {vcfg.vocab_size}")
    bad = [i for i in cfg.aux_layer_ids if not 0 <= i <= vcfg.num_hidden_layers]
    if bad:
        problems.append(f"aux layer ids {bad} do not exist in a {vcfg.num_hidden_layers}-layer verifier")
    if problems:
        raise CheckpointError("drafter does not fit the verifier: " + "; ".join(problems))
    recorded = os.path.basename(str(cfg.verifier).rstrip("/"))
    given = os.path.basename(str(getattr(vcfg, "_name_or_path", "") or verifier_name or "").rstrip("/"))
    if recorded and given and recorded != given and not force:
        raise CheckpointError(f"drafter was trained for verifier {cfg.verifier!r}, not {given!r}; "
                              f"pass --force to use it anyway")


def check_k(model: DraftModel, k: int) -> None:
    """K may not exceed the depths a drafter was trained on (vLLM would draft untrained positions)."""
    limit = model.max_draft_tokens()
    if limit is not None and k > limit:
        raise CheckpointError(f"--num-speculative-tokens {k}: the drafter was trained on {limit} depths, so vLLM "
                              f"would draft untrained positions; at most {limit}")


# ------------------------------------------------------------------------------------------ streaming export

_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int64: "I64",
              torch.int32: "I32", torch.bool: "BOOL", torch.uint8: "U8"}
STREAM_CHUNK_BYTES = 64 << 20


def stream_export(path: str | Path, out_dir: Path, dtype: torch.dtype, *, verifier_config, verifier_name: str,
                  force: bool, embeddings, updates: dict, k: int | None = None,
                  extra_provenance: dict | None = None) -> DraftConfig | None:
    """Export a speculators-format drafter (config.json + model.safetensors) tensor by tensor, in row chunks: every
    weight is checked (names and shapes against the drafter its config describes, finite values) and converted to
    `dtype` on its way to the new model.safetensors, so peak memory is one chunk (plus the verifier's embedding
    when the checkpoint has none) whatever the drafter's size. `updates`: DraftConfig fields to change (verifier,
    architectures); `k`: the K to record (checked against the depths trained). Writes config.json,
    model.safetensors, provenance.json into `out_dir`; returns the config.
    None for checkpoints of another layout (the caller loads those whole)."""
    path = Path(path)
    f = path / "model.safetensors"
    cfg_json = _config_json(path)
    if not f.is_file():
        return None
    reader = _StreamReader(f)
    names = list(reader.header)
    if _is_original_eagle3(cfg_json, names):
        return None
    cfg = _parse_config(path, cfg_json, original=False)
    check_compatible(cfg, verifier_config, verifier_name, force)
    if not cfg.aux_layer_ids:
        cfg.aux_layer_ids = default_aux_layers(verifier_config.num_hidden_layers)
    for key, value in updates.items():
        setattr(cfg, key, value)
    with torch.device("meta"):  # the drafter the config describes, without memory: its names and shapes
        model = build_drafter(cfg)
        if k:
            check_k(model, k)
            cfg.num_speculative_tokens = k
        meta = {n: v for n, v in model.state_dict().items() if not n.startswith("rotary.")}
        expected = {n: tuple(v.shape) for n, v in model.checkpoint_state_dict(meta).items()}
        try:  # what the algorithm needs of a checkpoint (P-EAGLE: mask_hidden and a mask token in the vocabulary)
            drafter_class(cfg.algorithm).state_dict_from_checkpoint(
                {n: torch.empty(expected.get(n, (1,))) for n in {*names, "embed_tokens.weight"}}, cfg)
        except ValueError as e:
            raise CheckpointError(f"{path}: {e}") from None
    stored = [n for n in names if not n.startswith("rotary.")]
    missing = sorted(set(expected) - set(stored) - {"embed_tokens.weight"})
    unexpected = sorted(set(stored) - set(expected))
    if missing or unexpected:
        raise CheckpointError(f"{path}: weights do not match the config: missing {missing}, unexpected {unexpected}")
    emb = embeddings().detach() if "embed_tokens.weight" not in stored else None
    plan = []
    for name in sorted(expected):
        shape, src_dtype = (tuple(emb.shape), emb.dtype) if emb is not None and name == "embed_tokens.weight" \
            else (reader.shape(name), reader.dtype(name))
        if shape != expected[name] and not (name == "mask_hidden" and math.prod(shape) == math.prod(expected[name])):
            raise CheckpointError(f"{path}: {name} has shape {list(shape)}, the config needs {list(expected[name])}")
        plan.append((name, expected[name], dtype if src_dtype.is_floating_point else src_dtype))

    def rows(name: str, a: int, b: int) -> torch.Tensor:  # rows a..b of a tensor (flattened to [rows, ...])
        if emb is not None and name == "embed_tokens.weight":
            return emb[a:b]
        return reader.rows(name, a, b)
    _write_stream(out_dir / "model.safetensors", plan, rows, what=str(f))
    cfg_out = speculators_config(model)
    cfg_out["torch_dtype"] = str(dtype).replace("torch.", "")
    write_json(out_dir / "provenance.json", provenance(extra_provenance))
    write_json(out_dir / "config.json", cfg_out)
    return cfg


class _StreamReader:
    """Rows of the tensors of a safetensors file, read with plain reads (no memory map: a mapped file's pages count
    as the process's memory once touched), so that reading a 4 GB checkpoint costs one chunk of memory."""

    def __init__(self, path: Path):
        self.path = path
        try:
            header, self.base = safetensors_header(path)
            for meta in header.values():
                a, b = meta["data_offsets"]
                if b - a != math.prod(meta["shape"]) * torch.empty(0, dtype=_torch_dtype(meta["dtype"])).element_size():
                    raise ValueError("a tensor's byte range does not match its shape")
        except (OSError, ValueError, KeyError, TypeError, struct.error) as e:
            raise CheckpointError(f"{path} cannot be read ({type(e).__name__}: {e}); the file is truncated or "
                                  f"corrupt") from None
        if self.base + max([m["data_offsets"][1] for m in header.values()], default=0) > path.stat().st_size:
            raise CheckpointError(f"{path} is shorter than its header says: the file is truncated")
        self.header = header

    def shape(self, name: str) -> tuple:
        return tuple(self.header[name]["shape"])

    def dtype(self, name: str) -> torch.dtype:
        return _torch_dtype(self.header[name]["dtype"])

    def rows(self, name: str, a: int, b: int) -> torch.Tensor:
        """Rows a..b of `name` (its first dimension; a 0- or 1-D tensor whole) -> tensor [b - a, ...]."""
        meta, dt = self.header[name], self.dtype(name)
        shape = self.shape(name)
        if len(shape) < 2:
            a, b, inner = 0, 1, math.prod(shape)
        else:
            b, inner = min(b, shape[0]), math.prod(shape[1:])
        size = torch.empty(0, dtype=dt).element_size()
        start = self.base + meta["data_offsets"][0] + a * inner * size
        buf = bytearray((b - a) * inner * size)
        with open(self.path, "rb") as fh:
            fh.seek(start)
            fh.readinto(buf)
        t = torch.frombuffer(buf, dtype=dt) if buf else torch.empty(0, dtype=dt)
        return t.reshape(shape) if len(shape) < 2 else t.reshape(b - a, *shape[1:])


def _torch_dtype(st_name: str) -> torch.dtype:
    for k, v in _ST_DTYPES.items():
        if v == st_name:
            return k
    raise CheckpointError(f"a tensor of safetensors dtype {st_name} is not one a drafter holds")


def _write_stream(target: Path, plan: list, source, what: str) -> None:
    """A safetensors file written tensor by tensor in row chunks (header first, then the data in header order),
    each chunk converted to its planned dtype and checked to be finite; atomically (beside, then renamed)."""
    header, offset = {}, 0
    for name, shape, dt in plan:
        n = math.prod(shape) * torch.empty(0, dtype=dt).element_size()
        header[name] = {"dtype": _ST_DTYPES[dt], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    with atomic_path(target) as tmp, open(tmp, "wb") as out:
        out.write(struct.pack("<Q", len(raw)))
        out.write(raw)
        for name, shape, dt in plan:
            rows = shape[0] if len(shape) > 1 else 1
            per_row = max(1, math.prod(shape[1:]) * 4) if len(shape) > 1 else 1
            step = max(1, STREAM_CHUNK_BYTES // per_row)
            for a in range(0, rows, step):
                part = source(name, a, a + step)  # [rows, ...] read from the file alone
                part = part.reshape(-1, *shape[1:]) if len(shape) > 1 else part.reshape(shape)
                if part.is_floating_point() and not bool(torch.isfinite(part).all()):
                    raise CheckpointError(f"{what}: weights hold NaN or infinity ({name}); training diverged: "
                                          f"train it again with a lower `paradraft train --lr`")
                out.write(part.to(dt).contiguous().view(torch.uint8).numpy().tobytes())
