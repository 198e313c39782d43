#!/bin/bash
# Session 7, call 6: 0.5b/1024 with 16 decode steps per host read against the default 8
# (same machine, back to back).
export PYTHONPATH=$PWD
CLI="python -c 'import sys; from hybridflow.cli import main; sys.exit(main())'"
for s in 16 8; do
  eval timeout 120 $CLI bench rollout --preset qwen2.5-0.5b --prompts 1024 --repeats 5 --no-hf --steps-per-sync $s --json $OUT/r1024_s$s.json 2>&1 | grep -v -i warn | grep -v "^ *_warn" | grep tok/s
done
