"""paradraft against the reference trainer (vllm-project/speculators' P-EAGLE trainer) on identical data.

Both trainers see the same prepared conversations, the same verifier hidden states (paradraft's extraction, written
into the reference's offline layout), the same draft vocabulary and mask token, the same number of optimizer steps
of about the same tokens (`--steps` packs of 2,048 token slots). The reference runs with its own defaults otherwise
(its draft layer, norm before residual, Muon + AdamW, linear decay to 0, its depth count and element-mean loss).
Both drafters are then scored by ONE rule: paradraft's held-out validation (per-depth accuracy and the acceptance
estimate, paradraft.models.loss.acceptance_estimate) on the same held-out split, the reference's checkpoint read by
paradraft's speculators-format loader (the format vLLM serves).

  python benchmarks/reference_trainer.py --data runs/quickstart/data --hidden-states runs/quickstart/hidden_states \
      --reference-python /path/to/venv-with-speculators/bin/python [--seeds 0 1 2] [--steps 120] \
      [--reference-depths 8] [--paradraft-depths 3] [--reference-args "FLAGS" --label NAME] [--skip-paradraft] \
      [--align-loss-mask] [--work DIR] [--output JSON]

Which predictions each trains: the reference shifts a sample to (x_{j+1}, g_j, target y_{j+1}, loss_mask l_{j+1})
(its `shift_batch`), so it trains the prediction made AFTER each assistant token: not the prediction of an
answer's first token (made at the last prompt token), but the one after the answer's last token. paradraft trains
slot j iff the token it predicts, x_{j+2}, is an assistant token (`paradraft.models.loss.slot_valid`): the first
answer token's prediction, not the one after the last. `--align-loss-mask` hands the reference the loss mask shifted
one token earlier (l'_k = l_{k+1}), so that both train exactly the same predictions.

The reference needs its own environment (speculators 0.9.0 pins transformers <= 5.19; paradraft's own may be newer):
  python -m venv V && V/bin/pip install torch==2.13.0 "transformers>=5,<=5.19" "datasets>=4,<=5.1" \
      "loguru>=0.7.2,<=0.7.3" "numpy>=2,<=2.5.4" "tqdm>=4.66.3,<=4.70.1" openai pydantic pydantic-settings rich \
      typer click psutil protobuf safetensors httpx aiohttp huggingface-hub \
      && V/bin/pip install --no-deps speculators==0.9.0 hs-connectors==0.9.0
(its other requirements, torchvision, torchaudio and the mooncake transfer engines, are not used by this path).
On a machine without an accelerator the reference's trainer needs three device fixes, applied here at run time
(RUNNER below), not by editing its files: its device index becomes "cpu", its autocast device "cpu", and
`torch.accelerator.synchronize()` a no-op. It trains in float32 here, as paradraft does on a CPU without bf16
matrix units (`--autocast auto`).

Rows are appended to --output after every run (a stopped comparison keeps what it measured).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from paradraft.config import QuickstartConfig, TrainConfig, config_to_dict
from paradraft.data.hidden_states import HiddenStates
from paradraft.data.prepare import PreparedDataset
from paradraft.models.checkpoint import load_drafter
from paradraft.quickstart import quickstart_steps
from paradraft.train.trainer import Trainer, train
from paradraft.verifier.load import embedded_model_dir


def quickstart_train(**over) -> TrainConfig:
    """`make demo`'s train step (paradraft.quickstart's own config) with `over` applied, every held-out sample
    scored."""
    return dataclasses.replace(dict(quickstart_steps(QuickstartConfig()))["train"], val_samples=10_000, **over)


# The reference's trainer on a CPU: three device fixes at run time, then its own command line (argv after the
# script name). Its trainer moves tensors to `get_local_rank()` (an int: cuda:0), autocasts on the accelerator's
# type ("cuda" when there is none) and synchronizes the accelerator around its timers.
RUNNER = r"""
import sys, torch
torch.accelerator.synchronize = lambda *a, **k: None
import speculators.train.trainer as T
T.get_local_rank = lambda: "cpu"
_init = T.Trainer.__init__
def _cpu_init(self, *a, **k):
    _init(self, *a, **k)
    self.device_type = "cpu"
T.Trainer.__init__ = _cpu_init
from speculators.train.cli import main
from speculators.train.config import TrainConfig
main(TrainConfig.resolve(sys.argv[1:]))
"""


def reference_loss_mask(loss_mask: torch.Tensor, align: bool) -> torch.Tensor:
    """loss_mask [T] bool -> the mask the reference is given: as is, or (align) shifted one token earlier,
    l'_k = l_{k+1} (l'_{T-1} = 0), so that its rule (slot j trains iff l'_{j+1}) is paradraft's (iff l_{j+2})."""
    if not align:
        return loss_mask
    out = torch.zeros_like(loss_mask)
    out[:-1] = loss_mask[1:]
    return out


def write_reference_data(data: str, hidden_states: str, out: Path, d2t: torch.Tensor, t2d: torch.Tensor,
                         align_loss_mask: bool = False) -> dict:
    """paradraft's prepared data + hidden states -> the reference's offline layout in `out`: an Arrow dataset
    (input_ids, loss_mask, seq_len; train samples first, then held-out, so its train_data_ratio splits them as
    paradraft does), hidden_states/hs_{i}.safetensors ({hidden_states [T, 4, H]: the 3 aux layers then the pre-norm
    last layer; token_ids [T]}), and d2t / t2d .npy (the reference's vocabulary files). `align_loss_mask`: see
    `reference_loss_mask`."""
    from datasets import Dataset
    from safetensors.torch import save_file

    ds = PreparedDataset(data)
    hs = HiddenStates(hidden_states)
    H = hs.manifest["hidden_size"]
    order = [int(i) for i in ds.indices("train")] + [int(i) for i in ds.indices("val")]
    pos = {s: j for j, s in enumerate(order)}
    (out / "hidden_states").mkdir(parents=True, exist_ok=True)
    rows = {"input_ids": [None] * len(order), "loss_mask": [None] * len(order), "seq_len": [0] * len(order)}
    seen = 0
    for s in hs:
        j = pos.get(s["sample_index"])
        if j is None:
            continue
        T = len(s["input_ids"])
        stacked = torch.cat([s["aux"].reshape(T, 3, H), s["last"].reshape(T, 1, H)], dim=1)  # [T, 4, H]
        save_file({"hidden_states": stacked.contiguous(), "token_ids": s["input_ids"].long().contiguous()},
                  str(out / "hidden_states" / f"hs_{j}.safetensors"))
        rows["input_ids"][j] = s["input_ids"].long().tolist()
        rows["loss_mask"][j] = reference_loss_mask(s["loss_mask"].bool(), align_loss_mask).tolist()
        rows["seq_len"][j] = T
        seen += 1
    if seen != len(order):
        raise SystemExit(f"--hidden-states {hidden_states} holds {seen} of the {len(order)} prepared samples")
    d = Dataset.from_dict(rows)
    d.set_format(type="torch")
    d.save_to_disk(str(out / "dataset"))
    # the Arrow dataset and its hidden states must sit in one directory (the reference reads DATA/hidden_states)
    for f in (out / "dataset").iterdir():
        os.replace(f, out / f.name)
    (out / "dataset").rmdir()
    np.save(out / "d2t.npy", d2t.numpy())
    np.save(out / "t2d.npy", t2d.numpy())
    n_train = len(ds.indices("train"))
    return {"num_train": n_train, "num_val": len(order) - n_train,
            "train_data_ratio": (n_train + 0.5) / len(order)}  # int(N * ratio) == n_train


def run_reference(python: str, ref_data: Path, info: dict, save: Path, steps: int, seed: int, depths: int,
                  mask_token_id: int, log: Path, extra: list[str]) -> float:
    verifier = embedded_model_dir()  # the HF directory paradraft converted from the embedded GGUF
    cmd = [python, "-c", RUNNER,
           "--speculator-type", "peagle", "--verifier-name-or-path", str(verifier),
           "--data-path", str(ref_data), "--total-seq-len", "2048",
           "--train-data-ratio", f"{info['train_data_ratio']:.6f}",
           "--d2t-path", str(ref_data / "d2t.npy"), "--t2d-path", str(ref_data / "t2d.npy"),
           "--mask-token-id", str(mask_token_id), "--num-depths", str(depths),
           "--hidden-states-dtype", "float32", "--on-missing", "raise",
           "--draft-attn-impl", "sdpa", "--loss-implementation", "eager", "--num-workers", "0",
           "--max-steps", str(steps), "--seed", str(seed), "--save-path", str(save),
           "--log-dir", str(save / "logs"), "--no-resume-from-checkpoint", *extra]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS=str(torch.get_num_threads()))
    t0 = time.time()
    with open(log, "w") as fh:
        r = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env)
    if r.returncode:
        raise SystemExit(f"the reference trainer failed (exit {r.returncode}); its log: {log}")
    return time.time() - t0


def own_validation(log: Path) -> dict[int, float]:
    """The reference's own last held-out per-depth accuracy (from its log): a cross-check of the scoring."""
    acc: dict[int, float] = {}
    for m in re.finditer(r"val/position_(\d+)_acc_epoch=([-+.\de]+)", log.read_text(errors="replace")):
        acc[int(m.group(1))] = float(m.group(2).rstrip(","))
    return acc


def final_checkpoint(save: Path) -> Path:
    """The reference's last epoch directory (past --max-steps its later epochs run at lr 0 and change nothing)."""
    epochs = sorted((p for p in save.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name))
    if not epochs:
        raise SystemExit(f"the reference wrote no checkpoint under {save}")
    return epochs[-1]


def score(trainer: Trainer, drafter_dir: Path) -> dict:
    """paradraft's held-out validation of a drafter checkpoint (the trainer's own validate(), its model swapped)."""
    model = load_drafter(drafter_dir, verifier=trainer.verifier, device=trainer.device)
    trainer.model = model
    return trainer.validate()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True)
    ap.add_argument("--hidden-states", required=True)
    ap.add_argument("--reference-python", required=True, help="a python with speculators 0.9.0 installed")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--reference-depths", type=int, default=8, help="the reference's --num-depths (its default: 8)")
    ap.add_argument("--paradraft-depths", type=int, default=3, help="paradraft's (the quickstart's default: 3)")
    ap.add_argument("--score-depths", type=int, default=3, help="depths scored (K of the estimate)")
    ap.add_argument("--skip-paradraft", action="store_true", help="train and score the reference only")
    ap.add_argument("--reference-args", default="",
                    help="more flags for the reference's trainer (e.g. '--optimizer adamw'): a variant of its defaults")
    ap.add_argument("--align-loss-mask", action="store_true",
                    help="give the reference the loss mask one token earlier, so it trains paradraft's predictions")
    ap.add_argument("--label", default="its defaults", help="what the reference row is called")
    ap.add_argument("--work", default=None, help="scratch directory (default: a temporary one, removed)")
    ap.add_argument("--output", default="benchmarks/results/reference_trainer.json")
    a = ap.parse_args()

    tmp = None if a.work else tempfile.TemporaryDirectory(prefix="paradraft-ref-")
    work = Path(a.work or tmp.name)
    work.mkdir(parents=True, exist_ok=True)
    out = Path(a.output)
    quickstart_flags = {k: v for k, v in config_to_dict(quickstart_train()).items()
                        if k not in ("data", "hidden_states", "output")}
    rows = json.loads(out.read_text())["rows"] if out.is_file() else []

    def add(row: dict) -> None:
        rows[:] = [r for r in rows if (r["trainer"], r["seed"], r["depths"]) != (row["trainer"], row["seed"],
                                                                               row["depths"])] + [row]
        doc = {"benchmark": "reference_trainer", "date": time.strftime("%Y-%m-%d"), "data": a.data,
               "hidden_states": a.hidden_states, "steps": a.steps, "score_depths": a.score_depths,
               "quickstart_flags": quickstart_flags, "rows": rows}
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(doc, indent=2) + "\n")
        print(json.dumps(row), flush=True)

    # one scorer: the quickstart's trainer, built once, whose validate() scores every drafter on the held-out split
    scorer = Trainer(quickstart_train(data=a.data, hidden_states=a.hidden_states, output=str(work / "scorer"),
                                      num_depths=a.score_depths, num_speculative_tokens=a.score_depths, max_steps=1))
    mask = int(scorer.model.cfg.mask_token_id)
    d2t, t2d = scorer.model.d2t.cpu(), scorer.model.t2d.cpu()
    ref_data = work / ("reference-data-aligned" if a.align_loss_mask else "reference-data")
    if not (ref_data / "d2t.npy").is_file():
        info = write_reference_data(a.data, a.hidden_states, ref_data, d2t, t2d, a.align_loss_mask)
        (ref_data / "paradraft_info.json").write_text(json.dumps(info))
    info = json.loads((ref_data / "paradraft_info.json").read_text())

    def row_of(trainer: str, seed: int, depths: int, secs: float, v: dict) -> dict:
        return {"trainer": trainer, "seed": seed, "depths": depths, "steps": a.steps, "seconds": round(secs, 1),
                "val_acceptance_length_estimate": v["acceptance_length_estimate"],
                "val_acceptance_length_by_k": v["acceptance_length_by_k"], "val_acc": v["acc"],
                "val_conditional_acc": v["conditional_acc"], "vocab_coverage": v["vocab_coverage"]}

    tag = "".join(c if c.isalnum() else "-" for c in a.label).strip("-")
    for seed in a.seeds:
        save = work / f"reference-{tag}-seed{seed}-depths{a.reference_depths}"
        secs = run_reference(a.reference_python, ref_data, info, save, a.steps, seed, a.reference_depths, mask,
                             work / f"{save.name}.log", a.reference_args.split())
        row = row_of(f"speculators 0.9.0 ({a.label})", seed, a.reference_depths, secs,
                     score(scorer, final_checkpoint(save)))
        row["reference_args"] = a.reference_args
        row["align_loss_mask"] = a.align_loss_mask
        own = own_validation(work / f"{save.name}.log")
        row["reference_own_val_acc"] = [own[d] for d in sorted(own)]  # its loss mask and anchors: close, not equal
        add(row)
        if a.skip_paradraft:
            continue
        run = work / f"paradraft-seed{seed}-depths{a.paradraft_depths}"
        t0 = time.time()
        train(quickstart_train(data=a.data, hidden_states=a.hidden_states, output=str(run),
                               num_depths=a.paradraft_depths,
                               num_speculative_tokens=min(a.score_depths, a.paradraft_depths),
                               max_steps=a.steps, save_every=10_000, seed=seed, overwrite=True))
        secs = time.time() - t0
        add(row_of("paradraft (quickstart defaults)", seed, a.paradraft_depths, secs, score(scorer, run)))
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    sys.exit(main())
