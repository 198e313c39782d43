#!/bin/bash
# Session 7, call 2: the three cases through the CLI with DecodeMatmul.linear tuned
# per shape (cuBLAS or a gemm_nt tile for qkv, o_proj, down in prefill and the split decode
# layer), prompt ids checked around the first prefill, k rotated in place in prefill; then
# the Triton kernel GPU tests (rope_store k in place, the linear tuner, flash prefill).
export PYTHONPATH=$PWD
CLI="python -c 'import sys; from hybridflow.cli import main; sys.exit(main())'"
eval timeout 150 $CLI bench rollout --preset qwen2.5-0.5b --prompts 1024 --repeats 5 --no-hf --json $OUT/r1024.json > $OUT/cli.log 2>&1
eval timeout 150 $CLI bench rollout --preset qwen2.5-0.5b --prompts 256 --repeats 5 --json $OUT/r256.json >> $OUT/cli.log 2>&1
eval timeout 200 $CLI bench rollout --preset qwen2.5-1.5b --prompts 256 --repeats 3 --json $OUT/r15.json >> $OUT/cli.log 2>&1
grep -v -i warn $OUT/cli.log | grep -v "^ *_warn"
for f in r1024 r256 r15; do python -c "
import json,sys; d=json.load(open('$OUT/$f.json'))['engine']
print('$f', d['tokens_per_s'], d['runs_s'], d['chain_decisions'])
for k,v in d['matmul_timings_us'].items(): print('  ', k, v)"; done
timeout 240 python -m pytest -q -m gpu tests/engine/test_kernels.py -x -p no:cacheprovider > $OUT/gpu_tests.txt 2>&1
tail -5 $OUT/gpu_tests.txt
