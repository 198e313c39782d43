#!/bin/bash
# Session 5, call 4 (final numbers, code as committed: gemm.TMA auto = on, kv layout token):
# GPU tests of the TMA / layout / PDL paths, the three cases through the CLI, step
# anatomy at 1024 rows.
export PYTHONPATH=$PWD
CLI="python -c 'import sys; from hybridflow.cli import main; sys.exit(main())'"
timeout 220 python -m pytest -q -m gpu -x tests/engine/test_kernels.py tests/engine/test_chain.py -k "tma or fast_engine or pdl or rope or attention or chain" > $OUT/tests.txt 2>&1
eval $CLI bench rollout --preset qwen2.5-0.5b --prompts 256 --repeats 5 --json $OUT/r256.json > $OUT/final.log 2>&1
eval $CLI bench rollout --preset qwen2.5-0.5b --prompts 1024 --repeats 3 --no-hf --json $OUT/r1024.json >> $OUT/final.log 2>&1
eval $CLI bench rollout --preset qwen2.5-1.5b --prompts 256 --repeats 3 --json $OUT/r15.json >> $OUT/final.log 2>&1
timeout 60 python benchmarks/engine_step.py --preset qwen2.5-0.5b --rows 1024 --json $OUT/step1024.json > $OUT/step.txt 2>&1
tail -2 $OUT/tests.txt; cat $OUT/final.log $OUT/step.txt
