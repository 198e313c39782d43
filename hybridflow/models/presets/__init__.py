"""Named model shapes (random init) for tests and benchmarks; no weights are downloaded.

Shapes copied from the public config.json of each model."""

from hybridflow.models.architecture import ModelArchitecture
from hybridflow.models.presets.deepseek import DEEPSEEK_V3
from hybridflow.models.presets.gpt_oss import GPT_OSS
from hybridflow.models.presets.llama import LLAMA3
from hybridflow.models.presets.qwen import QWEN
from hybridflow.models.presets.tiny import TINY

PRESETS: dict[str, ModelArchitecture] = {**TINY, **QWEN, **LLAMA3, **DEEPSEEK_V3, **GPT_OSS}


def preset_config(name: str) -> ModelArchitecture:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known presets: {sorted(PRESETS)}")
    return PRESETS[name].replace()  # a copy the caller may modify
