"""`python benchmarks/agent_steps.py`: the scheduler steps of `bench agent`'s workload, counted.

    python benchmarks/agent_steps.py --episodes 256 --turns 4 --variants passes static
    python benchmarks/agent_steps.py --episodes 8 --turns 2 --turn-tokens 4 --trace

Drives the engine's scheduler through the agent episodes of `hybridflow bench agent` (each
turn a request continuing its kept KV, a tool of --tool-latency-ms adding --tool-tokens ids
between turns) and one single-turn call of the same tokens, on a modeled clock: each step
advances it by what it would cost on the device (DeviceCosts: qwen2.5-0.5b on one H100 by
default), so requests arrive between steps as they would there, and the run is the same on
any machine. Prints, per variant, the steps by kind (step_log.py: decode-only chunks, mixed
static/eager steps, prefill passes), their decode rows and prompt tokens live against
computed (padded to the graphs' buckets), the eager first-token samplings, the host waits,
the graph shapes used, and the modeled seconds; --trace prints every step.

Variants: "passes" (max_prefill_tokens_per_step 0, the default engine), "eager" (mixed steps
of --budget tokens, graph_mixed_steps off), "static" (graph_mixed_steps on).

The steps of real runs on a GPU, with measured host times (the same table):

    hybridflow bench agent --preset qwen2.5-0.5b --repeats 3 --step-table \
        --engine max_prefill_tokens_per_step=2048 --engine graph_mixed_steps=true

Random weights, ignore_eos: what the scheduler does depends on lengths and arrival times
only, so by default the forwards are replaced by zero logits (--model-forwards runs the
model: the torch backend on the CPU, where the static step keeps its host side and pads as
on a GPU but computes nothing). On a GPU with --model-forwards the seconds are measured
host time, not modeled.
"""

from __future__ import annotations

import argparse
import heapq
import os
import sys
from dataclasses import dataclass, replace

import torch

from hybridflow.engine import Engine, EngineOptions, SamplingParams
from hybridflow.engine.scheduling import step_log
from hybridflow.engine.scheduling.static_step import StaticMixedStep
from hybridflow.models import load_model

VARIANTS = {"passes": {}, "eager": {"graph_mixed_steps": False},
            "static": {"graph_mixed_steps": True}}  # fmt: skip


@dataclass(frozen=True)
class DeviceCosts:
    """Modeled device and host milliseconds of a step (defaults: qwen2.5-0.5b in bf16 on one
    H100: ~1.8 ms a decode step at 256 rows, ~2 us a prefilled token; an eager mixed step's
    ~530 launches take 25-30 ms of host time). They set when requests arrive between steps;
    the counts of the table follow from that."""

    decode_ms: float = 0.9  # a decode forward's fixed part (the weights read once)
    row_ms: float = 0.0035  # each decode row computed (at its bucket)
    token_ms: float = 0.002  # each prompt token computed (chunks and passes, padding too)
    eager_ms: float = 25.0  # host time of an eager forward (a pass, an eager mixed step)
    step_ms: float = 0.3  # the scheduler's host time a step

    def seconds(self, step: step_log.StepRecord) -> float:
        device = step.forwards * (self.decode_ms + self.row_ms * step.row_bucket)
        device += self.token_ms * step.token_bucket
        eager = {"mixed eager": 1, "prefill": 1}.get(step.kind, 0)
        if step.kind in ("passes", "passes + decode"):
            eager = step.first_tokens  # one pass per admission
        host = self.step_ms + self.eager_ms * eager
        # the launches overlap the device's work; a step whose results the host read at
        # once adds that read after it (the next step's launches wait for it)
        return (max(device, host) + (self.step_ms if step.drains else 0.0)) / 1000


class Episodes:
    """bench agent's FixedScheduleEpisodes on the clock: a turn is submitted when its tool
    returns, its completion read at the end of the step that retires it."""

    def __init__(self, engine: Engine, prompts, args, sampling: SamplingParams):
        self.engine, self.args, self.sampling = engine, args, sampling
        self.contexts = [list(p) for p in prompts]
        self.turn = [0] * len(prompts)
        self.handles = [None] * len(prompts)
        self.arrivals = [(0.0, i) for i in range(len(prompts))]  # (time, episode) heap
        self.running: dict[int, object] = {}  # episode -> its turn's submission
        self.generated = 0

    def next_arrival(self) -> float | None:
        return self.arrivals[0][0] if self.arrivals else None

    def submit_due(self, now: float) -> int:
        """Submit the turns whose tools have returned by `now`; -> how many."""
        added = 0
        while self.arrivals and self.arrivals[0][0] <= now:
            _, i = heapq.heappop(self.arrivals)
            params = replace(self.sampling, max_new_tokens=self.args.turn_tokens,
                             seed=1000 * i + self.turn[i])  # fmt: skip
            reuse = None if self.handles[i] is None else [self.handles[i]]
            sub = self.engine.submission([self.contexts[i]], params, keep=True, reuse=reuse)
            self.engine.scheduler.add(sub)
            self.running[i] = sub
            added += 1
        return added

    def collect(self, now: float) -> None:
        """Turns finished by `now`: their tools start (the last turn's slot goes back), one
        after the other on the client's loop (--client-us each: the next turn's request is
        built and posted on one thread, so a burst's requests arrive spread out)."""
        args, vocab = self.args, self.engine.config.vocab_size
        for i, sub in list(self.running.items()):
            if not sub.done:
                continue
            del self.running[i]
            completion = sub.results[0]
            self.generated += len(completion.token_ids)
            self.contexts[i] += completion.token_ids
            self.turn[i] += 1
            if self.turn[i] == args.turns:
                self.engine.scheduler.release_kept([completion.kv_handle])
                continue
            self.handles[i] = completion.kv_handle
            self.contexts[i] += [(i * 31 + self.turn[i] * 7 + k) % (vocab - 16) + 16
                                 for k in range(args.tool_tokens)]  # fmt: skip
            now += args.client_us / 1e6
            heapq.heappush(self.arrivals, (now + args.tool_latency_ms / 1000, i))

    @property
    def done(self) -> bool:
        return not self.arrivals and not self.running


class SingleTurn:
    """The single-turn call: every prompt at once, all its tokens in one request each."""

    def __init__(self, engine: Engine, prompts, args, sampling: SamplingParams):
        tokens = args.turns * args.turn_tokens
        self.sub = engine.submission(prompts, replace(sampling, max_new_tokens=tokens, seed=0))
        self.engine, self.submitted = engine, False

    def next_arrival(self) -> float | None:
        return None if self.submitted else 0.0

    def submit_due(self, now: float) -> int:
        if self.submitted:
            return 0
        self.engine.scheduler.add(self.sub)
        self.submitted = True
        return len(self.sub.max_new)

    def collect(self, now: float) -> None:
        pass

    @property
    def done(self) -> bool:
        return self.submitted and self.sub.done


def run_steps(engine: Engine, source, costs: DeviceCosts | None) -> tuple[float, list[float]]:
    """Step the scheduler until the source's requests are done; -> (seconds, each step's):
    modeled, or the steps' measured host time when costs is None. Before a step with nothing decoding and a
    few requests waiting, the service's gather window (RolloutService._gather) lets more of a
    burst arrive, as there."""
    scheduler, now, seconds = engine.scheduler, 0.0, []
    quiet = engine.options.admission_gather_ms / 1000
    while not source.done:
        source.submit_due(now)
        if not scheduler.busy:
            now = max(now, source.next_arrival())
            continue
        if _should_gather(scheduler):
            deadline = now + 10 * quiet
            while now < deadline:
                arrival = source.next_arrival()
                if arrival is None or arrival > min(now + quiet, deadline):
                    now = min(now + quiet, deadline)
                    break
                now = arrival
                source.submit_due(now)
            source.submit_due(now)
        scheduler.step()
        step = scheduler.step_log[-1]
        seconds.append(costs.seconds(step) if costs is not None else step.seconds)
        now += seconds[-1]
        source.collect(now)
    return now, seconds


def _should_gather(scheduler) -> bool:
    if scheduler.rows or scheduler.prefilling or scheduler.pending is not None:
        return False
    waiting = len(scheduler.waiting) + len(scheduler.extending) + len(scheduler.resuming)
    return 0 < waiting < max(1, scheduler.cache.num_slots // 8)


def zero_forwards(engine: Engine) -> None:
    """The engine's forwards (and its static step's) replaced by zero logits, each [rows it
    returns, V]: the scheduling runs as it is, the model does not."""

    def zeros(rows_arg: int):
        def forward(*args, **kwargs):
            return torch.zeros(args[rows_arg].shape[0], engine.config.vocab_size,
                               device=engine.device)  # fmt: skip

        return forward

    engine.prefill, engine.extend = zeros(8), zeros(6)  # last_index, keep
    engine.runner.decode_forward = zeros(3)  # the rows' tokens
    if engine.scheduler.static_step is not None:
        engine.scheduler.static_step.forward = zeros(7)  # keep


def build_engine(model, args, variant: str) -> Engine:
    settings = dict(VARIANTS[variant], sync_lag=1)  # the read-back lag of CUDA runs
    settings["max_prefill_tokens_per_step"] = 0 if variant == "passes" else args.budget
    if model.device.type != "cuda":  # the fused kernels on the CPU only interpreted
        settings.setdefault("decode_backend", "triton" if interpreted(args) else "torch")
    per_episode = args.turns * args.turn_tokens + (args.turns - 1) * args.tool_tokens
    engine = Engine(model, max_batch_size=args.episodes,
                    max_seq_len=args.prompt_len + per_episode,
                    options=EngineOptions(**settings))  # fmt: skip
    engine.start_generation()
    scheduler = engine.scheduler
    if variant == "static" and scheduler.static_step is None:
        # the torch backend has no static forward: the step's host side (buckets, padding,
        # uploads, sampling) with zero logits, as zero_forwards gives every pass
        scheduler.static_step = StaticMixedStep(engine, forward=None)
    if not args.model_forwards:
        zero_forwards(engine)
    elif model.device.type == "cuda":
        engine.warm_up(SamplingParams(temperature=1.0, ignore_eos=True))
    scheduler.step_log = []
    return engine


def interpreted(args) -> bool:
    """Whether the model's forwards run the fused kernels under Triton's CPU interpreter."""
    return args.model_forwards and os.environ.get("TRITON_INTERPRET") == "1"


def graph_shapes(steps: list[step_log.StepRecord]) -> tuple[set, set]:
    """The (batch bucket) of decode chunks and (batch, token bucket) of static steps used."""
    decode = {s.row_bucket for s in steps if s.kind in ("decode", "passes + decode")}
    static = {(s.row_bucket, s.token_bucket) for s in steps if s.kind == "mixed static"}
    return decode, static


def run_variant(model, args, variant: str, costs: DeviceCosts | None) -> dict:
    engine = build_engine(model, args, variant)
    g = torch.Generator().manual_seed(args.seed)
    vocab = engine.config.vocab_size
    prompts = torch.randint(16, vocab, (args.episodes, args.prompt_len), generator=g).tolist()
    sampling = SamplingParams(temperature=1.0, ignore_eos=True)
    out = {}
    for name, source in (("agent", Episodes(engine, prompts, args, sampling)),
                         ("single-turn", SingleTurn(engine, prompts, args, sampling))):  # fmt: skip
        scheduler = engine.scheduler
        scheduler.step_log = []
        out[name] = (scheduler.step_log, *run_steps(engine, source, costs))
    return out


def print_variant(variant: str, result: dict, layers: int, args) -> None:
    tokens = args.episodes * args.turns * args.turn_tokens
    rates = {name: tokens / seconds for name, (_, seconds, _) in result.items()}
    modeled = not args.model_forwards or args.device == "cpu"
    for name, (steps, seconds, each) in result.items():
        print(f"\n### {variant}: {name} ({len(steps):,} steps, {seconds * 1000:,.1f} ms "
              f"{'modeled' if modeled else 'measured'})\n")  # fmt: skip
        print(step_log.table(steps, layers, each if modeled else None))
        decode, static = graph_shapes(steps)
        print(f"graph shapes used: {len(decode)} decode buckets, {len(static)} static (rows, "
              f"tokens) pairs {sorted(static)}")  # fmt: skip
        if args.trace:
            print_trace(steps)
    print(f"\n{variant}: agent / single-turn {rates['agent'] / rates['single-turn']:.2f} "
          f"({'modeled' if modeled else 'measured'})")  # fmt: skip


def print_trace(steps: list[step_log.StepRecord]) -> None:
    print("\n| step | kind | forwards | rows / bucket | tokens / bucket | first tokens | "
          "captures | waits |\n|---|---|---|---|---|---|---|---|")  # fmt: skip
    for i, s in enumerate(steps):
        print(f"| {i} | {s.kind} | {s.forwards} | {s.rows} / {s.row_bucket} | {s.tokens} / "
              f"{s.token_bucket} | {s.first_tokens} | {s.captures} | {s.drains} |")  # fmt: skip


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="tiny", help="model preset (its shape: the layers count)")
    p.add_argument("--episodes", type=int, default=256)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--turn-tokens", type=int, default=64)
    p.add_argument("--tool-tokens", type=int, default=32)
    p.add_argument("--tool-latency-ms", type=float, default=10.0)
    p.add_argument("--client-us", type=float, default=50.0,
                   help="the client's time to take a finished turn and post the next")  # fmt: skip
    p.add_argument("--budget", type=int, default=2048, help="max_prefill_tokens_per_step")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--layers", type=int, default=24,
                   help="layers the work is counted in (24: qwen2.5-0.5b)")  # fmt: skip
    p.add_argument("--model-forwards", action="store_true",
                   help="run the model's forwards (default: zero logits)")  # fmt: skip
    p.add_argument("--device", default="cpu")
    p.add_argument("--trace", action="store_true", help="print every step")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.episodes < 1 or args.turns < 1 or args.turn_tokens < 1:
        print("agent_steps.py: --episodes, --turns and --turn-tokens must be at least 1",
              file=sys.stderr)  # fmt: skip
        return 2
    if (
        args.model_forwards
        and "static" in args.variants
        and args.device == "cpu"
        and not (interpreted(args))
    ):
        print("agent_steps.py: --model-forwards with the static variant runs the fused kernels: "
              "on the CPU set TRITON_INTERPRET=1 (slow), or leave it out (zero logits)",
              file=sys.stderr)  # fmt: skip
        return 2
    model = load_model(args.preset, device=args.device).eval()
    costs = None if args.model_forwards and args.device != "cpu" else DeviceCosts()
    print(f"agent_steps: {args.episodes} episodes x {args.turns} turns x {args.turn_tokens} "
          f"tokens, tools +{args.tool_tokens} after {args.tool_latency_ms:g} ms (client "
          f"{args.client_us:g} us a turn), prompts "
          f"{args.prompt_len}, budget {args.budget}; costs {costs}")  # fmt: skip
    with torch.no_grad():
        for variant in args.variants:
            print_variant(variant, run_variant(model, args, variant, costs), args.layers, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
