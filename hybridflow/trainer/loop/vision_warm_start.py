"""``model.path = sft:shapes``: the warm start of a vision-language preset (tiny-vl) on the
built-in image task, as warm_start.py's is of the text demo's: SFT from scratch until the
greedy accuracy reaches ``sft.stop_at_accuracy``, then cached with its tokenizer and its
image processor, so the RL run reads it like any Qwen2.5-VL directory.

The demonstrations and the accuracy problems are never from the task's validation split
(the RL run's before/after numbers). The accuracy is measured with the rollout engine on
the images (engine/images.py), greedy. A stop request ends the SFT without saving its
progress (the text warm start keeps it): the next run trains it again, a minute on a CPU.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import torch

from hybridflow.config import Config, ConfigError
from hybridflow.data.builtin import IMAGE_TASKS

VISION_TASKS = IMAGE_TASKS


def _problems(size: int, seed: int, val_size: int, data_seed: int) -> list[tuple]:
    """(picture, question, answer) of the shapes task, none from its validation split."""
    from hybridflow.data.shapes import shapes_problems, shapes_splits

    test = shapes_splits(0, val_size, data_seed)["test"]
    return shapes_problems(size, seed, frozenset((p, q) for p, q, _ in test))


def _items(problems, tokenizer, processor, split: str):
    """PromptItems (ids with the images' tokens, grids, mRoPE rows) and their answers."""
    from hybridflow.data.dataset import tokenize_records
    from hybridflow.data.schema import validate_row
    from hybridflow.data.shapes import shapes_row

    records = (validate_row(shapes_row(*problem, split, i), f"builtin:shapes[{split}] row {i}",
                            image_key="images") for i, problem in enumerate(problems))  # fmt: skip
    items, _ = tokenize_records(records, tokenizer, None, "error", processor)
    return items, [answer for _, _, answer in problems]


def sft_batch(items, answers, tokenizer, processor):
    """A Batch of prompts with their images and the answers (then eos) as responses, the
    loss on the response tokens: the layout of an RL sample (learners' packed passes)."""
    from hybridflow.data.dataset import make_prompt_batch
    from hybridflow.data.image_batch import MROPE_POSITIONS, extend_positions

    pad = tokenizer.pad_token_id or 0
    batch = make_prompt_batch(items, pad, images=processor)
    targets = [tokenizer.encode(a, add_special_tokens=False) + [tokenizer.eos_token_id]
               for a in answers]  # fmt: skip
    width = max(map(len, targets))
    responses = torch.full((len(items), width), pad, dtype=torch.long)  # [b, R]
    response_mask = torch.zeros(len(items), width)  # [b, R]
    for row, target in enumerate(targets):
        responses[row, : len(target)] = torch.tensor(target)
        response_mask[row, : len(target)] = 1
    tensors = batch.tensors
    tensors[MROPE_POSITIONS] = extend_positions(tensors[MROPE_POSITIONS], response_mask)
    tensors["attention_mask"] = torch.cat([tensors["attention_mask"], response_mask.long()], 1)
    tensors.update(responses=responses, response_mask=response_mask)
    return batch


@torch.no_grad()
def greedy_image_accuracy(model, tokenizer, processor, items, answers, max_new_tokens=6):
    """Fraction of the items whose greedy answer (the rollout engine, with the images) is
    exactly theirs."""
    from hybridflow.data.dataset import make_prompt_batch
    from hybridflow.engine import Engine, SamplingParams
    from hybridflow.engine.images import PromptImages

    batch = make_prompt_batch(items, tokenizer.pad_token_id or 0, images=processor)
    images = [PromptImages(pixels, grid, item.mrope_positions) for item, pixels, grid in
              zip(items, batch.arrays["pixel_values"], batch.arrays["image_grid_thw"])]  # fmt: skip
    was_training = model.training
    model.eval()
    engine = Engine(model, max_batch_size=len(items), max_seq_len=128)
    params = SamplingParams(temperature=0, max_new_tokens=max_new_tokens)
    results = engine.generate([item.prompt_ids for item in items], params, images=images)
    model.train(was_training)
    said = [tokenizer.decode(r.token_ids, skip_special_tokens=True).strip() for r in results]
    return sum(s == a for s, a in zip(said, answers)) / max(len(answers), 1)


def train_vision_warm_start(cfg: Config, task: str, target: Path, log=print, progress=None,
                            stop=None) -> None:  # fmt: skip
    """SFT of a fresh ``sft.preset`` model on the image task; published at ``target`` with
    its tokenizer and image processor."""
    from hybridflow.data.images import ImageProcessor
    from hybridflow.data.sampler import ResumableSampler
    from hybridflow.models import PRESETS, load_model, load_tokenizer
    from hybridflow.progress import quiet_reporter
    from hybridflow.trainer.lifecycle.divergence import check_update
    from hybridflow.trainer.loop.device import resolve_device
    from hybridflow.trainer.loop.published_model import publish
    from hybridflow.trainer.loop.sft_loop import SFTTrainer
    from hybridflow.workers.model_loading import default_tokenizer_path

    sft_cfg = cfg.sft
    spec = PRESETS[sft_cfg.preset].vision if sft_cfg.preset in PRESETS else None
    if spec is None:
        raise ConfigError([f"model.path = sft:{task} is an image task: sft.preset = "
                           f"{sft_cfg.preset!r} must be a vision-language preset (tiny-vl)"])  # fmt: skip
    started = time.perf_counter()
    tokenizer = load_tokenizer(default_tokenizer_path(cfg.model))
    processor = ImageProcessor.for_encoder(spec)
    val_size, seed = cfg.data.builtin_val_size, cfg.trainer.seed
    items, answers = _items(_problems(sft_cfg.builtin_size, 2_000_003, val_size, 0), tokenizer,
                            processor, "sft")  # fmt: skip
    checks = _items(_problems(sft_cfg.eval_size, 3_000_017, val_size, 0), tokenizer, processor,
                    "check")  # fmt: skip
    device = resolve_device(cfg.trainer.device)
    device = "cuda:0" if device == "cuda" else device
    torch.manual_seed(seed)
    model = load_model(sft_cfg.preset, dtype=torch.float32, device=device)
    trainer = SFTTrainer(model, sft_cfg, device, grad_clip=1.0)
    sampler = ResumableSampler(len(items), min(sft_cfg.batch_size, len(items)), seed=seed)
    accuracy, step = 0.0, 0
    with (progress or quiet_reporter()).task("warm start SFT on images", unit="steps") as bar:
        for step in range(1, sft_cfg.total_steps + 1):
            rows = sampler.next_batch()
            batch = sft_batch([items[i] for i in rows], [answers[i] for i in rows], tokenizer,
                              processor)  # fmt: skip
            metrics = trainer.step(batch)
            check_update(metrics, "sft", step=f"SFT step {step}", kept="none",
                         fix="lower sft.lr")  # fmt: skip
            bar.update(step, status=f"loss {metrics['sft/loss']:.3f}, accuracy {accuracy:.2f}")
            if step % sft_cfg.eval_every == 0 or step == sft_cfg.total_steps:
                accuracy = greedy_image_accuracy(trainer.model, tokenizer, processor, *checks)
                log(f"  sft step {step}/{sft_cfg.total_steps}  loss {metrics['sft/loss']:.3f}"
                    f"  greedy accuracy {accuracy:.3f}")  # fmt: skip
                target_accuracy = sft_cfg.stop_at_accuracy
                if target_accuracy is not None and accuracy >= target_accuracy:
                    break
            if stop is not None and stop.requested:
                raise stop.stopped(f"during the warm start SFT at step {step}: nothing saved")
    publish(trainer.model, tokenizer, dataclasses.replace(sft_cfg, train_files=[task]), target)
    processor.processor.save_pretrained(str(target))  # preprocessor_config.json
    log(f"warm start: SFT done in {time.perf_counter() - started:.0f} s ({step} steps, greedy "
        f"accuracy {accuracy:.3f})")  # fmt: skip
