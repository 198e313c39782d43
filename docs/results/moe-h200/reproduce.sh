#!/usr/bin/env bash
# Mixture of experts (Qwen3-30B-A3B, random bf16 weights) on one H200: docs/performance.md,
# "Mixture of experts". Run from the repository root with OUT set.
set -euo pipefail
export PYTHONPATH=$PWD
python benchmarks/rollout.py --out "$OUT" --only variants --presets qwen3-30b-a3b  # rollout.{json,log}
python benchmarks/moe_layer.py --out "$OUT" --tokens 256,1024,16384                 # moe-layer.json
python benchmarks/moe_layer.py --out "$OUT/align" --align --tokens 256,1024          # align.json (moe_align.json)
python benchmarks/moe_layer.py --out "$OUT/sweep" --sweep --tokens 256,1024,4096,16384  # moe-layer-sweep.json
python benchmarks/rollout.py --out "$OUT/gap" --only moegap                        # gap.json
python benchmarks/rollout.py --out "$OUT/profile" --only profile --profile-cases qwen3-30b-a3b:256
