"""fxshard: compile-style distributed training for PyTorch.

    step = fxshard.shard(model, loss_fn, example_batch, optimizer=fxshard.optim.AdamW(lr=1e-3))
    metrics = step(batch)
"""

import os as _os

# The repository keeps passes/ and models/ at its top level, installed as fxshard.passes and
# fxshard.models (pyproject's package-dir). When fxshard is imported straight from a checkout (the
# checkout on sys.path, no install, or an editable install whose finder loses to the checkout),
# look for those subpackages beside this folder too.
_checkout = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if all(_os.path.isfile(_os.path.join(_checkout, d, "__init__.py")) for d in ("passes", "models")):
    __path__.append(_checkout)  # noqa: F821 - a package's own __path__

from . import meta, optim  # noqa: E402
from .api import check, shard, trace  # noqa: E402
from .checkpoint import export_hf, load, load_hf, save  # noqa: E402
from .config import Config  # noqa: E402
from .errors import FxShardError  # noqa: E402
from .loss_scale import LossScale  # noqa: E402
from .mesh import Mesh  # noqa: E402
from .moe_modules import register_moe  # noqa: E402
from .program import Input, InputKind, Output, OutputKind, Placement, Program  # noqa: E402

__all__ = ["shard", "trace", "check", "save", "load", "export_hf", "load_hf", "Config", "LossScale", "Mesh", "FxShardError",
           "register_moe", "Program", "Input", "InputKind", "Output", "OutputKind", "Placement", "optim", "meta"]
