#!/bin/bash
# Resident memory of 80 offline training steps on the quickstart's data (runs/quickstart, from `make demo`) at three
# sizes of oneDNN's primitive cache: torch's default 1,024, 8, and 64 (what `import paradraft` sets since
# 2026-12-04). One thread, anonymous RSS sampled every 5 s. The log beside this script is the 2026-12-04 run (its
# rows "default", "cap" and "pkg": the last with no variable in the shell, the bound set by `import paradraft`).
cd "$(dirname "$0")/../../.." || exit 1
export HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1
for cap in 1024 8 64; do
  rm -rf "/tmp/memprobe-$cap"
  ONEDNN_PRIMITIVE_CACHE_CAPACITY=$cap .venv/bin/paradraft train --data runs/quickstart/data \
    --hidden-states runs/quickstart/hidden_states --output "/tmp/memprobe-$cap" --max-steps 80 --batch-tokens 2048 \
    --val-samples 1 --save-every 1000 > "/tmp/memprobe-$cap.log" 2>&1 &
  pid=$!
  while kill -0 $pid 2>/dev/null; do
    echo "$cap $(date +%T) $(awk '/RssAnon/{print $2}' /proc/$pid/status 2>/dev/null) \
$(tail -1 "/tmp/memprobe-$cap/metrics.jsonl" 2>/dev/null | cut -c1-14)"
    sleep 5
  done
done
