"""The results of benchmarks/grpo_vs_trl.py: a run's summary (seconds per step, tokens/s,
peak memory) and the table of a GPU-scaling run."""

from __future__ import annotations


def add_scaling_efficiency(results: list[dict]) -> None:
    """``scaling_efficiency``: per-GPU tokens/s over the 1-GPU run's (equal per-GPU work, so
    also 1-GPU step time / N-GPU step time); NaN without a 1-GPU run."""
    base = next((r for r in results if r.get("gpus") == 1 and "error" not in r), None)
    for r in results:
        if "error" not in r:
            r["scaling_efficiency"] = (
                r["tokens_per_s_per_gpu"] / base["tokens_per_s_per_gpu"] if base else float("nan")
            )


def scaling_table(results: list[dict]) -> list[str]:
    """Step time, tokens/s (total and per GPU), scaling efficiency, peak memory per GPU and
    the stage breakdown of each run (``add_scaling_efficiency`` first)."""
    lines = [
        f"{'GPUs':>4}{'prompts':>9}{'s/step':>9}{'tokens/s':>11}{'tok/s/GPU':>11}"
        f"{'scaling':>9}  peak GiB per GPU"
    ]
    for r in results:
        if "error" in r:
            lines.append(f"{r['gpus']:>4}  failed: {r['error'][:200]}")
            continue
        peaks = " ".join(f"{p:.1f}" for p in r.get("peak_gib_per_gpu", [])) or "n/a"
        lines.append(
            f"{r['gpus']:>4}{r['prompts']:>9}{r['step_s']:>9.2f}{r['tokens_per_s']:>11.0f}"
            f"{r['tokens_per_s_per_gpu']:>11.0f}{100 * r['scaling_efficiency']:>8.1f}%  {peaks}"
        )
    ok = [r for r in results if "breakdown" in r]
    if ok:
        lines.append("stage breakdown (s, mean of timed steps): " + " | ".join(
            f"{r['gpus']} GPU" for r in ok))  # fmt: skip
        for key in dict.fromkeys(k for r in ok for k in r["breakdown"]):  # union, in order
            values = "".join(f"{r['breakdown'].get(key, 0.0):>10.3f}" for r in ok)
            lines.append(f"  {key:<28}{values}")
        overhead = "".join(f"{_controller_s(r['breakdown']):>10.3f}" for r in ok)
        lines.append(f"  {'controller (step - stages)':<28}{overhead}")
    return lines


def _controller_s(breakdown: dict[str, float]) -> float:
    return breakdown["timing_s/step"] - sum(v for k, v in breakdown.items() if k != "timing_s/step")


def package_version(pkg: str) -> str:
    from importlib.metadata import version

    try:
        return version(pkg)
    except Exception:
        return "?"


def step_summary(name: str, times: list[float], args, peak_gib: float, gpus: int = 1,
             prompt_tokens: float | None = None) -> dict:  # fmt: skip
    """``args.prompts`` prompts per GPU; tokens count prompt + response tokens
    (``prompt_tokens``: a prompt's mean, its image tokens counted; default --prompt-len)."""
    timed = times[1:] if len(times) > 1 else times  # first step excluded (warm-up)
    step_s = sum(timed) / len(timed)
    prompt_tokens = args.prompt_len if prompt_tokens is None else prompt_tokens
    tokens = gpus * args.prompts * args.samples * (prompt_tokens + args.new_tokens)
    return {
        "name": name,
        "gpus": gpus,
        "prompts": gpus * args.prompts,
        "step_s": step_s,
        "all_steps_s": times,
        "tokens_per_s": tokens / step_s,
        "tokens_per_s_per_gpu": tokens / step_s / gpus,
        "peak_gib": peak_gib,
    }


def mean_prompt_length(made) -> float | None:
    """A prompt's mean token count with its images (None: text prompts, --prompt-len)."""
    return None if made is None else made.summary()["prompt_tokens"]["mean"]
