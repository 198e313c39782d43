"""`hybridflow train` with a reward model: two steps of the tiny preset scored by a tiny
LlamaForSequenceClassification beside a rule reward, combined with configured weights."""

from __future__ import annotations

import math

import pytest
from reward_model_helpers import write_reward_model
from trainer_helpers import read_metrics, tiny_config

from hybridflow.config import ConfigError, validate
from hybridflow.errors import UserError
from hybridflow.models import load_tokenizer
from hybridflow.trainer.lifecycle.run import train


def test_two_steps_with_a_reward_model_and_a_rule_reward(tmp_path, quiet):
    directory = write_reward_model(tmp_path / "rm", "llama", tokenizer=load_tokenizer("char"))
    cfg = tiny_config(tmp_path, f"reward.model.path={directory}",
                      "reward.weights={rule: 1.0, model: 0.5}",
                      "reward.model.max_tokens_per_gpu=64", "trainer.val_before_train=false")  # fmt: skip
    train(cfg, log=quiet)
    metrics = read_metrics(tmp_path / "run")
    for step in (1, 2):
        model_mean = metrics[step]["reward/model/mean"]
        assert math.isfinite(model_mean) and model_mean != round(model_mean)  # continuous
        assert metrics[step]["reward/model/min"] < metrics[step]["reward/model/max"]
        # score = rule + 0.5 · model, averaged over the batch
        expected = metrics[step]["reward/rule/mean"] + 0.5 * model_mean
        assert metrics[step]["score/mean"] == pytest.approx(expected, abs=1e-5)


def test_a_checkpoint_without_a_score_head_is_refused_before_loading(tmp_path):
    from hybridflow.models import build_model
    from hybridflow.models.presets import preset_config

    build_model(preset_config("tiny")).save_pretrained(str(tmp_path / "lm"))
    cfg = tiny_config(tmp_path, f"reward.model.path={tmp_path / 'lm'}")
    with pytest.raises(ConfigError, match="holds no score.weight head"):
        validate(cfg)


def test_a_judge_on_the_policys_own_rollout_service_counts_failures_and_stops(tmp_path):
    # The tiny random policy judges its own answers greedily; its replies ("aaaaaa") hold no
    # digit: every sample fails, each step's failures are counted, the message is printed
    # once, and the second such step stops the run (reward.max_failed_steps=2).
    template = tmp_path / "judge.txt"
    template.write_text("{prompt}{response}?")
    cfg = tiny_config(tmp_path, f"reward.judge.template={template}",
                      r"reward.judge.score_pattern=\d", "reward.weights={rule: 1.0, judge: 0.1}",
                      "reward.max_failed_steps=2", "trainer.val_before_train=false",
                      "data.max_prompt_length=48")  # fmt: skip
    lines = []
    with pytest.raises(UserError, match="the judge failed on every sample for 2 steps"):
        train(cfg, log=lines.append)
    row = read_metrics(tmp_path / "run")[1]
    assert row["reward/judge/num_errors"] == 16 and row["reward/judge/failure_rate"] == 1.0
    assert row["score/mean"] == pytest.approx(row["reward/rule/mean"], abs=1e-6)  # judge 0
    shown = [line for line in lines if line.startswith("judge error (shown once)")]
    assert len(shown) == 1 and "judge reply has no score" in shown[0]


def test_a_template_without_the_response_slot_is_refused(tmp_path):
    template = tmp_path / "judge.txt"
    template.write_text("Rate this: {prompt}")
    cfg = tiny_config(tmp_path, f"reward.judge.template={template}")
    with pytest.raises(ConfigError, match=r"has no \{response\} slot"):
        validate(cfg)


def test_hybridflow_train_exits_2_on_a_reward_model_without_a_score_head(tmp_path, capsys):
    from hybridflow.cli import main
    from hybridflow.models import build_model
    from hybridflow.models.presets import preset_config

    build_model(preset_config("tiny")).save_pretrained(str(tmp_path / "lm"))
    code = main(["train", f"reward.model.path={tmp_path / 'lm'}",
                 f"trainer.run_dir={tmp_path / 'run'}", "model.path=tiny"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert "holds no score.weight head" in err and not (tmp_path / "run").exists()


def test_the_runs_model_scores_are_a_direct_transformers_forward_of_the_same_tokens(
    tmp_path, quiet, monkeypatch
):
    import torch
    from reward_model_helpers import transformers_score

    from hybridflow.learners.reward_model import RewardModelScorer, policy_token_rows

    scored = []  # (token rows, scores) of every call the run's reward-model role made
    original = RewardModelScorer.compute_rm_scores

    def recording(self, batch):
        out = original(self, batch)
        scored.append((policy_token_rows(batch), out.tensors["rm_scores"].tolist()))
        return out

    monkeypatch.setattr(RewardModelScorer, "compute_rm_scores", recording)
    directory = write_reward_model(tmp_path / "rm", "llama", tokenizer=load_tokenizer("char"))
    cfg = tiny_config(tmp_path, f"reward.model.path={directory}", "trainer.total_steps=1",
                      "reward.model.max_tokens_per_gpu=48", "trainer.val_before_train=false")  # fmt: skip
    train(cfg, log=quiet)
    # the step's 16 samples (the reward model alone: verl's default), then the validation's
    (rows, scores), (val_rows, val_scores) = scored
    assert len(rows) == 16 and len({round(s, 4) for s in scores}) > 8  # continuous
    expected = [transformers_score(directory, row) for row in rows + val_rows]
    torch.testing.assert_close(torch.tensor(scores + val_scores), torch.tensor(expected),
                               atol=1e-4, rtol=1e-4)  # fmt: skip
    row = read_metrics(tmp_path / "run")[1]
    assert row["score/mean"] == pytest.approx(sum(scores) / 16, abs=1e-5)


def test_a_judge_behind_an_openai_server_scores_a_run(tmp_path, quiet, monkeypatch):
    """A second model's server (a stand-in that replies "Score: <prompt length mod 7>"): no
    failures, the score is rule + 0.1 x judge, and the step asks it beside its reference
    pass (the server is not the training group)."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from hybridflow.trainer.loop import rl_loop

    asked, beside = [], []

    def counted(*args, _score_beside=rl_loop.score_beside):
        beside.append(args[2])
        return _score_beside(*args)

    monkeypatch.setattr(rl_loop, "score_beside", counted)

    class Judge(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            prompt = body["messages"][0]["content"]
            asked.append(prompt)
            data = json.dumps({"choices": [{"message": {"content":
                                                        f"Score: {len(prompt) % 7}"}}]}).encode()  # fmt: skip
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Judge)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    template = tmp_path / "judge.txt"
    template.write_text("Q: {prompt}\nA: {response}\nScore:")
    try:
        cfg = tiny_config(tmp_path, f"reward.judge.template={template}", "reward.judge.engine=url",
                          f"reward.judge.url=http://127.0.0.1:{server.server_address[1]}/v1",
                          "reward.weights={rule: 1.0, judge: 0.1}", "trainer.total_steps=1",
                          "trainer.val_before_train=false", "actor.use_kl_loss=true")  # fmt: skip
        train(cfg, log=quiet)
    finally:
        server.shutdown()
    assert beside == ["ref"]
    row = read_metrics(tmp_path / "run")[1]
    judged = [len(prompt) % 7 for prompt in asked[:16]]  # the step's; the validation's after
    assert len(asked) > 16 and row["reward/judge/failure_rate"] == 0.0
    assert row["reward/judge/mean"] == pytest.approx(sum(judged) / 16, abs=1e-6)
    assert row["score/mean"] == pytest.approx(row["reward/rule/mean"] + 0.1 * sum(judged) / 16,
                                              abs=1e-5)  # fmt: skip


def test_hybridflow_train_exits_2_on_a_judge_template_without_the_response_slot(tmp_path, capsys):
    from hybridflow.cli import main

    template = tmp_path / "judge.txt"
    template.write_text("Rate this: {prompt}")
    code = main(["train", f"reward.judge.template={template}", "model.path=tiny",
                 f"trainer.run_dir={tmp_path / 'run'}"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert "has no {response} slot" in err and not (tmp_path / "run").exists()


def test_the_reward_model_example_runs_on_the_cpu_and_names_its_score(tmp_path, capsys):
    """examples/reward_model.yaml as its first line runs it, shrunk (tiny policy, a tiny
    reward model in place of the real one): the run says the rule reward is combined with
    the reward model, and validation names its score, which is no accuracy."""
    from example_helpers import command_overrides
    from trainer_helpers import REPO, TINY

    from hybridflow.cli import main

    example = REPO / "examples" / "reward_model.yaml"
    directory = write_reward_model(tmp_path / "rm", "llama", tokenizer=load_tokenizer("char"))
    overrides = command_overrides(example, {"reward.model.path": str(directory)})
    shrink = [o for o in TINY if not o.startswith("reward.custom_fn")]  # the example's checker
    code = main(["train", "--config", str(example), *overrides, *shrink, "trainer.total_steps=1",
                 f"trainer.run_dir={tmp_path / 'run'}", f"trainer.cache_dir={tmp_path / 'cache'}"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    assert ("reward: the score is 1 × rule reward + 0.1 × reward-model score, the rule reward "
            "combined with the reward-model score (reward.weights)") in out  # fmt: skip
    assert "its score is 1 × rule reward + 0.1 × reward-model score, not an accuracy" in out
    assert "points" not in out and "val/reward/model/mean: step 0 " in out
    row = read_metrics(tmp_path / "run")[1]
    assert "val/reward/model/mean" in row and "val/reward/rule/mean" in row


def test_a_reward_model_alone_is_said_to_replace_the_rule_reward(tmp_path):
    directory = write_reward_model(tmp_path / "rm", "llama", tokenizer=load_tokenizer("char"))
    cfg = tiny_config(tmp_path, f"reward.model.path={directory}", "trainer.total_steps=1",
                      "trainer.val_before_train=false")  # fmt: skip
    lines = []
    train(cfg, log=lines.append)
    assert lines[1].startswith("reward: the score is the reward-model score, replacing the rule "
                               "reward (as verl's reward model does")  # fmt: skip
