#!/bin/bash
# Session 9, call 10 (the last ~180 s of the budget): stream-K after call9 — cut tiles summed
# from the parking area in row chunks, and a 256 x 128 tile (each weight tile through L2
# once at 256 rows). Its GPU tests, then the tuner's times at the M = 256 gate/up shapes.
export PYTHONPATH=$PWD
source benchmarks/triton_cache.sh restore
timeout 50 python -m pytest -q -m gpu tests/engine/test_kernels.py -k "streamk" -p no:cacheprovider 2>&1 | tail -2
timeout 60 python benchmarks/engine_streamk.py --json $OUT/streamk.json 2>&1 | grep -v -i warn
