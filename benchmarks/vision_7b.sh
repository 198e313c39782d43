#!/bin/bash
# Vision-language measurements at the Qwen2.5-VL-7B shape (the qwen2.5-vl-7b preset, random
# weights), one H200 or H100, from the repository root, within one 10-minute command
# (estimated ~2.5 + ~5 minutes; not yet timed on a GPU):
#   1. rollout tok/s against HF generate (transformers' Qwen2_5_VLForConditionalGeneration on
#      the same tensors), the same prompts and pixels, in one process;
#   2. a GRPO step (s/step) against TRL's GRPOTrainer on the same checkpoint, prompts and
#      images, in one process (benchmarks/grpo_vs_trl.py --which both).
# Images: Geometry3K-sized random RGB pictures, 256x256, 384x288, 448x448 and 576x432 in turn
# (81, 140, 256 and 315 image tokens at 28-pixel merged patches, 198 on average), one before
# each prompt's 64 random text tokens; n = 5 samples a prompt, verl's geo3k recipe's.
#
# hybridflow's GRPO side runs with model.dtype=bfloat16: bf16 weights, gradients and AdamW
# states, as TRL trains a model loaded in bf16 (the fp32-master default needs ~150 GiB at 7B;
# its memory plan names optimizer offload or bf16). Both freeze the vision tower
# (actor.freeze_vision_tower's default; grpo_vl.py freezes TRL's). The first GRPO step of
# each side is a warm-up (compilation); s/step is the second. The rollout bench pins the
# engine's timing choices in $CACHE, which the GRPO side's engine then reads.
#
# Each part has its own time limit (3.5 + 6 minutes), so a slow first part leaves the second
# its time; hybridflow's GRPO steps print their time and stages as each ends (a cut run
# still says how far it got); logs and JSON go to $OUT as each part ends. TRL missing:
# TRL_WHEEL=<its wheel> installs it (--no-deps), else the GRPO part measures hybridflow
# alone and says so.
set -uo pipefail
export PYTHONPATH=$PWD TRITON_CACHE_DIR=$PWD/.cache/triton TORCHINDUCTOR_CACHE_DIR=$PWD/.cache/inductor
OUT=${OUT:-.}
CACHE=$PWD/.cache/hf
mkdir -p "$OUT" "$CACHE"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"

timeout 210 python -m hybridflow bench rollout --preset qwen2.5-vl-7b --prompts 64 --n 5 \
    --prompt-len 64 --new-tokens 256 --images-per-prompt 1 \
    --image-size 256x256,384x288,448x448,576x432 --cache-dir "$CACHE" \
    --json "$OUT/rollout-vl-7b.json" 2>&1 | tee "$OUT/rollout-vl-7b.log"

WHICH=both
if ! python -c "import trl, datasets" 2>/dev/null; then
    [ -n "${TRL_WHEEL:-}" ] && pip install --no-deps "$TRL_WHEEL" >"$OUT/trl-install.log" 2>&1
    python -c "import trl, datasets" 2>/dev/null || { WHICH=hybridflow;
        echo "TRL (or datasets) is not importable here: the GRPO part measures hybridflow alone" | tee "$OUT/grpo-vl-7b.note"; }
fi
timeout 370 python benchmarks/grpo_vs_trl.py --which $WHICH --preset qwen2.5-vl-7b \
    --prompts 16 --samples 5 --prompt-len 64 --new-tokens 128 --steps 2 --trl-micro-batch 16 \
    --images-per-prompt 1 --image-size 256x256,384x288,448x448,576x432 \
    --override model.dtype=bfloat16 --override trainer.cache_dir="$CACHE" \
    --model-dir /tmp/vl7b --json "$OUT/grpo-vl-7b.json" 2>&1 | tee "$OUT/grpo-vl-7b.log"
