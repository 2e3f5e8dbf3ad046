"""Reference models, written as plain nn.Modules: nothing in them exists to help the tracer."""

from .gpt import GPT, GPTConfig
from .grouped_linear import GroupedLinear
from .moe_gpt import MoEGPT, MoEGPTConfig

__all__ = ["GPT", "GPTConfig", "GroupedLinear", "MoEGPT", "MoEGPTConfig"]
