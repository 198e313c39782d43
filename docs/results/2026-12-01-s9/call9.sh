#!/bin/bash
# Session 9, call 9: the stream-K gate/up (gemm_persistent.gemm_streamk) on the GPU: its
# kernel test (equal to gemm_nt for whole tiles, close and deterministic for cut ones), then
# 1.5b/256 and 0.5b/256 through the CLI with the tuner timing it (no HF: the budget is ~270 s).
export PYTHONPATH=$PWD
source benchmarks/triton_cache.sh restore
CLI="python -c 'import sys; from hybridflow.cli import main; sys.exit(main())'"
timeout 60 python -m pytest -q -m gpu tests/engine/test_kernels.py -k "streamk" -p no:cacheprovider 2>&1 | tail -2
eval timeout 90 $CLI bench rollout --preset qwen2.5-1.5b --prompts 256 --repeats 3 --no-hf --json $OUT/r15.json 2>&1 | grep -v -i warn | grep "tok/s"
eval timeout 50 $CLI bench rollout --preset qwen2.5-0.5b --prompts 256 --repeats 3 --no-hf --json $OUT/r256.json 2>&1 | grep -v -i warn | grep "tok/s"
for f in r15 r256; do python -c "
import json; d=json.load(open('$OUT/$f.json'))['engine']
print('$f', round(d['tokens_per_s']), d['runs_s'])
for k, v in d['matmul_timings_us'].items():
    if k.startswith('(256'): print('  ', k, sorted(v.items(), key=lambda x: x[1])[:6])"; done
