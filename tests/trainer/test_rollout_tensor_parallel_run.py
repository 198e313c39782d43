"""`hybridflow train` on two CPU processes with verl's layout keys: the actor in Ulysses
SP = 2 and the rollout tensor-parallel over both processes (one engine, its weights resharded
from the actor's FSDP2 shards after every update) logs the metrics of plain data parallelism
on the same two processes, which logs those of one process, step after step (the second
step samples with the resharded weights of the first update) and samples the same tokens
(the samples verl's trainer.rollout_data_dir writes); a data-parallel checkpoint resumes in
that layout. The later runs compare with the one-process run only (the plain data-parallel
run logs the same: the first test), which saves starting two more processes a test."""

from __future__ import annotations

import shutil

import pytest
from rollout_layout_helpers import (
    LAYOUT,
    ONE_PROCESS,
    PLAIN,
    VERL,
    assert_same,
    read_samples,
    train_run,
)


@pytest.mark.slow
def test_ulysses_actor_and_tensor_parallel_rollout_log_the_metrics_of_data_parallel(
    tmp_path, capsys
):
    # all through verl's keys, so verl's defaults apply to every run alike
    one = train_run(tmp_path / "one", *ONE_PROCESS)
    # checkpoints of steps 1 and 2: the resume below starts from the one of step 1
    plain = train_run(tmp_path / "dp", *PLAIN, "trainer.save_freq=1")
    layout = train_run(tmp_path / "layout", *LAYOUT)
    assert one.keys() == plain.keys() == layout.keys() == {1, 2}
    for step, want in plain.items():
        assert_same(one[step], want, step)  # the samples follow sample_index, not the rank
        assert_same(want, layout[step], step)
        # the same tokens: every sample's text, in the same order, in the three runs
        samples = read_samples(tmp_path / "dp", step)
        assert len(samples) == 16 and samples[0]["step"] == step
        assert (
            read_samples(tmp_path / "one", step)
            == samples
            == read_samples(tmp_path / "layout", step)
        )
    # resume across the change of layout: step 1 in data parallelism (its run's checkpoint),
    # step 2 in the layout
    step_1 = tmp_path / "dp" / "run" / "checkpoints" / "step_1"
    shutil.copytree(step_1, tmp_path / "resumed" / "run" / "checkpoints" / "step_1")
    capsys.readouterr()
    resumed = train_run(tmp_path / "resumed", *LAYOUT, "trainer.resume=auto")
    assert sorted(resumed) == [2]  # step 1 is not run again
    assert_same(plain[2], resumed[2], 2)
    assert read_samples(tmp_path / "resumed", 2) == read_samples(tmp_path / "dp", 2)
    out = capsys.readouterr()
    assert "rollout.tensor_parallel_size: 1 -> 2 (the rollout keeps no state" in out.out + out.err


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
    # 2 steps: step 2's requests are drawn while step 1 trains, so its sync lands among them
    partial = ("trainer.mode=async", "trainer.partial_rollout=true", "trainer.total_steps=2")
    plain = train_run(tmp_path / "dp", *ONE_PROCESS, *partial)
    layout = train_run(tmp_path / "layout", VERL + "rollout.tensor_model_parallel_size=2", *partial)
    assert plain.keys() == layout.keys() == {1, 2}
    assert_same(plain[1], layout[1], 1)
    assert read_samples(tmp_path / "dp", 1) == read_samples(tmp_path / "layout", 1)


@pytest.mark.slow
def test_agent_episodes_with_a_tensor_parallel_rollout_log_data_parallel(tmp_path):
    """rollout.agent.loop=tools with rollout TP = 2: each rank runs its own rows' episodes,
    the two ranks serving their turns in lockstep (engine/serving/lockstep.py; the tiny
    random model answers without tool calls, so an episode is one kept turn, released at its
    end); the metrics and samples are those of a data-parallel rollout. One step: the weight
    sync into a tensor-parallel rollout between steps is the other layout runs' to check."""
    agents = ("rollout.agent.loop=tools", "rollout.agent.tools=[calculator]",
              "data.max_prompt_length=64", "reward.custom_fn=null", "trainer.total_steps=1")  # fmt: skip
    plain = train_run(tmp_path / "dp", *ONE_PROCESS, *agents)
    layout = train_run(tmp_path / "layout", VERL + "rollout.tensor_model_parallel_size=2", *agents)
    assert plain.keys() == layout.keys() == {1}
    for step, want in plain.items():
        assert_same(want, layout[step], step)
        assert read_samples(tmp_path / "dp", step) == read_samples(tmp_path / "layout", step)


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
    plain = train_run(tmp_path / "dp", *ONE_PROCESS, *agents)
    layout = train_run(tmp_path / "layout", VERL + "rollout.tensor_model_parallel_size=2", *agents)
    assert plain.keys() == layout.keys() == {1}
    assert_same(plain[1], layout[1], 1)
    assert read_samples(tmp_path / "dp", 1) == read_samples(tmp_path / "layout", 1)


@pytest.mark.slow
def test_a_hybrid_with_a_tensor_parallel_rollout_logs_the_metrics_of_one_process(tmp_path):
    """tiny-hybrid (gated attention, Gated DeltaNet) with the rollout tensor-parallel over both
    processes (each rank its heads and their recurrent state, resharded from the actor's FSDP2
    shards after each update) logs the metrics and samples the tokens of one process."""
    hybrid = "model.path=tiny-hybrid"
    one = train_run(tmp_path / "one", hybrid, *ONE_PROCESS)
    layout = train_run(tmp_path / "layout", hybrid, VERL + "rollout.tensor_model_parallel_size=2")
    assert one.keys() == layout.keys() == {1, 2}
    for step, want in one.items():
        assert_same(want, layout[step], step)
        assert read_samples(tmp_path / "one", step) == read_samples(tmp_path / "layout", step)
