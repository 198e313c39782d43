"""Metric functions against hand-computed values; the stage timer."""

import time

import pytest
import torch

from hybridflow.trainer.observe.metrics import (
    Timer,
    data_metrics,
    estimate_mfu,
    forward_flops_per_token,
    mean_metrics,
    peak_flops_per_gpu,
    response_length_metrics,
    rl_step_flops,
    throughput_metrics,
)

MASK = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]])  # lengths 4, 2, 1


def test_response_length_and_clip_ratio():
    metrics = response_length_metrics(MASK)
    assert metrics["response_length/mean"] == pytest.approx(7 / 3)
    assert metrics["response_length/max"] == 4 and metrics["response_length/min"] == 1
    assert metrics["response_length/clip_ratio"] == pytest.approx(1 / 3)  # only row 0 hit R=4
    assert response_length_metrics(MASK, max_response_length=2)[
        "response_length/clip_ratio"
    ] == pytest.approx(2 / 3)


def test_data_metrics_use_sequence_sums_and_valid_tokens_only():
    scores = torch.zeros(3, 4)
    scores[0, 3], scores[1, 1], scores[2, 0] = 1.0, 0.0, 0.5
    rewards = scores - 0.1 * MASK  # e.g. a KL penalty on every valid token
    advantages = torch.tensor([[1.0, 1, 1, 1], [-2, -2, 99, 99], [3, 99, 99, 99]])  # 99 = padding
    metrics = data_metrics(
        {
            "response_mask": MASK,
            "token_level_scores": scores,
            "token_level_rewards": rewards,
            "advantages": advantages,
        }
    )
    assert metrics["score/mean"] == pytest.approx(0.5)
    assert metrics["score/max"] == 1.0 and metrics["score/min"] == 0.0
    # scores 1, 0, 0.5 around their mean 0.5: sqrt((0.25 + 0.25 + 0) / 3)
    assert metrics["score/std"] == pytest.approx((0.5 / 3) ** 0.5)
    # rewards per sequence: 1 - 0.4, 0 - 0.2, 0.5 - 0.1
    assert metrics["reward/mean"] == pytest.approx((0.6 - 0.2 + 0.4) / 3)
    # advantages over the 7 valid tokens: 4*1 - 2*2 + 3 = 3
    assert metrics["advantage/mean"] == pytest.approx(3 / 7)
    assert metrics["advantage/max"] == 3.0 and metrics["advantage/min"] == -2.0
    assert "value/mean" not in metrics


def test_throughput_and_mfu():
    perf = throughput_metrics(num_tokens=8000, step_time_s=2.0, n_gpus=4)
    assert perf["perf/tokens_per_s"] == 4000 and perf["perf/tokens_per_s_per_gpu"] == 1000
    # 0.5B params, no attention term: 1e9 FLOPs per token forward
    per_token = forward_flops_per_token(500_000_000)
    assert per_token == 1e9
    assert forward_flops_per_token(10, num_layers=2, hidden_size=8, context_length=4) == 20 + 256
    # generation + 2 forwards (old, ref) + 1 train pass (3 forwards) = 6 forwards
    flops = rl_step_flops(per_token, total_tokens=1000, forward_passes=2, train_passes=1)
    assert flops == 6e12
    assert estimate_mfu(flops, step_time_s=1.0, n_gpus=2, peak_flops=1e13) == pytest.approx(0.3)
    assert estimate_mfu(flops, 1.0, 1, None) is None
    assert peak_flops_per_gpu("NVIDIA H200") == 989e12 and peak_flops_per_gpu("Some NPU") is None


def test_mean_metrics():
    assert mean_metrics([{"a": 1.0, "b": 2.0}, {"a": 3.0}]) == {"a": 2.0, "b": 2.0}


def test_timer_accumulates_per_stage():
    timer = Timer()
    with timer("gen"):
        time.sleep(0.02)
    with timer("gen"):
        time.sleep(0.02)
    with pytest.raises(RuntimeError):
        with timer("update_actor"):
            raise RuntimeError("stage failed")  # the time up to the error still counts
    metrics = timer.metrics()
    assert set(metrics) == {"timing_s/gen", "timing_s/update_actor"}
    assert 0.04 <= metrics["timing_s/gen"] < 1.0
    per_token = timer.per_token_metrics(num_tokens=10)
    assert per_token["timing_per_token_ms/gen"] == pytest.approx(100 * metrics["timing_s/gen"])
    timer.reset()
    assert timer.metrics() == {}


def test_validation_mean_best_majority():
    from hybridflow.trainer.observe.metrics import validation_metrics

    # prompt u1 (gsm8k): answers 18, 17, 17 -> majority "17" is wrong
    # prompt u2 (gsm8k): answers 5, 5, None -> majority "5" right
    # prompt u3 (arithmetic, n=1): right
    metrics = validation_metrics(
        data_sources=["gsm8k"] * 6 + ["arithmetic"],
        uids=["u1", "u1", "u1", "u2", "u2", "u2", "u3"],
        scores=[1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0],
        predictions=["18", "17", "17", "5", "5", None, "68"],
    )
    assert metrics == {
        "val/gsm8k/mean@3": pytest.approx(0.5),
        "val/gsm8k/best@3": 1.0,
        "val/gsm8k/maj@3": 0.5,
        "val/arithmetic/mean@1": 1.0,
        "val/arithmetic/best@1": 1.0,
        "val/arithmetic/maj@1": 1.0,
    }
    no_votes = validation_metrics(["a"], ["u"], [1.0])
    assert set(no_votes) == {"val/a/mean@1", "val/a/best@1"}


def test_majority_tie_goes_to_the_first_seen():
    from hybridflow.trainer.observe.metrics import validation_metrics

    metrics = validation_metrics(["s"] * 4, ["u"] * 4, [0.0, 1.0, 0.0, 1.0], ["a", "b", "a", "b"])
    assert metrics["val/s/maj@4"] == 0.0


def test_device_name_comes_from_nvidia_smi_without_a_cuda_context(monkeypatch):
    """The controller (no CUDA context) asks nvidia-smi; it never initialises CUDA."""
    import subprocess

    from hybridflow.trainer.observe import metrics

    calls = []

    def fake_run(cmd, **kwargs):
        calls.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, stdout="NVIDIA H200\n", stderr="")

    monkeypatch.setattr(metrics.torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(
        metrics.torch.cuda, "get_device_name", lambda *a: pytest.fail("would create a context")
    )
    monkeypatch.setattr(metrics.subprocess, "run", fake_run)
    metrics.cuda_device_name.cache_clear()
    try:
        assert metrics.peak_flops_per_gpu() == 989e12
        assert calls and calls[0][0] == "nvidia-smi"

        def missing(cmd, **kwargs):
            raise FileNotFoundError(cmd[0])

        monkeypatch.setattr(metrics.subprocess, "run", missing)
        metrics.cuda_device_name.cache_clear()
        assert metrics.peak_flops_per_gpu() is None  # no GPU tool: MFU unknown, no crash
    finally:
        metrics.cuda_device_name.cache_clear()


def test_rollout_gap_metrics_by_hand():
    from hybridflow.trainer.observe.metrics import rollout_gap_metrics

    old = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -9.0, -1.0]])
    rollout = torch.tensor([[-1.0, -2.1, -2.5], [-0.5, 0.0, -1.3]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 1]])  # the -9 vs 0 token is padding
    got = rollout_gap_metrics(old, rollout, mask)
    # |diffs| on the 5 tokens: 0, 0.1, 0.5, 0, 0.3 -> mean 0.18, max 0.5; log 1.25 = 0.223:
    # 0.5 and 0.3 are outside [0.8, 1.25] -> 2 of 5
    assert abs(got["rollout_gap/abs_logprob_diff_mean"] - 0.18) < 1e-6
    assert abs(got["rollout_gap/abs_logprob_diff_max"] - 0.5) < 1e-6
    assert abs(got["rollout_gap/ratio_outside_0.8_1.25"] - 0.4) < 1e-9
    assert got["rollout_gap/abs_logprob_diff_p99"] <= 0.5
