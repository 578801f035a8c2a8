"""`paradraft vocab`: the draft vocabulary, as EAGLE / speculators / vLLM store it.

  d2t  int64 [draft_vocab]  offset: draft id i <-> target id i + d2t[i]
  t2d  bool  [target_vocab] True where the target token is in the draft vocabulary
Draft ids are in ascending target-id order (so d2t is non-decreasing).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from ..config import VocabConfig
from ..errors import UserError
from ..outputs import claim_file, output_lock
from ..utils import save_tensors, write_json
from ..verifier import embedding_rows, load_tokenizer
from .prepare import PreparedDataset
from .template import PROBE_ANSWER, PROBE_USER, special_token_strings


class VocabError(UserError, ValueError):
    """A draft vocabulary that cannot be built or does not fit."""


def template_special_ids(tokenizer) -> list[int]:
    """Ids of the special tokens the chat template emits (plus EOS): these must be draftable."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": PROBE_USER}, {"role": "assistant", "content": PROBE_ANSWER}],
            tokenize=False)
        for tok in special_token_strings(tokenizer):
            if tok in text:
                ids.add(int(tokenizer.convert_tokens_to_ids(tok)))
    return sorted(ids)


def build_vocab(freqs: np.ndarray, size: int, target_vocab_size: int, always: list[int] = (),
                fill: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t int64 [size], t2d bool [target_vocab_size]) from token counts [>= target_vocab_size]."""
    if size <= 0 or size > target_vocab_size:
        raise VocabError(f"draft vocabulary size {size} must be in 1..{target_vocab_size} (the verifier's vocab)")
    freqs = np.asarray(freqs[:target_vocab_size], dtype=np.int64)
    always = [int(t) for t in always if 0 <= int(t) < target_vocab_size]
    seen = int((freqs > 0).sum())
    chosen = list(dict.fromkeys(always))
    # most frequent first; ties broken by the lower token id (deterministic)
    order = np.lexsort((np.arange(len(freqs)), -freqs))
    taken = set(chosen)
    for t in order:
        if len(chosen) >= size or freqs[t] == 0:
            break
        if int(t) not in taken:
            chosen.append(int(t))
            taken.add(int(t))
    if len(chosen) < size:
        if not fill:
            raise VocabError(f"asked for {size} draft tokens but the data has only {seen} distinct trained tokens "
                             f"(+{len(always)} special); use a smaller --size or --fill to pad by tokenizer order")
        for t in range(target_vocab_size):
            if len(chosen) >= size:
                break
            if t not in taken:
                chosen.append(t)
                taken.add(t)
    target_ids = torch.tensor(sorted(chosen), dtype=torch.int64)  # [size]
    d2t = target_ids - torch.arange(size, dtype=torch.int64)  # [size]
    t2d = torch.zeros(target_vocab_size, dtype=torch.bool)
    t2d[target_ids] = True
    return d2t, t2d


def draft_vocabulary(token_freqs, size: int, rows: int, tokenizer=None,
                     fill: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """THE draft-vocabulary rule (used by `vocab`, `train` and the coverage benchmark): the `size` most frequent
    trained tokens plus the special tokens the chat template emits, over a verifier embedding of `rows` rows
    (a padded vocabulary has more rows than the tokenizer has tokens; d2t / t2d are sized to the rows, as vLLM
    reads them). token_freqs: counts of any length (from one or more prepared datasets, summed by the caller).
    -> (d2t int64 [min(size, rows)], t2d bool [rows])."""
    freqs = np.zeros(rows, dtype=np.int64)
    f = np.asarray(token_freqs)[:rows]
    freqs[: len(f)] = f
    special = template_special_ids(tokenizer) if tokenizer is not None else []
    return build_vocab(freqs, min(size, rows), rows, always=special, fill=fill)


def draft_to_target_ids(d2t: torch.Tensor) -> torch.Tensor:
    """Target ids of the draft vocabulary [draft_vocab]."""
    return d2t + torch.arange(len(d2t), device=d2t.device, dtype=d2t.dtype)


def save_vocab(path: str | Path, d2t: torch.Tensor, t2d: torch.Tensor, meta: dict | None = None,
               flag: str = "--output") -> None:
    """Write d2t/t2d to a safetensors file (and a small JSON summary beside it, `NAME.json`), atomically. Either
    file may replace only a vocabulary (or its summary) paradraft wrote (outputs.claim_file)."""
    path = Path(path)
    side = claim_vocab_output(path, flag)
    with output_lock(path, flag, reentrant=True):
        save_tensors({"d2t": d2t.contiguous(), "t2d": t2d.contiguous()}, path,
                     metadata={"paradraft": "vocab", **{k: str(v) for k, v in (meta or {}).items()}})
        write_json(side, {"draft_vocab_size": len(d2t), "target_vocab_size": len(t2d), **(meta or {})})


def claim_vocab_output(path: str | Path, flag: str = "--output") -> Path:
    """Check (before any work) that the vocabulary file and its summary beside it may be written; the summary path."""
    path = Path(path)
    if path.suffix == ".json":
        raise VocabError(f"{flag} {path}: the vocabulary is a safetensors file and its summary is written beside it "
                         f"as NAME.json; give a path ending in .safetensors")
    claim_file(path, "vocab", flag)
    side = path.with_suffix(".json")
    claim_file(side, "vocab_summary", flag)
    return side


def load_vocab(path: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) from a vocab file, checked for consistency."""
    try:
        t = load_file(str(path))
        d2t, t2d = t["d2t"].long(), t["t2d"].bool()
    except FileNotFoundError:
        raise VocabError(f"--vocab {path}: no such file") from None
    except Exception as e:  # SafetensorError, a missing tensor
        raise VocabError(f"--vocab {path}: not a draft vocabulary file ({type(e).__name__}: {e})") from None
    ids = draft_to_target_ids(d2t)
    if ids.min() < 0 or ids.max() >= len(t2d) or not bool(t2d[ids].all()) or int(t2d.sum()) != len(d2t):
        raise VocabError(f"{path}: d2t and t2d disagree (a stale or corrupt vocabulary file)")
    return d2t, t2d


def vocab(cfg: VocabConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Run `paradraft vocab`."""
    claim_vocab_output(cfg.output)  # before any work
    with output_lock(cfg.output, "--output"):  # a second vocab run on the same output is refused, not raced
        return _vocab(cfg)


def _vocab(cfg: VocabConfig) -> tuple[torch.Tensor, torch.Tensor]:
    sets = [PreparedDataset(p) for p in cfg.data]
    verifier = cfg.verifier or sets[0].manifest["verifier"]
    tok = load_tokenizer(verifier)
    rows = embedding_rows(verifier)  # the verifier's embedding, not the tokenizer: padded vocabularies differ
    counts = [d.token_freqs() for d in sets]
    freqs = np.zeros(max(rows, *(len(f) for f in counts)), dtype=np.int64)
    for f in counts:
        freqs[:len(f)] += f
    if cfg.size > rows:
        raise VocabError(f"--size {cfg.size} is larger than the verifier's {rows}-token vocabulary")
    d2t, t2d = draft_vocabulary(freqs, cfg.size, rows, tok, fill=cfg.fill)
    freqs = freqs[:rows]
    covered = float(freqs[t2d.numpy()].sum() / max(1, freqs.sum()))
    save_vocab(cfg.output, d2t, t2d, {"verifier": verifier, "sources": ",".join(cfg.data),
                                      "coverage": round(covered, 6)})
    print(f"[vocab] {cfg.size} draft tokens of {rows}; they cover {covered:.2%} of trained tokens -> {cfg.output}")
    return d2t, t2d
