#!/bin/bash
# Session 12 call4: call3 found split prefixes slower (x2 +5 us, x3 +8 us...) and a launch of
# one program per possible entry (rows x kv heads x splits, mostly empty) the likely cause.
# Now a fixed grid (PREFIX_PROGRAMS) walks the work items. GPU tests; the sweep of tiles x
# splits x programs; whole generations with splits 1 vs auto at 0.5b, 64 prompts x n = 8.
export PYTHONPATH=$PWD
source benchmarks/triton_cache.sh restore
timeout 170 python -m pytest -q -m gpu tests/engine/test_shared_prefix.py -p no:cacheprovider 2>&1 | tail -2
timeout 150 python benchmarks/engine_prefix.py --out $OUT 2>&1 | grep -v -i warn
timeout 110 python benchmarks/engine_ab.py --preset qwen2.5-0.5b --prompts 64 --n 8 --prompt-len 256 --rounds 6 --a shared_prefix.PREFIX_SPLITS=1 --b shared_prefix.PREFIX_SPLITS=None 2>&1 | grep -v -i warn | grep -v "attention tile"
