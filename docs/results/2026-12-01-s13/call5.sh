#!/bin/bash
# Session 13 call5: attention_kernels.START_PREFETCH (each program asks L2 for its row's first
# positions before q's loads and RoPE). call4 found the 0.5b attention 28-38% over a
# read-only kernel at 256-380 positions (1.5b: within 1-6%): a fixed start-up per program?
# 1. GPU tests (bitwise unchanged outputs; the fused RoPE kernel's equality tests);
# 2. the tuned attention at START_PREFETCH 0/128/256/1024, n = 1 shapes and a call's lengths;
# 3. whole generations 0 vs 256 at 0.5b/256 and 0.5b/1024.
export PYTHONPATH=$PWD
source benchmarks/triton_cache.sh restore
timeout 150 python -m pytest -q -m gpu tests/engine/test_kernels.py -k "start_prefetch or rope_equals" 2>&1 | tail -3
timeout 200 python benchmarks/engine_attention.py --start-prefetch --out $OUT 2>&1 | grep -v -i warn
timeout 120 python benchmarks/engine_ab.py --preset qwen2.5-0.5b --prompts 256 --rounds 6 --a attention_kernels.START_PREFETCH=0 --b attention_kernels.START_PREFETCH=256 --json $OUT/ab_256.json 2>&1 | grep -v -i warn | grep -v "attention tile"
timeout 120 python benchmarks/engine_ab.py --preset qwen2.5-0.5b --prompts 1024 --rounds 4 --a attention_kernels.START_PREFETCH=0 --b attention_kernels.START_PREFETCH=256 --json $OUT/ab_1024.json 2>&1 | grep -v -i warn | grep -v "attention tile"
