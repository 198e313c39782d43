#!/bin/bash
# Session 12 call5: final defaults (shared prefix on, one program per (group, kv head) from a
# fixed grid of 264, no prefix splits): whole generations off vs on at 0.5b and 1.5b, 64
# prompts x n = 8, 256-token prompts, 256 new tokens.
export PYTHONPATH=$PWD
source benchmarks/triton_cache.sh restore
for preset in qwen2.5-0.5b qwen2.5-1.5b; do
timeout 120 python benchmarks/engine_ab.py --preset $preset --prompts 64 --n 8 --prompt-len 256 --rounds 6 --a shared_prefix.MODE=off --b shared_prefix.MODE=auto 2>&1 | grep -v -i warn | grep -v "attention tile"
done
