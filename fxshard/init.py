"""Rank-independent initialization of a model built on the `meta` device.

Rule: every module that owns parameters or buffers directly initializes them with its own
`reset_parameters()` (PyTorch's convention); in a transformers model, with the model's
`_init_weights(module)` (what `from_config` initializes it with, rotary tables included); a
torchtitan module with its own `_init_self_parameters()` and `_init_self_buffers()` (what its
`init_states` runs for each module, children first); each under a random seed derived from
(seed, module path). Floating-point tensors start as NaN, so a tensor the
initializer leaves alone is an error, never uninitialized memory.
A tensor's values therefore depend only on the seed and where it lives in the model, never on the
rank or on what else was initialized first. A rank that needs only its shard of a flat unit
materializes one module at a time, keeps the slice that falls in its shard and drops the rest, so
peak memory is the rank's shards plus the largest single module.
"""

from __future__ import annotations

import hashlib
from typing import Iterator

import torch
import torch.nn as nn

from .errors import FxShardError
from .program import FlatUnit


def module_seed(seed: int, path: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{path}".encode()).digest()[:8], "little") % (2**63)


def _owned_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module, list[str], list[str]]]:
    """(path, module, canonical parameter names it owns, buffer names it owns). A tied parameter is
    owned by the module where named_parameters() first meets it."""
    canonical = {id(p): name for name, p in model.named_parameters()}
    for path, module in model.named_modules():
        prefix = f"{path}." if path else ""
        params = [prefix + n for n, p in module.named_parameters(recurse=False) if canonical.get(id(p)) == prefix + n]
        buffers = [prefix + n for n, _ in module.named_buffers(recurse=False)]
        if params or buffers:
            yield path, module, params, buffers


def _materialize(model: nn.Module, path: str, module: nn.Module, seed: int, device) -> dict[str, torch.Tensor]:
    """One module's own tensors, initialized on `device`; the model's module stays on meta."""
    device = torch.device(device)
    initialize = _initializer(model, path, module, device)
    # the meta tensors themselves go back afterwards: a weight tied to another module stays one object
    originals = dict(module._parameters), dict(module._buffers)
    module.to_empty(device=device, recurse=False)
    try:
        own = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(module_seed(seed, path))
            with torch.no_grad():
                for _, tensor in own:
                    if tensor.is_floating_point() or tensor.is_complex():
                        tensor.fill_(float("nan"))
                try:
                    initialize()
                except FxShardError:
                    raise
                except Exception as error:
                    raise FxShardError(
                        f"initializing module {path or type(model).__name__!r} ({type(module).__name__}) of a model "
                        f"built on the meta device failed: {type(error).__name__}: {error}. Fix its initializer, or "
                        f"build the model on a real device") from error
        prefix = f"{path}." if path else ""
        values = {prefix + n: t.detach() for n, t in [*module.named_parameters(recurse=False),
                                                       *module.named_buffers(recurse=False)]}
        left = [name for name, t in values.items() if (t.is_floating_point() or t.is_complex()) and t.isnan().any()]
        if left:
            raise FxShardError(
                f"initializing module {path or type(model).__name__!r} ({type(module).__name__}) on {device} leaves "
                f"{', '.join(left)} (partly) unset: its initializer does not write every element. Build the model "
                f"on a real device, or make the initializer cover them")
        return values
    finally:
        module._parameters.update(originals[0])
        module._buffers.update(originals[1])


def _is_transformers(module: nn.Module) -> bool:
    return callable(getattr(module, "_init_weights", None)) and hasattr(getattr(module, "config", None), "model_type")


def _is_titan(module: nn.Module) -> bool:
    """torchtitan's Module protocol (torchtitan/protocols/module.py)."""
    return callable(getattr(module, "_init_self_parameters", None)) and \
        callable(getattr(module, "_init_self_buffers", None))


def _post_order(module: nn.Module, path: str = "") -> Iterator[tuple[str, nn.Module]]:
    """Children before their parent, in registration order: the order of torchtitan's `init_states`."""
    for name, child in module.named_children():
        yield from _post_order(child, f"{path}.{name}" if path else name)
    yield path, module


def _titan_initializer(model: nn.Module, module: nn.Module, device: torch.device):
    """torchtitan's `init_states` restricted to `module`'s own tensors: `_init_self_parameters()`
    (its `param_init` functions, else `reset_parameters()`), then `_init_self_buffers()` on `device`.
    A parameter tied to other modules (an embedding and the output head) is written by each torchtitan
    module holding it, in `init_states`' order, so the last writer decides as in torchtitan, where the
    tied embedding's initializer skips it; the others' calls touch only this tensor, the rest of
    theirs being on meta."""
    own = {id(p): name for name, p in module._parameters.items() if p is not None}  # still the meta tensors
    writers = []  # (holder, {its local name: module's local name})
    for _, holder in _post_order(model):
        if holder is module:
            writers.append((module, {}))
        elif _is_titan(holder):
            shared = {local: own[id(p)] for local, p in holder._parameters.items() if p is not None and id(p) in own}
            if shared:
                writers.append((holder, shared))

    def initialize():
        for holder, shared in writers:
            saved = {local: holder._parameters[local] for local in shared}
            holder._parameters.update({local: module._parameters[name] for local, name in shared.items()})
            try:
                holder._init_self_parameters()
            finally:
                holder._parameters.update(saved)
        module._init_self_buffers(buffer_device=device)
    return initialize


def _initializer(model: nn.Module, path: str, module: nn.Module, device: torch.device):
    """What initializes `module`'s own tensors: in a transformers model, `_init_weights` of the module
    and then of each of its ancestors, nearest first, each by the innermost transformers model holding
    it, as `initialize_weights` applies it (children before parents: GPT-2's attention rescales its
    c_proj, Qwen3-Next's MoE block initializes its router); the ancestors' calls touch only
    this module's tensors, the others being on meta. A torchtitan module: its own `init_states` step
    (`_titan_initializer`). Else the module's `reset_parameters()`."""
    if _is_transformers(model):
        parts = path.split(".") if path else []
        chain = [".".join(parts[:end]) for end in range(len(parts), -1, -1)]  # the module, then up to the root

        def initialize():
            for where in chain:
                owner, walked = model, model
                for name in where.split(".") if where else []:
                    walked = walked.get_submodule(name)
                    owner = walked if _is_transformers(walked) else owner
                owner._init_weights(model.get_submodule(where))
        return initialize
    if _is_titan(module):
        return _titan_initializer(model, module, device)
    if hasattr(module, "reset_parameters"):
        return module.reset_parameters
    raise FxShardError(
        f"module {path or type(model).__name__!r} ({type(module).__name__}) owns tensors but has no "
        f"reset_parameters(); a model built on the meta device is initialized module by module with "
        f"reset_parameters() (or a transformers model's _init_weights, or torchtitan's _init_self_parameters and "
        f"_init_self_buffers): add one, or build the model on a real device")


class MetaInit:
    """Initial tensors of a meta-device model: whole (`param`, `buffer`) or one rank's unit shard."""

    def __init__(self, model: nn.Module, seed: int, device):
        self.model, self.seed, self.device = model, seed, torch.device(device)
        self._buffers = None

    def materialize_all(self) -> dict[str, torch.Tensor]:
        tensors = {}
        for path, module, _, _ in _owned_modules(self.model):
            tensors.update(_materialize(self.model, path, module, self.seed, self.device))
        return tensors

    def tensors_named(self, names: set[str]) -> dict[str, torch.Tensor]:
        """Only the named parameters/buffers, materializing only the modules that own them."""
        found = {}
        for path, module, params, buffers in _owned_modules(self.model):
            if names & {*params, *buffers}:
                values = _materialize(self.model, path, module, self.seed, self.device)
                found.update({k: v for k, v in values.items() if k in names})
        return found

    def unit_shard(self, unit: FlatUnit, rank: int | None) -> torch.Tensor:
        """The unit's flat buffer (rank None) or rank's shard of it, one module at a time."""
        start, stop = (0, unit.padded_numel) if rank is None else (rank * unit.shard_numel,
                                                                    (rank + 1) * unit.shard_numel)
        out = torch.zeros(stop - start, dtype=unit.dtype, device=self.device)
        wanted = {m.name: m for m in unit.members if m.offset < stop and m.offset + m.numel > start}
        for path, module, params, _ in _owned_modules(self.model):
            if not wanted.keys() & set(params):
                continue
            values = _materialize(self.model, path, module, self.seed, self.device)
            for name in set(params) & wanted.keys():
                member = wanted[name]
                low, high = max(start, member.offset), min(stop, member.offset + member.numel)
                flat = values[name].reshape(-1).to(unit.dtype)
                out[low - start:high - start] = flat[low - member.offset:high - member.offset]
        return out
