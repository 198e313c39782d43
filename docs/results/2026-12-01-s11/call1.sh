#!/bin/bash
# Session 11, call 1: session 10's prepared A/Bs (next_call.sh: lean off vs auto, SiLU block
# 512 vs 1024, both settings in one process, calls interleaved), then a timeline of a 1.5b
# call (where its 165 ms before the first decode step goes), then the Triton cache.
export PYTHONPATH=$PWD
source benchmarks/triton_cache.sh restore
timeout 150 python benchmarks/engine_ab.py --preset qwen2.5-1.5b --prompts 256 --rounds 8 --a lean.MODE=off --b lean.MODE=auto --json $OUT/ab_lean15.json 2>&1 | grep -v -i warn
timeout 150 python benchmarks/engine_ab.py --preset qwen2.5-0.5b --prompts 1024 --rounds 8 --a lean.MODE=off --b lean.MODE=auto --json $OUT/ab_lean1024.json 2>&1 | grep -v -i warn
timeout 120 python benchmarks/engine_ab.py --preset qwen2.5-1.5b --prompts 256 --rounds 6 --a kernels.SILU_BLOCK=512 --b kernels.SILU_BLOCK=1024 --json $OUT/ab_silu15.json 2>&1 | grep -v -i warn
timeout 100 python benchmarks/engine_timeline.py --preset qwen2.5-1.5b --rows 256 --json $OUT/timeline15.json 2>&1 | grep -v -i warn | head -40
bash benchmarks/triton_cache.sh save $OUT
ls -la $OUT
