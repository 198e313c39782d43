#!/bin/bash
# Session 13 call6: GPU tests after removing the stream-K gate/up (test_gemm.py changed) and
# reverting the two experiments (test_kernels.py, test_shared_prefix.py back to session 12's).
export PYTHONPATH=$PWD
source benchmarks/triton_cache.sh restore
timeout 280 python -m pytest -q -m gpu tests/engine/test_gemm.py tests/engine/test_shared_prefix.py -k "not generations" 2>&1 | tail -3
