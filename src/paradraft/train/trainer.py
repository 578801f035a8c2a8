"""The generic trainer: any drafter whose forward(batch, generator, **args) returns (loss, stats).

AdamW (or Muon + AdamW: --optimizer muon), linear warmup + cosine decay (to 10%), gradient clipping and
accumulation, autocast over float32 master weights (bf16 where it is the fast path: resolve_autocast), packed
sequences with document ids, deterministic under --seed. Checkpoints every --save-every steps keep model,
optimizer, scheduler, data position and every RNG state, so a resumed run ends with the same weights as one never
stopped. SIGINT / SIGTERM save before exiting; a non-finite loss stops the run and keeps the last good checkpoint.
torchrun gives DDP (gloo on CPU, NCCL on GPU); --fsdp shards the drafter instead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import pickle
import random
import shutil
import signal
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import yaml
from safetensors.torch import load_file
from tqdm import tqdm

from ..config import RESUME_MAY_CHANGE, TrainConfig, config_to_dict, field_defaults
from ..data.prepare import PreparedDataset
from ..data.vocab import draft_to_target_ids, draft_vocabulary, load_vocab
from ..errors import Paused, UserError
from ..models.checkpoint import build_drafter, nonfinite_tensors, write_drafter
from ..models.common import DraftConfig, DraftModel
from ..models.loss import acceptance_estimate
from ..models.registry import drafter_class
from ..outputs import KIND_FILES, claim_dir, output_lock, write_marker
from ..utils import (
    DTYPES,
    bf16_gemm,
    fingerprint,
    json_safe,
    read_json,
    resolve_device,
    resolve_dtype,
    save_tensors,
    save_torch,
    write_json,
    write_text_atomic,
)
from ..verifier import adapter_for, load_verifier, resolve_verifier
from .data import TARGET_CACHE_BYTES, OfflineSource, OnlineSource, TargetHead, epoch_plan
from .distributed import full_state_dict, load_full_state_dict, shard_fsdp
from .partition import partitioned
from .plot import plot_metrics

# 2-D weights that stay with AdamW under --optimizer muon: token embeddings and the output head are lookup tables /
# classifiers, not layer maps, and orthogonalising their updates is not what Muon is for (Keller Jordan's practice)
_ADAMW_ONLY = ("embed_tokens", "lm_head")


def newton_schulz_float32(grad: torch.Tensor, ns_coefficients: tuple[float, float, float], ns_steps: int,
                          eps: float) -> torch.Tensor:
    """Muon's orthogonalisation of an update [A, B] (the quintic Newton-Schulz iteration with the coefficients torch's
    Muon passes) in float32. torch runs it in bf16, which is fast only where bf16 matrix products are
    (`utils.bf16_gemm`): on a 2-core AVX2 CPU each of its products took ~0.27 s, 23 s of a 26 s quickstart step."""
    a, b, c = ns_coefficients
    x = grad.float()
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T  # [min(A, B), max(A, B)]: the Gram matrix on the short side
    x = x / x.norm().clamp(min=eps)  # spectral norm <= 1
    for _ in range(ns_steps):
        gram = x @ x.T  # [n, n]
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)  # a x + (b G + c G^2) x
    return x.T if tall else x


@contextlib.contextmanager
def _muon_in_float32(on: bool):
    """torch's Muon with `newton_schulz_float32` in place of its bf16 iteration while inside (when `on`)."""
    import torch.optim._muon as muon_impl

    name = "_zeropower_via_newtonschulz"
    if not on or not hasattr(muon_impl, name):
        yield
        return
    torch_ns = getattr(muon_impl, name)
    setattr(muon_impl, name, newton_schulz_float32)
    try:
        yield
    finally:
        setattr(muon_impl, name, torch_ns)


class MuonAdamW:
    """--optimizer muon: torch's Muon over the draft layers' weight matrices (2-D, both sides > 1, not embeddings or
    lm_head) and AdamW (0.9, --adam-beta2) over every other trained parameter. One optimizer to the trainer:
    param_groups spans both (each group's "lr_scale" is its peak rate over --lr), and the state dict holds both."""

    def __init__(self, model: torch.nn.Module, cfg: TrainConfig):
        matrices, rest = [], []
        for name, p in model.named_parameters():
            if not p.requires_grad:
                continue
            if p.ndim == 2 and min(p.shape) > 1 and not any(h in name for h in _ADAMW_ONLY):
                matrices.append(p)
            else:
                rest.append(p)
        muon_lr = cfg.muon_lr if cfg.muon_lr is not None else cfg.lr
        # match_rms_adamw: the orthogonalised update is scaled to AdamW's typical RMS (0.2 sqrt(max(A, B))), so
        # the Muon group's rate is on AdamW's scale
        self.muon = torch.optim.Muon(matrices, lr=muon_lr, weight_decay=cfg.muon_weight_decay,
                                     adjust_lr_fn="match_rms_adamw") if matrices else None
        self.adamw = torch.optim.AdamW(rest, lr=cfg.lr, weight_decay=cfg.weight_decay,
                                       betas=(0.9, cfg.adam_beta2)) if rest else None
        for g in self.muon.param_groups if self.muon else []:
            g["lr_scale"] = muon_lr / cfg.lr
        self.parts = {k: o for k, o in (("muon", self.muon), ("adamw", self.adamw)) if o is not None}
        # Muon's iteration in float32 where bf16 products are slow (a CPU without oneDNN's bf16, utils.bf16_gemm)
        self.ns_float32 = bool(matrices) and not bf16_gemm(str(matrices[0].device))

    @property
    def param_groups(self) -> list[dict]:
        return [g for o in self.parts.values() for g in o.param_groups]

    def step(self) -> None:
        for k, o in self.parts.items():
            with _muon_in_float32(k == "muon" and self.ns_float32):
                o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.parts.values():
            o.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {k: o.state_dict() for k, o in self.parts.items()}

    def load_state_dict(self, state: dict) -> None:
        if set(state) != set(self.parts):
            raise KeyError(f"optimizer state holds {sorted(state)}, this run's optimizer {sorted(self.parts)}")
        for k, o in self.parts.items():
            o.load_state_dict(state[k])


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig):
    """The optimizer --optimizer names, over the model's trained parameters (one rule for training and tests)."""
    if cfg.optimizer == "muon":
        return MuonAdamW(model, cfg)
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, cfg.adam_beta2))


class TrainingError(UserError, RuntimeError):
    """Training cannot go on (non-finite loss, bad inputs)."""


class ResumeMismatchError(TrainingError):
    """--resume with flags or data other than the run's (no older checkpoint can help)."""


def resolve_autocast(name: str, device: str) -> str:
    """The autocast dtype `--autocast auto` means on this device (utils.fast_dtype). Measured on a 2-core AVX-512
    CPU without AMX: bf16 matmuls at 133-151 GFLOP/s against float32's 185-246, a P-EAGLE step 1.6x slower in bf16."""
    return resolve_dtype(name, device)


def lr_at(step: int, warmup_steps: int, total: int, schedule: str = "cosine") -> float:
    """Learning-rate multiplier: linear warmup, then `schedule` over the remaining steps to `total`: cosine from 1
    to 0.1, linear from 1 to 0 (the speculators trainers' default), or constant 1."""
    if step < warmup_steps:
        return (step + 1) / max(1, warmup_steps)
    progress = min(1.0, (step - warmup_steps) / max(1, total - warmup_steps))
    if schedule == "linear":
        return 1.0 - progress
    if schedule == "constant":
        return 1.0
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def init_normal(model: torch.nn.Module, std: float, gen: torch.Generator) -> None:
    """--init-std: every weight matrix of the drafter's fc and draft layers -> N(0, std) (the embeddings and
    lm_head keep the verifier's rows, norms their ones, P-EAGLE's mask_hidden its own init)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and name.split(".")[0] in ("fc", "layers"):
                p.copy_(torch.randn(p.shape, generator=gen) * std)


def noisy(hidden: torch.Tensor, rel_std: float, gen: torch.Generator) -> torch.Tensor:
    """hidden [T, 3Hv] plus Gaussian noise of std rel_std x each verifier layer's per-slot RMS (the three
    concatenated layers have very different scales). Drawn from the run's generator: resume stays exact."""
    T, D = hidden.shape
    parts = hidden.float().view(T, 3, D // 3)  # [T, 3, Hv]
    rms = parts.pow(2).mean(-1, keepdim=True).sqrt()  # [T, 3, 1]
    eps = torch.randn(parts.shape, generator=gen, device=gen.device).to(hidden.device)  # [T, 3, Hv]
    return (parts + rel_std * rms * eps).view(T, D).to(hidden.dtype)


TRAIN_OUTPUTS = KIND_FILES["train_run"]  # what train writes in --output (outputs.py, the one list)


def _has_run(out: Path) -> bool:
    return out.is_dir() and any((out / f).exists() for f in TRAIN_OUTPUTS)


def checkpoints_in(out: Path) -> list[Path]:
    """Step checkpoints of a run directory, oldest first."""
    return sorted((out / "checkpoints").glob("step-*")) if (out / "checkpoints").is_dir() else []


def ran_dtype(state: dict, key: str) -> str | None:
    """The dtype (`autocast`, `verifier_dtype`) a checkpoint's state records its run ran in, if it names one."""
    ran = state.get(key) or (state.get("config") or {}).get(key)
    return ran if ran in DTYPES else None


def newest_state(out: Path) -> dict:
    """The state.json of the newest checkpoint in `out` ({} when there is none or it cannot be read)."""
    found = checkpoints_in(out)
    try:
        return read_json(found[-1] / "state.json") if found else {}
    except (OSError, ValueError):
        return {}


def resume_problems(state: dict, cfg: TrainConfig, data_identity: str) -> list[str]:
    """Why a checkpoint's run cannot be continued with `cfg` (empty: it can). Only the flags in
    RESUME_MAY_CHANGE may differ; the data must be the same dataset."""
    want = config_to_dict(cfg)
    # a flag added after the checkpoint was written ran there as its default (new flags keep the old behaviour), or
    # as the value LATER_FLAGS records where the default may since have changed; a flag whose default is now the
    # algorithm's had the value DraftModel.train_defaults records
    saved = {**field_defaults(TrainConfig), **DraftModel.train_defaults, **LATER_FLAGS,
             **(state.get("config") or {})}
    for k in ("autocast", "verifier_dtype"):  # the dtype the run used, where its flag said auto
        if saved.get(k) == "auto" and state.get(k):
            saved[k] = state[k]
    if saved.get("loss_decay") is None and saved.get("algorithm"):  # saved before the default was resolved into it
        saved["loss_decay"] = drafter_class(saved["algorithm"]).unset_loss_decay
    # `auto` continues the run's dtype
    problems = [f"--{k.replace('_', '-')} {want.get(k)!r} (the checkpoint has {saved.get(k)!r})"
                for k in sorted(set(saved) | set(want)) if k not in RESUME_MAY_CHANGE and saved.get(k) != want.get(k)
                and k in want and not (k in ("autocast", "verifier_dtype") and want[k] == "auto")]
    if state.get("data_identity") not in (None, data_identity):
        problems.append(f"--data {cfg.data} is another dataset than the one the run was trained on")
    return problems


def check_run_dir(out: Path, cfg: TrainConfig, data_identity: str) -> None:
    """What train may do with --output, decided before any work: start in a new or empty directory, continue
    (--resume) a run whose flags match, or replace (--overwrite) a run it wrote. Anything else is refused."""
    if cfg.resume:
        found = checkpoints_in(out)
        if not found:
            if _has_run(out):
                raise TrainingError(f"--resume: {out} holds no checkpoint to continue from (a finished drafter or "
                                    f"metrics only); pass --overwrite to train anew there, or choose another --output")
            return
        try:
            state = read_json(found[-1] / "state.json")
        except (OSError, ValueError):
            return  # unreadable: load_checkpoint falls back to an older one and checks that
        problems = resume_problems(state, cfg, data_identity)
        if problems:
            raise ResumeMismatchError(f"--resume: these flags differ from the run in {out}: " + "; ".join(problems)
                                + "; use the run's flags, or --overwrite to start it anew")
    elif _has_run(out) and not cfg.overwrite:
        raise TrainingError(f"--output {out} holds a training run; pass --resume to continue it, --overwrite to "
                            f"replace it, or choose another --output")


def remove_run(out: Path) -> None:
    """Delete what train wrote in `out` (its own files only; anything else there stays)."""
    for name in TRAIN_OUTPUTS:
        p = out / name
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        elif p.exists() or p.is_symlink():
            p.unlink()


class Distributed:
    """torchrun environment (or a single process)."""

    def __init__(self, device: str):
        self.world = int(os.environ.get("WORLD_SIZE", 1))
        self.rank = int(os.environ.get("RANK", 0))
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self.enabled = self.world > 1
        if self.enabled and not torch.distributed.is_initialized():
            torch.distributed.init_process_group("nccl" if device.startswith("cuda") else "gloo")

    @property
    def main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.enabled:
            torch.distributed.barrier()

    def mean(self, x: float) -> float:
        if not self.enabled:
            return x
        t = torch.tensor([x], dtype=torch.float64)
        torch.distributed.all_reduce(t)
        return float(t[0]) / self.world


def _rng_state(gen: torch.Generator) -> dict:
    return {"torch": torch.get_rng_state(), "cod": gen.get_state(), "python": random.getstate(),
            "numpy": np.random.get_state()}


def _set_rng_state(state: dict, gen: torch.Generator) -> None:
    torch.set_rng_state(state["torch"])
    gen.set_state(state["cod"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])


class Trainer:
    """Train one drafter as `cfg` says; see the module docstring."""

    def __init__(self, cfg: TrainConfig, verifier=None, tokenizer=None):
        self.cfg = cfg
        device = resolve_device(cfg.device)  # cuda:LOCAL_RANK under torchrun; a missing GPU is a one-line error
        self.dist = Distributed(device)
        if device.startswith("cuda"):
            torch.cuda.set_device(device)
        self.device = device
        self.autocast = resolve_autocast(cfg.autocast, device)  # a resumed run keeps the dtype it started with
        self.out = Path(cfg.output)
        self.algo = drafter_class(cfg.algorithm)  # the drafter protocol (models/common.py)
        self.algo.resolve_train_config(cfg)  # its defaults (K) and what it refuses, before any work
        # before any work: --output must be new, empty or a training run of ours, and say what happens to it
        claim_dir(self.out, "train_run", "--output", legacy=lambda p: (p / "train_config.yaml").is_file())
        self.ds = PreparedDataset(cfg.data)
        self.data_identity = dataset_identity(self.ds.manifest)
        if self.dist.main:
            check_run_dir(self.out, cfg, self.data_identity)
        self.verifier_name = cfg.verifier or self.ds.manifest["verifier"]
        self.verifier_dtype = resolve_dtype(cfg.verifier_dtype, device)
        if cfg.resume and cfg.verifier_dtype == "auto":  # the run's numerics stay the same on another machine
            self.verifier_dtype = ran_dtype(newest_state(self.out), "verifier_dtype") or self.verifier_dtype
        if verifier is None:
            verifier, tokenizer = load_verifier(self.verifier_name, dtype=self.verifier_dtype, device=device)
        self.verifier, self.tok = verifier, tokenizer
        for p in verifier.parameters():
            p.requires_grad_(False)

        # ---- data
        if cfg.online:
            pad = tokenizer.pad_token_id if tokenizer is not None and tokenizer.pad_token_id is not None else 0
            self.source = OnlineSource(verifier, self.ds, None, device, pad)
        else:
            self.source = OfflineSource(cfg.hidden_states)
            hs = self.source.hs.manifest
            if hs.get("verifier") not in (self.verifier_name, None):
                raise TrainingError(f"--hidden-states {cfg.hidden_states} was extracted with verifier "
                                    f"{hs.get('verifier')!r}, not {self.verifier_name!r}")
            if "data_identity" in hs and hs["data_identity"] != self.ds.manifest.get("identity"):
                raise TrainingError(f"--hidden-states {cfg.hidden_states} was extracted from another dataset than "
                                    f"--data {cfg.data} (extracted from {hs.get('data')}); extract from this one")
        self.train_idx = self.source.available(self.ds.indices("train"))
        self.val_idx = self.source.available(self.ds.indices("val"))[: cfg.val_samples]
        if len(self.train_idx) == 0:
            raise TrainingError("no training samples (the hidden states hold none of the train split?)")
        self.lengths = {int(i): int(self.ds.offsets[i + 1] - self.ds.offsets[i]) for i in
                        np.concatenate([self.train_idx, self.val_idx])}
        # sequence partitioning (train/partition.py): a pack of more slots trains in partitions of this many anchors
        self.partition_tokens = cfg.partition_tokens or cfg.batch_tokens
        longest = max(self.lengths.values()) - 1  # slots of the longest sample
        if cfg.fsdp and self.dist.enabled and max(longest, cfg.batch_tokens) > self.partition_tokens:
            raise TrainingError(f"--fsdp: packs of up to {max(longest, cfg.batch_tokens)} slots are longer than "
                                f"--partition-tokens {self.partition_tokens}, and sequence partitioning runs under DDP "
                                f"only (FSDP's collectives need the same number of passes on every rank); drop --fsdp, "
                                f"or raise --partition-tokens to {max(longest, cfg.batch_tokens)}")

        # ---- vocabulary and model
        V = adapter_for(verifier).embedding_rows(verifier)  # rows, not tokenizer length (padded vocabularies)
        token_freqs = self.ds.token_freqs()
        if cfg.vocab:
            d2t, t2d = load_vocab(cfg.vocab)
            if len(t2d) != V:
                raise TrainingError(f"vocab {cfg.vocab} is for a {len(t2d)}-token verifier, this one has {V}")
        else:
            d2t, t2d = draft_vocabulary(token_freqs, cfg.draft_vocab_size, V, tokenizer, fill=True)
        own = self.algo.config_overrides(cfg, tokenizer, V, token_freqs)  # e.g. P-EAGLE's mask token
        torch.manual_seed(cfg.seed)
        dcfg = DraftConfig.from_verifier(
            verifier.config, algorithm=cfg.algorithm, num_layers=cfg.num_layers, draft_vocab_size=len(d2t),
            flavour=None if cfg.draft_layer == "auto" else cfg.draft_layer,  # None: the verifier's family
            norm_before_residual=cfg.norm_before_residual,
            num_speculative_tokens=cfg.num_speculative_tokens, aux_layer_ids=list(self.source.layer_ids),
            verifier=resolve_verifier(self.verifier_name), **own)
        self.model = build_drafter(dcfg)
        self.model.init_from_verifier(verifier, d2t, t2d, norm=cfg.init_norm == "verifier")
        if cfg.mask_hidden_init != "normal":  # P-EAGLE only (refused for others by resolve_train_config)
            with torch.no_grad():  # mask_hidden [1, 3Hv]: zeros, or N(0, 1) from the run's seed
                if cfg.mask_hidden_init == "zero":
                    self.model.mask_hidden.zero_()
                else:
                    self.model.mask_hidden.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(cfg.seed))
        if cfg.init_std is not None:
            init_normal(self.model, cfg.init_std, torch.Generator().manual_seed(cfg.seed))
        # the drafter's own copy of the verifier's embeddings (written to every checkpoint): frozen unless asked
        self.model.embed_tokens.weight.requires_grad_(cfg.train_embeddings)
        self.model.lm_head.weight.requires_grad_(not cfg.freeze_lm_head)  # the verifier's rows, or trained from them
        self.model.to(device)
        backend = cfg.attention if cfg.attention != "auto" else ("flex" if device.startswith("cuda") else "sdpa")
        self.model.backend = backend
        # offline on a CPU the targets of every sample are kept after the first epoch (bit-identical, see TargetHead)
        self.target_head = TargetHead(verifier, draft_to_target_ids(d2t), device,
                                      cache_bytes=0 if cfg.online or device != "cpu" else TARGET_CACHE_BYTES)
        self.train_args = self.algo.train_args(cfg)
        self.num_depths = self.algo.scored_depths(cfg)
        self.wrapped = self._wrap(self.model)
        self.opt = build_optimizer(self.model, cfg)
        self.gen = torch.Generator().manual_seed(cfg.seed)
        self.step, self.epoch, self.pack_pos = 0, 0, 0
        self.trained_tokens = 0  # depth-0 targets trained so far, every process (the data-scaling axis)
        self.stop_signal = None

    def _wrap(self, model):
        if not self.dist.enabled:
            return model
        if self.cfg.fsdp:
            return shard_fsdp(model)
        from torch.nn.parallel import DistributedDataParallel as DDP

        # the buffers (d2t, t2d, rope) never change: no broadcast in each forward, so a partitioned pack's extra
        # forwards (under no_sync) need no collective the other ranks would have to match
        return DDP(model, device_ids=[self.dist.local_rank] if self.device.startswith("cuda") else None,
                   broadcast_buffers=False)

    # ------------------------------------------------------------------------------------------ schedule

    def packs_per_epoch(self) -> int:
        return len(epoch_plan(self.train_idx, self.lengths, self.source, self.cfg.batch_tokens, self.cfg.seed, 0))

    def total_steps(self) -> int:
        if self.cfg.max_steps is not None:  # --max-steps overrides --epochs (epochs cycle as needed)
            return self.cfg.max_steps
        per_step = self.cfg.grad_accum * self.dist.world
        return max(1, self.cfg.epochs * (self.packs_per_epoch() // per_step))

    # ------------------------------------------------------------------------------------------ checkpoints

    @property
    def ckpt_dir(self) -> Path:
        return self.out / "checkpoints"

    def save_checkpoint(self) -> Path:
        """Full training state at this step: rank 0 writes model/optimizer/state, every rank its RNG state."""
        path = self.ckpt_dir / f"step-{self.step:07d}"
        tmp = self.ckpt_dir / f".tmp-step-{self.step:07d}"
        sd = full_state_dict(self.model)  # a collective under FSDP
        bad = nonfinite_tensors(sd) if self.dist.main else []
        if self.dist.enabled:  # every rank stops alike
            flag = torch.tensor([float(len(bad))], device=self.device if self.device != "cpu" else "cpu")
            torch.distributed.all_reduce(flag)
            bad = bad or (["(on rank 0)"] if float(flag) > 0 else [])
        if bad:
            raise TrainingError(f"the weights hold NaN or infinity after step {self.step} ({', '.join(bad[:3])}; "
                                f"the learning rate is too high or the data is broken): nothing saved; "
                                f"the last good checkpoint is kept in {self.ckpt_dir}")
        if self.dist.main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            save_tensors(sd, tmp / "model.safetensors")
            write_json(tmp / "state.json", {"step": self.step, "epoch": self.epoch, "pack_pos": self.pack_pos,
                                            "trained_tokens": self.trained_tokens, "world_size": self.dist.world,
                                            "config": config_to_dict(self.cfg), "autocast": self.autocast,
                                            "verifier_dtype": self.verifier_dtype,
                                            "data_identity": self.data_identity})
        self.dist.barrier()
        # FSDP optimizer state is sharded: each rank keeps its own shard (resume with the same world size)
        if self.cfg.fsdp and self.dist.enabled:
            save_torch({"opt": self.opt.state_dict()}, tmp / f"optimizer-{self.dist.rank}.pt")
        elif self.dist.main:
            save_torch({"opt": self.opt.state_dict()}, tmp / "optimizer.pt")
        save_torch(_rng_state(self.gen), tmp / f"rng-{self.dist.rank}.pt")
        self.dist.barrier()
        if self.dist.main:  # one rename makes the checkpoint exist; a kill before it leaves only .tmp-*
            shutil.rmtree(path, ignore_errors=True)
            os.rename(tmp, path)
            for old in sorted(self.ckpt_dir.glob("step-*"))[: -self.cfg.keep_checkpoints]:
                shutil.rmtree(old, ignore_errors=True)
        self.dist.barrier()
        return path

    def latest_checkpoint(self) -> Path | None:
        found = checkpoints_in(self.out)
        return found[-1] if found else None

    def load_checkpoint(self, path: Path) -> None:
        """Restore the full training state from `path`; TrainingError naming the file if any part is unreadable."""
        try:
            st = read_json(path / "state.json")
            sd = load_file(str(path / "model.safetensors"))
        except Exception as e:  # OSError, JSON errors, SafetensorError (truncated file)
            raise TrainingError(f"checkpoint {path} cannot be read ({type(e).__name__}: {e})") from None
        problems = resume_problems(st, self.cfg, self.data_identity)
        if problems:
            raise ResumeMismatchError(f"--resume: these flags differ from the run in {self.out}: "
                                      + "; ".join(problems))
        if st.get("world_size", 1) != self.dist.world and self.cfg.fsdp:
            raise TrainingError(f"{path} was written by {st.get('world_size')} FSDP ranks; resume with as many")
        opt_file = path / (f"optimizer-{self.dist.rank}.pt" if self.cfg.fsdp and self.dist.enabled else "optimizer.pt")
        rng = path / f"rng-{self.dist.rank}.pt"
        try:
            opt_state = torch.load(opt_file, weights_only=False)["opt"]
            rng_state = torch.load(rng, weights_only=False) if rng.is_file() else None
            load_full_state_dict(self.model, {k: v.to(self.device) for k, v in sd.items()})
        except (OSError, EOFError, KeyError, RuntimeError, pickle.UnpicklingError) as e:
            raise TrainingError(f"checkpoint {path} cannot be restored ({type(e).__name__}: {e})") from None
        self.opt.load_state_dict(opt_state)
        self.step, self.epoch, self.pack_pos = st["step"], st["epoch"], st["pack_pos"]
        self.trained_tokens = st.get("trained_tokens", 0)
        if self.cfg.autocast == "auto":  # the run's numerics stay the same on another machine
            self.autocast = ran_dtype(st, "autocast") or self.autocast
        if rng_state is not None:
            _set_rng_state(rng_state, self.gen)

    def resume(self) -> None:
        """Continue from the newest readable checkpoint; a damaged one (a kill mid-write on another filesystem,
        a truncated copy) is reported and the one before it is used."""
        found = checkpoints_in(self.out)
        if not found:
            print(f"[train] --resume: no checkpoint in {self.ckpt_dir}; starting fresh")
            return
        for path in reversed(found):
            try:
                self.load_checkpoint(path)
            except ResumeMismatchError:
                raise
            except TrainingError as e:
                print(f"[train] {e}; trying the checkpoint before it")
                continue
            print(f"[train] resumed from {path} (step {self.step})")
            return
        raise TrainingError(f"--resume: no checkpoint in {self.ckpt_dir} can be read; --overwrite starts anew")

    def _trim_metrics(self, metrics_path: Path) -> None:
        """After a resume, drop metric lines past the restored step (a killed run logged steps it never saved)."""
        if not metrics_path.is_file():
            return
        keep = []
        for line in metrics_path.read_text(encoding="utf-8").splitlines():
            try:
                if json.loads(line)["step"] <= self.step:
                    keep.append(line)
            except (ValueError, KeyError, TypeError):
                continue  # a torn last line
        write_text_atomic(metrics_path, "".join(x + "\n" for x in keep))

    # ------------------------------------------------------------------------------------------ loop

    def _install_signals(self):
        def handler(signum, frame):
            self.stop_signal = signum
        old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
        return old

    def train_step(self, packs: list, lr: float) -> tuple[float, dict, int, float]:
        """One optimizer step over this process's packed sequences (gradient accumulation over `packs`).
        -> (mean loss, summed per-depth stats, slots trained, gradient norm before clipping)."""
        cfg = self.cfg
        for g in self.opt.param_groups:
            g["lr"] = lr * g.get("lr_scale", 1.0)  # lr: --lr on the schedule; Muon's group may run at its own peak
        loss_sum, stats_acc, n_tok = 0.0, None, 0
        for micro, pack in enumerate(packs):
            # COD draws depend only on (seed, epoch, global pack index): the same elements whichever process
            # trains the pack, so DDP with N ranks equals one process with N x grad_accum
            g_idx = self.pack_pos + self.dist.rank * cfg.grad_accum + micro
            self.gen.manual_seed(cfg.seed * 1_000_003 + self.epoch * 100_003 + g_idx)
            b = self.target_head.slot_batch(self.source.get(pack))
            if cfg.hidden_noise > 0:
                b = dataclasses.replace(b, hidden=noisy(b.hidden, cfg.hidden_noise, self.gen))
            n_tok += len(b)

            def check(loss):
                if not torch.isfinite(loss):
                    raise TrainingError(f"non-finite loss {float(loss.detach())} at step {self.step} (lr {lr:.2e}); "
                                        f"the last good checkpoint is kept in {self.ckpt_dir}")

            if len(b) > self.partition_tokens:  # one long sample: its partitions, last first, one backward each
                loss, stats = self._partitioned(self.wrapped, b, self.gen, self.train_args, 1.0 / cfg.grad_accum,
                                                check)
            else:
                with self._autocast():
                    loss, stats = self.wrapped(b, generator=self.gen, **self.train_args)
                check(loss)
                (loss / cfg.grad_accum).backward()
            loss_sum += float(loss.detach()) / cfg.grad_accum
            stats_acc = _merge(stats_acc, stats)
        gnorm = torch.nn.utils.clip_grad_norm_([p for p in self.model.parameters() if p.requires_grad],
                                               cfg.max_grad_norm)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss_sum, stats_acc, n_tok, float(gnorm)

    def _autocast(self):
        return torch.autocast(self.device.split(":")[0], dtype=getattr(torch, self.autocast),
                              enabled=self.autocast != "float32")

    def _partitioned(self, module, b, generator, args, scale, check=None):
        """One pack in partitions of --partition-tokens anchors (train/partition.py); `scale` None = evaluation.
        Under DDP every partition but the last runs in no_sync: one gradient all-reduce per pack, as unpartitioned."""
        ddp = module is not self.model and not self.cfg.fsdp

        def call(sub, **kw):
            with self._autocast():
                return module(sub, **kw)

        def sync(last):
            return module.no_sync() if ddp and not last else contextlib.nullcontext()

        return partitioned(call, self.model, b, self.partition_tokens, self.num_depths, self.num_depths, args,
                           generator=generator, scale=scale, sync=sync, check=check)

    def train(self) -> dict:
        """Run training to the end (or to a signal); returns the final metrics."""
        if not self.dist.main:
            return self._train()
        with output_lock(self.out, "--output"):  # one writer per run directory (rank 0 of a torchrun job)
            return self._train()

    def _train(self) -> dict:
        cfg = self.cfg
        metrics_path = self.out / "metrics.jsonl"
        if self.dist.main:
            if cfg.overwrite:
                remove_run(self.out)  # train's own files only
            self.out.mkdir(parents=True, exist_ok=True)
            write_marker(self.out, "train_run")
        self.dist.barrier()
        if cfg.resume:
            self.resume()
        elif self.latest_checkpoint() is not None:  # every rank refuses (no rank left waiting at a barrier)
            raise TrainingError(f"--output {self.out} already holds checkpoints; pass --resume to continue, "
                                f"--overwrite to replace the run, or choose another --output")
        if self.dist.main:
            write_text_atomic(self.out / "train_config.yaml", yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
            if cfg.resume:
                self._trim_metrics(metrics_path)
            elif metrics_path.exists():
                metrics_path.unlink()
        total = self.total_steps()
        tb = self._tensorboard()
        old_signals = self._install_signals()
        per_step = cfg.grad_accum * self.dist.world
        bar = tqdm(total=total, initial=self.step, desc=f"train {cfg.algorithm}", unit="step",
                   disable=None if self.dist.main else True)
        t_last, tok_count = time.time(), 0
        deadline = None if cfg.time_limit is None else t_last + 60 * cfg.time_limit
        last_val = None
        try:
            while self.step < total:
                plan = epoch_plan(self.train_idx, self.lengths, self.source, cfg.batch_tokens, cfg.seed, self.epoch)
                usable = len(plan) - len(plan) % per_step
                if usable == 0:
                    raise TrainingError(f"one optimizer step needs {per_step} packed sequences but an epoch has "
                                        f"{len(plan)}; lower --grad-accum or --batch-tokens")
                if self.pack_pos + per_step > usable:
                    self.epoch, self.pack_pos = self.epoch + 1, 0
                    continue
                mine = plan[self.pack_pos + self.dist.rank * cfg.grad_accum:
                            self.pack_pos + (self.dist.rank + 1) * cfg.grad_accum]
                lr = cfg.lr * lr_at(self.step, cfg.warmup_steps, total, cfg.lr_schedule)
                loss_sum, stats_acc, n_tok, gnorm = self.train_step(mine, lr)
                self.step += 1
                self.pack_pos += per_step
                tok_count += n_tok * self.dist.world
                self.trained_tokens += round(self.dist.mean(float(stats_acc["count"][0])) * self.dist.world)
                loss_g = self.dist.mean(loss_sum)
                acc = [a / max(1, c) for a, c in zip(stats_acc["correct"], stats_acc["count"])]
                now = time.time()
                rec = {"step": self.step, "epoch": self.epoch, "loss": loss_g, "lr": lr, "grad_norm": float(gnorm),
                       "acc": acc, "tokens_per_s": tok_count / max(1e-9, now - t_last),
                       "trained_tokens": self.trained_tokens, "step_s": now - t_last}
                if cfg.val_every and self.step % cfg.val_every == 0 and len(self.val_idx):
                    last_val = self.validate()
                    rec["val"] = last_val
                if self.dist.main and self.step % cfg.log_every == 0:
                    with open(metrics_path, "a") as fh:
                        fh.write(json.dumps(json_safe(rec), allow_nan=False) + "\n")
                    if tb is not None:
                        tb.add_scalar("loss", loss_g, self.step)
                        for d, a in enumerate(acc):
                            tb.add_scalar(f"acc/depth{d}", a, self.step)
                bar.update(1)
                bar.set_postfix(loss=f"{loss_g:.3f}", acc0=f"{acc[0]:.2f}", tok_s=f"{rec['tokens_per_s']:.0f}")
                # the time limit: stop before a step that would end past it (every rank decides alike)
                out_of_time = deadline is not None and self.step < total and \
                    self.dist.mean(float(time.time() + rec["step_s"] > deadline)) > 0
                if self.step % cfg.save_every == 0 or self.stop_signal is not None or out_of_time:
                    self.save_checkpoint()
                t_last, tok_count = time.time(), 0  # validation and checkpoints are not step time
                if self.stop_signal is not None:
                    raise KeyboardInterrupt(f"signal {self.stop_signal}: checkpoint saved at step {self.step}")
                if out_of_time:
                    raise Paused(f"--time-limit {cfg.time_limit:g} min reached at step {self.step} of {total}; "
                                 f"checkpoint saved in {self.ckpt_dir} (the same command with --resume continues)")
        finally:
            bar.close()
            for s, h in old_signals.items():
                signal.signal(s, h)
            if tb is not None:
                tb.close()
        final = {"step": self.step, "autocast": self.autocast, "verifier_dtype": self.verifier_dtype}
        if len(self.val_idx):
            final["val"] = last_val if (last_val and cfg.val_every and self.step % cfg.val_every == 0) \
                else self.validate()
        if self.latest_checkpoint() is None or not self.latest_checkpoint().name.endswith(f"{self.step:07d}"):
            self.save_checkpoint()
        sd = full_state_dict(self.model)  # a collective under FSDP
        if self.dist.main:
            self._write_final(final, sd)
        self.dist.barrier()
        return final

    def _write_final(self, final: dict, state_dict: dict) -> None:
        """The final checkpoint goes to --output itself, in the export format, beside metrics and the plot."""
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-final-", dir=self.out))
        try:
            identity = train_identity(self.cfg, self.data_identity, self.autocast, self.verifier_dtype)
            write_drafter(self.model, tmp, state_dict=state_dict,
                          extra_provenance={"train_config": config_to_dict(self.cfg), "final": final,
                                            "data_identity": self.data_identity, "train_identity": identity})
            for f in ("model.safetensors", "provenance.json", "config.json"):  # config.json last
                os.replace(tmp / f, self.out / f)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        write_json(self.out / "final_metrics.json", final)
        try:
            plot_metrics(self.out / "metrics.jsonl", self.out / "training.png")
        except Exception as e:  # a plot must never lose a trained model
            print(f"[train] plot skipped: {e}")
        print(f"[train] done at step {self.step}: checkpoint in {self.out}"
              + (f"; val acceptance length (estimate, K={self.cfg.num_speculative_tokens}): "
                 f"{final['val']['acceptance_length_estimate']:.3f}" if final.get("val") else ""))

    @torch.no_grad()
    def validate(self) -> dict:
        """Held-out per-depth accuracy (every depth at every position, no COD) and the acceptance estimate."""
        self.model.eval()
        args = self.algo.validation_args(self.train_args)
        els, stats_acc, offset = [], None, 0
        covered = trained = 0  # trained targets whose verifier argmax is in the draft vocabulary
        plan = epoch_plan(self.val_idx, self.lengths, self.source, self.cfg.batch_tokens, 0, 0)
        for pack in plan:
            b = self.target_head.slot_batch(self.source.get(pack))
            t2d = self.model.t2d.to(b.target_ids.device)
            covered += int(t2d[b.target_ids[b.valid]].sum())
            trained += int(b.valid.sum())
            if len(b) > self.partition_tokens:  # a long sample: in partitions, as training runs it
                loss, stats = self._partitioned(self.model, b, torch.Generator().manual_seed(0), args, None)
            else:
                with self._autocast():
                    loss, stats = self.model(b, generator=torch.Generator().manual_seed(0), **args)
            stats["loss"] = float(loss)
            stats_acc = _merge(stats_acc, stats)
            a, d, c, v = stats["elements"]
            els.append((a.cpu() + offset, d.cpu(), c.cpu(), v.cpu()))  # anchors of different packs kept apart
            offset += len(b)
        self.model.train()
        a, d, c, v = (torch.cat([e[i] for e in els]) for i in range(4))
        est = acceptance_estimate(a, d, c, v, self.num_depths)
        K = min(self.cfg.num_speculative_tokens, self.num_depths)
        al = est["acceptance_length"]
        return {"acc": [x / max(1, n) for x, n in zip(stats_acc["correct"], stats_acc["count"])],
                "conditional_acc": est["conditional_acc"], "acceptance_length_by_k": al,
                "acceptance_length_estimate": al.get(K, max(al.values()) if al else 1.0),
                "vocab_coverage": covered / max(1, trained),  # the ceiling of depth-0 accuracy
                "loss": stats_acc["loss"] / max(1, stats_acc["n"])}

    def _tensorboard(self):
        if not self.dist.main:
            return None
        try:
            from torch.utils.tensorboard import SummaryWriter
        except Exception:
            return None
        return SummaryWriter(str(self.out / "tensorboard"))


def _merge(acc: dict | None, stats: dict) -> dict:
    """Sum per-depth correct counts and element counts over micro-batches."""
    correct = [a * c if a == a else 0.0 for a, c in zip(stats["acc"], stats["count"])]
    if acc is None:
        return {"correct": correct, "count": list(stats["count"]), "loss": stats.get("loss", 0.0), "n": 1}
    acc["correct"] = [x + y for x, y in zip(acc["correct"], correct)]
    acc["count"] = [x + y for x, y in zip(acc["count"], stats["count"])]
    acc["loss"] += stats.get("loss", 0.0)
    acc["n"] += 1
    return acc


# flags that do not change what a finished run produced (where files are, how often it saved and logged)
IDENTITY_IGNORES = ("resume", "overwrite", "device", "output", "data", "hidden_states", "save_every", "time_limit",
                    "keep_checkpoints", "log_every", "attention", "partition_tokens")


# flags added after runs were finished without them: {flag: the value those runs ran with}. At that value a flag is
# left out of a run's identity, so a run finished before it existed is still reused; a checkpoint saved before it
# existed resumes with that value (whatever the flag's default becomes)
LATER_FLAGS = {"adam_beta2": 0.95, "train_out_of_vocab": False, "init_std": None}


def dataset_identity(manifest: dict) -> str:
    """The identity of a prepared dataset (what its manifest records), as checkpoints and runs store it."""
    return fingerprint(manifest.get("identity") or manifest)


def train_identity(cfg: TrainConfig, data_identity: str, autocast: str | None = None,
                   verifier_dtype: str | None = None) -> str:
    """What a finished run was made from: its resolved flags (less IDENTITY_IGNORES) and its dataset. `autocast` and
    `verifier_dtype` are the dtypes the run used (default: what the flags mean on this machine), so `auto` reuses a
    run made in the dtype it resolves to here, whichever way that run spelled it."""
    kept = {k: v for k, v in config_to_dict(cfg).items()
            if k not in IDENTITY_IGNORES and not (k in LATER_FLAGS and v == LATER_FLAGS[k])}
    device = resolve_device(cfg.device)
    kept["autocast"] = autocast or resolve_autocast(cfg.autocast, device)
    kept["verifier_dtype"] = verifier_dtype or resolve_dtype(cfg.verifier_dtype, device)
    return fingerprint({"config": kept, "data": data_identity})


def finished_run(cfg: TrainConfig) -> dict | None:
    """The final metrics of a finished run in cfg.output made with these flags on this data, else None."""
    out = Path(cfg.output)
    if not ((out / "model.safetensors").is_file() and (out / "config.json").is_file()):
        return None
    try:
        prov = read_json(out / "provenance.json")
    except (OSError, ValueError):
        return None
    algo = drafter_class(cfg.algorithm)
    algo.resolve_train_config(cfg)
    data = dataset_identity(PreparedDataset(cfg.data).manifest)
    alike = [cfg]
    if cfg.loss_decay == algo.unset_loss_decay:  # also a run saved before --loss-decay's default was resolved
        alike.append(dataclasses.replace(cfg, loss_decay=None))
    saved_epochs = (prov.get("train_config") or {}).get("epochs")
    if cfg.max_steps is not None and saved_epochs not in (None, cfg.epochs):
        # --max-steps overrides --epochs, so the epochs a run recorded (1, the default before 2026-12-02) did not
        # change what it trained
        alike += [dataclasses.replace(c, epochs=saved_epochs) for c in alike]
    if prov.get("train_identity") not in [train_identity(c, data) for c in alike]:
        return None
    return prov.get("final") or {}


def can_resume(cfg: TrainConfig) -> bool:
    """Whether cfg.output holds a checkpoint this config may continue (same flags but those RESUME_MAY_CHANGE,
    same data): what a pipeline that owns the run directory asks before choosing --resume or --overwrite."""
    found = checkpoints_in(Path(cfg.output))
    if not found:
        return False
    try:
        state = read_json(found[-1] / "state.json")
    except (OSError, ValueError):
        return False
    drafter_class(cfg.algorithm).resolve_train_config(cfg)
    return not resume_problems(state, cfg, dataset_identity(PreparedDataset(cfg.data).manifest))


def train(cfg: TrainConfig, verifier=None, tokenizer=None) -> dict:
    """Run `paradraft train`: a finished run with these flags on this data is reused (unless --overwrite);
    otherwise train (see Trainer). Returns the final metrics."""
    if not cfg.overwrite and not cfg.resume:
        done = finished_run(cfg)
        if done is not None:
            print(f"[train] {cfg.output} already holds a drafter trained with these flags on this data; reusing it "
                  f"(--overwrite trains it anew)")
            return done
    return Trainer(cfg, verifier, tokenizer).train()
