#!/bin/bash
# Session 7, call 4 (final code): the engine-vs-trainer log-prob gap (fp32 and bf16 tiny-4l,
# bf16 qwen2.5-0.5b) re-measured, then the GPU tests not run in calls 1-3: the lagged-snapshot
# test of test_kernels (fp32, compiles ~2 min), tests/models and tests/algos.
export PYTHONPATH=$PWD
timeout 150 python benchmarks/rollout.py --out $OUT --only check > $OUT/check.txt 2>&1
grep -v -i warn $OUT/check.txt | grep -v "^ *_warn" | tail -30
timeout 200 python -m pytest -q -m gpu tests/engine/test_kernels.py -k lagged -p no:cacheprovider > $OUT/gpu_tests.txt 2>&1
tail -2 $OUT/gpu_tests.txt
timeout 120 python -m pytest -q -m gpu tests/models tests/algos -p no:cacheprovider >> $OUT/gpu_tests.txt 2>&1
tail -2 $OUT/gpu_tests.txt
