#!/bin/bash
# Session 13 call4: does a program per row (all kv heads, one contiguous run per position)
# read the cache faster than a program per (row, kv head), at the n = 1 shapes? Read-only
# floors (engine_attention.py --row-reads) next to the tuned attention kernel.
export PYTHONPATH=$PWD
source benchmarks/triton_cache.sh restore
timeout 240 python benchmarks/engine_attention.py --row-reads --out $OUT 2>&1 | grep -v -i warn
