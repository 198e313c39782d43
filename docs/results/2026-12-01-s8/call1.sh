#!/bin/bash
# Session 8, call 1: the staged TAIL split (last partial wave of gate/up split along K) on the
# GPU for the first time: its kernel tests, then the CLI with --tail-split on vs off at
# qwen2.5-1.5b/256 and qwen2.5-0.5b/1024. The Triton cache goes back in $OUT for later calls.
export PYTHONPATH=$PWD
export TRITON_CACHE_DIR=$PWD/.cache/triton
CLI="python -c 'import sys; from hybridflow.cli import main; sys.exit(main())'"
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
timeout 200 python -m pytest -q -m gpu tests/engine/test_kernels.py -k "tail or gemm" -x -p no:cacheprovider > $OUT/gpu_tests.txt 2>&1
tail -4 $OUT/gpu_tests.txt
for ts in on off; do
  eval timeout 110 $CLI bench rollout --preset qwen2.5-1.5b --prompts 256 --repeats 3 --no-hf --tail-split $ts --json $OUT/r15_$ts.json 2>&1 | grep -v -i warn | grep "tok/s"
  eval timeout 80 $CLI bench rollout --preset qwen2.5-0.5b --prompts 1024 --repeats 5 --no-hf --tail-split $ts --json $OUT/r1024_$ts.json 2>&1 | grep -v -i warn | grep "tok/s"
done
for f in r15_on r15_off r1024_on r1024_off; do python -c "
import json; d=json.load(open('$OUT/$f.json'))['engine']
print('$f', d['tokens_per_s'], d['runs_s'])
for k,v in d['matmul_timings_us'].items():
    print('  ', k, v)" 2>&1 | tail -20; done
tar czf $OUT/triton_cache.tgz -C .cache triton && ls -la $OUT/triton_cache.tgz
