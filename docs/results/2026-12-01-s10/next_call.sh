#!/bin/bash
# Next session's first call (written in session 10, not run): resolve the ~1-2% effects that
# whole-call runs in separate processes could not (engine/NOTES.md run 14), with both
# settings in one process and the calls interleaved (benchmarks/engine_ab.py).
export PYTHONPATH=$PWD
source benchmarks/triton_cache.sh restore
timeout 150 python benchmarks/engine_ab.py --preset qwen2.5-1.5b --prompts 256 --rounds 8 --a lean.MODE=off --b lean.MODE=auto --json $OUT/ab_lean15.json 2>&1 | grep -v -i warn
timeout 150 python benchmarks/engine_ab.py --preset qwen2.5-0.5b --prompts 1024 --rounds 8 --a lean.MODE=off --b lean.MODE=auto --json $OUT/ab_lean1024.json 2>&1 | grep -v -i warn
timeout 150 python benchmarks/engine_ab.py --preset qwen2.5-1.5b --prompts 256 --rounds 8 --a kernels.SILU_BLOCK=512 --b kernels.SILU_BLOCK=1024 --json $OUT/ab_silu15.json 2>&1 | grep -v -i warn
bash benchmarks/triton_cache.sh save $OUT
