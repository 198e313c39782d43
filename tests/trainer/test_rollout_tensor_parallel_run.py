"""`hybridflow train` on two CPU processes with verl's layout keys: the actor in Ulysses
SP = 2 and the rollout tensor-parallel over both processes (one engine, its weights resharded
from the actor's FSDP2 shards after every update) logs the metrics of plain data parallelism
on the same two processes, which logs those of one process, step after step (the second
step samples with the resharded weights of the first update) and samples the same tokens
(the samples verl's trainer.rollout_data_dir writes); a data-parallel checkpoint resumes in
that layout."""

from __future__ import annotations

import json
import math

import pytest
from trainer_helpers import TINY

from hybridflow.cli import main

VERL = "actor_rollout_ref."
# verl's own keys (the local backend follows from 2 devices on one node; "file" is our
# metrics.jsonl); the tiny model and data are ours (trainer_helpers.TINY)
RUN = ["trainer.nnodes=1", "trainer.n_gpus_per_node=2", VERL + "actor.use_kl_loss=True",
       "trainer.save_freq=-1", "trainer.test_freq=-1", "trainer.val_before_train=False",
       "trainer.logger=['console','file']"]  # fmt: skip
NOT_COMPARED = ("timing_s/", "perf/", "memory/")  # wall-clock and host measurements


PLAIN = (VERL + "rollout.tensor_model_parallel_size=1",)
LAYOUT = (VERL + "actor.ulysses_sequence_parallel_size=2",
          VERL + "rollout.tensor_model_parallel_size=2")  # fmt: skip


def _train(tmp_path, *layout: str) -> dict[int, dict]:
    run_dir = tmp_path / "run"
    argv = ["train", *TINY, *RUN, *layout, f"trainer.run_dir={run_dir}",
            f"trainer.cache_dir={tmp_path / 'cache'}",
            f"trainer.rollout_data_dir={tmp_path / 'rollouts'}"]  # fmt: skip
    assert main(argv) == 0
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {row["step"]: row for row in map(json.loads, lines)}


def _samples(tmp_path, step: int) -> list[dict]:
    """The step's samples as verl's trainer.rollout_data_dir writes them (text and score),
    sorted: the file follows the order the ranks train the rows in, balanced by length over
    the data-parallel ranks, which differs between 1 and 2 of them."""
    lines = (tmp_path / "rollouts" / f"{step}.jsonl").read_text().splitlines()
    return sorted((json.loads(line) for line in lines), key=lambda row: json.dumps(row))


def _assert_same(want: dict, got: dict, step: int) -> None:
    compared = [k for k, v in want.items()
                if isinstance(v, float) and not k.startswith(NOT_COMPARED)]  # fmt: skip
    assert {"actor/pg_loss", "actor/grad_norm", "score/mean", "critic/vf_loss",
            "response_length/mean"} <= set(compared)  # fmt: skip
    for key in compared:
        if math.isnan(want[key]):
            assert math.isnan(got[key]), (step, key)
        else:
            assert got[key] == pytest.approx(want[key], rel=1e-3, abs=1e-6), (step, key)


@pytest.mark.slow
def test_ulysses_actor_and_tensor_parallel_rollout_log_the_metrics_of_data_parallel(
    tmp_path, capsys
):
    # all through verl's keys, so verl's defaults apply to every run alike
    one = _train(tmp_path / "one", *PLAIN, "trainer.backend=inprocess", "trainer.n_gpus_per_node=1")
    plain = _train(tmp_path / "dp", *PLAIN)
    layout = _train(tmp_path / "layout", *LAYOUT)
    assert one.keys() == plain.keys() == layout.keys() == {1, 2}
    for step, want in plain.items():
        _assert_same(one[step], want, step)  # the samples follow sample_index, not the rank
        _assert_same(want, layout[step], step)
        # the same tokens: every sample's text, in the same order, in the three runs
        samples = _samples(tmp_path / "dp", step)
        assert len(samples) == 16 and samples[0]["step"] == step
        assert _samples(tmp_path / "one", step) == samples == _samples(tmp_path / "layout", step)
    # resume across the change of layout: step 1 in data parallelism, step 2 in the layout
    _train(tmp_path / "resumed", *PLAIN, "trainer.total_steps=1", "trainer.save_freq=1")
    capsys.readouterr()
    resumed = _train(tmp_path / "resumed", *LAYOUT, "trainer.resume=auto")
    assert sorted(resumed) == [1, 2]
    _assert_same(plain[2], resumed[2], 2)
    assert _samples(tmp_path / "resumed", 2) == _samples(tmp_path / "dp", 2)
    out = capsys.readouterr()
    assert "rollout.tensor_parallel_size: 1 -> 2 (the rollout keeps no state" in out.out + out.err


@pytest.mark.slow
def test_a_mixture_of_experts_rollout_with_split_experts_logs_the_metrics_of_data_parallel(
    tmp_path,
):
    """tiny-moe with verl's rollout TP = 2 and EP = 2 (each process holds 4 of the 8 experts
    of every sparse layer, resharded from the actor's FSDP2 shards) and the trainer replaying
    the rollout's routing (actor.router_replay=rollout: the engine's record, the same on both
    ranks, returned once per sample) logs the metrics of data parallelism; so does the same
    rollout resharded from an expert-parallel actor (EP = 2: each process trains 4 experts)."""
    moe = ("model.path=tiny-moe", "actor.router_replay=rollout")  # after TINY's model.path
    rollout = (
        VERL + "rollout.tensor_model_parallel_size=2",
        VERL + "rollout.expert_parallel_size=2",
    )
    plain = _train(tmp_path / "dp", *PLAIN, *moe)
    layouts = {
        "layout": _train(tmp_path / "layout", *moe, *rollout),
        "ep": _train(tmp_path / "ep", *moe, *rollout, "actor.expert_parallel_size=2",
                     "critic.expert_parallel_size=1"),
    }  # fmt: skip
    for name, layout in layouts.items():
        assert plain.keys() == layout.keys() == {1, 2}
        for step, want in plain.items():
            _assert_same(want, layout[step], step)
            assert _samples(tmp_path / "dp", step) == _samples(tmp_path / name, step)


@pytest.mark.slow
def test_experts_over_rollout_replicas_and_offloaded_expert_shards_log_data_parallel(tmp_path):
    """tiny-moe with the rollout's experts spread over its two replicas of one process each
    (rollout.expert_parallel_size=2: attention data-parallel, 4 experts a process, the tokens
    dispatched by all-to-all; engine/expert_spread.py), resharded from an expert-parallel
    actor whose expert shards and AdamW state are on the host (actor.param_offload), logs the
    metrics and samples the tokens of plain data parallelism."""
    moe = ("model.path=tiny-moe", "actor.router_replay=rollout")
    plain = _train(tmp_path / "dp", *PLAIN, *moe)
    wide = _train(tmp_path / "wide", *moe, "rollout.expert_parallel_size=2",
                  "actor.expert_parallel_size=2", "critic.expert_parallel_size=1",
                  "actor.param_offload=true", "ref.param_offload=true")  # fmt: skip
    assert plain.keys() == wide.keys() == {1, 2}
    for step, want in plain.items():
        _assert_same(want, wide[step], step)
        assert _samples(tmp_path / "dp", step) == _samples(tmp_path / "wide", step)


@pytest.mark.slow
def test_expert_lora_with_a_tensor_parallel_rollout_logs_data_parallel(tmp_path):
    """tiny-moe with LoRA on its experts (per-expert factors) and attention, rollout TP = 2
    with the experts split: each sync merges W_e + scale · B_e @ A_e of a rank's own experts
    as they reshard (workers/rollout_tp.training_sources); the run logs the metrics and
    samples the tokens of data parallelism, where the engines get whole merged tensors."""
    lora = ("model.path=tiny-moe", "model.lora_rank=8", "model.lora_alpha=16",
            "model.lora_target_modules=[q_proj,experts]", "actor.lr=1e-2")  # fmt: skip
    plain = _train(tmp_path / "dp", *PLAIN, *lora)
    layout = _train(tmp_path / "tp", *lora, VERL + "rollout.tensor_model_parallel_size=2")
    assert plain.keys() == layout.keys() == {1, 2}
    for step, want in plain.items():
        _assert_same(want, layout[step], step)
        assert _samples(tmp_path / "dp", step) == _samples(tmp_path / "tp", step)


@pytest.mark.slow
def test_deepseek_v3_with_experts_over_rollout_replicas_logs_data_parallel(tmp_path):
    """tiny-deepseek-v3 (MLA, grouped routing, a shared expert) with its rollout experts
    spread over two replicas of one process, the weights resharded from
    an FSDP2 actor, logs the metrics and samples the tokens of data parallelism."""
    model = ("model.path=tiny-deepseek-v3",)
    plain = _train(tmp_path / "dp", *PLAIN, *model)
    wide = _train(tmp_path / "wide", *model, "rollout.expert_parallel_size=2")
    assert plain.keys() == wide.keys() == {1, 2}
    for step, want in plain.items():
        _assert_same(want, wide[step], step)
        assert _samples(tmp_path / "dp", step) == _samples(tmp_path / "wide", step)


@pytest.mark.slow
def test_partial_rollouts_in_async_mode_with_a_tensor_parallel_rollout_log_data_parallel(
    tmp_path,
):
    """trainer.mode=async with partial rollouts: the rollout runs as a service, its two
    ranks in lockstep (engine/serving/lockstep.py) with the weights resharded into it
    between two decode steps. Step 1 (drawn wholly before the first sync) logs the metrics
    and samples the tokens of the same run with a data-parallel rollout; later steps depend
    on where a sync lands in a request, a matter of timing in either run (the exact update
    between two steps: tests/engine/serving/test_lockstep.py), so they are only run."""
    partial = ("trainer.mode=async", "trainer.partial_rollout=true", "trainer.total_steps=3")
    plain = _train(tmp_path / "dp", *PLAIN, *partial)
    layout = _train(tmp_path / "layout", VERL + "rollout.tensor_model_parallel_size=2", *partial)
    assert plain.keys() == layout.keys() == {1, 2, 3}
    _assert_same(plain[1], layout[1], 1)
    assert _samples(tmp_path / "dp", 1) == _samples(tmp_path / "layout", 1)


@pytest.mark.slow
def test_agent_episodes_with_a_tensor_parallel_rollout_log_data_parallel(tmp_path):
    """rollout.agent.loop=tools with rollout TP = 2: each rank runs its own rows' episodes,
    the two ranks serving their turns in lockstep (engine/serving/lockstep.py; the tiny
    random model answers without tool calls, so an episode is one kept turn, released at its
    end); the metrics and samples are those of a data-parallel rollout, step after step."""
    agents = ("rollout.agent.loop=tools", "rollout.agent.tools=[calculator]",
              "data.max_prompt_length=64", "reward.custom_fn=null")  # fmt: skip
    plain = _train(tmp_path / "dp", *PLAIN, *agents)
    layout = _train(tmp_path / "layout", VERL + "rollout.tensor_model_parallel_size=2", *agents)
    assert plain.keys() == layout.keys() and len(plain) >= 2
    for step, want in plain.items():
        _assert_same(want, layout[step], step)
        assert _samples(tmp_path / "dp", step) == _samples(tmp_path / "layout", step)


TWO_TURN_PROGRAM = """
async def run(client, messages, *, model, extra_info):
    first = await client.chat.completions.create(model=model, messages=messages)
    messages = messages + [
        {"role": "assistant", "content": first.choices[0].message.content or ""},
        {"role": "user", "content": "go on"},
    ]
    second = await client.chat.completions.create(model=model, messages=messages)
    return second.choices[0].message.content or ""
"""


@pytest.mark.slow
def test_agent_programs_with_a_tensor_parallel_rollout_log_data_parallel(tmp_path):
    """rollout.agent.loop=openai with rollout TP = 2: each rank's program episodes take two
    turns over HTTP, the second continuing the kept K/V of the first on both ranks (the
    server's episode sessions) and released at each episode's end; the metrics and samples
    are those of a data-parallel rollout."""
    pytest.importorskip("openai")
    pytest.importorskip("aiohttp")
    program = tmp_path / "two_turns.py"
    program.write_text(TWO_TURN_PROGRAM)
    agents = ("rollout.agent.loop=openai", f"rollout.agent.program={program}:run",
              "rollout.agent.max_tokens_per_turn=4", "data.max_prompt_length=64",
              "reward.custom_fn=null", "trainer.total_steps=1")  # fmt: skip
    plain = _train(tmp_path / "dp", *PLAIN, *agents)
    layout = _train(tmp_path / "layout", VERL + "rollout.tensor_model_parallel_size=2", *agents)
    assert plain.keys() == layout.keys() == {1}
    _assert_same(plain[1], layout[1], 1)
    assert _samples(tmp_path / "dp", 1) == _samples(tmp_path / "layout", 1)
