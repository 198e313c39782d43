#!/bin/bash
# Session 10, call 6: the lean decode paths end to end, same machine, processes alternated:
# --lean off (split / chain only) vs auto, at 1.5b/256 and 0.5b/1024.
export PYTHONPATH=$PWD
source benchmarks/triton_cache.sh restore
CLI="python -c 'import sys; from hybridflow.cli import main; sys.exit(main())'"
for run in "qwen2.5-1.5b 256 off a" "qwen2.5-1.5b 256 auto a" "qwen2.5-1.5b 256 off b" "qwen2.5-1.5b 256 auto b" "qwen2.5-0.5b 1024 off a" "qwen2.5-0.5b 1024 auto a"; do
  set -- $run
  eval timeout 80 $CLI bench rollout --preset $1 --prompts $2 --repeats 3 --no-hf --lean $3 --json $OUT/r_$1_$2_$3_$4.json 2>&1 | grep -v -i warn | grep "tok/s" | sed "s/^/$1 $2 lean=$3: /"
done
