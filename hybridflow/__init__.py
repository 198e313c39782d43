"""hybridflow: RL post-training of LLMs with a single controller driving SPMD worker groups.

Kept light on purpose: ``import hybridflow`` loads no torch; subpackages import what they use.
"""

__version__ = "0.1.0"
