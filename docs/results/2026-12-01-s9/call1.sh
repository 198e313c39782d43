#!/bin/bash
# Session 9, call 1 (written in session 8 as its call7, which the budget refused; the 1024-row
# run added): attention_kernels.STORE_LAST off vs on in one process (the new token's store
# after the loop, its load and RoPE still in front), the kernel's GPU test with both settings,
# 0.5b/1024 through the CLI as this machine's reference, and the Triton cache saved for the
# calls after it (benchmarks/triton_cache.sh).
export PYTHONPATH=$PWD
source benchmarks/triton_cache.sh restore
CLI="python -c 'import sys; from hybridflow.cli import main; sys.exit(main())'"
timeout 100 python benchmarks/engine_attention.py --store-order --out $OUT 2>&1 | grep STORE_LAST
timeout 80 python -m pytest -q -m gpu tests/engine/test_kernels.py -k "rope_equals" -p no:cacheprovider 2>&1 | tail -2
eval timeout 150 $CLI bench rollout --preset qwen2.5-0.5b --prompts 1024 --repeats 5 --no-hf --json $OUT/r1024.json 2>&1 | grep -v -i warn | grep "tok/s"
bash benchmarks/triton_cache.sh save $OUT
ls -la $OUT
