"""`paradraft prepare`: chat data -> tokenized samples + assistant loss mask, memory-mappable on disk.

Layout of a prepared directory (all numpy `.npy`, opened with mmap):
  input_ids.npy  int32 [total_tokens]     every sample's tokens, concatenated
  loss_mask.npy  uint8 [total_tokens]     1 = assistant token (trained)
  offsets.npy    int64 [num_samples + 1]  sample i is [offsets[i], offsets[i+1])
  split.npy      uint8 [num_samples]      0 = train, 1 = validation
  token_freqs.npy int64 [vocab_size]      counts of loss-masked tokens of the train split
  sample_ids.json, manifest.json
"""

from __future__ import annotations

import random
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
from tqdm import tqdm

from ..config import PrepareConfig, config_to_dict
from ..errors import DataError, UserError
from ..outputs import check_replaceable, claim_dir, output_lock, replace_dir
from ..utils import fingerprint, read_json, read_json_input, save_npy, write_json
from ..verifier import load_tokenizer
from .sources import Skip, join_parts, read_source, source_fingerprint
from .template import TemplateError, segment_conversation, set_chat_template, template_info, tokenize_segments

FORMAT_VERSION = 2  # 2: duplicate conversations removed before the split


class DatasetExistsError(UserError, FileExistsError):
    """The output directory holds a different dataset."""


def _identity(cfg: PrepareConfig, tokenizer) -> dict:
    identity = {
        "format_version": FORMAT_VERSION,
        "sources": [source_fingerprint(s) for s in cfg.data],
        "verifier": cfg.verifier, "seq_length": cfg.seq_length, "max_samples": cfg.max_samples, "seed": cfg.seed,
        "val_fraction": cfg.val_fraction, "last_turn_only": cfg.last_turn_only,
        "chat_template": fingerprint(tokenizer.chat_template),
    }
    # options added later: recorded only when they change what was written, so datasets prepared before they
    # existed keep their identity (and are reused)
    if cfg.long_conversations != "truncate":
        identity["long_conversations"] = cfg.long_conversations
    if cfg.join_parts:
        identity["join_parts"] = True
    return identity


def split_long(ids: list[int], mask: list[int], seq_length: int) -> list[tuple[list[int], list[int]]]:
    """A tokenized conversation longer than `seq_length` -> windows of at most `seq_length` tokens.

    Every trained (mask 1) token is trained in exactly one window, where it is new; the tokens before it in that
    window are context (mask 0 there). A window ends at the end of an assistant turn where one fits (else it is
    cut inside a turn, which the next window continues) and carries as much preceding context as fits: it begins
    `seq_length` tokens before its end (or at the conversation's start). Windows without a trained token after
    their first position are left out.
    """
    L = len(ids)
    if L <= seq_length:
        return [(ids, mask)]
    ends = [p for p in range(1, L) if mask[p - 1] and not mask[p]] + [L]  # ends of assistant turns (and the end)
    out, c = [], 0
    while c < L:
        fit = [e for e in ends if c < e <= c + seq_length]
        b = max(fit) if fit else min(L, c + seq_length)
        a = max(0, b - seq_length)
        w_mask = [0] * (c - a) + mask[c:b]
        if any(w_mask[1:]):  # position 0 is never predicted
            out.append((ids[a:b], w_mask))
        c = b
    return out


def _legacy_dataset(path: Path) -> bool:
    """A dataset written before output markers existed (its manifest carries an identity)."""
    try:
        return "identity" in read_json(path / "manifest.json")
    except (OSError, ValueError):
        return False


def prepare(cfg: PrepareConfig, tokenizer=None) -> dict:
    """Run `prepare`; return the manifest. Reuses an identical finished dataset in `cfg.output`."""
    out = Path(cfg.output)
    claim_dir(out, "dataset", "--output", legacy=_legacy_dataset)  # before any work: a foreign dir is refused
    if tokenizer is None:
        tokenizer = load_tokenizer(cfg.verifier)
    set_chat_template(tokenizer, cfg.chat_template)
    info = template_info(tokenizer)
    identity = _identity(cfg, tokenizer)
    with output_lock(out, "--output"):  # a second prepare into the same directory is refused, not raced
        old = _read_manifest(out)
        if old is not None:
            if old.get("identity") == identity:
                print(f"[prepare] {out} already holds this dataset ({old['num_samples']} samples); reusing it")
                if cfg.preview:
                    preview(out, tokenizer, cfg.preview)
                return old
            if not cfg.overwrite:
                raise DatasetExistsError(f"--output {out}: holds a different dataset (other sources or options); "
                                         f"pass --overwrite to replace it, or choose another --output")
        if out.is_dir():
            check_replaceable(out, "dataset", "--output")
        return _prepare(cfg, tokenizer, info, identity, out)


def _read_manifest(out: Path) -> dict | None:
    if not (out / "manifest.json").is_file():
        return None
    try:
        return read_json(out / "manifest.json")
    except ValueError:
        return {}  # unreadable: a different dataset as far as reuse goes


def conversation_key(messages: list[dict]) -> str:
    """Content identity of a conversation (roles and texts), for removing duplicates before the split."""
    return fingerprint([[m["role"], m["content"]] for m in messages])


def _prepare(cfg: PrepareConfig, tokenizer, info, identity: dict, out: Path) -> dict:
    t0 = time.time()
    skipped: Counter = Counter()
    convs: list[dict] = []
    seen: set[str] = set()
    for spec in cfg.data:
        items = read_source(spec)
        if cfg.join_parts:
            items = join_parts(items)
        for item in tqdm(items, desc=f"read {spec}", unit=" conv", leave=False, disable=None):
            if isinstance(item, Skip):
                skipped[item.reason] += 1
                continue
            key = conversation_key(item["messages"])
            if key in seen:  # the same conversation twice would land in both splits: kept once, counted
                skipped["duplicate"] += 1
                continue
            seen.add(key)
            if item.get("tool_turns_left_out"):  # OpenAI tool turns: not text the verifier writes, counted
                skipped["tool_turns_left_out"] += item["tool_turns_left_out"]
            convs.append(item)
    random.Random(cfg.seed).shuffle(convs)

    samples: list[tuple[str, list[int], list[int]]] = []
    conv_of: list[int] = []  # the conversation each sample comes from (its windows stay in one split)
    n_split = 0
    limit = cfg.max_samples if cfg.max_samples is not None else float("inf")  # samples (a split conversation: several)
    chunk = 256
    bar = tqdm(total=min(limit, len(convs)), desc="prepare", unit=" conv", disable=None)
    pos = 0
    while pos < len(convs) and len(samples) < limit:
        batch = convs[pos:pos + chunk]
        pos += len(batch)
        segmented, kept = [], []
        for conv in batch:
            try:
                segmented.append(segment_conversation(tokenizer, info, conv["messages"]))
                kept.append(conv)
            except TemplateError:
                skipped["template_mismatch"] += 1
            except Exception:  # jinja raising on a conversation it rejects (e.g. role order)
                skipped["template_error"] += 1
        for ci, (conv, (ids, mask)) in enumerate(zip(kept, tokenize_segments(tokenizer, segmented,
                                                                            cfg.last_turn_only))):
            if cfg.long_conversations == "split" and len(ids) > cfg.seq_length:
                windows = split_long(ids, mask, cfg.seq_length)
                n_split += 1
            else:
                windows = [(ids[:cfg.seq_length], mask[:cfg.seq_length])]
            if not any(mask[1:]) or not windows or not any(windows[0][1][1:]):  # position 0 is never predicted
                skipped["empty_loss_mask_after_truncation"] += 1
                continue
            for w, (w_ids, w_mask) in enumerate(windows):
                if len(samples) < limit:
                    samples.append((conv["id"] if len(windows) == 1 else f"{conv['id']}#{w}", w_ids, w_mask))
                    conv_of.append(pos - len(batch) + ci)
            bar.update(1)
    bar.close()
    if not samples:
        raise DataError(f"--data {' '.join(cfg.data)}: no usable samples; skipped: {dict(skipped)}")

    n = len(samples)
    n_val = int(round(n * cfg.val_fraction)) if cfg.val_fraction > 0 else 0
    if cfg.val_fraction > 0 and n >= 2:
        n_val = max(1, n_val)
    n_val = min(n_val, n - 1)
    start = n - n_val  # the split falls between conversations: a conversation's windows never straddle it
    while 0 < start < n and conv_of[start] == conv_of[start - 1]:
        start += 1
    n_val = n - start
    lengths = np.array([len(s[1]) for s in samples], dtype=np.int64)
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    input_ids = np.fromiter((t for s in samples for t in s[1]), dtype=np.int32, count=int(offsets[-1]))
    loss_mask = np.fromiter((m for s in samples for m in s[2]), dtype=np.uint8, count=int(offsets[-1]))
    split = np.zeros(n, dtype=np.uint8)
    split[n - n_val:] = 1
    vocab_size = max(len(tokenizer), int(input_ids.max()) + 1)
    train_end = int(offsets[n - n_val])
    train_ids = input_ids[:train_end][loss_mask[:train_end].astype(bool)]
    freqs = np.bincount(train_ids, minlength=vocab_size).astype(np.int64)

    manifest = {
        "num_samples": n, "num_train": n - n_val, "num_val": n_val,
        "num_tokens": int(offsets[-1]), "num_loss_tokens": int(loss_mask.sum()),
        "skipped": dict(sorted(skipped.items())), "verifier": cfg.verifier, "seq_length": cfg.seq_length,
        "long_conversations": {"mode": cfg.long_conversations, "conversations_split": n_split,
                               "conversations": len(set(conv_of))},
        "sources": list(cfg.data), "vocab_size": vocab_size,
        "template": {"assistant_header": info.header, "end_of_turn": info.end_of_turn},
        "config": config_to_dict(cfg), "identity": identity, "seconds": round(time.time() - t0, 2),
    }
    with replace_dir(out, "dataset", "--output") as tmp:
        save_npy(tmp / "input_ids.npy", input_ids)
        save_npy(tmp / "loss_mask.npy", loss_mask)
        save_npy(tmp / "offsets.npy", offsets)
        save_npy(tmp / "split.npy", split)
        save_npy(tmp / "token_freqs.npy", freqs)
        write_json(tmp / "sample_ids.json", [s[0] for s in samples], indent=0)
        write_json(tmp / "manifest.json", manifest)  # written last: its presence marks a complete dataset
    print(f"[prepare] {n} samples ({n - n_val} train, {n_val} val), {manifest['num_tokens']} tokens, "
          f"{manifest['num_loss_tokens']} trained, in {manifest['seconds']} s -> {out}")
    if skipped:
        print("[prepare] skipped: " + ", ".join(f"{k}={v}" for k, v in sorted(skipped.items())))
    if cfg.preview:
        preview(out, tokenizer, cfg.preview)
    return manifest


class PreparedDataset:
    """Read-only, memory-mapped view of a prepared directory."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not (self.path / "manifest.json").is_file():
            raise DataError(f"{self.path} is not a prepared dataset (no manifest.json); run `paradraft prepare`")
        self.manifest = read_json_input(self.path / "manifest.json", DataError, "prepared dataset",
                                        ("num_samples", "verifier"))
        self.input_ids = self._array("input_ids.npy", mmap=True)
        self.loss_mask = self._array("loss_mask.npy", mmap=True)
        self.offsets = self._array("offsets.npy")
        self.split = self._array("split.npy")
        self._ids: list[str] | None = None
        n = len(self.offsets) - 1
        if n < 0 or int(self.offsets[-1]) != len(self.input_ids) or \
                len(self.loss_mask) != len(self.input_ids) or len(self.split) != n or \
                n != self.manifest["num_samples"] or (n and (np.diff(self.offsets) < 0).any()):
            end = int(self.offsets[-1]) if n >= 0 else "?"
            raise DataError(f"{self.path}: its arrays disagree (offsets end at {end}, {len(self.input_ids)} "
                            f"tokens, {len(self.loss_mask)} mask entries, {len(self.split)} split entries, the "
                            f"manifest says {self.manifest['num_samples']} samples); the dataset is damaged: "
                            f"prepare it again")

    def _array(self, name: str, mmap: bool = False) -> np.ndarray:
        f = self.path / name
        try:
            a = np.load(f, mmap_mode="r" if mmap else None, allow_pickle=False)
        except FileNotFoundError:
            raise DataError(f"{f}: missing; the dataset is incomplete: prepare it again") from None
        except (ValueError, OSError, EOFError) as e:  # truncated, not .npy, an object array
            raise DataError(f"{f}: cannot be read ({type(e).__name__}: {str(e)[:80]}); the dataset is damaged: "
                            f"prepare it again") from None
        if a.ndim != 1:
            raise DataError(f"{f}: has shape {a.shape}, not one dimension; the dataset is damaged: prepare it again")
        return a

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def sample_ids(self) -> list[str]:
        """Sample ids, in storage order."""
        if self._ids is None:
            try:
                ids = read_json(self.path / "sample_ids.json")
            except (OSError, ValueError) as e:
                raise DataError(f"{self.path / 'sample_ids.json'}: cannot be read ({type(e).__name__}); the dataset "
                                f"is damaged: prepare it again") from None
            if not isinstance(ids, list) or len(ids) != len(self):
                raise DataError(f"{self.path / 'sample_ids.json'}: does not list the dataset's {len(self)} samples; "
                                f"the dataset is damaged: prepare it again")
            self._ids = ids
        return self._ids

    def indices(self, split: str = "train") -> np.ndarray:
        """Sample indices of 'train', 'val' or 'all'."""
        if split == "all":
            return np.arange(len(self))
        return np.nonzero(self.split == (1 if split == "val" else 0))[0]

    def sample(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """(input_ids int64 [T], loss_mask bool [T]) of sample i."""
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return np.asarray(self.input_ids[a:b], dtype=np.int64), np.asarray(self.loss_mask[a:b], dtype=bool)

    def token_freqs(self) -> np.ndarray:
        """Counts of loss-masked train tokens [vocab_size]."""
        return self._array("token_freqs.npy")


def preview(path: str | Path, tokenizer, n: int, stream=None) -> None:
    """Print n samples with the loss-masked text highlighted (green on a terminal, [[brackets]] otherwise)."""
    stream = stream or sys.stdout
    ds = PreparedDataset(path)
    color = stream.isatty()
    on, off = ("\x1b[32m", "\x1b[0m") if color else ("[[", "]]")
    for i in range(min(n, len(ds))):
        ids, mask = ds.sample(i)
        pieces, start = [], 0
        for j in range(1, len(ids) + 1):
            if j == len(ids) or mask[j] != mask[start]:
                text = tokenizer.decode(ids[start:j].tolist())
                pieces.append(f"{on}{text}{off}" if mask[start] else text)
                start = j
        stream.write(f"----- sample {i} ({ds.sample_ids[i]}, {len(ids)} tokens, {int(mask.sum())} trained)\n")
        stream.write("".join(pieces) + "\n")
