# The README's two commands. Each sets itself up from a fresh clone and is quick once set up.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup test demo lint clean

$(PY):
	python3 -m venv $(VENV)

# torch first, pinned to the CPU build on this machine's disk when none is installed,
# so an unpinned requirement never pulls a multi-GB CUDA build.
$(STAMP): pyproject.toml | $(PY)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

# The Triton kernels on the CPU through the interpreter (run as numpy; the main run skips
# them, and compiles each one for sm_90 instead).
KERNEL_TESTS := tests/engine/test_adapters_fused.py tests/engine/kernels/test_kernels.py tests/engine/kernels/test_gemm.py tests/engine/layers/test_chain.py tests/engine/layers/test_lean.py tests/engine/kernels/test_shared_prefix.py \
	tests/engine/kernels/test_sampler_fused.py tests/models/heads/test_logprob_kernels.py tests/models/heads/test_fused_head_kernels.py tests/engine/serving/test_service_fused.py tests/engine/test_fp8_engine.py tests/engine/kernels/test_fp8_kernels.py \
	tests/engine/test_paged_fused.py tests/engine/test_tensor_parallel_fused.py tests/engine/kernels/test_paged_attention.py tests/engine/kernels/test_sink_attention.py \
	tests/engine/kernels/experts/test_moe_kernels.py tests/engine/kernels/experts/test_moe_engine_fused.py tests/engine/kernels/test_delta_step.py tests/engine/kernels/test_latent_attention.py tests/engine/layers/test_moe_grouped_mm.py tests/engine/scheduling/test_mixed_fused.py tests/engine/speculative/test_verify_fused.py tests/engine/speculative/test_static_verify_fused.py \
	tests/engine/kernels/test_chunk_attention.py tests/engine/scheduling/test_static_step_fused.py tests/engine/layers/test_eager.py tests/engine/kernels/test_sink_prefill.py tests/engine/kernels/experts/test_biased_experts.py \
	tests/engine/layers/test_expert_step.py tests/engine/kernels/test_latent_rope.py tests/engine/kernels/experts/test_grouped_route.py \
	tests/engine/test_image_engine_fused.py tests/engine/test_expert_spread_fused.py

# The main run is spread over TEST_WORKERS processes (pytest-xdist, a test file to a
# process: most tests wait on processes of their own, so two keep both cores busy; the files
# with the most slow tests go first, so both finish together: tests/collection_order.py), and the
# kernel tests run in one more process beside it; their output follows the main run's.
# Fails if either failed.
TEST_WORKERS ?= 2
# One compute thread a test process: the test processes, the kernel run and the ranks they
# start share the host's cores, and torch's default (a thread per core in every process) has
# their OpenMP threads spin against each other. Measured on 2 cores: three test processes
# side by side took 120 s with torch's default, 72 s with one thread each.
test: export OMP_NUM_THREADS ?= 1
test: $(STAMP)
	@log=$$(mktemp); \
	TRITON_INTERPRET=1 $(PY) -m pytest -q -p no:cacheprovider $(KERNEL_TESTS) >$$log 2>&1 & \
	kernels=$$!; \
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder; main=$$?; \
	wait $$kernels; interpreted=$$?; \
	echo "== the Triton kernels under TRITON_INTERPRET=1 (run beside the tests above)"; \
	cat $$log; rm -f $$log; \
	exit $$(( main || interpreted ))

demo: $(STAMP)
	$(VENV)/bin/hybridflow train

lint: $(STAMP)
	$(VENV)/bin/ruff check hybridflow tests benchmarks dev
	$(VENV)/bin/ruff format --check hybridflow tests benchmarks dev

clean:
	rm -rf $(VENV) .pytest_cache
