"""The verifier's incremental forward for the engine: a ragged, per-row KV cache with rollback, plus aux states.

`VerifierRunner` (the fast path, for the families registered in families/) reuses the Hugging Face modules' weights
and sub-modules (norms, projections, MLP or experts, rotary embedding) and does the attention itself over a
preallocated cache [B, KVH, S_max, D] per layer, where every row has its own length. It covers q/k norms (Qwen3),
projection biases, attention sinks and sliding windows (GPT-OSS), and MLPs that also return router scores (MoE).
Rolling back a row's rejected tokens is setting its length back: the stale entries are masked, then overwritten;
the accepted prefix is never recomputed.

`GenericRunner` serves any other tappable decoder-only model through Hugging Face's own forward, one cache per
row (rollback = crop), with the aux states from `output_hidden_states`: slower, the same tokens.

Both: forward(tokens [B', n], rows, last_only, counts) -> (logits [B', n or 1, V] float32, aux [B', n, len(aux) * H]);
set_lengths. `last_only` computes the logits of the last position only (a prefill needs no others: the lm_head over
every prompt position is ~20% of a SmolLM2 prefill); that row of the full logits, up to float rounding. `counts`
[B'] (a batched prefill of ragged prompts): row j's tokens are its first counts[j], the rest right padding; its
length advances by counts[j], so what the padding wrote lies past it, stale by the cache's rule, and `last_only`
takes position counts[j] - 1.
"""

from __future__ import annotations

import time
import weakref

import torch
import torch.nn.functional as F

from .. import kernels
from ..utils import compile_step, graphs_compiled
from .adapters import adapter_for
from .linear import GATED_MLPS, TILE_ROWS, linear, linears, mlp


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


# a model -> (its weights' storage and versions, its packed projections): one packed copy per verifier, whatever the
# number of its runners
_PACKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def make_runner(model, aux_layer_ids: list[int] | None = None, max_batch: int = 1, max_len: int = 4096):
    """The runner for a verifier: the fast one for the families it implements, else the generic one."""
    cls = VerifierRunner if adapter_for(model).fast else GenericRunner
    return cls(model, aux_layer_ids, max_batch, max_len)


class VerifierRunner:
    """Batched incremental forward of a HF causal LM with per-row lengths (the families registered in families/)."""

    def __init__(self, model, aux_layer_ids: list[int] | None = None, max_batch: int = 1, max_len: int = 4096):
        self.adapter = adapter_for(model)
        self.model = model
        self.inner = model.model
        cfg = model.config
        self.L = cfg.num_hidden_layers
        self.nkv = cfg.num_key_value_heads
        self.nh = cfg.num_attention_heads
        self.hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.aux = list(aux_layer_ids or [])
        self.dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device
        if self.device.type == "cpu":
            kernels.available()  # the CPU kernel is built (once per host) with the engine, not in its first step, and
            # before any compiled step traces a call to it
            kernels.move_to_huge_pages(model)  # every step streams the weights: from 2 MiB pages (on_huge_pages)
        # the projections' tile-packed copy, made by the first decoding or verification step of TILE_ROWS rows (a
        # compiled step serves all B rows; _pack_tiles): a runner that only ever decodes one row (plain `generate`
        # of one prompt) holds no copy it would not read
        self.tiles, self.head_tiles = [None] * self.L, None
        self._tiles_pending = (self.dtype == torch.bfloat16 and self.device.type == "cpu"
                               and kernels.tiles_available())
        # decoding and verification steps attend through paradraft's kernel on a CPU where it is built (_attend)
        self.attention_kernel = kernels.attends(self.device, self.dtype, self.hd)
        self.max_len = max_len
        self._compiled = None  # (layers, head) compiled by compile()
        # layers per compiled group: ~10 (equal groups); one group's code serves every group
        self.group = -(-self.L // -(-self.L // 10))
        self.compile_s = 0.0  # seconds the steps that compiled took (utils.graphs_compiled)
        self.alloc(max_batch)

    def compile(self) -> None:
        """Compile the decoding and verification steps (up to 16 tokens per row; a prefill stays eager) with
        torch.compile (inductor): a group of ~10 consecutive layers, whose code every group reuses (the layers'
        weights are its inputs), and the logits. Per-operation overhead was ~40% of a bf16 decoding step of the
        embedded verifier on 2 cores; one graph of all 30 layers ran ~0.5 ms faster per step but took ~2x as long
        to compile (BENCHMARKS.md, "The engine at the machine's limit"). Rows and keys in use are dynamic, so a run
        compiles once per kind of step (decoding, verifying K+1, one row or several, a batch within the kernel's
        rows or past them); the first such step pays it (~25 s on 2 cores, ~4 s where inductor's on-disk cache
        already holds it), added to `compile_s` (every step that compiled a graph: utils.graphs_compiled)."""
        # (utils.compile_step: this runner's own code, its model's modules unguarded). One-token steps (decoding)
        # and multi-token steps (verification) each have their own, so that neither checks the other's guards first
        self._compiled = {one: (compile_step(self._layers, self.device), compile_step(self._head, self.device),
                                compile_step(self._inputs, self.device)) for one in (True, False)}
        self._mark_batch_dynamic()

    def _mark_batch_dynamic(self) -> None:
        """The caches' rows vary from one generate call to the next (a batch of 2, then of 32): dynamic from the
        first compilation, not recompiled when a second size comes."""
        if self._compiled is not None:
            for t in self.k + self.v:
                torch._dynamo.maybe_mark_dynamic(t, 0)

    def _pack_tiles(self):
        """The projections' weights packed in the AMX tile layout (kernels.pack_tiles), for steps of 2..128 bf16
        rows (verification, batches; verifier/linear.py), on AMX hosts in bf16 (_tiles_pending): per layer (q|k|v,
        o, gate|up, down) or None, and the lm_head's; None where a family's modules are not the plain projections
        the rule takes. A copy of those weights (+269 MB for the embedded verifier in bf16), made once
        per model and shared by its runners (bench's engines) while its weights stay the same tensors and versions:
        the verifier's weights must not change under a runner."""
        # the weights as they are now (inference tensors, as a model loaded in inference mode has, keep no version)
        mark = [(p.data_ptr(), 0 if p.is_inference() else p._version) for p in self.model.parameters()]
        kept = _PACKED.get(self.model)
        if kept is None or kept[0] != mark:
            kept = _PACKED[self.model] = (mark, self._pack_all())
        return kept[1]

    def _pack_all(self):
        """_pack_tiles' work: every projection of the model packed."""

        def pack(modules):
            # the modules' weights as ONE packed weight (q|k|v, gate|up: the outputs side by side, as `linears` reads
            # them): 4 tensors a layer for a compiled step's guards to check instead of 7 (its time alone was not
            # measurably different; what cut the guards' time was utils.compile_step)
            if any(type(m) is not torch.nn.Linear for m in modules):
                return None
            w = modules[0].weight if len(modules) == 1 else torch.cat([m.weight for m in modules])
            tiles = kernels.pack_tiles(w)
            return None if tiles is None else [tiles]

        def settle(packed):
            # a layer's packed weights (or the lm_head's) side by side on 2 MiB pages (kernels.on_huge_pages), in the
            # order a step reads them; layer by layer, so that the copies made on the way are one layer's
            live = [t for t in packed if t is not None]
            for t, moved in zip(live, kernels.on_huge_pages([t[0] for t in live])):
                t[0] = moved

        layers = []
        for layer in self.inner.layers:
            attn, m = layer.self_attn, layer.mlp
            qkv, o = pack([attn.q_proj, attn.k_proj, attn.v_proj]), pack([attn.o_proj])
            ffn = None
            if type(m).__name__ in GATED_MLPS:
                ffn = (pack([m.gate_proj, m.up_proj]), pack([m.down_proj]))
            settle([qkv, o, *(ffn or ())])
            layers.append((qkv, o, ffn))
        head = getattr(self.model, "lm_head", None)
        head = pack([head]) if isinstance(head, torch.nn.Linear) else None
        settle([head])
        return layers, head

    ZERO_CHUNK = 256  # places zeroed at a time as the keys in use grow (`_zero_to`)

    def alloc(self, batch: int) -> None:
        """(Re)allocate the caches for `batch` rows, [B, KVH, max_len, D] (one shape for every compiled step), their
        places zeroed only as the keys in use reach them (`_zero_to`)."""
        shape = (batch, self.nkv, self.max_len, self.hd)  # [B, KVH, S_max, D]
        self.k = [torch.empty(shape, dtype=self.dtype, device=self.device) for _ in range(self.L)]
        self.v = [torch.empty(shape, dtype=self.dtype, device=self.device) for _ in range(self.L)]
        self._zeroed = 0  # places [0, _zeroed) of every row are written or zero
        self.lengths = torch.zeros(batch, dtype=torch.long, device=self.device)
        self._mark_batch_dynamic()

    def _zero_to(self, S: int) -> None:
        """Zero the caches' places up to at least S (the keys a step reads), ZERO_CHUNK places at a time.

        Attention reads places [0, S) of each row, S the longest row's position + 1: a shorter row's places past its
        length are masked, but must be finite (a weight of 0 times a NaN value is NaN), so they must not be whatever
        torch.empty left there. Zeroing all of max_len at alloc instead wrote (and kept resident) 6 GB for a batch
        of 32 in float32 at the default 4,096 places, ~3 s of such a `generate` call on the 2-core AVX2 host, for
        places never read."""
        if S <= self._zeroed:
            return
        end = min(self.max_len, max(S, self._zeroed + self.ZERO_CHUNK))
        for t in self.k + self.v:
            t[:, :, self._zeroed:end].zero_()
        self._zeroed = end

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, rows: torch.Tensor | None = None, last_only: bool = False,
                counts: torch.Tensor | None = None):
        """Feed tokens [B', n] to rows (default all; distinct and ascending: B' = B rows are taken as all rows in
        order) at their current lengths; lengths advance by n (by counts [B'] where given: right-padded rows, see the
        module's docstring).

        -> (logits [B', n, V] float32, or [B', 1, V] with last_only, aux hidden [B', n, len(aux) * H]).
        """
        Bq, n = tokens.shape
        B = self.k[0].shape[0]
        # (a prefill never packs: it is eager, and a runner whose compiled steps ran without the copy would recompile)
        if self._tiles_pending and not last_only and TILE_ROWS[0] <= max(Bq, B) * n <= TILE_ROWS[1]:
            self.tiles, self.head_tiles = self._pack_tiles()
            self._tiles_pending = False
        if (self._compiled is not None and n <= 16 and not last_only and counts is None and rows is not None and Bq < B
                and int(self.lengths.max()) + n <= self.max_len):  # (every row has room for n more)
            # a compiled step serves every row of the cache: the other rows are fed a token at their own length (an
            # entry past a row's length is stale by the cache's rule) and keep their lengths, their outputs dropped.
            # Gathering a subset's cache copied it whole in every layer and step (regenerate at batch 32 spent more
            # there than in its projections), and every subset size was another compiled graph.
            everyone = torch.zeros(B, n, dtype=tokens.dtype, device=tokens.device)
            everyone[rows] = tokens
            before = self.lengths.clone()
            logits, aux = self.forward(everyone, None, last_only)
            after = before.clone()
            after[rows] = self.lengths[rows]
            self.lengths.copy_(after)
            return logits[rows], aux[rows]
        if rows is None:
            rows = torch.arange(Bq, device=self.device)
        all_rows = Bq == B  # rows are then 0..B-1 in order
        start = self.lengths[rows]  # [B']
        S = int(start.max()) + n  # keys in use
        if S > self.max_len:
            raise RuntimeError(f"sequence longer than the engine's max_len {self.max_len}")
        self._zero_to(S)
        compiled = self._compiled[n == 1] if self._compiled and n <= 16 and not last_only else None  # (a prefill
        # stays eager)
        graphs = graphs_compiled() if compiled else 0
        t0 = time.perf_counter()
        if compiled:
            for t in (tokens, start, rows):  # rows and keys in use vary; tokens per row do not
                torch._dynamo.maybe_mark_dynamic(t, 0)
        h, cos, sin, pos = (compiled[2] if compiled else self._inputs)(tokens, start)
        key_pos = causal = None
        if not (self.attention_kernel and n <= kernels.ATTENTION_QUERIES):  # the attention reads a mask (_layer)
            # mask [B', 1, n, S]: key j visible to query i when j <= pos[i] (its own cache row, causal)
            key_pos = torch.arange(S, device=self.device)[None, None, :]
            causal = (key_pos <= pos[:, :, None])[:, None]
        ridx = rows[:, None].expand(Bq, n)
        if compiled:
            for t in (h, cos, sin, pos, ridx) + (() if causal is None else (causal,)):
                torch._dynamo.maybe_mark_dynamic(t, 0)
            if causal is not None:
                torch._dynamo.maybe_mark_dynamic(causal, 3)
                torch._dynamo.maybe_mark_dynamic(key_pos, 2)
        last = None
        if last_only:  # [B']: each row's last real position
            last = torch.full((Bq,), n - 1, device=self.device) if counts is None else counts.to(self.device) - 1
        logits, aux = self._body(h, cos, sin, pos, rows, ridx, key_pos, causal, self.k, self.v, last, all_rows,
                                 *(compiled[:2] if compiled else ()))
        if compiled and graphs_compiled() > graphs:  # this step compiled (or recompiled) a graph
            self.compile_s += time.perf_counter() - t0
        advance = n if counts is None else counts.to(self.device)
        if all_rows:
            self.lengths += advance
        else:
            self.lengths[rows] = start + advance
        return logits, aux

    def _inputs(self, tokens, start):
        """A step's inputs: tokens [B', n] at positions start [B'] + 0..n-1 -> (embeddings [B', n, H], cos and sin
        [B', n, 1, D] of the rotation, positions [B', n]). Compiled with the steps (compile): ~10 small operations
        that ran eagerly, each on caches the step's weights had just streamed through."""
        pos = start[:, None] + torch.arange(tokens.shape[1], device=start.device)[None]  # [B', n]
        h = self.inner.embed_tokens(tokens)  # [B', n, H]
        cos, sin = self.inner.rotary_emb(h, pos)  # [B', n, D] (or [B', n, D/2]: GPT-OSS rotates halves)
        if cos.shape[-1] * 2 == self.hd:
            cos, sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)  # the same rotation, rotate_half form
        return h, cos[:, :, None, :], sin[:, :, None, :], pos

    def _body(self, h, cos, sin, pos, rows, ridx, key_pos, causal, ks, vs, last: torch.Tensor | None,
              all_rows: bool, layer=None, head=None):
        """The layers and the logits. h [B', n, H], cos/sin [B', n, 1, D], pos/ridx [B', n], rows [B'],
        key_pos [1, 1, S] and causal [B', 1, n, S] (None where the attention needs no mask), the caches ks/vs
        [B, KVH, S_max, D] written in place, last [B'] (each row's position whose logits alone are wanted) or None
        (every position's) -> (logits [B', n or 1, V] float32, aux [B', n, len(aux) * H]).
        `layer`/`head`: compiled `_layers`/`_head`."""
        layer, head = layer or self._layers, head or self._head
        auxes = []
        g = self.group
        for i0 in range(0, self.L, g):
            hs = layer(self.inner.layers[i0:i0 + g], h, cos, sin, pos, rows, ridx, key_pos, causal, ks[i0:i0 + g],
                       vs[i0:i0 + g], all_rows, self.tiles[i0:i0 + g])
            auxes += [(i0 + j, x) for j, x in enumerate(hs[:-1]) if i0 + j in self.aux]
            h = hs[-1]
        wanted = h if last is None else h[torch.arange(h.shape[0], device=h.device), last][:, None]  # [B', 1, H]
        logits = head(wanted, self.head_tiles)
        aux = torch.cat([dict(auxes)[i] for i in self.aux], dim=-1) if self.aux else h.new_zeros(*h.shape[:2], 0)
        return logits, aux

    def _head(self, h, tiles=None):
        """Final norm and logits: h [B', m, H] -> [B', m, V] float32 (tiles: the lm_head's packed weight)."""
        return self.adapter.logits(self.model, self.adapter.final_norm(self.model)(h), tiles=tiles).float()

    def _layers(self, blocks, h, cos, sin, pos, rows, ridx, key_pos, causal, kcs, vcs, all_rows: bool, tiles):
        """Consecutive decoder layers -> the input of each, then the last output ([B', n, H] each)."""
        hs = [h]
        for block, kc, vc, t in zip(blocks, kcs, vcs, tiles):
            hs.append(self._layer(block, hs[-1], cos, sin, pos, rows, ridx, key_pos, causal, kc, vc, all_rows, t))
        return hs

    def _layer(self, layer, h, cos, sin, pos, rows, ridx, key_pos, causal, kc, vc, all_rows: bool, tiles=None):
        """One decoder layer: h [B', n, H] -> [B', n, H]; writes its keys/values into kc/vc [B, KVH, S_max, D].
        tiles: its projections' packed weights (q|k|v, o, (gate|up, down)) from _pack_tiles, or None."""
        Bq, n = h.shape[:2]
        t_qkv, t_o, t_ffn = tiles or (None, None, None)
        x = layer.input_layernorm(h)
        attn = layer.self_attn
        q, k, v = linears([attn.q_proj, attn.k_proj, attn.v_proj], x, t_qkv)  # one kernel call where it applies
        q = q.view(Bq, n, self.nh, self.hd)
        k = k.view(Bq, n, self.nkv, self.hd)
        v = v.view(Bq, n, self.nkv, self.hd)
        if getattr(attn, "q_norm", None) is not None:
            q, k = attn.q_norm(q), attn.k_norm(k)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        kc[ridx, :, pos] = k  # [B', n, KVH, D] into [B, KVH, S_max, D]
        vc[ridx, :, pos] = v
        window, sinks = getattr(attn, "sliding_window", None), getattr(attn, "sinks", None)
        if self.attention_kernel and n <= kernels.ATTENTION_QUERIES:  # on the cache as it is (see _attend)
            o = kernels.decode_attention(q.contiguous(), kc, vc, rows, pos, attn.scaling, window or 0, sinks)
        else:
            S = causal.shape[-1]
            kk = kc[:, :, :S] if all_rows else kc[rows, :, :S]  # [B', KVH, S, D]
            vv = vc[:, :, :S] if all_rows else vc[rows, :, :S]
            mask = causal
            if window:  # a key is visible only within the window: kv > q - window
                mask = causal & (key_pos > pos[:, :, None] - window)[:, None]
            o = self._attend(q.transpose(1, 2), kk, vv, mask, attn.scaling, sinks).transpose(1, 2)
        h = h + linear(attn.o_proj, o.reshape(Bq, n, self.nh * self.hd), t_o)  # o [B', n, H, D]
        m = mlp(layer.mlp, layer.post_attention_layernorm(h), t_ffn)
        return h + (m[0] if isinstance(m, tuple) else m)  # MoE blocks may also return router scores

    def _attend(self, q, k, v, mask, scale, sinks=None):
        """q [B, H, n, D], k/v [B, KVH, S, D], mask [B, 1, n, S], sinks [H] or None -> [B, H, n, D].

        Few queries (decoding, verifying K+1 drafts): on a CPU with paradraft's kernel, `kernels.decode_attention`
        on the cache as it is (_layer calls it instead of this; ~0.8 against ~1.6 ms of inductor's loops per bf16
        step of the embedded verifier at ~300 keys, and ~1.5 against ~4.7 ms for a 4-token verification step);
        elsewhere grouped matmuls, 5x faster than CPU SDPA here, which was 80% of a batch-16 decode step in the
        profile. Many queries (prefill): SDPA. Attention sinks add one logit per head to the softmax's
        denominator (a key that is attended to but has no value).
        """
        B, H, n, D = q.shape
        if n > 16 and sinks is None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=H != self.nkv)
        G = H // self.nkv
        qg = q.reshape(B, self.nkv, G * n, D)  # head h = kv * G + g, rows ordered (g, i)
        # compiled: products and sums that inductor fuses into one loop (a batch-1 bf16 step 5 ms faster than two tiny
        # bmm per layer; at batch 32 and ~280 keys 77 ms against 82 ms)
        fused = self._compiled is not None
        if fused:
            s = (qg[:, :, :, None, :].float() * k[:, :, None, :, :].float()).sum(-1) * scale  # [B, KVH, G*n, S]
        else:
            s = (qg @ k.transpose(-1, -2)).float() * scale  # [B, KVH, G*n, S]
        m = mask.reshape(B, 1, 1, n, -1).expand(B, 1, G, n, mask.shape[-1]).reshape(B, 1, G * n, -1)
        s = s.masked_fill(~m, float("-inf"))
        if sinks is None:
            p = torch.softmax(s, dim=-1)
        else:
            sink = sinks.float().reshape(1, self.nkv, G, 1).expand(B, self.nkv, G, n).reshape(B, self.nkv, G * n, 1)
            p = torch.softmax(torch.cat([s, sink], -1), dim=-1)[..., :-1]  # [B, KVH, G*n, S]
        if fused:
            return (p[..., None] * v[:, :, None].float()).sum(-2).to(v.dtype).reshape(B, H, n, D)
        return (p.to(v.dtype) @ v).reshape(B, H, n, D)

    def set_lengths(self, rows: torch.Tensor, lengths: torch.Tensor) -> None:
        """Roll rows back (or forward) to these lengths; entries beyond are stale and masked."""
        self.lengths[rows] = lengths


class GenericRunner:
    """The same interface through Hugging Face's own forward: one DynamicCache per row, cropped on rollback."""

    def __init__(self, model, aux_layer_ids: list[int] | None = None, max_batch: int = 1, max_len: int = 4096):
        adapter_for(model)
        self.model = model
        self.aux = list(aux_layer_ids or [])
        self.device = next(model.parameters()).device
        self.max_len = max_len
        self.alloc(max_batch)

    def alloc(self, batch: int) -> None:
        from transformers import DynamicCache

        self.caches = [DynamicCache(config=self.model.config) for _ in range(batch)]
        for cache in self.caches:  # sliding-window layers keep what a rollback needs until the next crop
            for layer in getattr(cache, "layers", []):
                if hasattr(layer, "activate_past_recording"):
                    layer.activate_past_recording()
        self.lengths = torch.zeros(batch, dtype=torch.long, device=self.device)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, rows: torch.Tensor | None = None, last_only: bool = False,
                counts: torch.Tensor | None = None):
        Bq, n = tokens.shape
        rows = torch.arange(Bq, device=self.device) if rows is None else rows
        if int(self.lengths[rows].max()) + n > self.max_len:
            raise RuntimeError(f"sequence longer than the engine's max_len {self.max_len}")
        counts = [n] * Bq if counts is None else counts.tolist()
        logits, auxes = [], []
        for j, r in enumerate(rows.tolist()):  # row by row: the padding is never fed
            start, c = int(self.lengths[r]), counts[j]
            pos = torch.arange(start, start + c, device=self.device)[None]
            out = self.model(input_ids=tokens[j:j + 1, :c], past_key_values=self.caches[r], position_ids=pos,
                             use_cache=True, output_hidden_states=bool(self.aux),
                             **({"logits_to_keep": 1} if last_only else {}))
            logits.append(F.pad(out.logits.float(), (0, 0, 0, (1 if last_only else n) - out.logits.shape[1])))
            if self.aux:
                auxes.append(F.pad(torch.cat([out.hidden_states[i] for i in self.aux], -1), (0, 0, 0, n - c)))
            self.lengths[r] = start + c
        logits = torch.cat(logits)  # [B', n or 1, V]
        aux = torch.cat(auxes) if self.aux else logits.new_zeros(Bq, n, 0)
        return logits, aux

    def set_lengths(self, rows: torch.Tensor, lengths: torch.Tensor) -> None:
        """Roll rows back to these lengths (the cache drops everything past them)."""
        for r, n in zip(rows.tolist(), lengths.tolist()):
            removed = int(self.lengths[r]) - n
            if removed < 0:
                raise ValueError("the generic runner rolls rows back only")
            self.caches[r].crop(-removed)  # also trims sliding-window layers back to what the next step needs
            self.lengths[r] = n
