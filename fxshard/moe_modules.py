"""MoE modules whose forward fxshard swaps while it traces: `fxshard.register_moe`.

`passes/recognize_moe.py` recognizes MoE layers by their dataflow (a sort of the top-k expert ids,
counted offsets, grouped GEMMs). A layer written another way — a Python loop over experts that reads
the routing on the host, one weight copy gathered per token (`bmm`), a kernel fxshard cannot see
into — is not recognized, and some of them cannot be traced at all. For those, register a forward
that computes the same function with fxshard's primitives (`fxshard.moe.dispatch` / `combine`,
`fxshard.ops.grouped_mm`, or plain torch ops in the recognized form):

    def forward(module, x):                     # the module's own arguments follow `module`
        ...                                     # same result as module.forward(x)
    fxshard.register_moe(MyMoE, forward)

While fxshard traces a model (shard, check, trace, evaluate), every instance of the type
(subclasses included) runs `forward(module, *args, **kwargs)` instead of its own forward; the model
is not edited and runs its own code outside fxshard. The parameters stay the module's: the forward
reads them as attributes, so names, checkpoints and expert parallelism see the model's own tensors.
The traced program's notes (and the dump's summary) list every module swapped.

Built in, after the user's registrations: transformers' experts modules (classes decorated with
`use_experts_implementation`: Mixtral, Qwen2/3-MoE, DeepSeek, ...) configured with another
implementation than "grouped_mm" ("eager" loops over experts on the host and cannot be traced;
"batched_mm" gathers a weight matrix per token) trace with transformers' own "grouped_mm"
implementation, which computes the same function, so that the recognizer finds them.
"""

from __future__ import annotations

import contextlib
import types
from typing import Callable, Iterator

import torch.nn as nn

from .errors import FxShardError

_registered: dict[type, Callable] = {}


def register_moe(module_type: type, forward: Callable | None) -> None:
    """While fxshard traces, instances of `module_type` run `forward(module, *args, **kwargs)` (module
    docstring). Registering a type again replaces its forward; `forward=None` removes it."""
    if not (isinstance(module_type, type) and issubclass(module_type, nn.Module)):
        raise FxShardError(f"register_moe takes an nn.Module subclass, got {module_type!r}")
    if forward is None:
        _registered.pop(module_type, None)
        return
    if not callable(forward):
        raise FxShardError(f"register_moe({module_type.__name__}, forward): forward must be callable "
                           f"(module, *args, **kwargs) -> output, got {forward!r}")
    _registered[module_type] = forward


def _forward_for(module: nn.Module) -> tuple[Callable, str] | None:
    for module_type in type(module).__mro__:
        if module_type in _registered:
            forward = _registered[module_type]
            return forward, f"registered {getattr(forward, '__qualname__', forward)!s}"
    return _transformers_experts(module)


# transformers' own experts implementations that compute what its "grouped_mm" one does (a loop over
# experts, batched GEMMs): traced as that one, which the MoE recognizer knows. A custom implementation
# (ExpertsInterface.register) may compute something else, and is traced as written.
_SAME_AS_GROUPED_MM = ("eager", "batched_mm")


def _transformers_experts(module: nn.Module) -> tuple[Callable, str] | None:
    """transformers' experts modules on one of its implementations of the same function as
    "grouped_mm" (`_SAME_AS_GROUPED_MM`): that implementation."""
    config = getattr(module, "config", None)
    implementation = getattr(config, "_experts_implementation", None)
    if not hasattr(module, "_is_expert_parallel") or implementation not in _SAME_AS_GROUPED_MM:
        return None
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError:
        return None
    grouped = ALL_EXPERTS_FUNCTIONS.get("grouped_mm")
    if grouped is None:
        return None
    return grouped, f"transformers' {implementation!r} experts traced as its 'grouped_mm' experts (same function)"


@contextlib.contextmanager
def swapped_forwards(model: nn.Module) -> Iterator[list[str]]:
    """Every registered module of `model` runs its registered forward inside; yields "path: how" lines."""
    swapped, lines = [], []  # (module, the instance's own forward attribute if it had one)
    try:
        for path, module in model.named_modules():
            found = _forward_for(module)
            if found is None:
                continue
            forward, how = found
            swapped.append((module, vars(module).get("forward")))
            module.forward = types.MethodType(forward, module)  # an instance attribute, shadowing the class's
            lines.append(f"{path}: {type(module).__name__}, {how}")
        yield lines
    finally:
        for module, own in swapped:
            if own is None:
                del module.forward
            else:
                module.forward = own
