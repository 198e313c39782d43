"""examples/geo3k.yaml: verl's Qwen2.5-VL-7B geo3k GRPO recipe in our keys. Its first line's
commands (convert the Hub's parquet, then validate with a Qwen2.5-VL directory) pass, and
the memory plan of the 7B shape fits a node of 141 GiB GPUs as verl lays it out."""

from pathlib import Path

from example_helpers import command_overrides
from geo3k_helpers import write_hub_parquet, write_tiny_qwen2_5_vl

from hybridflow.config import load_config, validate
from hybridflow.trainer.plan import memory_fixes as mf
from hybridflow.trainer.plan import memory_from_config as mfc

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "geo3k.yaml"


def test_the_example_keeps_verls_recipe():
    cfg = load_config(str(EXAMPLE), [])
    assert (cfg.data.train_batch_size, cfg.data.max_prompt_length,
            cfg.data.max_response_length) == (512, 1024, 2048)  # fmt: skip
    assert (cfg.actor.lr, cfg.actor.ppo_mini_batch_size, cfg.rollout.n) == (1e-6, 128, 5)
    assert (cfg.actor.use_kl_loss, cfg.actor.kl_loss_coef, cfg.actor.kl_loss_type) == (
        True, 0.01, "low_var_kl")  # fmt: skip
    assert cfg.actor.entropy_coeff == 0 and cfg.actor.freeze_vision_tower
    assert cfg.rollout.gpu_memory_utilization == 0.6 and cfg.data.image_key == "images"
    assert command_overrides(EXAMPLE) == ["model.path=/models/Qwen2.5-VL-7B-Instruct"]


def test_converted_data_and_a_qwen2_5_vl_directory_validate(tmp_path, monkeypatch, capsys):
    from hybridflow.cli import main

    monkeypatch.chdir(tmp_path)  # the example's data/geo3k/ paths are relative
    for split, rows in (("train", 512), ("test", 4)):  # one batch of the example's 512
        hub = write_hub_parquet(tmp_path / "hub" / f"{split}-00000-of-00001.parquet", rows)
        assert main(["data", "geo3k", "--input", str(hub), "--out", "data/geo3k"]) == 0
    model = write_tiny_qwen2_5_vl(tmp_path / "Qwen2.5-VL-tiny")
    capsys.readouterr()
    assert main(["config", "validate", "--config", str(EXAMPLE), f"model.path={model}"]) == 0
    assert "error" not in capsys.readouterr().err


def test_the_7b_plan_fits_a_node_of_h200s():
    cfg = load_config(str(EXAMPLE), ["model.path=qwen2.5-vl-7b"])
    plan = mfc.plan_for_config(cfg, validate(cfg), 141 * 2**30)
    assert mf.fits(plan)
