#!/bin/bash
# Session 7, call 7 (final code, the machine of calls 4-6): the three cases once more.
export PYTHONPATH=$PWD
CLI="python -c 'import sys; from hybridflow.cli import main; sys.exit(main())'"
eval timeout 60 $CLI bench rollout --preset qwen2.5-0.5b --prompts 1024 --repeats 5 --no-hf --json $OUT/r1024.json 2>&1 | grep -v -i warn | grep "tok/s"
eval timeout 90 $CLI bench rollout --preset qwen2.5-0.5b --prompts 256 --repeats 5 --json $OUT/r256.json 2>&1 | grep -v -i warn | grep "tok/s"
eval timeout 110 $CLI bench rollout --preset qwen2.5-1.5b --prompts 256 --repeats 3 --json $OUT/r15.json 2>&1 | grep -v -i warn | grep "tok/s"
