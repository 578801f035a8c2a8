"""Verifier hidden states: offline extraction to safetensors shards, the shard reader, and online mode.

What is stored per sample (all positions t of the prepared sample, after the optional trained-only cut):
  aux   [T, 3H]  residual streams at the INPUT of decoder layers `layer_ids` (HF output_hidden_states[i]),
                 concatenated in the order of layer_ids: the tensor vLLM's EAGLE-3 path hands the drafter
  last  [T, H]   the last decoder layer's output BEFORE the final norm; the verifier's distribution at t is
                 exactly lm_head(norm(last[t]))
  input_ids [T] int32, loss_mask [T] uint8.
A shard `shard-NNNNN.safetensors` concatenates its samples (offsets [n+1], sample_index [n] into the prepared
dataset); `shard-NNNNN.json` beside it records its checksum; `manifest.json` is written once every shard exists.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from tqdm import tqdm

from ..config import parse_shard
from ..errors import UserError
from ..outputs import check_replaceable, claim_dir, write_marker
from ..utils import read_json, read_json_input, resolve_device, resolve_dtype, save_tensors, sha256_file, write_json
from ..verifier import Tap, compute_samples, default_aux_layers, load_verifier, load_verifier_config, resolve_verifier
from .prepare import PreparedDataset
from .vllm_hidden import VllmHiddenStates, check_supported

FORMAT = "paradraft-hidden-states-v1"


class HiddenStateError(UserError, RuntimeError):
    """A shard or manifest that is missing, corrupt, or does not match."""


class NotEnoughDiskError(HiddenStateError):
    """The output disk lacks room for the extraction."""


def resolve_layers(num_layers: int, layers: list[int] | None) -> list[int]:
    """Aux layer ids: given, or the EAGLE-3 default [2, L//2, L-3]."""
    return list(layers) if layers else default_aux_layers(num_layers)


def trained_cut(loss_mask: np.ndarray) -> int:
    """Length of a sample that keeps every position training reads (through the last trained token)."""
    idx = np.nonzero(loss_mask)[0]
    return int(idx[-1]) + 1 if len(idx) else 0


def _shard_name(k: int) -> str:
    return f"shard-{k:05d}"


def _parse_shard(spec: str | None) -> tuple[int, int]:
    if spec:
        return parse_shard(spec)
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def _bytes_per_token(H: int, n_layers: int, dtype: torch.dtype) -> int:
    return (n_layers * H + H) * torch.finfo(dtype).bits // 8 + 4 + 1


def extract(cfg, model=None, tokenizer=None) -> dict:
    """Run `paradraft extract` (or `--validate`). Returns the manifest (or validation report)."""
    out = Path(cfg.output)
    if cfg.validate:
        return validate(out)
    device = resolve_device(cfg.device)  # before any work: a GPU that is not there is a one-line error
    ds = PreparedDataset(cfg.data)
    claim_dir(out, "hidden_states", "--output", legacy=lambda p: (p / "identity.json").is_file())
    verifier_name = cfg.verifier or ds.manifest["verifier"]
    engine = cfg.engine
    # the verifier computes in `compute_dtype` and the shards store `dtype`: `auto` computes in the fast dtype of the
    # device (float32 on a CPU without AMX, where bf16 is the slow path) and stores bfloat16 (half the disk)
    compute_dtype = resolve_dtype(cfg.dtype, "cuda" if engine == "vllm" else device)
    dtype = getattr(torch, "bfloat16" if cfg.dtype == "auto" else cfg.dtype)
    if engine == "vllm":
        check_supported(cfg.vllm_python)  # before anything is written: on CPU it cannot work, and says why
        vcfg = load_verifier_config(verifier_name)
    else:
        if model is None:
            model, tokenizer = load_verifier(verifier_name, dtype=compute_dtype, device=device)
        vcfg = model.config
    L, H = vcfg.num_hidden_layers, vcfg.hidden_size
    layer_ids = resolve_layers(L, cfg.layers)
    bad = [i for i in layer_ids if not 0 <= i < L]
    if bad:  # checked before anything is written
        raise HiddenStateError(f"--layers {','.join(map(str, layer_ids))}: ids {bad} do not exist in a {L}-layer "
                               f"verifier (valid: 0..{L - 1})")
    indices = ds.indices(cfg.split)
    if cfg.max_samples is not None:
        indices = indices[: cfg.max_samples]
    lengths = [int(ds.offsets[i + 1] - ds.offsets[i]) for i in indices]
    if cfg.trained_only:
        lengths_kept = [trained_cut(ds.sample(int(i))[1]) for i in indices]
    else:
        lengths_kept = lengths
    shards = [list(range(s, min(s + cfg.samples_per_shard, len(indices))))
              for s in range(0, len(indices), cfg.samples_per_shard)]
    k, n = _parse_shard(cfg.shard)
    mine = [s for s in range(len(shards)) if s % n == k]
    identity = {"format": FORMAT, "data": str(Path(cfg.data).resolve()), "data_identity": ds.manifest.get("identity"),
                "verifier": verifier_name, "layer_ids": layer_ids, "dtype": str(dtype).removeprefix("torch."),
                "split": cfg.split, "trained_only": cfg.trained_only, "samples_per_shard": cfg.samples_per_shard,
                "num_samples": len(indices)}
    if compute_dtype != identity["dtype"]:  # recorded only when it differs: bf16 extractions of before match
        identity["compute_dtype"] = compute_dtype
    _claim_identity(out, identity, cfg.overwrite)

    bpt = _bytes_per_token(H, len(layer_ids), dtype)
    todo = [s for s in mine if not _shard_done(out, s)]
    need = sum(lengths_kept[i] for s in todo for i in shards[s]) * bpt
    total_all = sum(lengths) * bpt
    free = shutil.disk_usage(out).free
    print(f"[extract] {len(indices)} samples in {len(shards)} shards ({len(mine)} for shard {k}/{n}, "
          f"{len(todo)} to do); needs {need / 2**30:.2f} GiB, {free / 2**30:.2f} GiB free"
          + (f"; trained-only saves {1 - sum(lengths_kept) / max(1, sum(lengths)):.1%} "
             f"of positions ({(total_all - sum(lengths_kept) * bpt) / 2**30:.2f} GiB) before last-state thinning"
             if cfg.trained_only else ""))
    if need > free:
        raise NotEnoughDiskError(f"extraction needs {need / 2**30:.2f} GiB but {out} has only "
                                 f"{free / 2**30:.2f} GiB free; free space, use --trained-only, or --shard")

    if engine == "vllm":
        compute = VllmHiddenStates(resolve_verifier(verifier_name), layer_ids, L, compute_dtype,
                                   max_len=max(lengths_kept, default=1), work_dir=out, python=cfg.vllm_python)
    else:
        tap = Tap(model, layer_ids)
        pad = (tokenizer.pad_token_id if tokenizer is not None and tokenizer.pad_token_id is not None else 0)
        compute = HfHiddenStates(tap, cfg.batch_tokens, device, pad)
    bar = tqdm(total=sum(lengths_kept[i] for s in todo for i in shards[s]), unit="tok", unit_scale=True,
               desc="extract", disable=None)
    t0 = time.time()
    n_done, n_todo = 0, sum(len(shards[x]) for x in todo)
    try:
        with compute:
            for s in todo:
                samples = []
                for i in shards[s]:
                    ids, mask = ds.sample(int(indices[i]))
                    cut = lengths_kept[i]
                    samples.append((ids[:cut], mask[:cut]))
                results = compute(samples)
                _write_shard(out, s, results, [int(indices[i]) for i in shards[s]], dtype, cfg.trained_only)
                n_done += len(samples)
                bar.update(sum(len(x[0]) for x in samples))
                bar.set_postfix(samples=f"{n_done}/{n_todo}")
    finally:
        bar.close()
    elapsed = time.time() - t0
    done = [s for s in range(len(shards)) if _shard_done(out, s)]
    manifest = None
    if len(done) == len(shards):
        manifest = _write_manifest(out, identity, len(shards), H, vcfg.vocab_size)
        print(f"[extract] complete: {manifest['num_tokens']} tokens in {len(shards)} shards, "
              f"{manifest['bytes'] / 2**30:.2f} GiB -> {out}")
    else:
        print(f"[extract] shard {k}/{n} done in {elapsed:.1f} s; {len(done)}/{len(shards)} shards exist")
    return manifest or {"shards_done": len(done), "num_shards": len(shards)}


class HfHiddenStates:
    """The Hugging Face extraction as a callable like VllmHiddenStates: samples -> per-sample dicts."""

    def __init__(self, tap: Tap, batch_tokens: int, device: str, pad_id: int):
        self.tap, self.batch_tokens, self.device, self.pad_id = tap, batch_tokens, device, pad_id

    def __call__(self, samples: list) -> list[dict]:
        return compute_samples(self.tap, samples, self.batch_tokens, self.device, self.pad_id)

    def __enter__(self) -> "HfHiddenStates":
        return self

    def __exit__(self, *exc) -> None:
        self.tap.remove()


def _claim_identity(out: Path, identity: dict, overwrite: bool = False) -> None:
    """Write `identity.json` if absent (atomically: of two extractions starting at once one wins and the other
    compares), else require it to equal `identity` (or, with overwrite, remove the other extraction's files).
    Marks the directory as paradraft's hidden states."""
    out.mkdir(parents=True, exist_ok=True)
    ident_path = out / "identity.json"
    if ident_path.is_file() and read_json(ident_path) != identity:
        if not overwrite:
            raise HiddenStateError(f"--output {out}: holds hidden states of another extraction (different data, "
                                   f"verifier, layers or options); pass --overwrite to replace them, or choose "
                                   f"another --output")
        check_replaceable(out, "hidden_states", "--output")
        for f in [*out.glob("shard-*.safetensors"), *out.glob("shard-*.json"), out / "manifest.json", ident_path]:
            f.unlink(missing_ok=True)
    if not ident_path.is_file():
        tmp = out / f".identity.json.tmp-{os.getpid()}"
        write_json(tmp, identity)
        try:
            os.link(tmp, ident_path)  # fails if another process linked first
        except FileExistsError:
            pass
        finally:
            tmp.unlink()
    write_marker(out, "hidden_states")
    if read_json(ident_path) != identity:
        raise HiddenStateError(f"--output {out}: another extraction with other options started in it at the same "
                               f"time; choose another --output")


def _shard_done(out: Path, s: int) -> bool:
    return (out / f"{_shard_name(s)}.json").is_file() and (out / f"{_shard_name(s)}.safetensors").is_file()


def _write_shard(out: Path, s: int, results: list[dict], sample_index: list[int], dtype, trained_only: bool):
    lens = [len(r["input_ids"]) for r in results]
    offsets = torch.zeros(len(lens) + 1, dtype=torch.int64)
    offsets[1:] = torch.tensor(lens, dtype=torch.int64).cumsum(0)
    ids = torch.cat([r["input_ids"] for r in results])
    mask = torch.cat([r["loss_mask"] for r in results])
    last = torch.cat([r["last"] for r in results]).to(dtype)
    tensors = {"aux": torch.cat([r["aux"] for r in results]).to(dtype).contiguous(), "input_ids": ids,
               "loss_mask": mask, "offsets": offsets, "sample_index": torch.tensor(sample_index, dtype=torch.int64)}
    if trained_only:
        # last[p] is a target only where x_{p+1} is trained (slot p-1 is valid): keep those rows
        keep = torch.zeros(len(ids), dtype=torch.bool)
        for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist()):
            keep[a:b - 1] = mask[a + 1:b].bool()
        tensors["last_keep"] = keep.to(torch.uint8)
        tensors["last"] = last[keep].contiguous()
    else:
        tensors["last"] = last.contiguous()
    name = _shard_name(s)
    save_tensors(tensors, out / f"{name}.safetensors", metadata={"format": FORMAT})
    digest = sha256_file(out / f"{name}.safetensors")  # the shard counts as done only once its .json exists
    write_json(out / f"{name}.json", {"file": f"{name}.safetensors", "num_samples": len(lens),
                                      "num_tokens": int(offsets[-1]), "sha256": digest,
                                      "bytes": (out / f"{name}.safetensors").stat().st_size,
                                      "sample_index": sample_index})


def _write_manifest(out: Path, identity: dict, num_shards: int, H: int, vocab: int) -> dict:
    shards = [read_json(out / f"{_shard_name(s)}.json") for s in range(num_shards)]
    manifest = {**identity, "hidden_size": H, "aux_size": H * len(identity["layer_ids"]), "vocab_size": vocab,
                "num_shards": num_shards, "num_tokens": sum(s["num_tokens"] for s in shards),
                "bytes": sum(s["bytes"] for s in shards), "shapes": {"aux": ["T", H * len(identity["layer_ids"])],
                                                                   "last": ["T", H], "input_ids": ["T"]},
                "shards": shards}
    write_json(out / "manifest.json", manifest)
    return manifest


def validate(path: str | Path) -> dict:
    """Re-read every shard: checksum, shapes, offsets, finite values. Raises HiddenStateError naming the shard."""
    hs = HiddenStates(path)
    bad = []
    for k in tqdm(range(hs.num_shards), desc="validate", disable=None):
        try:
            hs.load_shard(k, verify=True)
        except HiddenStateError as e:
            bad.append(str(e))
    if bad:
        raise HiddenStateError(f"--output {path}: {len(bad)} of {hs.num_shards} shards failed validation: "
                               + "; ".join(bad))
    print(f"[extract] {path}: {hs.num_shards} shards, {hs.manifest['num_tokens']} tokens: all valid")
    return {"valid": True, "num_shards": hs.num_shards}


class HiddenStates:
    """Reader of an extraction directory; yields per-sample dicts like `compute_samples`."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        mp = self.path / "manifest.json"
        if not mp.is_file():
            raise HiddenStateError(f"{self.path} has no manifest.json: the extraction is missing or unfinished "
                                   f"(rerun the same `paradraft extract` command to complete it)")
        self.manifest = read_json_input(mp, HiddenStateError, "extraction",
                                        ("num_shards", "layer_ids", "shards", "hidden_size", "aux_size", "num_tokens"))
        self.num_shards = self.manifest["num_shards"]
        self.layer_ids = self.manifest["layer_ids"]
        shards = self.manifest["shards"]
        if not isinstance(shards, list) or len(shards) != self.num_shards or not all(
                isinstance(x, dict) and {"file", "sha256", "num_tokens"} <= set(x) for x in shards):
            raise HiddenStateError(f"{mp}: its shard list does not describe {self.num_shards} shards; the extraction "
                                   f"is damaged: extract again")
        self._verified: set[int] = set()

    def load_shard(self, k: int, verify: bool = True) -> list[dict]:
        """Samples of shard k; checks the checksum the first time (clear error naming the shard)."""
        info = self.manifest["shards"][k]
        f = self.path / info["file"]
        if not f.is_file():
            raise HiddenStateError(f"shard {f} is missing")
        if verify and k not in self._verified:
            if sha256_file(f) != info["sha256"]:
                raise HiddenStateError(f"shard {f} is corrupt (checksum mismatch); re-extract it: delete "
                                       f"{f.name} and {f.with_suffix('.json').name}, rerun `paradraft extract`")
            self._verified.add(k)
        try:
            with safe_open(str(f), framework="pt") as fh:
                t = {name: fh.get_tensor(name) for name in fh.keys()}
        except Exception as e:
            raise HiddenStateError(f"shard {f} cannot be read: {e}") from None
        missing = [k for k in ("aux", "last", "input_ids", "loss_mask", "offsets", "sample_index") if k not in t]
        if missing:
            raise HiddenStateError(f"shard {f} lacks {', '.join(missing)}; it is not an extraction shard")
        H = self.manifest["hidden_size"]
        n_tok = info["num_tokens"]
        if t["aux"].shape != (n_tok, self.manifest["aux_size"]) or t["input_ids"].shape[0] != n_tok \
                or int(t["offsets"][-1]) != n_tok:
            raise HiddenStateError(f"shard {f} has wrong shapes: aux {tuple(t['aux'].shape)}, expected "
                                   f"({n_tok}, {self.manifest['aux_size']})")
        if verify and not (torch.isfinite(t["aux"]).all() and torch.isfinite(t["last"]).all()):
            raise HiddenStateError(f"shard {f} holds non-finite values")
        last = t["last"]
        if "last_keep" in t:
            full = torch.zeros(n_tok, H, dtype=last.dtype)
            full[t["last_keep"].bool()] = last
            last = full
        out = []
        off = t["offsets"].tolist()
        for j in range(len(off) - 1):
            a, b = off[j], off[j + 1]
            out.append({"input_ids": t["input_ids"][a:b], "loss_mask": t["loss_mask"][a:b], "aux": t["aux"][a:b],
                        "last": last[a:b], "sample_index": int(t["sample_index"][j])})
        return out

    def __iter__(self):
        for k in range(self.num_shards):
            yield from self.load_shard(k)


class OnlineHiddenStates:
    """The same per-sample dicts, computed on the fly by the verifier inside the training process (no disk)."""

    def __init__(self, model, dataset, layer_ids: list[int] | None = None, batch_tokens: int = 8192,
                 device: str = "cpu", pad_id: int = 0):
        self.model, self.ds = model, dataset
        self.layer_ids = resolve_layers(model.config.num_hidden_layers, layer_ids)
        self.tap = Tap(model, self.layer_ids)
        self.batch_tokens, self.device, self.pad_id = batch_tokens, device, pad_id

    def compute(self, indices) -> list[dict]:
        """Per-sample dicts for prepared-dataset indices."""
        samples = [self.ds.sample(int(i)) for i in indices]
        res = compute_samples(self.tap, samples, self.batch_tokens, self.device, self.pad_id)
        for r, i in zip(res, indices):
            r["sample_index"] = int(i)
        return res
