#!/bin/bash
# Session 8, call 4: anatomy of the 1024-row step with the persistent gate/up (engine_step.py:
# replayed step, its parts and top kernels), then the 1024 case with --persistent off / on
# once more (call2's machine was noisy: runs spread 1.06-1.20 s).
export PYTHONPATH=$PWD
CLI="python -c 'import sys; from hybridflow.cli import main; sys.exit(main())'"
timeout 150 python benchmarks/engine_step.py --preset qwen2.5-0.5b --rows 1024 --length 128 --kernels 30 --json $OUT/step1024.json > $OUT/step1024.txt 2>&1
grep -v -i warn $OUT/step1024.txt | tail -45
for ps in off on; do
  eval timeout 80 $CLI bench rollout --preset qwen2.5-0.5b --prompts 1024 --repeats 5 --no-hf --persistent $ps --json $OUT/r1024_$ps.json 2>&1 | grep -v -i warn | grep "tok/s"
  python -c "import json; d=json.load(open('$OUT/r1024_$ps.json'))['engine']; print('$ps', d['runs_s'], d['ttft_s'])"
done
