"""hybridflow/errors.py: what the command line prints for user errors, environment
failures, CUDA out-of-memory and bugs."""

import errno

import pytest

from hybridflow.controller.errors import WorkerError
from hybridflow.errors import UserError, as_user_error, format_oom, report

# torch's CUDA caching allocator message, as a run on an 80 GB GPU prints it.
TORCH_OOM = (
    "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 3 has a total capacity of 79.15 GiB "
    "of which 1.02 GiB is free. Including non-PyTorch memory, this process has 78.11 GiB "
    "memory in use. Of the allocated memory 75.50 GiB is allocated by PyTorch, and 1.61 GiB "
    "is reserved by PyTorch but unallocated."
)


def test_user_error_prints_message_and_fix_without_traceback():
    def load():
        raise UserError("data.jsonl: line 3: not valid JSON", "fix the line")

    with pytest.raises(UserError) as info:
        load()
    text, status = report(info.value, debug=False)
    assert status == 2 and text == "error: data.jsonl: line 3: not valid JSON: fix the line"


def test_debug_shows_the_traceback_of_a_user_error_too():
    try:
        raise UserError("bad value")
    except UserError as error:
        text, status = report(error, debug=True)
    assert status == 2 and "Traceback" in text and text.rstrip().endswith("error: bad value")


def test_a_bug_keeps_its_traceback_and_says_it_is_a_bug():
    try:
        {}["missing"]
    except KeyError as error:
        text, status = report(error, debug=False)
    assert status == 1 and "Traceback" in text and "KeyError" in text and "bug" in text


def test_a_full_disk_names_the_path():
    error = OSError(errno.ENOSPC, "No space left on device", "/runs/demo/checkpoints/x.pt")
    text, status = report(error, debug=False)
    assert status == 2 and "no space left" in text and "/runs/demo/checkpoints/x.pt" in text
    assert "Traceback" not in text


def test_oom_names_stage_rank_and_memory_and_the_knobs():
    import torch

    # A synthetic torch.OutOfMemoryError with the allocator's real wording.
    text, status = report(torch.OutOfMemoryError(TORCH_OOM), debug=False)
    assert status == 2 and "Traceback" not in text
    assert "GPU 3" in text and "tried to allocate 2.00 GiB" in text
    assert "in use by this process 78.11 GiB" in text and "free 1.02 GiB" in text
    assert "actor.micro_batch_size_per_gpu" in text and "gradient_checkpointing" in text


def test_oom_in_a_worker_names_its_method_and_rank():
    error = WorkerError("fused", "actor", 2, "actor.update", f"OutOfMemoryError: {TORCH_OOM}")
    message = str(as_user_error(error))
    assert "in actor.update on rank 2 (GPU 3)" in message
    assert format_oom("CUDA out of memory.") .startswith("CUDA out of memory. To fit")  # fmt: skip


def test_a_user_error_raised_in_a_worker_is_shown_alone():
    error = WorkerError(
        "fused", "actor", 0, "__init__", "UserError: x/model.safetensors is truncated",
        "Traceback (most recent call last): ...", user_error=True,
    )  # fmt: skip
    text, status = report(error, debug=False)
    assert status == 2 and "Traceback" not in text
    assert "x/model.safetensors is truncated" in text and "rank 0" in text


HOST_OOM_TEXT = (
    "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
    "you tried to allocate 819200008192 bytes. Error code 12 (Cannot allocate memory)"
)


def test_a_refused_host_allocation_is_a_user_error_naming_its_size_and_the_knobs():
    text, status = report(RuntimeError(HOST_OOM_TEXT), debug=False)
    assert status == 2 and "Traceback" not in text and "bug" not in text
    assert "out of host memory: tried to allocate 762.9 GiB" in text
    assert "rollout.max_num_seqs" in text


def test_a_refused_host_allocation_in_a_worker_names_its_method_and_rank():
    error = WorkerError("fused", "rollout", 1, "rollout.generate", f"RuntimeError: {HOST_OOM_TEXT}")
    text, status = report(error, debug=False)
    assert status == 2 and "Traceback" not in text
    assert "out of host memory in rollout.generate on rank 1: tried to allocate 762.9 GiB" in text
