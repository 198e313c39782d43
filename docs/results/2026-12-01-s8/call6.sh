#!/bin/bash
# Session 8, call 6: decode attention with the new token's k/v load, RoPE and cache store
# moved after the loop (the loop's first loads no longer wait behind a store). Its GPU tests,
# the attention benchmark (compare call5: 1024 rows at 130 / 256 / 380 cached positions),
# then the three cases through the CLI (HF in the same process at 256 prompts).
export PYTHONPATH=$PWD
CLI="python -c 'import sys; from hybridflow.cli import main; sys.exit(main())'"
timeout 100 python -m pytest -q -m gpu tests/engine/test_kernels.py -k "attention or fast_engine" -p no:cacheprovider > $OUT/gpu_tests.txt 2>&1
tail -2 $OUT/gpu_tests.txt
timeout 90 python benchmarks/engine_attention.py --out $OUT/attn > $OUT/attn.txt 2>&1; grep BEST $OUT/attn.txt
eval timeout 80 $CLI bench rollout --preset qwen2.5-0.5b --prompts 1024 --repeats 5 --no-hf --json $OUT/r1024.json 2>&1 | grep -v -i warn | grep "tok/s"
eval timeout 110 $CLI bench rollout --preset qwen2.5-0.5b --prompts 256 --repeats 5 --json $OUT/r256.json 2>&1 | grep -v -i warn | grep "tok/s"
eval timeout 130 $CLI bench rollout --preset qwen2.5-1.5b --prompts 256 --repeats 3 --json $OUT/r15.json 2>&1 | grep -v -i warn | grep "tok/s"
for f in r1024 r256 r15; do python -c "
import json; d=json.load(open('$OUT/$f.json'))['engine']
print('$f', round(d['tokens_per_s']), d['ttft_s'], d['runs_s'], d['chain_decisions'])"; done
