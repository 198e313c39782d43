"""`hybridflow config plan`: the memory plan of a config, item by item, before any model loads;
exit status 2 (a ConfigError) when it cannot fit (trainer/plan/memory_check.py plans and checks)."""

from __future__ import annotations

import re

from hybridflow.config import Config, ConfigError, validate
from hybridflow.config.parallel_checks import layout_notes, not_yet_supported, roles_in_use
from hybridflow.config.validation import MAX_GPU_MEMORY_GIB
from hybridflow.parallel.roles import role_sizes
from hybridflow.trainer.loop.device import resolve_device
from hybridflow.trainer.plan import host_memory
from hybridflow.trainer.plan.host_memory import host_need_for, host_problems, host_text
from hybridflow.trainer.plan.memory_check import (
    forward_budget_problems,
    gpu_memory_or_none,
    memory_choices,
)
from hybridflow.trainer.plan.memory_fixes import fit_problems
from hybridflow.trainer.plan.memory_from_config import plan_for_config
from hybridflow.trainer.plan.memory_plan import GIB
from hybridflow.trainer.plan.memory_render import gib, render
from hybridflow.trainer.plan.memory_reward_model import reward_model_gpu, reward_model_gpu_problems
from hybridflow.trainer.plan.parallel_section import parallel_lines

SIZE_UNITS = {"gib": GIB, "g": GIB, "": GIB, "gb": 10**9, "mib": 2**20, "mb": 10**6, "tib": 2**40}


def parse_size(text: str) -> int:
    """'141GiB', '80GB', '80' (GiB) -> bytes; ConfigError naming the flag when unreadable."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    size = float(match.group(1)) * SIZE_UNITS[unit] if match and unit in SIZE_UNITS else 0.0
    if not 0 < size <= MAX_GPU_MEMORY_GIB * GIB:  # 400 digits of 9 read as inf
        raise ConfigError(
            [
                f"--gpu-memory {text!r} is not a size: write it like 141GiB, 80GB or 80 (GiB), "
                f"at most {MAX_GPU_MEMORY_GIB} GiB"
            ]  # fmt: skip
        )
    return int(size)


def unknown_shape_problem(model_path: str) -> str:
    """Why the plan has no shape for model.path: the checkpoint check's words where the
    path is no directory (a misspelt preset) or holds no config.json, else what reading
    its config.json raised."""
    from pathlib import Path

    from hybridflow.models.architecture_file import directory_architecture
    from hybridflow.trainer.lifecycle.preflight import checkpoint_problems

    path = Path(model_path).expanduser()
    if not (path / "config.json").is_file():
        return checkpoint_problems("model.path", model_path)[0]
    try:
        directory_architecture(model_path)
        reason = "it names no model shape hybridflow knows"
    except Exception as error:  # noqa: BLE001 - any reading failure is reported, never raised
        reason = f"{type(error).__name__}: {error}"
    return (f"model.path = {model_path}: its config.json gives no shape to plan ({reason}): "
            "point model.path at a Hugging Face model directory of a supported family, or a "
            "preset")  # fmt: skip


def plan_command(cfg: Config, gpu_memory: str | None = None, out=print, progress=None) -> int:
    """Print the plan; exit status 2 (a ConfigError) when it cannot fit the GPU, which is
    ``--gpu-memory``, else trainer.gpu_memory_gib, else the first visible GPU; with none of
    them the plan is printed and not checked. One plan (memory_from_config.plan_for_config, which
    ``validate`` and ``train`` check too), then the layout the plan recommends (its search
    reported on ``progress``, a ProgressReporter, where given)."""
    derived = validate(cfg, planning=True)
    if gpu_memory is not None:
        gpu_bytes, source = parse_size(gpu_memory), "--gpu-memory"
    else:
        gpu_bytes, source = gpu_memory_or_none(cfg)
    plan = plan_for_config(cfg, derived, gpu_bytes)
    need = host_need_for(cfg, derived, plan if gpu_bytes is not None else None)
    available, host_source = host_memory.available_host_bytes()
    host = host_problems(need, cfg, available, host_source)
    if plan is None:
        raise ConfigError([unknown_shape_problem(cfg.model.path), *host])
    out(render(plan, source, on_cpu=resolve_device(cfg.trainer.device) == "cpu"))
    for line in memory_choices(cfg, derived, gpu_bytes)[1]:
        out("  " + line)
    problems = fit_problems(cfg, plan, source) or forward_budget_problems(cfg, derived, plan)
    reward_gpu = reward_model_gpu(cfg, derived)
    if reward_gpu is not None:
        out(f"  per reward-model GPU: {gib(reward_gpu[0])} (its weights and one forward)")
        if gpu_bytes is not None:
            problems = problems or reward_model_gpu_problems(cfg, reward_gpu, gpu_bytes, source)
    for line in parallel_lines(cfg, derived, plan, fits=not problems, progress=progress):
        out("  " + line)
    for line in not_built_lines(cfg, derived) + quantized_weights_lines(cfg.model.path):
        out("  " + line)
    out("  " + host_text(need, cfg, available, host_source))
    problems += host
    if problems:
        raise ConfigError(problems)
    return 0


def not_built_lines(cfg: Config, derived) -> list[str]:
    """Notes on the configured layout: KV heads replicated by SP, and what train refuses."""
    lines = [note for note in layout_notes(cfg, {"actor", "ref", "critic"})]
    not_yet = not_yet_supported(role_sizes(cfg), roles_in_use(derived.use_reference,
                                                              derived.use_critic))  # fmt: skip
    if not_yet:  # "<key> = N...: <what> is not yet supported for the <role>: set ..."
        missing = sorted({p.split(": ")[1].replace(" is not yet supported for the", " of the")
                          for p in not_yet})  # fmt: skip
        lines.append(f"not yet supported, so hybridflow train refuses this layout for now: "
                     f"{'; '.join(missing)}")  # fmt: skip
    return lines


def quantized_weights_lines(model_path: str) -> list[str]:
    """A line when model.path stores its weights quantized (config.json's
    quantization_config): they load dequantised, so the plan counts them in the dtypes its
    items name, not the stored bytes (models/checkpoint_io/quantized_checkpoint.py)."""
    import json
    from pathlib import Path

    try:
        hf = json.loads((Path(model_path).expanduser() / "config.json").read_text())
        method = hf["quantization_config"]["quant_method"]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    return [f"model.path stores its weights as {method}; they load dequantised, so the weights "
            "above are counted in the dtypes named there (bf16 or fp32), not as stored"]  # fmt: skip
