"""Quantized checkpoints load dequantised: a GPT-OSS with MXFP4 experts and a DeepSeek-V3
with block-scaled FP8 projections (partial blocks at the ends) give the logits of the same
weights dequantised by transformers and stored plain; validate accepts them; a method not
read is named."""

import pytest
import torch

from hybridflow.errors import UserError
from hybridflow.model_config_values import ModelConfigError
from hybridflow.models.checkpoint_io.hf_checkpoint import load_model_from_dir
from hybridflow.models.checkpoint_io.loadability import config_problems
from tests.models.mla_moe_helpers import deepseek_transformers, edit_config, gpt_oss_transformers
from tests.models.quantized_helpers import fp8_blocks, mxfp4_gpt_oss, quantize_mxfp4
from tests.models.qwen3_5_helpers import two_sequences


def _logits(model):
    ids, mask = two_sequences()[:2]
    with torch.no_grad():
        out = model(ids, attention_mask=mask)
    return getattr(out, "logits", out)[mask.bool()]  # transformers' output, or our logits


def _load(path, capsys):
    model = load_model_from_dir(str(path)).eval()
    return model, [line for line in capsys.readouterr().err.splitlines() if "dequantised" in line]


def test_mxfp4_gpt_oss_gives_the_logits_of_its_dequantised_weights(tmp_path, capsys):
    original = gpt_oss_transformers(hidden_size=64, intermediate_size=32)
    original.save_pretrained(tmp_path / "mxfp4")
    mxfp4_gpt_oss(tmp_path / "mxfp4", tmp_path / "plain")
    assert config_problems(tmp_path / "mxfp4") == []  # refused before the loader read it
    ours, lines = _load(tmp_path / "mxfp4", capsys)
    plain = load_model_from_dir(str(tmp_path / "plain")).eval()
    assert len(lines) == 1 and "6 weight tensors dequantised from MXFP4" in lines[0]
    assert lines[0].endswith("to float32")
    assert ours.model.layers[0].mlp.experts.gate_up_proj.shape == (4, 64, 64)
    assert (_logits(ours) - _logits(plain)).abs().max() <= 1e-5
    # the quantisation moved the weights enough to show in the logits: they were read
    assert (_logits(ours) - _logits(original)).abs().max() > 1e-3


@pytest.mark.parametrize("block", [(16, 16), (128, 128)])
def test_fp8_blocks_gives_the_logits_of_its_dequantised_weights(tmp_path, capsys, block):
    """16 x 16 blocks leave partial ones at the ends (q_a_proj is 24 rows, q_b_proj 24 wide);
    128 x 128 (the released size) is one partial block per projection at this size."""
    original = deepseek_transformers()
    original.save_pretrained(tmp_path / "fp8")
    fp8_blocks(tmp_path / "fp8", tmp_path / "plain", block)
    assert config_problems(tmp_path / "fp8") == []
    ours, lines = _load(tmp_path / "fp8", capsys)
    plain = load_model_from_dir(str(tmp_path / "plain")).eval()
    assert len(lines) == 1 and f"FP8 e4m3 in {block[0]}x{block[1]} blocks" in lines[0]
    assert (_logits(ours) - _logits(plain)).abs().max() <= 1e-5
    assert (_logits(ours) - _logits(original)).abs().max() > 1e-4


def test_a_bf16_load_dequantises_straight_to_bf16(tmp_path, capsys):
    deepseek_transformers().save_pretrained(tmp_path / "fp8")
    fp8_blocks(tmp_path / "fp8", tmp_path / "plain", (16, 16))
    ours = load_model_from_dir(str(tmp_path / "fp8"), dtype=torch.bfloat16)
    plain = load_model_from_dir(str(tmp_path / "plain"), dtype=torch.bfloat16)
    assert "to bfloat16" in capsys.readouterr().err
    assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(),
                                                 plain.state_dict().values()))  # fmt: skip


def test_mxfp4_blocks_without_their_scales_are_named(tmp_path):
    from safetensors.torch import load_file, save_file

    gpt_oss_transformers(hidden_size=64, intermediate_size=32).save_pretrained(tmp_path / "q")
    mxfp4_gpt_oss(tmp_path / "q", tmp_path / "plain")
    weights = load_file(tmp_path / "q" / "model.safetensors")
    del weights["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(weights, tmp_path / "q" / "model.safetensors", metadata={"format": "pt"})
    problems = config_problems(tmp_path / "q")
    assert len(problems) == 1 and "without their pair" in problems[0]
    assert "model.layers.1.mlp.experts.down_proj_blocks" in problems[0]
    with pytest.raises(ModelConfigError, match="down_proj_blocks"):
        load_model_from_dir(str(tmp_path / "q"))


def test_a_quantization_not_read_is_named_by_validate_and_the_loader(tmp_path):
    gpt_oss_transformers().save_pretrained(tmp_path)
    edit_config(tmp_path, quantization_config={"quant_method": "gptq", "bits": 4})
    with pytest.raises(UserError, match="config.json: quantization_config describes gptq"):
        load_model_from_dir(str(tmp_path))
    problems = config_problems(tmp_path)
    assert len(problems) == 1 and str(tmp_path / "config.json") in problems[0]
    edit_config(tmp_path, quantization_config={"quant_method": "fp8"})  # per-tensor fp8
    assert "weight_block_size = None" in config_problems(tmp_path)[0]


def test_the_reference_quantiser_rounds_to_the_nearest_code():
    weight = torch.zeros(1, 32)
    weight[0, :4] = torch.tensor([6.0, 2.9, -0.26, 0.2])  # scale 1: 6, 3, -0.5, 0
    blocks, scales = quantize_mxfp4(weight)
    assert scales.tolist() == [[127]]
    assert blocks[0, 0, :2].tolist() == [0x5 << 4 | 0x7, 0x0 << 4 | 0x9]


def test_a_dequantised_model_saves_plain_and_loads_in_transformers(tmp_path):
    import json

    import transformers

    gpt_oss_transformers(hidden_size=64, intermediate_size=32).save_pretrained(tmp_path / "q")
    mxfp4_gpt_oss(tmp_path / "q", tmp_path / "plain")
    ours = load_model_from_dir(str(tmp_path / "q")).eval()
    ours.save_pretrained(str(tmp_path / "out"))
    assert "quantization_config" not in json.loads((tmp_path / "out" / "config.json").read_text())
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert (_logits(reloaded) - _logits(ours)).abs().max() <= 1e-4


def test_transformers_reads_these_checkpoints_as_released_ones_with_our_logits(tmp_path):
    """The test checkpoints have the released layout: transformers, dequantising on load,
    gives our logits. (Its FP8 loader derives the block from the scale grid, which is wrong
    where a partial block ends a weight, so the blocks here divide every projection.)"""
    import transformers

    gpt_oss_transformers(hidden_size=64, intermediate_size=32).save_pretrained(tmp_path / "q")
    mxfp4_gpt_oss(tmp_path / "q", tmp_path / "q_plain")
    deepseek_transformers().save_pretrained(tmp_path / "f")
    fp8_blocks(tmp_path / "f", tmp_path / "f_plain", (8, 8))
    for name, quantization in [("q", transformers.Mxfp4Config(dequantize=True)),
                               ("f", transformers.FineGrainedFP8Config(
                                   dequantize=True, weight_block_size=(8, 8)))]:  # fmt: skip
        theirs = transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path / name, quantization_config=quantization, dtype=torch.float32
        ).eval()
        ours = load_model_from_dir(str(tmp_path / name)).eval()
        assert (_logits(theirs) - _logits(ours)).abs().max() <= 1e-4


def test_scales_in_another_shard_are_read_with_their_blocks(tmp_path, capsys):
    import json

    from safetensors.torch import load_file, save_file

    gpt_oss_transformers(hidden_size=64, intermediate_size=32).save_pretrained(tmp_path / "q")
    mxfp4_gpt_oss(tmp_path / "q", tmp_path / "plain")
    weights = load_file(tmp_path / "q" / "model.safetensors")
    (tmp_path / "q" / "model.safetensors").unlink()
    second = {name for name in weights if name.endswith("_scales") or "layers.2." in name}
    shards = {"model-00001-of-00002.safetensors": {n: t for n, t in weights.items() if n not in second},
              "model-00002-of-00002.safetensors": {n: weights[n] for n in second}}  # fmt: skip
    for file, tensors in shards.items():
        save_file(tensors, tmp_path / "q" / file, metadata={"format": "pt"})
    weight_map = {name: file for file, tensors in shards.items() for name in tensors}
    index = {"metadata": {}, "weight_map": weight_map}
    (tmp_path / "q" / "model.safetensors.index.json").write_text(json.dumps(index))
    assert config_problems(tmp_path / "q") == []
    ours, lines = _load(tmp_path / "q", capsys)
    plain = load_model_from_dir(str(tmp_path / "plain")).eval()
    assert len(lines) == 1 and (_logits(ours) - _logits(plain)).abs().max() <= 1e-5


def test_block_fp8_loads_in_any_family_of_our_decoder(tmp_path, capsys):
    """Qwen3's FP8 releases use DeepSeek's layout: the loader does not ask the family."""
    from tests.models.model_helpers import randomized_model, small_config

    randomized_model(small_config("qwen3")).save_pretrained(str(tmp_path / "fp8"))
    fp8_blocks(tmp_path / "fp8", tmp_path / "plain", (16, 16))
    assert config_problems(tmp_path / "fp8") == []
    ours, lines = _load(tmp_path / "fp8", capsys)
    plain = load_model_from_dir(str(tmp_path / "plain")).eval()
    assert len(lines) == 1 and "14 weight tensors" in lines[0]  # 7 projections x 2 layers
    assert (_logits(ours) - _logits(plain)).abs().max() <= 1e-5


def test_a_load_dequantises_one_tensor_at_a_time(tmp_path, monkeypatch):
    """The stream hands each dequantised tensor on before it dequantises the next, so the
    host holds one stored tensor and its result beyond what the model has taken."""
    from hybridflow.models.checkpoint_io import dequantize, hf_checkpoint

    gpt_oss_transformers(hidden_size=64, intermediate_size=32).save_pretrained(tmp_path / "q")
    mxfp4_gpt_oss(tmp_path / "q", tmp_path / "plain")
    calls = []
    real = dequantize.mxfp4_experts_to_float
    monkeypatch.setattr(dequantize, "mxfp4_experts_to_float",
                        lambda *args: calls.append(1) or real(*args))  # fmt: skip
    stream = hf_checkpoint.iter_checkpoint_tensors(str(tmp_path / "q"), torch.float32)
    first = next(tensor for name, tensor in stream if name.endswith("experts.down_proj"))
    assert len(calls) == 1 and first.shape == (4, 32, 64)
    assert sum(1 for _ in stream) > 0 and len(calls) == 6


def _cut(tmp_path, suffix):
    """The first tensor ending in ``suffix`` loses its last row (its pair then does not fit)."""
    from safetensors.torch import load_file, save_file

    weights = load_file(tmp_path / "model.safetensors")
    name = next(n for n in sorted(weights) if n.endswith(suffix))
    weights[name] = weights[name][..., :-1].contiguous()
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    return name


@pytest.mark.parametrize("kind", ["fp8", "mxfp4"])
def test_scales_that_do_not_fit_their_tensor_are_named_at_validate(tmp_path, kind):
    """validate said nothing; the load then refused them (the dequantiser's shape check)."""
    if kind == "fp8":
        deepseek_transformers().save_pretrained(tmp_path / "q")
        fp8_blocks(tmp_path / "q", tmp_path / "plain", (16, 16))
        name, words = _cut(tmp_path / "q", "_scale_inv"), "blocks needs scale_inv"
    else:
        gpt_oss_transformers(hidden_size=64, intermediate_size=32).save_pretrained(tmp_path / "q")
        mxfp4_gpt_oss(tmp_path / "q", tmp_path / "plain")
        name, words = _cut(tmp_path / "q", "_scales"), "differ before the last dimension"
    (problem,) = config_problems(tmp_path / "q")
    assert name in problem and "do not fit" in problem and words in problem
    with pytest.raises(UserError, match=words):
        load_model_from_dir(str(tmp_path / "q"))


def test_mxfp4_scales_that_are_not_bytes_are_named_at_validate(tmp_path):
    """validate said nothing; the load then refused them (the dequantiser's dtype check)."""
    from safetensors.torch import load_file, save_file

    gpt_oss_transformers(hidden_size=64, intermediate_size=32).save_pretrained(tmp_path / "q")
    mxfp4_gpt_oss(tmp_path / "q", tmp_path / "plain")
    weights = load_file(tmp_path / "q" / "model.safetensors")
    name = "model.layers.0.mlp.experts.down_proj_scales"
    weights[name] = weights[name].float()
    save_file(weights, tmp_path / "q" / "model.safetensors", metadata={"format": "pt"})
    (problem,) = config_problems(tmp_path / "q")
    assert f"(e.g. {name} is F32;" in problem and "MXFP4 blocks and scales are U8" in problem


def test_mxfp4_tensors_without_a_quantization_config_say_what_config_json_lacks(tmp_path):
    gpt_oss_transformers(hidden_size=64, intermediate_size=32).save_pretrained(tmp_path / "q")
    mxfp4_gpt_oss(tmp_path / "q", tmp_path / "plain")
    edit_config(tmp_path / "q", quantization_config=None)
    (problem,) = config_problems(tmp_path / "q")
    assert "hold MXFP4 blocks and scales (e.g. model.layers.0.mlp.experts." in problem
    assert f"{tmp_path / 'q' / 'config.json'} has no quantization_config: add" in problem
