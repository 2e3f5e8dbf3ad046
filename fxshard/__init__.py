"""fxshard: compile-style distributed training for PyTorch.

    step = fxshard.shard(model, loss_fn, example_batch, optimizer=fxshard.optim.AdamW(lr=1e-3))
    metrics = step(batch)
"""

from . import meta, optim
from .api import shard, trace
from .config import Config
from .errors import FxShardError
from .mesh import Mesh
from .program import Input, InputKind, Output, OutputKind, Placement, Program

__all__ = ["shard", "trace", "Config", "Mesh", "FxShardError", "Program", "Input", "InputKind", "Output",
           "OutputKind", "Placement", "optim", "meta"]
