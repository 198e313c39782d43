#!/bin/bash
# Session 6, call 1: where the step goes (engine_step.py at the mean cache length, with the
# step's top kernels) for the three cases, and the decode attention next to its read
# floors (same-grid read-only kernel, a persistent flattened read-only kernel, torch.sum).
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > $OUT/gpu.txt
timeout 200 python benchmarks/engine_attention.py --out $OUT > $OUT/attention.txt 2>&1
for case in "qwen2.5-0.5b 256" "qwen2.5-0.5b 1024" "qwen2.5-1.5b 256"; do
  set -- $case
  timeout 120 python benchmarks/engine_step.py --preset $1 --rows $2 --kernels 30 --json $OUT/step_$1_$2.json >> $OUT/step.txt 2>&1
done
cat $OUT/attention.txt | grep -v "^ *floor: token read-only persistent" ; grep "persistent" $OUT/attention.txt | sort -t: -k3 -n | head -12; cat $OUT/step.txt
