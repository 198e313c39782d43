"""Prompt data: verl-schema files, chat templates, resumable sampling, synthetic tasks.

Importing this package stays light (no torch); `hybridflow.data.dataset` holds the
torch-facing parts (`PromptDataset`, `collate_prompts`, `PromptLoader`).
"""

from hybridflow.data.schema import (
    DataSchemaError,
    PromptRecord,
    load_prompt_records,
    validate_row,
    write_records,
    write_rows,
)

__all__ = [
    "DataSchemaError",
    "PromptRecord",
    "load_prompt_records",
    "validate_row",
    "write_records",
    "write_rows",
]
