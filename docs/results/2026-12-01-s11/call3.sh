#!/bin/bash
# Session 11, call 3: where a 0.5b call's prefill time goes (TTFT 187 ms of 1.04 s at 1024
# rows, 48 of 372 ms at 256): timelines (kernels launched by each admission vs its wall).
export PYTHONPATH=$PWD
source benchmarks/triton_cache.sh restore
for rows in 1024 256; do
timeout 120 python benchmarks/engine_timeline.py --preset qwen2.5-0.5b --rows $rows --json $OUT/timeline05_$rows.json 2>&1 | grep -v -i warn | grep -v "^  gap" | grep -v "_snapshot\|_retire\|FillFunc\|index_elementwise\|Memcpy\|vectorized_elementwise" | head -50
done
