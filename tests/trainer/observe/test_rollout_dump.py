"""trainer.rollout_data_dir: a step's samples as verl writes them, one JSON line each."""

import json

import numpy as np
import torch

from hybridflow.models.tokenizer import build_char_tokenizer
from hybridflow.protocol import Batch
from hybridflow.trainer.observe.rollout_dump import dump_rollouts


def test_a_steps_samples_are_one_json_line_each(tmp_path):
    tokenizer = build_char_tokenizer()
    pad = tokenizer.pad_token_id

    def ids(text):
        return tokenizer.encode(text, add_special_tokens=False)

    # prompts left-padded to 4 columns, responses right-padded to 3 (the eos is skipped)
    prompts = torch.tensor([[pad, *ids("1+2")], ids("12+3")])
    responses = torch.tensor([[*ids("3"), tokenizer.eos_token_id, pad], ids("15=")])
    attention = torch.tensor([[0, 1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1, 1]])
    batch = Batch({"prompts": prompts, "responses": responses, "attention_mask": attention,
                   "response_mask": attention[:, 4:]})  # fmt: skip
    batch.arrays["ground_truth"] = np.asarray(["3", "15"], dtype=object)
    batch.arrays["scores"] = np.asarray([1.0, 0.0])
    path = dump_rollouts(str(tmp_path / "rollouts"), 7, tokenizer, batch)
    assert path == tmp_path / "rollouts" / "7.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows == [
        {"input": "1+2", "output": "3", "gts": "3", "score": 1.0, "step": 7},
        {"input": "12+3", "output": "15=", "gts": "15", "score": 0.0, "step": 7},
    ]
