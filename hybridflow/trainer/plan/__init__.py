"""What a config costs before any model loads: the GPU and host memory plan, multi-GPU layouts, per-stage time floors; shared by `train`'s preflight and `hybridflow config validate` / `plan`."""
