"""The draft model EAGLE-3 and P-EAGLE share.

  fc            Linear(3H -> H, no bias): projects the concatenated verifier aux hidden states
  layers[0]     attention q/k/v take 2H = concat(input_layernorm(token embedding), hidden_norm(hidden));
                the residual is the hidden part (normalized first when norm_before_residual)
  layers[1:]    plain Llama / Qwen3 decoder layers
  norm          final RMSNorm; lm_head over the draft vocabulary; d2t / t2d map draft <-> target ids
  embed_tokens  the verifier's token embeddings (frozen); P-EAGLE trains one extra row, the mask token

Parameter names are the ones vLLM's EAGLE-3 / P-EAGLE loader reads, so `state_dict()` is the checkpoint.
Every forward works on a flat list of N *elements* (see attention.py) with explicit position ids; a
`DraftCache` keeps the keys/values of elements already processed. At inference a drafter may instead run on a
`RowCache` (`run_rows`): each row its own cache, element (a, d) at position a + d, the same rule (attention.py).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ConfigError, field_defaults
from ..data.vocab import draft_to_target_ids
from ..verifier import default_aux_layers, flavour_of
from ..verifier.linear import linear, linears
from .attention import Elements, attention, row_attention


@dataclass
class DraftConfig:
    """Architecture of a drafter; follows the verifier's layer config."""

    algorithm: str = "peagle"  # "peagle" | "eagle3"
    flavour: str = "llama"  # "llama" | "qwen3" (q/k RMSNorm per head)
    hidden_size: int = 576
    intermediate_size: int = 1536
    num_attention_heads: int = 9
    num_key_value_heads: int = 3
    head_dim: int = 64
    num_layers: int = 1
    rms_norm_eps: float = 1e-5
    rope_parameters: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    max_position_embeddings: int = 8192
    vocab_size: int = 49152  # the verifier's vocabulary
    draft_vocab_size: int = 8192
    aux_layer_ids: list[int] = field(default_factory=lambda: [2, 15, 27])
    target_hidden_size: int | None = None  # verifier hidden size when it differs from the drafter's
    norm_before_residual: bool = False
    mask_token_id: int | None = None  # P-EAGLE
    num_speculative_tokens: int = 7
    num_depths: int | None = None  # P-EAGLE: prediction depths trained (K may not exceed it); None = not recorded
    verifier: str = ""  # name_or_path vLLM opens
    verifier_architectures: list[str] = field(default_factory=list)
    tie_word_embeddings: bool = False

    @property
    def verifier_hidden(self) -> int:
        return self.target_hidden_size or self.hidden_size

    @classmethod
    def from_verifier(cls, vcfg, **overrides) -> "DraftConfig":
        """Draft config following a verifier's HF config (heads, KV heads, head_dim, rope, eps)."""
        rope = getattr(vcfg, "rope_parameters", None) or {"rope_type": "default",
                                                         "rope_theta": getattr(vcfg, "rope_theta", 10000.0)}
        kw = dict(
            flavour=flavour_of(vcfg),
            hidden_size=vcfg.hidden_size, intermediate_size=vcfg.intermediate_size,
            num_attention_heads=vcfg.num_attention_heads,
            num_key_value_heads=getattr(vcfg, "num_key_value_heads", None) or vcfg.num_attention_heads,
            head_dim=getattr(vcfg, "head_dim", None) or vcfg.hidden_size // vcfg.num_attention_heads,
            rms_norm_eps=vcfg.rms_norm_eps, rope_parameters=dict(rope),
            max_position_embeddings=vcfg.max_position_embeddings, vocab_size=vcfg.vocab_size,
            aux_layer_ids=default_aux_layers(vcfg.num_hidden_layers),
            verifier=getattr(vcfg, "_name_or_path", "") or "",
            verifier_architectures=list(getattr(vcfg, "architectures", None) or []),
        )
        kw.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**kw)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def hf_layer_config(self):
        """The draft layer's Hugging Face config (vLLM's `transformer_layer_config`)."""
        from transformers import LlamaConfig, Qwen3Config

        cls = Qwen3Config if self.flavour == "qwen3" else LlamaConfig
        return cls(hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
                   num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
                   head_dim=self.head_dim, num_hidden_layers=self.num_layers, rms_norm_eps=self.rms_norm_eps,
                   rope_parameters=dict(self.rope_parameters), max_position_embeddings=self.max_position_embeddings,
                   vocab_size=self.vocab_size, hidden_act="silu", attention_bias=False,
                   tie_word_embeddings=False)


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 (as Llama / Qwen3 do)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Rotary(nn.Module):
    """Rotary position embedding, frequencies from Hugging Face's rope init (handles llama3 / yarn scaling)."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        hf = cfg.hf_layer_config()
        rope_type = cfg.rope_parameters.get("rope_type", "default")
        if rope_type == "default":
            base = float(cfg.rope_parameters.get("rope_theta", 10000.0))
            inv = 1.0 / (base ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim))
            scaling = 1.0
        else:
            with torch.device("cpu"):  # real numbers even when the drafter is built on the meta device (export)
                inv, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf, "cpu")
        self.register_buffer("inv_freq", inv.float(), persistent=False)
        self.scaling = float(scaling)

    def forward(self, positions: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # positions [N] -> cos, sin [N, head_dim]
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scaling).to(dtype), (emb.sin() * self.scaling).to(dtype)


class Attention(nn.Module):
    def __init__(self, cfg: DraftConfig, input_size: int):
        super().__init__()
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(input_size, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(input_size, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(input_size, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, cfg.hidden_size, bias=False)
        if cfg.flavour == "qwen3":
            self.q_norm = RMSNorm(self.hd, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def _qkv(self, x, cos, sin):
        """x [N, in], cos/sin [N, hd] -> q [N, nh, hd], k / v [N, nkv, hd], q and k rotated."""
        n = x.shape[0]
        # projections through verifier.linear: drafting (a few rows, no gradient) gets its small-M rule
        q, k, v = linears([self.q_proj, self.k_proj, self.v_proj], x)  # one kernel call where it applies
        q, k, v = q.view(n, self.nh, self.hd), k.view(n, self.nkv, self.hd), v.view(n, self.nkv, self.hd)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        c, s = cos[:, None, :], sin[:, None, :]
        return q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s, v

    def forward(self, x, cos, sin, elems: Elements, cache_kv, cache_elems: Elements | None, backend: str,
                recompute: bool = False):
        # x [N, in]; cos/sin [N, hd]; cache_kv: (k, v) [1, KVH, M, hd] of earlier elements or None; recompute: see
        # attention()
        n = x.shape[0]
        q, k, v = self._qkv(x, cos, sin)
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, heads, N, hd]
        if cache_kv is not None:
            k_all, v_all = torch.cat([cache_kv[0], k], dim=2), torch.cat([cache_kv[1], v], dim=2)
            k_elems = Elements.cat([cache_elems, elems])
        else:
            k_all, v_all, k_elems = k, v, elems
        out = attention(q, k_all, v_all, elems, k_elems, backend=backend, scale=1.0 / math.sqrt(self.hd),
                        recompute=recompute)
        out = out.squeeze(0).transpose(0, 1).reshape(n, self.nh * self.hd)  # [N, H*hd]
        return linear(self.o_proj, out), (k, v)

    def step(self, x, cos, sin, kc, vc, rows, idx):
        """Inference on a RowCache: x [R*n, in], cos/sin [R*n, hd], this layer's kc / vc [B, KVH, S, hd] (this
        pass's keys and values are written at idx), rows [R], idx [R, n] (each element's place in its row)
        -> [R*n, H]."""
        R, n = idx.shape
        q, k, v = self._qkv(x, cos, sin)
        at = rows[:, None].expand(R, n)
        kc[at, :, idx] = k.view(R, n, self.nkv, self.hd)  # [R, n, KVH, hd] into [B, KVH, S, hd]
        vc[at, :, idx] = v.view(R, n, self.nkv, self.hd)
        out = row_attention(q.view(R, n, self.nh, self.hd), kc, vc, rows, idx, 1.0 / math.sqrt(self.hd))
        return linear(self.o_proj, out.reshape(R * n, self.nh * self.hd))


class MLP(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        gate, up = linears([self.gate_proj, self.up_proj], x)
        return linear(self.down_proj, F.silu(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm decoder layer; the first one takes (embedding, hidden) and attends over 2H inputs."""

    def __init__(self, cfg: DraftConfig, first: bool):
        super().__init__()
        self.first = first
        self.norm_before_residual = cfg.norm_before_residual
        H = cfg.hidden_size
        self.input_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        if first:
            self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, 2 * H if first else H)
        self.post_attention_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, h, emb, cos, sin, elems, cache_kv, cache_elems, backend, recompute=False):
        return self._around(h, emb, lambda x: self.self_attn(x, cos, sin, elems, cache_kv, cache_elems, backend,
                                                             recompute))

    def step(self, h, emb, cos, sin, kc, vc, rows, idx):
        """Inference on a RowCache (Attention.step): h, emb [R*n, H] -> [R*n, H]."""
        return self._around(h, emb, lambda x: (self.self_attn.step(x, cos, sin, kc, vc, rows, idx), None))[0]

    def _around(self, h, emb, attend):
        """The layer around its attention: attend(x [N, in]) -> (out [N, H], kv) -> (h [N, H], kv)."""
        if self.first:
            hn = self.hidden_norm(h)
            residual = hn if self.norm_before_residual else h
            x = torch.cat([self.input_layernorm(emb), hn], dim=-1)  # [N, 2H]
        else:
            residual = h
            x = self.input_layernorm(h)
        a, kv = attend(x)
        h = residual + a
        h = h + self.mlp(self.post_attention_layernorm(h))
        return h, kv


class DraftCache:
    """Keys/values of the elements a drafter has processed, per layer, with their (anchor, depth, doc)."""

    def __init__(self):
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.elems: Elements | None = None
        # the prefix of a partition of a long sample (train/partition.py): with a graph, attention rebuilds its
        # masks in backward rather than keeping masks that grow with the prefix (attention's `recompute`)
        self.recompute_masks = False

    def __len__(self) -> int:
        return 0 if self.elems is None else len(self.elems)

    def append(self, new_kv: list, elems: Elements) -> None:
        if self.kv is None:
            self.kv, self.elems = list(new_kv), elems
        else:
            self.kv = [(torch.cat([k0, k1], 2), torch.cat([v0, v1], 2)) for (k0, v0), (k1, v1) in zip(self.kv, new_kv)]
            self.elems = Elements.cat([self.elems, elems])

    def truncate(self, n: int) -> None:
        """Keep the first n elements (drop rejected / speculative ones)."""
        if self.kv is None or n >= len(self):
            return
        self.kv = [(k[:, :, :n], v[:, :, :n]) for k, v in self.kv]
        self.elems = self.elems.slice(0, n)

    def keep_docs(self, docs: list[int]) -> None:
        """Keep only the elements of these documents (finished rows of a batch leave the drafter's attention)."""
        if self.kv is None:
            return
        idx = torch.isin(self.elems.doc, torch.tensor(docs, device=self.elems.doc.device)).nonzero().flatten()  # [n]
        if len(idx) == len(self):
            return
        self.kv = [(k.index_select(2, idx.to(k.device)), v.index_select(2, idx.to(v.device))) for k, v in self.kv]
        self.elems = self.elems.select(idx)


class RowCache:
    """A drafter's keys and values at inference, by row: per layer (k, v) [B, KVH, S, hd]. Element (anchor a,
    depth d) of row r sits at place a + d - origin[r] of row r, where origin[r] is the position of the row's first
    context slot (attention.py: the rule is then causal attention by place within a row). Each call's context
    slots must continue the row's earlier ones (consecutive positions, as the engine feeds them); its drafts and
    any padding are written after them and are stale, never read, once the next context overwrites them."""

    def __init__(self, cfg: "DraftConfig", batch: int, places: int, device, dtype):
        shape = (batch, cfg.num_key_value_heads, places, cfg.head_dim)  # [B, KVH, S, hd]
        self.kv = [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
                   for _ in range(cfg.num_layers)]
        self.origin = torch.full((batch,), -1, dtype=torch.long, device=device)  # -1: the row has no context yet

    def keep_docs(self, docs: list[int]) -> None:
        """Rows never attend to each other's places: a finished row needs no removal (DraftCache's interface)."""


class DraftModel(nn.Module):
    """fc + decoder layers + norm + lm_head over the draft vocab, on flat element lists.

    It is also the drafter protocol: an algorithm is a subclass, registered by name (registry.py), that says how
    it trains (`train_args`, `forward`), drafts (`propose`), and what its checkpoints and vLLM need beyond the
    shared keys. The trainer, the engine, the checkpoint code and the exporter call only these hooks.
    """

    algorithm: str = ""  # registry name; config.json `speculators_model_type`
    architecture: str = ""  # config.json `architectures` entry vLLM dispatches on
    default_norm_before_residual: bool = False  # what a speculators config.json without the key means
    default_loss_decay: float = 1.0  # --loss-decay when not given: depth / step d weighted decay^d
    # what --loss-decay meant in a run whose saved config leaves it unset (None): runs saved before the default was
    # written into the config; they continue, and are recognised as finished, as they were trained
    unset_loss_decay: float = 1.0
    has_mask_hidden: bool = False  # --mask-hidden-init applies
    # TrainConfig flags whose default is the algorithm's: {field: its value when the flag is not given}. These are
    # also what every algorithm trained with before they were (resume reads them for checkpoints saved then)
    train_defaults: dict = {"optimizer": "adamw", "weight_decay": 0.0, "adam_beta2": 0.95, "lr_schedule": "cosine",
                            "warmup_steps": 20, "draft_layer": "auto"}

    # ---- training
    @classmethod
    def resolve_train_config(cls, cfg) -> None:
        """Fill this algorithm's defaults into a TrainConfig (K, --loss-decay, `train_defaults`) and refuse what it
        cannot train."""
        if cfg.num_speculative_tokens is None:
            cfg.num_speculative_tokens = 7
        if cfg.loss_decay is None:
            cfg.loss_decay = cls.default_loss_decay
        for k, v in cls.train_defaults.items():
            if getattr(cfg, k) is None:
                setattr(cfg, k, v)
        if cfg.optimizer != "muon" and (cfg.muon_lr is not None or
                                        cfg.muon_weight_decay != field_defaults(type(cfg))["muon_weight_decay"]):
            raise ConfigError(f"--muon-lr and --muon-weight-decay apply to --optimizer muon only (this run: "
                              f"--optimizer {cfg.optimizer})")
        if cfg.mask_hidden_init != "normal" and not cls.has_mask_hidden:
            raise ConfigError(f"--mask-hidden-init {cfg.mask_hidden_init} applies to P-EAGLE only (--algorithm "
                              f"peagle; this run: {cfg.algorithm})")

    @classmethod
    def train_args(cls, cfg) -> dict:
        """Keyword arguments of `forward(batch, generator, **args)` from a TrainConfig."""
        raise NotImplementedError

    @classmethod
    def scored_depths(cls, cfg) -> int:
        """How many depths (draft positions) training and validation report accuracy for."""
        raise NotImplementedError

    @classmethod
    def validation_args(cls, args: dict) -> dict:
        """`train_args` for held-out validation (every depth at every position)."""
        return dict(args)

    @classmethod
    def config_overrides(cls, cfg, tokenizer, vocab_size: int, token_freqs) -> dict:
        """DraftConfig fields this algorithm sets when a drafter is trained (e.g. P-EAGLE's mask token)."""
        return {}

    # ---- checkpoints and vLLM
    def config_keys(self) -> dict:
        """Top-level config.json keys beside the shared ones."""
        return {}

    @classmethod
    def speculative_config_keys(cls) -> dict:
        """Keys of vLLM's --speculative-config beside method, model and num_speculative_tokens."""
        return {}

    def checkpoint_state_dict(self, sd: dict) -> dict:
        """The state dict under the names vLLM reads (a hook for parameters stored elsewhere there)."""
        return sd

    @classmethod
    def state_dict_from_checkpoint(cls, sd: dict, cfg: DraftConfig) -> dict:
        """The inverse of `checkpoint_state_dict` (raise ValueError for a checkpoint that lacks what it needs)."""
        return sd

    def forward(self, b, generator: torch.Generator | None = None, context_bounds=None, **kw):
        """What the trainer calls (DDP and FSDP hook `forward`): `training_loss` of a packed sequence, or, with
        `context_bounds`, `context_cache` (the first phase of sequence partitioning, train/partition.py)."""
        if context_bounds is not None:
            return self.context_cache(b, context_bounds)
        return self.training_loss(b, generator, **kw)

    def training_loss(self, b, generator: torch.Generator | None = None, anchors=None, prefix=None, counts=None,
                      context_kv: bool = False, **args):
        """(loss, stats) of one packed SlotBatch, with `train_args` as keywords.

        For one partition of a longer sequence (train/partition.py): `anchors` = (anchor [N], depth [N]) are its
        elements (from `train_elements` of the whole sequence, in the partition's coordinates, context first);
        `prefix` is a DraftCache of the context before the partition; `counts` are the sequence's trained elements
        per depth (the loss's denominators); `context_kv` puts the keys/values of the partition's own context
        elements, per layer ([1, KVH, n0, hd] each), in stats["context_kv"]."""
        raise NotImplementedError

    def train_elements(self, b, generator: torch.Generator | None = None, **args):
        """(anchor [N], depth [N]) int64: the elements `training_loss` trains on `b` (context first, by anchor),
        drawn with `generator` as `training_loss` draws them."""
        raise NotImplementedError

    @torch.no_grad()
    def context_cache(self, b, bounds: list[tuple[int, int]]) -> "DraftCache":
        """Keys/values of every context (depth-0) element of `b`, computed partition by partition ([s, e) in
        `bounds`, in order) on top of the cache of the partitions before: per layer [1, KVH, len(b), hd]."""
        cache = DraftCache()
        for s, e in bounds:
            anchor = torch.arange(s, e, device=b.tokens.device)  # [n]
            elems = Elements(anchor, torch.zeros_like(anchor), b.doc[s:e])
            _, kv = self.run_layers(self.embed(b.tokens[s:e]), self.project(b.hidden[s:e]), b.positions[s:e],
                                    elems, cache)
            cache.append(kv, elems)
        return cache

    # ---- inference
    def max_draft_tokens(self) -> int | None:
        """The most draft tokens per pass this drafter was trained for (None: no limit recorded)."""
        return None

    def propose(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, counts: list[int],
                doc: torch.Tensor, k: int, cache: DraftCache, choose):
        """k draft tokens for each of R rows.

        tokens [n], hidden [n, 3Hv], positions [n]: the new context slots of all rows, concatenated, counts[r] of
        them row r's; doc [R] row ids (documents in the shared cache). `choose(draft_logits [..., Vd])` returns
        (tokens [...] target ids, q [..., V] or None at T=0), the engine's sampling rule. -> (draft [R, k],
        q [R, k, V] or None).
        """
        raise NotImplementedError

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.cfg = cfg
        H = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, H)
        self.embed_tokens.weight.requires_grad_(False)  # the verifier's, frozen
        self.fc = nn.Linear(3 * cfg.verifier_hidden, H, bias=False)
        self.layers = nn.ModuleList([DecoderLayer(cfg, first=(i == 0)) for i in range(cfg.num_layers)])
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(H, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        full = cfg.draft_vocab_size == cfg.vocab_size  # no draft vocabulary: every target token is draftable
        self.register_buffer("t2d", (torch.ones if full else torch.zeros)(cfg.vocab_size, dtype=torch.bool))
        self.rotary = Rotary(cfg)
        self.backend = "sdpa"

    def init_from_verifier(self, verifier, d2t: torch.Tensor, t2d: torch.Tensor, norm: bool = False) -> None:
        """Copy the verifier's embeddings and the draft-vocab rows of its lm_head; set d2t / t2d.

        norm=True also copies the verifier's final RMSNorm weight, the scale its lm_head was trained behind (for
        SmolLM2 it averages 1.8 and ranges -2.1..3.3); the default keeps the fresh norm's ones, which measured
        the same on the embedded verifier (`paradraft train --init-norm`).
        """
        with torch.no_grad():
            if norm:
                final_norm = getattr(getattr(verifier, "model", verifier), "norm", None)
                if final_norm is None or final_norm.weight.shape != self.norm.weight.shape:
                    raise ValueError("the verifier has no final norm of the drafter's size to copy (use norm=False)")
                self.norm.weight.copy_(final_norm.weight.to(self.norm.weight.dtype))
            emb = verifier.get_input_embeddings().weight
            self.embed_tokens.weight.copy_(emb.to(self.embed_tokens.weight.dtype))
            ids = draft_to_target_ids(d2t.long())
            self.lm_head.weight.copy_(verifier.lm_head.weight[ids].to(self.lm_head.weight.dtype))
            self.d2t.copy_(d2t.long())
            self.t2d.copy_(t2d.bool())

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token embeddings [N, H] (P-EAGLE overrides to use its trainable mask row)."""
        return self.embed_tokens(tokens)

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        """3H verifier states go through fc; H-sized drafter states (EAGLE-3 feedback) pass as they are."""
        return linear(self.fc, hidden) if hidden.shape[-1] == 3 * self.cfg.verifier_hidden else hidden  # [N, H]

    def run_layers(self, emb: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, elems: Elements,
                   cache: DraftCache | None = None) -> tuple[torch.Tensor, list]:
        """emb [N, H], hidden [N, H] (already projected), positions [N] -> prenorm hidden [N, H], new kv per layer."""
        cos, sin = self.rotary(positions, emb.dtype)
        h, new_kv = hidden, []
        for i, layer in enumerate(self.layers):
            ckv = cache.kv[i] if cache is not None and cache.kv is not None else None
            h, kv = layer(h, emb, cos, sin, elems, ckv, cache.elems if ckv is not None else None, self.backend,
                          cache is not None and cache.recompute_masks and torch.is_grad_enabled())
            new_kv.append(kv)
        return h, new_kv

    def row_cache(self, batch: int, max_len: int, k: int, device=None) -> "RowCache | DraftCache":
        """The cache the engine drafts with for `batch` rows of up to `max_len` positions, k drafts a pass: a
        RowCache where the algorithm drafts on one (`run_rows`), else a DraftCache."""
        return DraftCache()

    def run_rows(self, emb: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, idx: torch.Tensor,
                 rows: torch.Tensor, kv: list) -> torch.Tensor:
        """The layers on a RowCache's kv: emb, hidden [R, n, H] (projected), positions [R, n] (rotary), idx [R, n]
        (places in the rows) -> prenorm hidden [R, n, H]."""
        R, n, H = emb.shape
        cos, sin = self.rotary(positions.reshape(-1), emb.dtype)  # [R*n, hd]
        h, e = hidden.reshape(R * n, H), emb.reshape(R * n, H)
        for layer, (kc, vc) in zip(self.layers, kv):
            h = layer.step(h, e, cos, sin, kc, vc, rows, idx)
        return h.view(R, n, H)

    def logits(self, prenorm: torch.Tensor) -> torch.Tensor:
        """Draft-vocab logits [N, Vd] from prenorm hidden states [N, H]."""
        return linear(self.lm_head, self.norm(prenorm))
