#!/bin/bash
# Session 8, call 7 (the last ~160 s of device time): attention_kernels.STORE_LAST off vs on
# in one process (the new token's store after the loop, its load and RoPE still in front),
# then the kernel's GPU test with both settings.
export PYTHONPATH=$PWD
timeout 70 python benchmarks/engine_attention.py --store-order --out $OUT 2>&1 | grep STORE_LAST
timeout 25 python -m pytest -q -m gpu tests/engine/test_kernels.py -k "rope_equals" -p no:cacheprovider 2>&1 | tail -2
