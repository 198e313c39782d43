#!/bin/bash
# Written in session 8 for the next session's first call (session 8's device budget was spent
# before it could run): attention_kernels.STORE_LAST off vs on in one process (the new token's
# store after the loop, its load and RoPE still in front), the kernel's GPU test with both
# settings, and the Triton cache saved for the calls after it (benchmarks/triton_cache.sh).
export PYTHONPATH=$PWD
source benchmarks/triton_cache.sh restore
timeout 90 python benchmarks/engine_attention.py --store-order --out $OUT 2>&1 | grep STORE_LAST
timeout 60 python -m pytest -q -m gpu tests/engine/test_kernels.py -k "rope_equals" -p no:cacheprovider 2>&1 | tail -2
bash benchmarks/triton_cache.sh save $OUT
