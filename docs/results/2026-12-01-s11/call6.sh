#!/bin/bash
# Session 11, call 6: the GPU tests call5's timeout cut (stop tokens through lagged snapshots
# on CUDA, the lean layers, PDL).
export PYTHONPATH=$PWD
source benchmarks/triton_cache.sh restore
timeout 280 python -m pytest -q -m gpu tests/engine/test_kernels.py tests/engine/test_lean.py -k "lagged or lean or pdl" -p no:cacheprovider 2>&1 | tail -4
