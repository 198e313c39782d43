#!/bin/bash
# Session 8, call 2: the persistent gate/up kernel (gemm_persistent.py; TAIL removed after
# call1). GPU tests (bitwise equal to gemm_nt, the tuner's candidates), then the CLI with
# --persistent on vs off at 0.5b/1024 (prefill 16384-row and 1024-row decode gate/up), and
# 1.5b/256 (prefill only: decode buckets below 1024 rows get no persistent candidates).
export PYTHONPATH=$PWD
CLI="python -c 'import sys; from hybridflow.cli import main; sys.exit(main())'"
timeout 150 python -m pytest -q -m gpu tests/engine/test_kernels.py -k "persistent or gemm_nt or decode_matmul" -p no:cacheprovider > $OUT/gpu_tests.txt 2>&1
tail -4 $OUT/gpu_tests.txt
for ps in on off on; do
  eval timeout 80 $CLI bench rollout --preset qwen2.5-0.5b --prompts 1024 --repeats 5 --no-hf --persistent $ps --json $OUT/r1024_$ps.json 2>&1 | grep -v -i warn | grep "tok/s"
done
eval timeout 110 $CLI bench rollout --preset qwen2.5-1.5b --prompts 256 --repeats 3 --no-hf --persistent on --json $OUT/r15_on.json 2>&1 | grep -v -i warn | grep "tok/s"
for f in r1024_on r1024_off r15_on; do python -c "
import json; d=json.load(open('$OUT/$f.json'))['engine']
print('$f', round(d['tokens_per_s']), d['ttft_s'], d['runs_s'], d['chain_decisions'])
for k,v in d['matmul_timings_us'].items():
    print('  ', k, sorted(v.items(), key=lambda kv: kv[1])[:5])" 2>&1 | tail -8; done
