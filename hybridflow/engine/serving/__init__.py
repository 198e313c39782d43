"""The engine as a request-level server on its own thread: RolloutService, request handles, its CUDA stream."""
