"""BatchSpec: the pytree structure, shapes and dtypes a compiled step accepts."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree

from .errors import FxShardError


@dataclass(frozen=True)
class LeafSpec:
    path: str
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class BatchSpec:
    treespec: pytree.TreeSpec
    leaves: tuple[LeafSpec, ...]
    device: torch.device

    @property
    def paths(self) -> list[str]:
        return [leaf.path for leaf in self.leaves]

    @classmethod
    def from_example(cls, batch) -> "BatchSpec":
        flat, treespec = pytree.tree_flatten_with_path(batch)
        if not flat:
            raise FxShardError("example_batch holds no tensors; pass a tensor or a dict/tuple of tensors")
        leaves, devices = [], set()
        for key_path, value in flat:
            path = "batch" + pytree.keystr(key_path)
            if not isinstance(value, torch.Tensor):
                raise FxShardError(
                    f"example_batch leaf {path} is a {type(value).__name__}, not a tensor; every leaf of "
                    f"the batch must be a tensor (put constants in loss_fn instead)")
            leaves.append(LeafSpec(path, tuple(value.shape), value.dtype))
            devices.add(value.device)
        if len(devices) != 1:
            raise FxShardError(f"example_batch tensors lie on several devices {sorted(map(str, devices))}; "
                               f"put them on one")
        return cls(treespec, tuple(leaves), devices.pop())

    def flatten(self, batch) -> list[torch.Tensor]:
        """The batch's leaves, checked against the example's structure, shapes and dtypes."""
        flat, treespec = pytree.tree_flatten(batch)
        if treespec != self.treespec:
            raise FxShardError(
                f"batch structure differs from example_batch: got {treespec}, expected {self.treespec}")
        for leaf, spec in zip(flat, self.leaves):
            if not isinstance(leaf, torch.Tensor):
                raise FxShardError(f"batch leaf {spec.path} is a {type(leaf).__name__}, expected a tensor")
            if tuple(leaf.shape) != spec.shape or leaf.dtype != spec.dtype:
                raise FxShardError(
                    f"batch leaf {spec.path} has shape {tuple(leaf.shape)} and dtype {leaf.dtype}, but the "
                    f"step was traced for shape {spec.shape} and {spec.dtype} (static shapes); pad or "
                    f"crop the batch to that shape, or shard() again with an example of the new shape")
            if leaf.device != self.device:
                raise FxShardError(f"batch leaf {spec.path} is on {leaf.device}, the step runs on {self.device}")
        return flat

    def unflatten(self, leaves):
        return pytree.tree_unflatten(list(leaves), self.treespec)
