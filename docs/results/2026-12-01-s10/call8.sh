#!/bin/bash
# Session 10, call 8 (the budget's last ~300 s): cuBLAS library and workspace settings at the
# decode matmul shapes (benchmarks/engine_blas.py), one process per setting.
export PYTHONPATH=$PWD
timeout 45 python benchmarks/engine_blas.py --json $OUT/default.json 2>&1 | grep -v -i warn
CUBLAS_WORKSPACE_CONFIG=:65536:2 timeout 45 python benchmarks/engine_blas.py --json $OUT/ws64.json 2>&1 | grep -v -i warn
timeout 45 python benchmarks/engine_blas.py --lib cublaslt --json $OUT/lt.json 2>&1 | grep -v -i warn
TORCH_CUBLASLT_WORKSPACE_SIZE=65536 timeout 45 python benchmarks/engine_blas.py --lib cublaslt --json $OUT/lt64.json 2>&1 | grep -v -i warn
