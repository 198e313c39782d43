#!/bin/bash
# Session 6, call 6: chunk graphs (graphs.CHUNK_GRAPHS: a chunk of decode steps as one
# multi-step graph) on/off through the CLI, their GPU bitwise test with the PDL test, and
# engine_step.py's launch patterns at 1024 rows.
export PYTHONPATH=$PWD
CLI="python -c 'import sys; from hybridflow.cli import main; sys.exit(main())'"
eval $CLI bench rollout --preset qwen2.5-0.5b --prompts 256 --repeats 5 --json $OUT/r256.json > $OUT/final.log 2>&1
eval $CLI bench rollout --preset qwen2.5-0.5b --prompts 256 --repeats 5 --no-hf --chunk-graphs off --json $OUT/r256_off.json >> $OUT/final.log 2>&1
eval $CLI bench rollout --preset qwen2.5-0.5b --prompts 1024 --repeats 3 --no-hf --json $OUT/r1024.json >> $OUT/final.log 2>&1
grep -v -i warn $OUT/final.log | grep -v "^ *_warn"
timeout 200 python -m pytest -q -m gpu tests/engine/test_kernels.py -k "chunk_graphs or pdl_launches" --durations=3 > $OUT/tests.txt 2>&1
tail -6 $OUT/tests.txt
timeout 100 python benchmarks/engine_step.py --preset qwen2.5-0.5b --rows 1024 --kernels 0 --json $OUT/step1024.json > $OUT/step.txt 2>&1
grep -v -i warn $OUT/step.txt
