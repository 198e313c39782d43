"""Host memory before any model loads: a step's data on the controller, and on a CPU run the
model's memory plan, against the memory this machine has free. On several nodes the
controller's host holds its own GPUs' shares of the offloaded state (trainer.n_gpus_per_node
of them), not the whole run's: each node has its own memory.

A step's batch holds every sample of ``data.train_batch_size × rollout.n`` at full length on
the controller. ``rollout.n=100000000`` makes that terabytes: without this check the run
starts, and the kernel kills it minutes later. The bytes counted are a lower bound (the
tensors a step always builds, one copy; arrays of text beside them), so a refusal is certain
to be right; a run near the limit may still need more.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridflow.config import Config, Derived
from hybridflow.trainer.plan.memory_plan import GENERATE, GIB, STEP

# Per-token tensors of one sample in a step's batch (trainer/loop/stages.py):
INT64_PER_PROMPT_TOKEN = 3
"""prompts, prompt_mask, attention_mask (its prompt part)."""
INT64_PER_RESPONSE_TOKEN = 3
"""responses, attention_mask (its response part), token_versions."""
FLOAT32_PER_RESPONSE_TOKEN = 8
"""response_mask, rollout_logprobs, old_logprobs, entropy, token_level_scores,
token_level_rewards, advantages, returns (ref_logprobs and values come on top)."""
TEXT_BYTES_PER_SAMPLE = 100
"""The decoded response and its arrays (uid, ground truth, data source): Python objects
of about this many bytes each, plus a byte per response token."""


def sample_bytes(prompt_tokens: int, response_tokens: int, reference: bool, critic: bool) -> int:
    """Bytes one sample of a step takes on the controller, at least."""
    floats = FLOAT32_PER_RESPONSE_TOKEN + int(reference) + int(critic)
    return (
        8 * INT64_PER_PROMPT_TOKEN * prompt_tokens
        + (8 * INT64_PER_RESPONSE_TOKEN + 4 * floats + 1) * response_tokens
        + TEXT_BYTES_PER_SAMPLE
    )


@dataclass(frozen=True)
class HostNeed:
    """What a run needs of host memory, by part (bytes)."""

    samples: int
    """Samples of the larger of a training step and a validation pass."""
    data_bytes: int
    model_bytes: int
    """The memory plan's host items (offloaded weights and optimizer state), and on a CPU
    run, where the device is the host, the larger of what its optimizer step holds (every
    weight, the gradients and AdamW's state) and what its generation holds (the weights,
    AdamW's state and the rollout's KV cache: the engine zeroes every page of it up front, so
    a cache past the host's memory is its end). Activations and the engine's workspace are
    left out (estimates, not a lower bound)."""
    what: str = ""
    """Where the samples come from, for messages."""
    model_what: str = "the model's offloaded state"
    """What model_bytes counts, for messages."""
    on_cpu: bool = False
    """model_bytes is a CPU run's whole model (else what a GPU run offloads to the host)."""
    kv_cache_bytes: int = 0
    """The part of model_bytes that is the rollout's KV cache (a CPU run's generation)."""

    @property
    def total(self) -> int:
        return self.data_bytes + self.model_bytes


def host_need(cfg: Config, derived: Derived, plan=None, on_cpu: bool = False) -> HostNeed:
    """The host bytes of a step's data and of the model (``plan``: the run's MemoryPlan, or
    None when the model's shape is unknown)."""
    d = cfg.data
    validation = d.val_batch_size * max(cfg.rollout.val_n, 1) if d.val_files else 0
    samples = max(derived.samples_per_step, validation)
    if samples == derived.samples_per_step:
        what = (f"a training step is {samples:,} samples (data.train_batch_size = "
                f"{d.train_batch_size} × rollout.n = {cfg.rollout.n})")  # fmt: skip
    else:
        what = (f"a validation pass is {samples:,} samples (data.val_batch_size = "
                f"{d.val_batch_size} × rollout.val_n = {cfg.rollout.val_n})")  # fmt: skip
    per_sample = sample_bytes(d.max_prompt_length, d.max_response_length,
                              derived.use_reference, derived.use_critic)  # fmt: skip
    model, kv, model_what = 0, 0, "the model's offloaded state"
    if plan is not None:
        model = plan.host_bytes()
    if plan is not None and on_cpu:  # the device is the host: its larger phase
        step, (generation, kv) = plan.phase_bytes(STEP), cpu_generation_bytes(plan)
        model_what = "the model's weights, gradients and optimizer state"
        if generation > step:
            model_what = (f"generation's weights, optimizer state and KV cache ({gib(kv)} for "
                          f"rollout.max_num_seqs = {cfg.rollout.max_num_seqs:,} sequences of "
                          f"up to {d.max_prompt_length} + {d.max_response_length} tokens)")  # fmt: skip
        model, kv = model + max(step, generation), kv if generation > step else 0
    if plan is not None and plan.options.gpus_per_host < plan.options.train_gpus:
        # several nodes: each host holds its own GPUs' shares; the controller's the most
        o = plan.options
        model_what += f" of one node's {o.gpus_per_host} GPUs (of {o.train_gpus})"
    return HostNeed(samples, samples * per_sample, model, what, model_what, on_cpu, kv)


def cpu_generation_bytes(plan) -> tuple[int, int]:
    """(bytes a CPU run's generation holds, its KV cache's part): the plan's generation
    items but the engine's workspace, an estimate it reserves on a GPU (kv_cache.py)."""
    held = [i for i in plan.items if GENERATE in i.phases and not i.rollout_gpu
            and "workspace" not in i.name]  # fmt: skip
    kv = sum(i.gpu_bytes for i in held if i.name.startswith("KV cache"))
    return sum(i.gpu_bytes for i in held), kv


def available_host_bytes() -> tuple[int | None, str]:
    """(bytes this process may still allocate, where the number comes from): the smaller of
    the kernel's MemAvailable and what the cgroup's memory.max leaves; (None, "") when
    neither can be read (not Linux)."""
    found: list[tuple[int, str]] = []
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    found.append((int(line.split()[1]) * 1024, "MemAvailable, /proc/meminfo"))
    except (OSError, ValueError, IndexError):
        pass
    limit = _cgroup_room()
    if limit is not None:
        found.append((limit, "the cgroup's memory.max less memory.current"))
    return min(found) if found else (None, "")


def _cgroup_room() -> int | None:
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            text = f.read().strip()
        if text == "max":
            return None
        with open("/sys/fs/cgroup/memory.current") as f:
            return max(0, int(text) - int(f.read().strip()))
    except (OSError, ValueError):
        return None


def gib(n: int) -> str:
    """Bytes as GiB, or MiB below one GiB (a step's data is often a few MiB)."""
    return f"{n / GIB:,.1f} GiB" if n >= GIB else f"{n / 2**20:,.1f} MiB"


def host_text(need: HostNeed, cfg: Config, available: int | None, source: str) -> str:
    """One line for `config plan`: the parts, the total and the machine's free memory."""
    parts = (f"host: a step's data {gib(need.data_bytes)} ({need.samples:,} samples of up to "
             f"{cfg.data.max_prompt_length} + {cfg.data.max_response_length} tokens)")  # fmt: skip
    if need.model_bytes:
        parts += f" + {need.model_what} {gib(need.model_bytes)}"
    if available is None:
        return f"{parts}; free host memory unknown, not checked"
    word = "fits" if need.total <= available else "does NOT fit"
    return f"{parts} = {gib(need.total)}; {gib(available)} free ({source}): {word}"


def host_problems(need: HostNeed, cfg: Config, available: int | None, source: str) -> list[str]:
    """One problem, with the numbers, when the run cannot fit the host's free memory."""
    if available is None or need.total <= available:
        return []
    d = cfg.data
    model = f", and {need.model_what} {gib(need.model_bytes)}" if need.model_bytes else ""
    if need.data_bytes >= need.model_bytes:
        fix = ("lower rollout.n, data.train_batch_size (or data.val_batch_size, rollout.val_n) "
               "or data.max_response_length")  # fmt: skip
    elif 2 * need.kv_cache_bytes >= need.model_bytes:  # the cache is most of it
        fix = ("lower rollout.max_num_seqs (a CPU rollout's cache holds that many sequences "
               "whole, allocated up front) or data.max_response_length")  # fmt: skip
    elif need.on_cpu:
        fix = "train a smaller model, or LoRA (model.lora_rank=64), or on a GPU"
    else:  # offloaded state: each node holds its GPUs' shares of it
        fix = ("spread the training over more nodes (trainer.nnodes), offload less "
               "(actor.param_offload, ref.param_offload), or train LoRA (model.lora_rank=64)")  # fmt: skip
    return [
        f"the run needs at least {gib(need.total)} of host memory, {gib(available)} is free "
        f"({source}): {need.what} of up to {d.max_prompt_length} + {d.max_response_length} "
        f"tokens, {gib(need.data_bytes)} on the controller{model}; {fix}, or run on a machine "
        f"with more memory"
    ]


def check_host_memory(cfg: Config, derived: Derived, gpu_plan=None, log=lambda *a: None):
    """Raise a ConfigError with the numbers when the run cannot fit the host's free memory;
    ``gpu_plan``: the GPU memory plan when the run has one (its host items count), else the
    run is planned here as a CPU run. Returns the HostNeed."""
    from hybridflow.config import ConfigError

    need = host_need_for(cfg, derived, gpu_plan)
    available, source = available_host_bytes()
    problems = host_problems(need, cfg, available, source)
    if problems:
        raise ConfigError(problems)
    return need


def host_need_for(cfg: Config, derived: Derived, gpu_plan=None) -> HostNeed:
    """:func:`host_need` with the model planned: ``gpu_plan``'s host items, or on a run
    without a GPU plan the CPU run's whole plan (None when the model's shape is unknown)."""
    if gpu_plan is not None:
        return host_need(cfg, derived, gpu_plan, on_cpu=False)
    from hybridflow.trainer.plan.memory_from_config import plan_for_config

    plan = plan_for_config(cfg, derived, None) if cfg.trainer.device != "cuda" else None
    return host_need(cfg, derived, plan, on_cpu=plan is not None)
