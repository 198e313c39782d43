#!/bin/bash
# Session 5, call 1: GPU tests after the attention_kernels move, step anatomy, kernel profiles.
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv -lms 500 > $OUT/clocks.csv &
CLI="python -c 'import sys; from hybridflow.cli import main; sys.exit(main())'"
# cold-process variance probe first (clocks logged alongside)
eval $CLI bench rollout --preset qwen2.5-0.5b --prompts 256 --repeats 5 --no-hf --json $OUT/r256.json > $OUT/r256.log 2>&1
timeout 200 python -m pytest -q -m gpu tests/engine/test_kernels.py tests/engine/test_chain.py -x > $OUT/tests.txt 2>&1
for c in "qwen2.5-0.5b 256" "qwen2.5-0.5b 1024" "qwen2.5-1.5b 256"; do set -- $c
  timeout 150 python benchmarks/engine_step.py --preset $1 --rows $2 --json $OUT/step_$1_$2.json >> $OUT/step.txt 2>&1
done
timeout 180 python benchmarks/rollout.py --out $OUT/prof --only prefill,profile --prefill-cases qwen2.5-0.5b:1024,qwen2.5-1.5b:256 --profile-cases qwen2.5-0.5b:1024,qwen2.5-1.5b:256 > $OUT/prof.txt 2>&1
kill %1
tail -3 $OUT/tests.txt; cat $OUT/r256.log $OUT/step.txt
