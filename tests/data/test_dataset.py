"""PromptDataset + collate: chat template, overlong modes, left padding, Batch wrapping."""

import numpy as np
import pytest
import torch

from hybridflow.data.dataset import PromptDataset, PromptLoader, collate_prompts, make_prompt_batch
from hybridflow.data.schema import DataSchemaError, PromptRecord
from hybridflow.models.tokenizer import build_char_tokenizer

TOKENIZER = build_char_tokenizer()
IM_START = TOKENIZER.convert_tokens_to_ids("<|im_start|>")


def record(question, truth="0", where="f.jsonl: line 1"):
    return PromptRecord(
        data_source="arithmetic",
        prompt=[{"role": "user", "content": question}],
        ground_truth=truth,
        extra_info={"q": question},
        where=where,
    )


RECORDS = [
    record("1+2=", "3"),
    record("10+20=", "30"),
    record("100+200=", "300", "f.jsonl: line 3"),
]


def test_chat_template_applied():
    dataset = PromptDataset(RECORDS, TOKENIZER)
    ids = dataset[0].prompt_ids
    # <|im_start|> u 1 + 2 = <|im_end|> <|im_start|> a   (<|im_end|> is eos, id 4)
    assert ids == [
        IM_START,
        *TOKENIZER.encode("u1+2=", add_special_tokens=False),
        4,
        IM_START,
        TOKENIZER.convert_tokens_to_ids("a"),
    ]


def test_overlong_filter_counts():
    # lengths: 4+5=9, 6+5=11, 8+5=13 tokens; the one exactly at the limit is kept
    dataset = PromptDataset(RECORDS, TOKENIZER, max_prompt_length=11, overlong="filter")
    assert len(dataset) == 2 and dataset.num_filtered == 1
    assert [item.index for item in dataset.items] == [0, 1]


def test_overlong_error_names_row_and_limit():
    with pytest.raises(
        DataSchemaError, match=r"f\.jsonl: line 3: prompt has 13 tokens.*max_prompt_length=11"
    ):
        PromptDataset(RECORDS, TOKENIZER, max_prompt_length=11, overlong="error")


def test_overlong_truncate_keeps_the_end():
    dataset = PromptDataset(RECORDS, TOKENIZER, max_prompt_length=5, overlong="truncate")
    full = PromptDataset(RECORDS, TOKENIZER)
    assert dataset.num_filtered == 0
    assert len(full[2].prompt_ids) == 13 and len(dataset[2].prompt_ids) == 5
    assert dataset[2].prompt_ids == full[2].prompt_ids[-5:]
    # the last 5 tokens: "0=" of the question, then <|im_end|> and the generation prompt
    assert TOKENIZER.decode(dataset[2].prompt_ids) == "0=<|im_end|><|im_start|>a"


def test_collate_left_pads_and_gathers_arrays():
    dataset = PromptDataset(RECORDS, TOKENIZER)
    tensors, arrays = collate_prompts([dataset[0], dataset[2]], TOKENIZER.pad_token_id)
    prompts, mask = tensors["prompts"], tensors["attention_mask"]
    assert prompts.shape == (2, 13) and prompts.dtype == torch.long
    assert mask[0].tolist() == [0] * 4 + [1] * 9
    assert prompts[0, :4].tolist() == [TOKENIZER.pad_token_id] * 4
    assert prompts[0, 4:].tolist() == dataset[0].prompt_ids
    assert prompts[1].tolist() == dataset[2].prompt_ids
    assert list(arrays["ground_truth"]) == ["3", "300"]
    assert arrays["raw_prompt"][1] == [{"role": "user", "content": "100+200="}]
    assert arrays["extra_info"][0] == {"q": "1+2="}
    assert arrays["index"].tolist() == [0, 2]
    assert all(a.shape == (2,) for a in arrays.values())


def test_collate_pad_to_fixed_width():
    dataset = PromptDataset(RECORDS, TOKENIZER)
    tensors, _ = collate_prompts([dataset[0]], TOKENIZER.pad_token_id, pad_to=16)
    assert tensors["prompts"].shape == (1, 16) and tensors["attention_mask"].sum() == 9
    with pytest.raises(ValueError, match="shorter than the longest"):
        collate_prompts([dataset[2]], 0, pad_to=4)


def test_object_arrays_hold_equal_shaped_lists():
    # np.array would turn two equal-length lists into a 2-D array; rows must stay lists.
    cd = [
        PromptRecord(
            "countdown", [{"role": "user", "content": "x"}], {"target": 3, "numbers": [1, 2]}
        ),
        PromptRecord(
            "countdown", [{"role": "user", "content": "y"}], {"target": 4, "numbers": [2, 2]}
        ),
    ]
    _, arrays = collate_prompts(PromptDataset(cd, TOKENIZER).items, 0)
    assert arrays["raw_prompt"].dtype == object and arrays["raw_prompt"].shape == (2,)


def test_loader_batches_are_batch_objects_and_resume_exactly():
    dataset = PromptDataset([record(f"{i}+1=", str(i + 1)) for i in range(10)], TOKENIZER)
    loader = PromptLoader(dataset, batch_size=3, pad_token_id=0, seed=5)
    first = [loader.next_batch() for _ in range(2)]
    assert len(first[0]) == 3 and "prompts" in first[0] and "ground_truth" in first[0]
    state = loader.state_dict()
    later = [loader.next_batch()["index"].tolist() for _ in range(4)]
    resumed = PromptLoader(dataset, batch_size=3, pad_token_id=0, seed=5)
    resumed.load_state_dict(state)
    assert [resumed.next_batch()["index"].tolist() for _ in range(4)] == later


def test_make_prompt_batch_matches_collate():
    dataset = PromptDataset(RECORDS, TOKENIZER)
    batch = make_prompt_batch(dataset.items, TOKENIZER.pad_token_id)
    tensors, arrays = collate_prompts(dataset.items, TOKENIZER.pad_token_id)
    assert torch.equal(batch["prompts"], tensors["prompts"])
    assert np.array_equal(batch["index"], arrays["index"])


class ListOfListsTokenizer:
    """transformers returns nested lists / BatchEncoding in some versions."""

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        return {"input_ids": [[5, 6, len(messages[0]["content"])]]}


def test_tokenizer_output_forms_are_normalised():
    dataset = PromptDataset(RECORDS[:1], ListOfListsTokenizer())
    assert dataset[0].prompt_ids == [5, 6, 4]


def tiny_hf_tokenizer():
    """A real transformers tokenizer built offline (transformers 5 returns a BatchEncoding)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    symbols = ["<pad>", "<eos>", "<unk>", *"abcdefghijklmnopqrstuvwxyz0123456789+=:| "]
    backend = Tokenizer(models.WordLevel({c: i for i, c in enumerate(symbols)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['role'] }}:{{ m['content'] }}|{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    return tokenizer


def test_hugging_face_tokenizer_prompt_ids():
    tokenizer = tiny_hf_tokenizer()
    dataset = PromptDataset(RECORDS[:1], tokenizer)
    assert tokenizer.decode(dataset[0].prompt_ids).replace(" ", "") == "user:1+2=|assistant:"


def test_build_prompt_datasets_from_config():
    from hybridflow.config import DataConfig
    from hybridflow.data.dataset import build_prompt_datasets

    config = DataConfig(builtin_train_size=50, builtin_val_size=10, max_prompt_length=32)
    train, val = build_prompt_datasets(config, TOKENIZER, seed=0, known_data_sources=["arithmetic"])
    assert len(train) == 50 and len(val) == 10 and train.num_filtered == 0
    config.val_files = []
    assert build_prompt_datasets(config, TOKENIZER)[1] is None


def test_a_prompt_that_tokenizes_to_nothing_is_named():
    class Silent:  # a tokenizer that reads none of the row's text (the wrong one for the data)
        def apply_chat_template(self, messages, **kwargs):
            return []

        def encode(self, text, **kwargs):
            return []

    with pytest.raises(DataSchemaError, match=r"f\.jsonl: line 3: the prompt is no tokens"):
        PromptDataset(RECORDS[2:], Silent())


READ_HUGE_ROWS = """
import json, sys
from hybridflow.data.dataset import PromptDataset
from hybridflow.data.sft_examples import load_sft_rows, tokenize_sft_rows
from hybridflow.models.tokenizer import build_char_tokenizer


def peak_kib():  # VmHWM, the peak resident size since the last reset
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))


tokenizer = build_char_tokenizer()
tokenizer.encode("warm up")
for kind, path in zip(sys.argv[1::2], sys.argv[2::2]):
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")  # resets VmHWM to the current resident size
    before = peak_kib()
    if kind == "sft":
        examples, dropped = tokenize_sft_rows(load_sft_rows(path), tokenizer, 4, max_length=64)
        kept = len(examples)
    else:
        dataset = PromptDataset.from_files(path, tokenizer, max_prompt_length=64)
        kept, dropped = len(dataset), dataset.num_filtered
    grown_mib = (peak_kib() - before) / 1024
    print(json.dumps({"kind": kind, "kept": kept, "dropped": dropped, "grown_mib": grown_mib}))
"""
HUGE_CHARS = 2_000_000  # the char tokenizer took ~200 MiB a million characters to tokenize


def test_a_huge_row_is_dropped_as_it_is_read_in_bounded_memory(tmp_path):
    """One row of 2 M characters among short ones, with a 64-token limit, in a prompt file
    (jsonl, parquet) and an SFT file: it is counted as dropped and costs a few times its
    size at most (tokenized whole, it cost ~400 MiB)."""
    import json
    import subprocess
    import sys

    from hybridflow.data.schema import write_rows

    huge = "1+2=" * (HUGE_CHARS // 4)
    prompts = [record(question).to_row() for question in ("1+2=", huge, "2+2=")]
    files = {
        "jsonl": write_rows(prompts, tmp_path / "rows.jsonl"),
        "parquet": write_rows(prompts, tmp_path / "rows.parquet"),
        "sft": write_rows([{"prompt": "1+2=", "response": answer} for answer in ("3", huge, "3")],
                          tmp_path / "sft.jsonl"),
    }  # fmt: skip
    arguments = [str(item) for kind, path in files.items() for item in (kind, path)]
    done = subprocess.run([sys.executable, "-c", READ_HUGE_ROWS, *arguments],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    measured = [json.loads(line) for line in done.stdout.splitlines()]
    assert [m["kind"] for m in measured] == list(files)
    for m in measured:
        assert m["kept"] == 2 and m["dropped"] == 1 and m["grown_mib"] < 64, m


def test_a_prompt_within_the_limit_is_tokenized_and_kept():
    """The character limit drops only what no tokenization could fit: a prompt of exactly
    max_prompt_length tokens (one character each) is kept."""
    question = "7" * (64 - 5)  # the template adds 5 tokens
    dataset = PromptDataset([record(question)], TOKENIZER, max_prompt_length=64)
    assert len(dataset[0].prompt_ids) == 64 and dataset.num_filtered == 0


def test_a_huge_prompt_is_refused_by_its_characters_in_error_mode():
    with pytest.raises(DataSchemaError, match=r"line 1: prompt has 100000 characters, more than "
                       r"data.max_prompt_length=8 tokens can hold with this tokenizer \(416\)"):  # fmt: skip
        PromptDataset([record("9" * 100_000)], TOKENIZER, max_prompt_length=8, overlong="error")


def test_a_huge_prompt_cut_by_characters_truncates_as_tokenizing_it_whole_would():
    from hybridflow.data.chat import encode_chat_prompt

    long = record("".join(f"{i}+{i}=" for i in range(5000)))  # ~39k characters, cut to 832
    dataset = PromptDataset([long], TOKENIZER, max_prompt_length=8, overlong="truncate")
    assert dataset[0].prompt_ids == encode_chat_prompt(TOKENIZER, long.prompt)[-8:]
    assert len(dataset[0].record.prompt[0]["content"]) == 2 * 8 * 52  # 52: 4 x "<|endoftext|>"


def test_a_tokenizer_without_a_chat_template_is_a_user_error_naming_it():
    """A base model's tokenizer has no chat template: a clear error (exit 2), not
    transformers' ValueError reported as a bug."""
    from hybridflow.data.chat import encode_chat_prompt
    from hybridflow.errors import UserError

    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = None
    tokenizer.name_or_path = "/models/base"
    with pytest.raises(UserError, match="tokenizer in /models/base has no chat template") as info:
        encode_chat_prompt(tokenizer, [{"role": "user", "content": "1+2="}])
    assert info.value.exit_code == 2 and "chat_template" in info.value.fix
