#!/bin/bash
# The first generate() of a 7B engine with an empty and with a warm pinned-choices cache
# (two processes, the same cache directory), one H200.
set -euo pipefail
for run in cold warm; do
  hybridflow bench rollout --preset qwen2.5-7b --prompts 64 --new-tokens 64 --no-hf \
    --cache-dir /tmp/choices --json "$OUT/7b-$run.json"
done
