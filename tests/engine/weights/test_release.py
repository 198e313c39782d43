"""Engine.release_weights / restore_weights (weights/release.py) on CPU, fp32: the weights'
storage is freed between a generation and the sync, the buffers are kept, and after the
sync rewrites the parameters the engine draws the tokens it drew before."""

from __future__ import annotations

import pytest
import torch

from hybridflow.engine import Engine, EngineOptions, SamplingParams
from hybridflow.engine.weights.release import check_rewritten
from hybridflow.models import build_model
from hybridflow.models.presets import preset_config

PROMPTS = [[5, 17, 9, 33, 2], [40, 41], [12, 3, 8]]
PARAMS = SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=7)


def _trainer_and_engine(preset: str) -> tuple[torch.nn.Module, Engine]:
    """A 'trainer' model and an engine over its own copy (as a sharded actor's rollout),
    the DeepSeek score-correction buffers away from 0 so that losing them would show."""
    trainer = build_model(preset_config(preset), seed=3).eval().requires_grad_(False)
    generator = torch.Generator().manual_seed(5)
    for _, buffer in trainer.named_buffers():
        buffer.uniform_(-1.0, 1.0, generator=generator)
    copy = build_model(preset_config(preset), seed=3).eval().requires_grad_(False)
    copy.load_state_dict(trainer.state_dict())
    engine = Engine(copy, max_batch_size=8, max_seq_len=64, options=EngineOptions())
    return trainer, engine


def _parameters_only(trainer) -> list[tuple[str, torch.Tensor]]:
    """What a sync sends: the parameters (a tied lm_head not repeated, as hf_weights and
    HF checkpoints), no buffers (the reshard moves parameters only)."""
    return [(name, tensor) for name, tensor in trainer.named_parameters()
            if name != "lm_head.weight"]  # fmt: skip


@pytest.mark.parametrize("preset", ["tiny", "tiny-deepseek-v3"])
def test_released_weights_are_freed_and_after_the_sync_draw_what_kept_ones_draw(preset):
    """Two engines over copies of one trainer: one releases its weights after generating,
    the trainer steps, both take its weights: the same tokens (and not the old ones)."""
    trainer, engine = _trainer_and_engine(preset)
    _, kept = _trainer_and_engine(preset)
    before = [c.token_ids for c in engine.generate(PROMPTS, PARAMS)]
    model = engine.model
    total = sum({p.untyped_storage()._cdata: p.untyped_storage().nbytes()
                 for p in model.parameters()}.values())  # fmt: skip
    freed = engine.release_weights()
    assert freed == total > 0
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    buffers = dict(model.named_buffers())
    assert all(b.untyped_storage().nbytes() > 0 for b in buffers.values())
    assert engine.release_weights() == 0  # released once
    with pytest.raises(RuntimeError, match="sync the weights before generating"):
        engine.generate(PROMPTS, PARAMS)

    generator = torch.Generator().manual_seed(11)  # the update
    for p in trainer.parameters():
        p.add_(torch.randn(p.shape, generator=generator), alpha=0.5)
    restored = engine.restore_weights()
    engine.load_weights(_parameters_only(trainer))
    kept.load_weights(_parameters_only(trainer))
    # the tied head is the embedding: rewritten with it
    check_rewritten(restored, {name for name, _ in _parameters_only(trainer)})
    assert engine.restore_weights() is None  # nothing left to restore
    after = [c.token_ids for c in engine.generate(PROMPTS, PARAMS)]
    # the decode runner keyed its graphs by the addresses the weights came back at
    # (graphs.DecodeRunner.check_weights drops those captured on other ones)
    assert engine.runner._weights_key == tuple(p.data_ptr() for p in model.parameters())
    assert after == [c.token_ids for c in kept.generate(PROMPTS, PARAMS)]
    assert after != before
    for name, buffer in trainer.named_buffers():
        assert torch.equal(buffers[name], buffer)


def test_a_sync_that_misses_a_freed_weight_is_named():
    trainer, engine = _trainer_and_engine("tiny")
    engine.release_weights()
    restored = engine.restore_weights()
    sent = [(n, t) for n, t in _parameters_only(trainer) if "layers.1.mlp.up_proj" not in n]
    engine.load_weights(sent)
    with pytest.raises(RuntimeError, match=r"did not rewrite 1 freed .*layers\.1\.mlp\.up_proj"):
        check_rewritten(restored, {name for name, _ in sent})
