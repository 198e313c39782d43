#!/bin/bash
# Session 10, call 9 (call8's machine, still warm; the command as it ran, one line): cuBLAS
# workspace sizes at three shapes, then 1.5b/256 end to end with torch's default workspace
# and with CUBLAS_WORKSPACE_CONFIG=:65536:2. Only the first JSON came back ($OUT refuses
# names with ':'); the numbers are in the README.
export PYTHONPATH=$PWD; for ws in :16384:2 :32768:1 :65536:2; do CUBLAS_WORKSPACE_CONFIG=$ws timeout 30 python benchmarks/engine_blas.py --json $OUT/ws$ws.json 2>&1 | grep -v -i warn | grep "CONFIG\|1.5b/256 down\|gate_up\|0.5b/1024 down"; done; CLI="python -c 'import sys; from hybridflow.cli import main; sys.exit(main())'"; for ws in "" ":65536:2"; do CUBLAS_WORKSPACE_CONFIG=$ws eval timeout 70 $CLI bench rollout --preset qwen2.5-1.5b --prompts 256 --repeats 3 --no-hf --json $OUT/r15ws$ws.json 2>&1 | grep "tok/s" | sed "s/^/ws=$ws /"; done
