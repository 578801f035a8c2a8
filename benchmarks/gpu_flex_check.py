"""GPU check (run where CUDA exists): P-EAGLE training with compiled flex_attention vs the dense SDPA path.

Same weights, same batch, same COD elements: compares loss and gradients, times a training step of each, and
records peak GPU memory. Writes JSON (default $OUT/gpu_flex.json or benchmarks/results/gpu_flex.json).
"""

from __future__ import annotations

import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from paradraft.models.common import DraftConfig  # noqa: E402
from paradraft.models.loss import SlotBatch  # noqa: E402
from paradraft.models.peagle import PEagleDrafter, cod_sample  # noqa: E402


def batch(T, dev, docs=4):
    g = torch.Generator().manual_seed(0)
    doc = torch.arange(T) * docs // T
    pos = torch.arange(T) - (doc * T // docs) + 1
    b = SlotBatch(tokens=torch.randint(0, 8192, (T,), generator=g), hidden=torch.randn(T, 3 * 576, generator=g),
                  positions=pos, doc=doc, target_p=torch.softmax(torch.randn(T, 8192, generator=g), -1),
                  target_ids=torch.randint(0, 9000, (T,), generator=g), valid=(pos > 30))
    return SlotBatch(*(getattr(b, f).to(dev) for f in ("tokens", "hidden", "positions", "doc", "target_p",
                                                         "target_ids", "valid")))


def step(model, b, K, anchors, dtype=torch.bfloat16):
    with torch.autocast("cuda", dtype=dtype):
        loss, stats, _, _ = model.train_forward(b, K, anchors=anchors)
    loss.backward()
    return loss.detach().float()


def main():
    dev = "cuda"
    cfg = DraftConfig(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                      head_dim=64, num_layers=2, vocab_size=49152, draft_vocab_size=8192, mask_token_id=16,
                      rope_parameters={"rope_type": "default", "rope_theta": 100000.0})
    torch.manual_seed(0)
    base = PEagleDrafter(cfg)
    base.t2d[:8192] = True
    rows = []
    for T in (2048, 8192):
        K = 8
        b = batch(T, dev)
        anchors = cod_sample(b.valid.cpu(), K, generator=torch.Generator().manual_seed(0),
                             document_ids=b.doc.cpu())
        anchors = tuple(a.to(dev) for a in anchors)
        res = {"tokens": T, "depths": K, "elements": int(anchors[0].numel())}
        grads = {}
        for backend in ("sdpa", "flex"):
            m = copy.deepcopy(base).to(dev)
            m.backend = backend
            torch.cuda.reset_peak_memory_stats()
            loss = step(m, b, K, anchors, dtype=torch.float32 if T == 2048 else torch.bfloat16)
            grads[backend] = {n: p.grad.detach().float().clone() for n, p in m.named_parameters() if p.grad is not None}
            res[f"{backend}_loss"] = float(loss)
            times = []
            for _ in range(5):
                m.zero_grad(set_to_none=True)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                step(m, b, K, anchors)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            res[f"{backend}_step_ms"] = 1000 * statistics.median(times)
            res[f"{backend}_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
            del m
        res["max_rel_grad_diff"] = max(
            float((grads["sdpa"][n] - grads["flex"][n]).norm() / (grads["sdpa"][n].norm() + 1e-12))
            for n in grads["sdpa"])
        res["loss_abs_diff"] = abs(res["sdpa_loss"] - res["flex_loss"])
        rows.append(res)
        print(json.dumps(res), flush=True)
    out = {"benchmark": "gpu_flex_check", "date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(),
           "torch": torch.__version__, "note": "T=2048 loss/grad compared in float32, T=8192 in bf16 autocast; "
           "step times in bf16 autocast; 2 draft layers, SmolLM2 sizes, 8k draft vocab, COD K=8", "rows": rows}
    path = Path(os.environ.get("OUT", "benchmarks/results")) / "gpu_flex.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
