"""The tables of benchmarks/speculative_tail.py: the generation phase's calls with speculation
off and on, and the GRPO runs' steps, each with its speed-up against its baseline."""

from __future__ import annotations

TAIL_TARGET = 1.5
STEP_TARGET = 1.2

SPEC_KEYS = {
    "passes": "rollout/speculative_passes",
    "accepted": "rollout/speculative_acceptance_rate",
    "tokens_per_pass": "rollout/speculative_tokens_per_pass",
    "saved_s": "rollout/speculative_tail_seconds_saved",
}


def mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def generation_summary(calls: list[dict]) -> dict | None:
    """The means over the timed calls (the warm-up left out); None when none was timed."""
    timed = [c for c in calls if not c.get("warmup")]
    if not timed:
        return None
    summary = {key: mean([c[key] for c in timed])
               for key in ("seconds", "tail_s", "tokens_per_s", "response_mean")}  # fmt: skip
    summary.update(calls=len(timed), response_max=max(c["response_max"] for c in timed),
                   cut=sum(c["cut"] for c in timed) / len(timed))  # fmt: skip
    for name, key in SPEC_KEYS.items():
        values = [c[key] for c in timed if key in c]
        summary[name] = mean(values) if values else None
    return summary


def same_tokens(off: list[dict], on: list[dict]) -> tuple[int, int]:
    """Completions with the same tokens in the calls of the same seed: (same, compared)."""
    by_seed = {c["seed"]: c["digests"] for c in off if not c.get("warmup")}
    same = total = 0
    for call in on:
        if call.get("warmup") or call["seed"] not in by_seed:
            continue
        pairs = list(zip(by_seed[call["seed"]], call["digests"]))
        same += sum(a == b for a, b in pairs)
        total += len(pairs)
    return same, total


def ratio(base: float | None, other: float | None) -> float | None:
    return base / other if base and other else None


def _cell(value, spec: str, none: str = "-") -> str:
    return none if value is None else format(value, spec)


def print_generation(data: dict) -> None:
    off, on = generation_summary(data.get("off", [])), generation_summary(data.get("ngram", []))
    print(f"\nGeneration on {data['device']}: {data['prompts']} GSM8K prompts × "
          f"{data['samples']}, temperature {data['temperature']:g}, up to "
          f"{data['max_new_tokens']} new tokens; the tail: at most {data['tail_rows']} rows "
          "decoding; means of the timed calls")  # fmt: skip
    print("| speculation | calls | call s | tail s | before the tail s | tokens/s "
          "| response mean / max | cut at max | passes | accepted | tokens/pass "
          "| saved s (est.) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, s in (("off", off), ("ngram", on)):
        if s is None:
            print(f"| {name} | 0 | - | - | - | - | - | - | - | - | - | - |")
            continue
        print(f"| {name} | {s['calls']} | {s['seconds']:.2f} | {s['tail_s']:.2f} | "
              f"{s['seconds'] - s['tail_s']:.2f} | {s['tokens_per_s']:,.0f} | "
              f"{s['response_mean']:.0f} / {s['response_max']} | {s['cut']:.1f} | "
              f"{_cell(s['passes'], '.0f')} | {_cell(s['accepted'], '.1%')} | "
              f"{_cell(s['tokens_per_pass'], '.2f')} | {_cell(s['saved_s'], '.2f')} |")  # fmt: skip
    if off and on:
        tail, call = ratio(off["tail_s"], on["tail_s"]), ratio(off["seconds"], on["seconds"])
        same, total = same_tokens(data["off"], data["ngram"])
        print(f"tail {_cell(tail, '.2f')}× faster (target {TAIL_TARGET}×), the whole call "
              f"{_cell(call, '.2f')}×; {same} of {total} completions the same tokens as "
              f"without speculation (a float rounding apart can change a draw)")  # fmt: skip


def baseline_of(mode: str) -> str:
    """The mode a speculative one is compared with: the same without ':spec'."""
    return mode.removesuffix(":spec")


def print_rl(results: list[dict], warmup: int) -> None:
    by_mode = {r["mode"]: r for r in results}
    print(f"\nGRPO steps on the checkpoint; mean of the steps after the first {warmup} and "
          "before the last; speed-up against the same mode without speculation")  # fmt: skip
    print("| mode | s/step | speed-up | gen s | tail s | accepted | tokens/pass | tail s saved "
          "| response mean / max | steps (s) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        m = r["async_metrics"]
        base = by_mode.get(baseline_of(r["mode"]))
        speedup = ratio(base["step_s"], r["step_s"]) if base and base is not r else None
        name = r["mode"] if r["complete"] else f"{r['mode']} (stopped at its limit)"
        steps = " ".join(f"{s:.2f}" for s in r["steps_s"])
        print(f"| {name} | {r['step_s']:.2f} | {_cell(speedup, '.2f')}{'×' if speedup else ''} | "
              f"{r.get('gen_s', 0.0):.2f} | {_cell(m.get('rollout/tail_seconds'), '.2f')} | "
              f"{_cell(m.get(SPEC_KEYS['accepted']), '.1%')} | "
              f"{_cell(m.get(SPEC_KEYS['tokens_per_pass']), '.2f')} | "
              f"{_cell(m.get(SPEC_KEYS['saved_s']), '.2f')} | "
              f"{r['response_mean']:.0f} / {r['response_max']:.0f} | {steps} |")  # fmt: skip
    sync, spec = by_mode.get("sync"), by_mode.get("sync:spec")
    if sync and spec:
        print(f"sync step {sync['step_s'] / spec['step_s']:.2f}× faster with speculation "
              f"(target {STEP_TARGET}×)")  # fmt: skip
