#!/bin/bash
# Session 13 call2: shared_prefix.KERNEL "l2" (no prefix kernel: each row reads its prompt's
# prefix from the first sample's slot, so a prompt's samples hit the same addresses and L2
# serves all but the first read) against the pair of kernels.
# 1. GPU tests of the shared-prefix kernels (both kernels, engine-level generations);
# 2. engine_prefix.py --pdl-only: plain, l2 and the pair per layer at GRPO shapes;
# 3. whole generations pair vs l2, 0.5b and 1.5b, 64 prompts x 8, 256-token prompts.
export PYTHONPATH=$PWD
source benchmarks/triton_cache.sh restore
timeout 240 python -m pytest -q -m gpu tests/engine/test_shared_prefix.py 2>&1 | tail -4
timeout 120 python benchmarks/engine_prefix.py --pdl-only --out $OUT 2>&1 | grep -v -i warn
for preset in qwen2.5-0.5b qwen2.5-1.5b; do
timeout 150 python benchmarks/engine_ab.py --preset $preset --prompts 64 --n 8 --prompt-len 256 --rounds 4 --a shared_prefix.KERNEL=pair --b shared_prefix.KERNEL=l2 --json $OUT/ab_$preset.json 2>&1 | grep -v -i warn | grep -v "attention tile"
done
