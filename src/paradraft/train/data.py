"""Training data: per-sample verifier tensors (offline shards or online) -> packed SlotBatches with targets."""

from __future__ import annotations

import os
from collections import OrderedDict

import numpy as np
import torch

from ..data.hidden_states import HiddenStates, OnlineHiddenStates
from ..models.loss import SlotBatch, pack_slots, slot_valid, slots_from_sample
from ..verifier import VerifierHead

try:  # offline CPU training keeps up to 2 GiB of targets (~65k trained tokens at an 8k draft vocab), 1/8 of the RAM
    TARGET_CACHE_BYTES = min(2 << 30, os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 8)
except (ValueError, OSError, AttributeError):  # no sysconf (Windows): the lm_head as before
    TARGET_CACHE_BYTES = 0


class OfflineSource:
    """Samples from extracted shards (a small LRU of decoded shards)."""

    def __init__(self, path, cache_shards: int = 2):
        self.hs = HiddenStates(path)
        self.where: dict[int, int] = {}
        for k, info in enumerate(self.hs.manifest["shards"]):
            for idx in info["sample_index"]:
                self.where[int(idx)] = k
        self.cache: OrderedDict[int, dict] = OrderedDict()
        self.cache_shards = cache_shards

    @property
    def layer_ids(self) -> list[int]:
        return self.hs.layer_ids

    def available(self, indices) -> np.ndarray:
        """The indices that this extraction holds."""
        return np.array([i for i in indices if int(i) in self.where], dtype=np.int64)

    def shard_of(self, idx: int) -> int:
        return self.where[int(idx)]

    def get(self, indices) -> list[dict]:
        out = []
        for i in indices:
            k = self.where[int(i)]
            if k not in self.cache:
                self.cache[k] = {s["sample_index"]: s for s in self.hs.load_shard(k)}
                while len(self.cache) > self.cache_shards:
                    self.cache.popitem(last=False)
            self.cache.move_to_end(k)
            out.append(self.cache[k][int(i)])
        return out


class OnlineSource:
    """Samples computed by the verifier in this process."""

    def __init__(self, verifier, dataset, layer_ids, device, pad_id: int = 0, batch_tokens: int = 8192):
        self.online = OnlineHiddenStates(verifier, dataset, layer_ids, batch_tokens, device, pad_id)
        self.layer_ids = self.online.layer_ids

    def available(self, indices):
        return np.asarray(indices, dtype=np.int64)

    def shard_of(self, idx: int) -> int:
        return 0

    def get(self, indices) -> list[dict]:
        return self.online.compute(list(indices))


class TargetHead:
    """The verifier's final norm + lm_head, to turn stored last hidden states into target distributions.

    With `cache_bytes` > 0 (offline training on a CPU) the targets of each sample are kept after their first
    computation, up to that many bytes (first come, never evicted: every epoch visits every sample), so the
    epochs after the first skip the lm_head. A cached target is the same computation on the same stored input,
    so training is bit-identical with or without the cache."""

    def __init__(self, verifier, draft_target_ids: torch.Tensor, device="cpu", cache_bytes: int = 0):
        self.head = VerifierHead(verifier, device)
        self.ids = draft_target_ids.to(device)
        self.device = device
        self.cache_bytes, self.cached_bytes = cache_bytes, 0
        self.cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # sample index -> (p [n, Vd], ids [n])

    def slot_batch(self, samples: list[dict]) -> SlotBatch:
        """Packed SlotBatch of samples (the EAGLE shift, verifier targets, document ids)."""
        parts = []
        for s in samples:
            last, mask = s["last"].to(self.device), s["loss_mask"].bool().to(self.device)  # [S, H], [S]
            tp, tid = self.targets(last, mask, s.get("sample_index"))
            parts.append(slots_from_sample(s["input_ids"].long().to(self.device), mask,
                                           s["aux"].to(self.device).float(), tp, tid))
        b = pack_slots(parts)
        return b

    def targets(self, last: torch.Tensor, loss_mask: torch.Tensor, key: int | None = None):
        """last [S, H], loss_mask [S] bool -> (target_p [S, Vd] float32, target_ids [S]) of one sample, computed
        only at the positions a slot trains on: verifier position p is slot p - 1 (`slot_valid`, the EAGLE shift).
        Every other row is zeros (never read: the loss, accuracy and validation all select valid slots), which
        saves the lm_head over prompts and padding."""
        S = last.shape[0]
        need = torch.zeros(S, dtype=torch.bool, device=last.device)  # [S]
        need[1:] = slot_valid(loss_mask)
        rows = need.nonzero().flatten()  # [n]
        tp = torch.zeros(S, len(self.ids), dtype=torch.float32, device=last.device)  # [S, Vd]
        tid = torch.zeros(S, dtype=torch.long, device=last.device)  # [S]
        hit = self.cache.get(key) if key is not None else None
        if hit is not None:
            tp[rows], tid[rows] = hit
            return tp, tid
        # written into place chunk by chunk (the head's own chunks): a long sample holds one copy of its targets
        chunk = self.head.CHUNK
        for c in range(0, len(rows), chunk):
            r = rows[c:c + chunk]
            tp[r], tid[r] = self.head.targets(last[r], self.ids, chunk=chunk)  # [c, Vd], [c]
        if key is not None:
            size = len(rows) * (len(self.ids) * tp.element_size() + tid.element_size())
            if self.cached_bytes + size <= self.cache_bytes:
                self.cache[key] = (tp[rows], tid[rows])
                self.cached_bytes += size
        return tp, tid


def epoch_plan(indices: np.ndarray, lengths: dict[int, int], source, batch_tokens: int, seed: int,
               epoch: int) -> list[list[int]]:
    """Deterministic packs (lists of sample indices) for one epoch: shard order shuffled, samples shuffled within
    each shard (so offline training reads each shard once), then greedily packed up to `batch_tokens` slots."""
    rng = np.random.default_rng([seed, epoch])
    by_shard: dict[int, list[int]] = {}
    for i in indices:
        by_shard.setdefault(source.shard_of(int(i)), []).append(int(i))
    order = []
    for k in rng.permutation(sorted(by_shard)):
        items = by_shard[int(k)]
        order.extend(items[j] for j in rng.permutation(len(items)))
    packs, cur, cur_len = [], [], 0
    for i in order:
        n = max(1, min(lengths[i], batch_tokens + 1) - 1)
        if cur and cur_len + n > batch_tokens:
            packs.append(cur)
            cur, cur_len = [], 0
        cur.append(i)
        cur_len += n
    if cur:
        packs.append(cur)
    return packs
