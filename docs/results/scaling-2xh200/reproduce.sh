#!/bin/bash
# 2-GPU scaling (docs/performance.md): two NVIDIA H200 of one host, from the repository root.
set -e
export PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0
OUT=${OUT:-.}
python benchmarks/grpo_vs_trl.py --which hybridflow --scaling 1 2 --run-timeout 90 --model-dir /tmp/m05 \
    --json $OUT/grpo-step.json 2>&1 | tee $OUT/grpo-step.log
python benchmarks/train_scaling.py --gpus 1 2 --rows-per-gpu 48 --configs fsdp \
    --json $OUT/fsdp-update.json 2>&1 | tee $OUT/fsdp-update.log
python benchmarks/train_scaling.py --gpus 2 --rows-per-gpu 48 --configs fsdp --no-share-cores \
    --json $OUT/fsdp-update-no-share-cores.json 2>&1 | tee $OUT/fsdp-update-no-share-cores.log
