"""Training data: per-sample verifier tensors (offline shards or online) -> packed SlotBatches with targets."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

from ..data.hidden_states import HiddenStates, OnlineHiddenStates
from ..models.loss import SlotBatch, pack_slots, slots_from_sample
from ..verifier import VerifierHead


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
    """The verifier's final norm + lm_head, to turn stored last hidden states into target distributions."""

    def __init__(self, verifier, draft_target_ids: torch.Tensor, device="cpu"):
        self.head = VerifierHead(verifier, device)
        self.ids = draft_target_ids.to(device)
        self.device = device

    def slot_batch(self, samples: list[dict]) -> SlotBatch:
        """Packed SlotBatch of samples (the EAGLE shift, verifier targets, document ids)."""
        parts = []
        for s in samples:
            last = s["last"].to(self.device)
            tp, tid = self.head.targets(last, self.ids)
            parts.append(slots_from_sample(s["input_ids"].long().to(self.device), s["loss_mask"].bool().to(self.device),
                                           s["aux"].to(self.device).float(), tp, tid))
        b = pack_slots(parts)
        return b


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
