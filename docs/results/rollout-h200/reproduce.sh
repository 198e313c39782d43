#!/bin/bash
# Rollout engine (docs/performance.md): one NVIDIA H200, from the repository root.
set -e
export PYTHONPATH=$PWD
OUT=${OUT:-.}
hybridflow bench rollout --preset qwen2.5-0.5b --prompts 1024 --repeats 5 --no-hf --json $OUT/qwen2.5-0.5b-1024.json
hybridflow bench rollout --preset qwen2.5-0.5b --prompts 256 --repeats 5 --json $OUT/qwen2.5-0.5b-256.json
hybridflow bench rollout --preset qwen2.5-1.5b --prompts 256 --repeats 3 --json $OUT/qwen2.5-1.5b-256.json
hybridflow bench rollout --preset qwen2.5-0.5b --prompts 64 --n 8 --prompt-len 256 --repeats 3
hybridflow bench rollout --preset qwen2.5-1.5b --prompts 64 --n 8 --prompt-len 256 --repeats 3
python benchmarks/engine_timeline.py --preset qwen2.5-1.5b --rows 256 --json $OUT/timeline-qwen2.5-1.5b-256.json
