#!/bin/bash
# Session 10, call 2: why the lean layers do not win at 1.5b/256 (call1: split 2205, lean
# 2215-2218 us): the replayed step's kernels with each decode path forced.
export PYTHONPATH=$PWD
source benchmarks/triton_cache.sh restore
for lean in off kernel silu; do
  timeout 100 python benchmarks/engine_step.py --preset qwen2.5-1.5b --rows 256 --lean $lean --kernels 40 --json $OUT/step15_$lean.json 2>&1 | grep -v -i warn | grep "|\|tok/s"
done
bash benchmarks/triton_cache.sh save $OUT
