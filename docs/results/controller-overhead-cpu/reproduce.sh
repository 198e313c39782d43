#!/bin/bash
# Controller overhead (docs/performance-host.md): a 2-core CPU host, from the repository root.
# before.log: the ray backend of 545b2f0 (Ray carried a Batch's tensors out of band, any
# other tensor through torch's pickling), timed by this benchmark script; after.log: every
# backend and Ray's encodings; turns.log: the two correct encodings of a Batch, 30 rounds.
set -e
OUT=${OUT:-.}
git worktree add --detach /tmp/hybridflow-545b2f0 545b2f0
PYTHONPATH=/tmp/hybridflow-545b2f0 python benchmarks/controller_overhead.py --backends ray \
  --repeats 15 | tee $OUT/before.log
export PYTHONPATH=$PWD
python benchmarks/controller_overhead.py --encodings --repeats 15 | tee $OUT/after.log
python benchmarks/controller_overhead.py --backends --repeats 30 --encodings \
  "Batch pickle (copy)" "numpy views (copy)" "numpy views (read-only)" | tee $OUT/turns.log

# The local backend's segments reused from call to call (docs/performance-host.md, "Controller
# overhead"): local-before.log at 1da2e15 (a fresh /dev/shm file per message), run from that
# tree (the fork server imports hybridflow from the current directory); local-after.log: every
# backend in one run; steps.log: the transfer step by step.
git worktree add --detach /tmp/hybridflow-1da2e15 1da2e15
(cd /tmp/hybridflow-1da2e15 && PYTHONPATH=$PWD python benchmarks/controller_overhead.py \
  --backends local --repeats 15) | tee $OUT/local-before.log
python benchmarks/controller_overhead.py --repeats 15 | tee $OUT/local-after.log
python benchmarks/shared_memory_steps.py | tee $OUT/steps.log
