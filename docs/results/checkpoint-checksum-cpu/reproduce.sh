#!/bin/bash
# Checkpoint checksums (docs/performance.md): a 2-core CPU host, from the repository root.
# Writes checksum.json (the rows) into $OUT; the table on stdout.
set -e
export PYTHONPATH=$PWD
OUT=${OUT:-.}
python benchmarks/checkpoint_checksum.py --gib 1 --repeats 5 --json $OUT/checksum.json \
  | tee $OUT/checksum.log
