#!/bin/bash
# Session 6, call 2: engine_attention.py again (call1's run stopped at the torch.sum floor).
export PYTHONPATH=$PWD
timeout 300 python benchmarks/engine_attention.py --out $OUT > $OUT/attention.txt 2>&1
grep -v "persistent" $OUT/attention.txt; grep "persistent" $OUT/attention.txt | sort -t: -k3 -n | head -12
