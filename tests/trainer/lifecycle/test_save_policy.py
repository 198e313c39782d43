"""trainer.async_save's default (save_policy.py): background saves unless their host copy is
large for the host or the state lives on the host already; a set value is kept."""

from __future__ import annotations

from hybridflow.config import load_config
from hybridflow.trainer.lifecycle.save_policy import save_defaults

GIB = 2**30


def resolved(overrides, host_gib, critic=False):
    said = []
    cfg = save_defaults(load_config(None, overrides), said.append, critic, host_gib * GIB)
    return cfg.trainer.async_save, said


def test_small_models_save_in_the_background():
    assert resolved(["model.path=qwen2.5-0.5b"], host_gib=128) == (True, [])


def test_a_7b_full_parameter_copy_is_too_big_for_a_128_gib_host_but_lora_is_not():
    background, said = resolved(["model.path=qwen2.5-7b"], host_gib=128)
    assert not background and "GiB" in said[0] and "trainer.async_save=true" in said[0]
    assert resolved(["model.path=qwen2.5-7b"], host_gib=512) == (True, [])
    assert resolved(["model.path=qwen2.5-7b", "model.lora_rank=64"], host_gib=128) == (True, [])


def test_a_critic_doubles_the_copy():
    assert resolved(["model.path=qwen2.5-1.5b"], host_gib=96)[0]  # 17 GiB: under a quarter
    assert not resolved(["model.path=qwen2.5-1.5b"], host_gib=96, critic=True)[0]  # 34 GiB


def test_optimizer_offload_writes_in_the_foreground_and_a_set_value_is_kept():
    background, said = resolved(["actor.optimizer_offload=true"], host_gib=1024)
    assert not background and "optimizer_offload" in said[0]
    assert resolved(["model.path=qwen2.5-7b", "trainer.async_save=true"], host_gib=16) == (True, [])
    assert resolved(["trainer.async_save=false"], host_gib=1024) == (False, [])
