"""`hybridflow bench agent`: multi-turn episodes through the agent path (EngineClient and an
asyncio loop per episode, a tool of fixed latency between turns) against one single-turn
`generate` of the same number of generated tokens, in the same run.

    hybridflow bench agent --preset qwen2.5-0.5b --episodes 256 --turns 4 --tool-latency-ms 10
    hybridflow bench agent --preset tiny --episodes 4 --turns 2 --turn-tokens 4 --device cpu

Random-weight presets write no tool calls, so each episode follows a fixed schedule: a turn
of --turn-tokens tokens (ignore_eos), then a "tool" that waits --tool-latency-ms and returns
--tool-tokens token ids, for --turns turns. Each episode is an EngineClient session, so a
turn continues the KV the last one kept (--no-kept-kv: every turn prefills its whole
conversation). Prefill recomputed: prefilled tokens beyond the prompts and the tools' tokens
(with kept KV that is the last sampled token of each turn), over all context tokens.

After a warm-up pair, --repeats timed pairs (an agent run, then the single-turn call)
alternate in the process, so both paths meet the same host state; each path reports its
median, and agent / single-turn is the median of the pairs' ratios. One pair is under a
second at 0.5b on an H200, where a fresh process moves the ratio by tenths; pairs in one
process move it by far less.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import statistics
import time


def add_agent_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="qwen2.5-0.5b", help="model preset or local HF directory")
    p.add_argument("--episodes", type=int, default=256, help="episodes run at once")
    p.add_argument("--turns", type=int, default=4, help="model turns per episode")
    p.add_argument("--prompt-len", type=int, default=128, help="tokens of each prompt")
    p.add_argument("--turn-tokens", type=int, default=64, help="tokens the model writes a turn")
    p.add_argument("--tool-tokens", type=int, default=32, help="tokens a tool result adds")
    p.add_argument("--tool-latency-ms", type=float, default=10.0,
                   help="how long each tool call waits")  # fmt: skip
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                   help="weights' and activations' dtype")  # fmt: skip
    p.add_argument("--device", default=None, help="device to run on (default: cuda if available)")
    p.add_argument("--engine", action="append", default=[], metavar="NAME=VALUE",
                   help="an EngineOptions field (repeatable; default: none, EngineOptions' "
                   "defaults)")  # fmt: skip
    p.add_argument("--repeats", type=_positive_int, default=5,
                   help="timed pairs of an agent run and a single-turn call, alternating")  # fmt: skip
    p.add_argument("--no-kept-kv", dest="kept_kv", action="store_false",
                   help="every turn prefills its whole conversation")  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts and the sampling")
    p.add_argument("--step-table", action="store_true",
                   help="log the timed runs' scheduler steps and print them by kind (decode "
                   "chunks, mixed static/eager steps, prefill steps: rows and tokens live and "
                   "computed, captures, host waits, host ms)")  # fmt: skip
    p.add_argument("--json", default=None,
                   help="also write the results to this file (default: print only)")  # fmt: skip


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


class FixedScheduleEpisodes:
    """The benchmark's episodes: `turns` turns of `turn_tokens`, a tool of `latency_s`
    between them returning `tool_tokens` ids. Counts what the engine prefilled."""

    def __init__(self, turns: int, turn_tokens: int, tool_tokens: int, latency_s: float,
                 vocab: int, sampling, kept_kv: bool = True):  # fmt: skip
        self.turns, self.turn_tokens, self.tool_tokens = turns, turn_tokens, tool_tokens
        self.latency_s, self.vocab, self.sampling = latency_s, vocab, sampling
        self.kept_kv = kept_kv
        self.generated = 0

    async def run(self, prompt: list[int], client, seed: int) -> list[int]:
        context = list(prompt)
        session = {"session": seed} if self.kept_kv else {}
        for turn in range(self.turns):
            params = dataclasses.replace(self.sampling, max_new_tokens=self.turn_tokens,
                                         seed=seed + turn)  # fmt: skip
            completion = await client.generate(context, params, **session)
            context += completion.token_ids
            self.generated += len(completion.token_ids)
            if turn + 1 < self.turns:
                await asyncio.sleep(self.latency_s)  # the tool
                context += [(seed * 31 + turn * 7 + i) % (self.vocab - 16) + 16
                            for i in range(self.tool_tokens)]  # fmt: skip
        if self.kept_kv:
            await client.close_session(seed)
        return context


def bench_agent(args, progress=None) -> dict:
    import torch

    from hybridflow.agents.client import EngineClient
    from hybridflow.bench.common import (
        WARM_UP,
        counted,
        engine_options,
        load_bench_model,
        make_prompts,
        sync_device,
    )
    from hybridflow.engine import Engine, SamplingParams
    from hybridflow.progress import quiet_reporter

    progress = progress or quiet_reporter()
    model, device = load_bench_model(args, progress)
    vocab = model.config.vocab_size
    prompts = make_prompts(args.episodes, args.prompt_len, vocab, args.seed)
    per_episode = args.turns * args.turn_tokens + (args.turns - 1) * args.tool_tokens
    options = engine_options(SimpleArgs(args.engine))
    engine = Engine(model, max_batch_size=args.episodes, max_seq_len=args.prompt_len + per_episode,
                    options=options)  # fmt: skip
    sampling = SamplingParams(temperature=1.0, ignore_eos=True)

    def agent_run() -> tuple[float, FixedScheduleEpisodes, EngineClient]:
        episodes = FixedScheduleEpisodes(args.turns, args.turn_tokens, args.tool_tokens,
                                         args.tool_latency_ms / 1000, vocab, sampling,
                                         args.kept_kv)  # fmt: skip
        client = EngineClient(engine)
        before = engine.prefill_tokens
        counters = _decode_counters(engine)

        async def everything():
            await asyncio.gather(*(episodes.run(p, client, args.seed + 1000 * i)
                                   for i, p in enumerate(prompts)))  # fmt: skip

        start = time.perf_counter()
        asyncio.run(everything())
        sync_device(device)
        seconds = time.perf_counter() - start
        episodes.prefilled = engine.prefill_tokens - before
        steps, rows, passes, mixed = (b - a for a, b in zip(counters, _decode_counters(engine)))
        episodes.mean_rows, episodes.prefill_passes = rows / max(steps, 1), passes
        episodes.mixed_steps = mixed
        client.close()  # the kept slots back before anything else runs on the engine
        return seconds, episodes, client

    single_params = SamplingParams(temperature=1.0, ignore_eos=True, seed=args.seed,
                                   max_new_tokens=args.turns * args.turn_tokens)  # fmt: skip

    def single_run() -> tuple[float, float]:
        counters = _decode_counters(engine)
        start = time.perf_counter()
        engine.generate(prompts, single_params)
        sync_device(device)
        seconds = time.perf_counter() - start
        steps, rows, _, _ = (b - a for a, b in zip(counters, _decode_counters(engine)))
        return seconds, rows / max(steps, 1)

    with progress.task(WARM_UP):
        engine.warm_up(sampling)  # every batch size's graph: the episodes' batch size wanders
        agent_run(), single_run()  # warm-up: compile, tune, capture every bucket both use
    captures, static_steps = _graph_counters(engine)
    step_logs = {"agent": [], "single-turn": []} if args.step_table else None

    def logged(path: str, run):
        """run(), its scheduler steps added to step_logs[path] (--step-table)."""
        if step_logs is None:
            return run()
        engine.scheduler.step_log = []
        try:
            return run()
        finally:
            step_logs[path] += engine.scheduler.step_log
            engine.scheduler.step_log = None

    with progress.task("timed pairs", total=args.repeats, unit="pairs") as task:
        timed_pair = counted(task, lambda: (logged("agent", agent_run),
                                            logged("single-turn", single_run)))  # fmt: skip
        pairs = [timed_pair() for _ in range(args.repeats)]
    captures, static_steps = (b - a for a, b in zip((captures, static_steps),
                                                     _graph_counters(engine)))  # fmt: skip
    agent_s = statistics.median(agent[0] for agent, _ in pairs)
    single_s = statistics.median(single[0] for _, single in pairs)
    _, episodes, client = pairs[-1][0]
    single_rows = pairs[-1][1][1]
    generated = episodes.generated
    single_tokens = args.episodes * args.turns * args.turn_tokens
    ratios = [(generated / agent[0]) / (single_tokens / single[0]) for agent, single in pairs]
    # with KV kept between turns only the first prompt and the tools' tokens need a prefill
    needed = args.episodes * (args.prompt_len + (args.turns - 1) * args.tool_tokens)
    context = args.episodes * (args.prompt_len + per_episode)
    result = {
        "preset": args.preset, "episodes": args.episodes, "turns": args.turns,
        "prompt_len": args.prompt_len, "turn_tokens": args.turn_tokens,
        "tool_tokens": args.tool_tokens, "tool_latency_ms": args.tool_latency_ms,
        "kept_kv": args.kept_kv, "kv_evictions": engine.kept.evictions,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "agent": {"seconds": agent_s, "generated_tokens": generated,
                  "tokens_per_s": generated / agent_s, "requests": client.requests,
                  "mean_rows_per_step": episodes.mean_rows,
                  "prefill_passes": episodes.prefill_passes, "graph_captures": captures,
                  "mixed_steps": episodes.mixed_steps,
                  "static_mixed_steps_while_timed": static_steps,
                  "prefilled_tokens": episodes.prefilled},
        "single_turn": {"seconds": single_s, "generated_tokens": single_tokens,
                        "tokens_per_s": single_tokens / single_s,
                        "mean_rows_per_step": single_rows},
        "prefill_recomputed_over_context": (episodes.prefilled - needed) / context,
        "repeats": args.repeats,
        "pairs": [{"agent_s": agent[0], "single_turn_s": single[0], "ratio": ratio}
                  for (agent, single), ratio in zip(pairs, ratios)],
        "agent_over_single_turn": statistics.median(ratios),
    }  # fmt: skip
    if step_logs is not None:
        result["step_tables"] = _step_tables(step_logs, model.config.num_hidden_layers)
    engine.release()
    return result


def _decode_counters(engine) -> tuple[int, int, int, int]:
    """(decode steps, rows decoded summed over them, prefill passes or finished prefill jobs,
    mixed steps) so far (steps and rows: their ratio is the mean batch)."""
    scheduler = engine.scheduler
    if scheduler is None:
        return (0, 0, 0, 0)
    return (scheduler.decode_steps, scheduler.decoded_rows, scheduler.admissions,
            scheduler.mixed_steps)  # fmt: skip


def _graph_counters(engine) -> tuple[int, int]:
    """(graphs captured, mixed steps replayed or run with static shapes) so far: the decode
    runner's and the static mixed steps' (graph_mixed_steps)."""
    scheduler = engine.scheduler
    if scheduler is None:
        return (0, 0)
    static = scheduler.static_step
    if static is None:
        return (scheduler.runner.captures, 0)
    return (scheduler.runner.captures + static.captures, static.steps)


def _step_tables(step_logs: dict, layers: int) -> dict:
    """Per path: its steps' totals by kind and the table of them (step_log.py)."""
    from hybridflow.engine.scheduling import step_log

    return {path: {"steps": len(steps), "table": step_log.table(steps, layers),
                   "by_kind": {kind: dataclasses.asdict(totals)
                               for kind, totals in step_log.summarize(steps).items()}}
            for path, steps in step_logs.items()}  # fmt: skip


@dataclasses.dataclass
class SimpleArgs:
    engine: list


def print_result(result: dict) -> None:
    a, s = result["agent"], result["single_turn"]
    print(f"{result['preset']} on {result['device']}: {result['episodes']} episodes x "
          f"{result['turns']} turns x {result['turn_tokens']} tokens, tools +"
          f"{result['tool_tokens']} tokens after {result['tool_latency_ms']:g} ms, kept KV "
          f"{'on' if result['kept_kv'] else 'off'}")  # fmt: skip
    print("| path | generated tok/s | seconds | mean rows per decode step |\n|---|---|---|---|")
    print(f"| agent episodes | {a['tokens_per_s']:,.0f} | {a['seconds']:.3f} | "
          f"{a['mean_rows_per_step']:.1f} |")  # fmt: skip
    print(f"| single-turn generate | {s['tokens_per_s']:,.0f} | {s['seconds']:.3f} | "
          f"{s['mean_rows_per_step']:.1f} |")  # fmt: skip
    ratios = sorted(pair["ratio"] for pair in result["pairs"])
    print(f"seconds: medians of {result['repeats']} alternating pairs; agent / single-turn of "
          f"each pair from {ratios[0]:.2f} to {ratios[-1]:.2f}")  # fmt: skip
    print(f"agent / single-turn: {result['agent_over_single_turn']:.2f}; prefill recomputed / "
          f"context tokens: {result['prefill_recomputed_over_context']:.2f}; prefill passes: "
          f"{a['prefill_passes']}; mixed steps: {a['mixed_steps']}; static-shape mixed steps "
          f"while timed (graph_mixed_steps): {a['static_mixed_steps_while_timed']}; graphs "
          f"captured while timed: {a['graph_captures']}")  # fmt: skip
    for path, logged in result.get("step_tables", {}).items():
        print(f"\nscheduler steps of the {result['repeats']} timed {path} runs "
              f"({logged['steps']:,} steps):\n{logged['table']}")  # fmt: skip


def run_agent_command(args) -> int:
    from hybridflow.bench.common import run_bench_command

    return run_bench_command(
        "agent", args, bench_agent, print_result, engine_args=SimpleArgs(args.engine)
    )
