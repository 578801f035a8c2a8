"""Peak memory of `paradraft export` for a drafter of a Qwen3-8B-shaped verifier (vocabulary and width of Qwen3-8B,
151,936 x 4096; 2 decoder layers so that it fits this machine), against the budget the issue sets: the size of that
embedding in float32 plus 1 GB.

The verifier (random weights, bf16, sharded safetensors like a real checkpoint, ~3.3 GB) and a float32 P-EAGLE
drafter for it (1 layer, 32k draft vocabulary, ~4.1 GB) are built once under --work. Each export runs in a fresh
process; its peak resident memory is read from the kernel (getrusage of the child). `--old-src DIR` measures
another checkout's `src` the same way (e.g. the export before streaming, which loaded the whole verifier in float32).

    python benchmarks/bench_export_memory.py [--work runs/bench-export] [--old-src /tmp/oldmain/src] [-o FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
V, H, LAYERS, DRAFT_VOCAB = 151936, 4096, 2, 32000


def build(work: Path) -> tuple[Path, Path]:
    """The verifier and the drafter, once."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    sys.path.insert(0, str(ROOT / "src"))
    from paradraft.models.checkpoint import build_drafter, save_drafter
    from paradraft.models.common import DraftConfig

    vdir, ddir = work / "verifier", work / "drafter"
    if not (vdir / "config.json").is_file():
        cfg = Qwen3Config(vocab_size=V, hidden_size=H, intermediate_size=12288, num_hidden_layers=LAYERS,
                          num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
                          max_position_embeddings=40960, rope_theta=1e6)
        with torch.device("meta"):
            model = Qwen3ForCausalLM(cfg)
        model = model.to_empty(device="cpu").to(torch.bfloat16)
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0, 0.02)
        model.save_pretrained(vdir, max_shard_size="1GB")  # sharded, with an index, as real checkpoints are
        del model
    if not (ddir / "config.json").is_file():
        from transformers import AutoConfig

        vcfg = AutoConfig.from_pretrained(vdir)
        dcfg = DraftConfig(algorithm="peagle", flavour="qwen3", hidden_size=H, intermediate_size=12288,
                           num_attention_heads=32, num_key_value_heads=8, head_dim=128, num_layers=1,
                           rope_parameters={"rope_type": "default", "rope_theta": 1e6}, vocab_size=vcfg.vocab_size,
                           draft_vocab_size=DRAFT_VOCAB, aux_layer_ids=[0, 1, 2], mask_token_id=V - 1,
                           num_depths=8, num_speculative_tokens=3, verifier=str(vdir), norm_before_residual=True)
        torch.manual_seed(0)
        d = build_drafter(dcfg)
        d.t2d[:DRAFT_VOCAB] = True
        save_drafter(d, ddir)  # float32, as train writes it
    return vdir, ddir


def measure(src: Path, vdir: Path, ddir: Path, out: Path) -> dict:
    """Peak RSS of one export in a fresh process (the child of a small launcher, so that RUSAGE_CHILDREN is its)."""
    import shutil

    shutil.rmtree(out, ignore_errors=True)
    launcher = ("import resource, subprocess, sys; p = subprocess.run(sys.argv[1:]); "
                "print('MAXRSS', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(p.returncode)")
    env = {**os.environ, "PYTHONPATH": str(src)}
    t0 = time.time()
    p = subprocess.run([sys.executable, "-c", launcher, sys.executable, "-m", "paradraft", "export", str(ddir), "-o",
                        str(out), "--verifier", str(vdir), "--dtype", "bfloat16"], capture_output=True, text=True,
                       env=env)
    if p.returncode != 0:
        raise SystemExit(f"export with {src} failed:\n{p.stderr[-3000:]}")
    kb = int(next(ln.split()[1] for ln in p.stdout.splitlines() if ln.startswith("MAXRSS")))
    return {"src": str(src), "peak_rss_gib": round(kb / 2**20, 3), "seconds": round(time.time() - t0, 1),
            "output_bytes": sum(f.stat().st_size for f in out.iterdir())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default=str(ROOT / "runs" / "bench-export"))
    ap.add_argument("--old-src", default=None, help="also measure this checkout's src (e.g. the previous export)")
    ap.add_argument("-o", "--output", default=str(ROOT / "benchmarks" / "results" / "export-memory.json"))
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    vdir, ddir = build(work)
    budget = V * H * 4 / 2**30 + 1.0
    rows = [{"label": "this checkout", **measure(ROOT / "src", vdir, ddir, work / "export")}]
    if args.old_src:
        rows.append({"label": "old", **measure(Path(args.old_src), vdir, ddir, work / "export-old")})
    disk = {p.name: round(sum(f.stat().st_size for f in p.iterdir()) / 2**30, 2) for p in (vdir, ddir)}
    res = {"date": time.strftime("%Y-%m-%d %H:%M"), "host": platform.node(), "cpu": platform.processor(),
           "verifier": f"Qwen3, vocab {V}, hidden {H}, {LAYERS} layers, bf16 (random)", "drafter": "P-EAGLE, 1 layer, "
           f"draft vocab {DRAFT_VOCAB}, float32", "disk_gib": disk,
           "budget_gib (embedding float32 + 1 GB)": round(budget, 3), "rows": rows,
           "within_budget": rows[0]["peak_rss_gib"] <= budget}
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
