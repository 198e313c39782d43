"""examples/hybrid.yaml end to end, shortened: the SFT warm start trains a tiny-hybrid
(Gated DeltaNet + gated attention) in our own decoder, GRPO loads it back natively (no
transformers fallback), the engine generates with its recurrent states, rewards are logged."""

import json

from trainer_helpers import read_metrics, tiny_config

from hybridflow.engine import Engine
from hybridflow.models import native_support_problem
from hybridflow.trainer.lifecycle.run import train


def test_hybrid_example_warm_starts_and_trains_natively(tmp_path, quiet, capfd, monkeypatch):
    engines = []
    init = Engine.__init__

    def recorded(self, *args, **kwargs):
        init(self, *args, **kwargs)
        engines.append(self)

    monkeypatch.setattr(Engine, "__init__", recorded)
    cfg = tiny_config(
        tmp_path,
        "model.path=sft:arithmetic",  # the example's own warm start, a few steps of it
        "sft.total_steps=3",
        "sft.stop_at_accuracy=null",
        "sft.batch_size=8",
        "sft.builtin_size=64",
        "trainer.total_steps=2",
        "trainer.val_before_train=false",
        example="hybrid",
    )
    assert cfg.sft.preset == "tiny-hybrid"
    train(cfg, log=quiet)
    assert "through transformers" not in capfd.readouterr().err
    (warm,) = (tmp_path / "cache").glob("sft-arithmetic-*/config.json")
    config = json.loads(warm.read_text())
    assert config["model_type"] == "qwen3_5_text" and native_support_problem(config) is None
    # the rollout engine (and the SFT accuracy check's) ran the model on its own path
    assert engines and all(engine.native and engine.slow_reason is None for engine in engines)
    assert engines[-1].model.recurrent_layers == [0, 1, 2]
    rows = read_metrics(cfg.trainer.run_dir)
    assert sorted(rows) == [1, 2]
    assert all("score/mean" in row and "reward/mean" in row for row in rows.values()), rows[1]
