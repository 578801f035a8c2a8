#!/usr/bin/env bash
# The seed's run: a P-EAGLE drafter for Qwen3-8B on 4 GPUs (docs/guides/train-on-gpus.md sizes it: ~41 GB per H100
# online, ~2 minutes an epoch by formula). Every knob is an environment variable, so the same script runs in a small
# CPU form in CI (tests/test_examples.py): a tiny verifier, 2 gloo processes, a dozen conversations.
#
#   examples/train_qwen3_8b_4gpu.sh                       # the real run (needs the model in the HF cache or network)
#   VERIFIER=path/to/tiny NPROC=2 DEVICE=cpu SAMPLES=12 SEQ=256 DRAFT_VOCAB=256 MAX_STEPS=2 examples/train_qwen3_8b_4gpu.sh
set -euo pipefail
VERIFIER=${VERIFIER:-Qwen/Qwen3-8B}
DATA=${DATA:-sharegpt}            # a built-in source, a ShareGPT / messages JSON(L), or a datasets directory
SAMPLES=${SAMPLES:-5000}          # the seed's 5,000 samples
SEQ=${SEQ:-8192}
DRAFT_VOCAB=${DRAFT_VOCAB:-32000}
NPROC=${NPROC:-4}
DEVICE=${DEVICE:-cuda}            # cuda: each torchrun rank takes cuda:LOCAL_RANK
DEPTHS=${DEPTHS:-8}
WORK=${WORK:-runs/qwen3-8b}
PY=${PY:-python}
STEPS=${MAX_STEPS:+--max-steps $MAX_STEPS}
PORT=${MASTER_PORT:-29561}

pd() { "$PY" -m paradraft "$@"; }
tr() { "$PY" -m torch.distributed.run --nproc_per_node "$NPROC" --master_port "$PORT" -m paradraft "$@"; }

# 1. on-policy answers: the verifier answers the user turns itself (ranks split the conversations)
tr regenerate --verifier "$VERIFIER" --data "$DATA" --max-samples "$SAMPLES" --device "$DEVICE" -o "$WORK/regen.jsonl"
# 2. tokens and the assistant loss mask; 3. the draft vocabulary
pd prepare --verifier "$VERIFIER" --data "$WORK/regen.jsonl" --seq-length "$SEQ" -o "$WORK/data"
pd vocab --data "$WORK/data" --size "$DRAFT_VOCAB" --fill -o "$WORK/vocab.safetensors"
# 4. train online (the verifier runs inside training: nothing on disk), DDP over the ranks
tr train --data "$WORK/data" --online --vocab "$WORK/vocab.safetensors" --num-depths "$DEPTHS" \
    --batch-tokens "$SEQ" --device "$DEVICE" $STEPS -o "$WORK/peagle"
# 5. the checkpoint vLLM serves, and the serve command with the K held-out validation supports
pd export "$WORK/peagle" -o "$WORK/export"
