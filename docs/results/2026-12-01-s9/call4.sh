#!/bin/bash
# Session 9, call 4: where the host's time goes in a warm 0.5b/1024 generate() (cProfile):
# call3's timeline showed the GPU idle during admissions on a slow host (the eager prefill
# launches every kernel from Python: ~17 ms of host per 16k-token admission on call2's host
# against ~21 ms of GPU work).
export PYTHONPATH=$PWD
source benchmarks/triton_cache.sh restore
cd benchmarks
timeout 150 python engine_host.py --preset qwen2.5-0.5b --rows 1024 --top 45 > $OUT/host_1024.txt 2>&1
grep -v -i warn $OUT/host_1024.txt | head -120
