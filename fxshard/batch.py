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
            if value.is_meta:
                raise FxShardError(
                    f"example_batch leaf {path} is on the meta device; pass a real example batch (on the device "
                    f"the step will run on: only its shapes, dtypes and device are read). A model may be on meta.")
            leaves.append(LeafSpec(path, tuple(value.shape), value.dtype))
            devices.add(value.device)
        if len(devices) != 1:
            raise FxShardError(f"example_batch tensors lie on several devices {sorted(map(str, devices))}; "
                               f"put them on one")
        return cls(treespec, tuple(leaves), devices.pop())

    def flatten(self, batch) -> list[torch.Tensor]:
        """The batch's leaves, checked against the example's structure, shapes and dtypes, made
        contiguous (the program was traced, and its compiled regions generated, for contiguous leaves;
        `tokens[:, :-1]` is not)."""
        flat, treespec = pytree.tree_flatten(batch)
        if treespec != self.treespec:
            by_path = {"batch" + pytree.keystr(path): leaf for path, leaf in pytree.tree_flatten_with_path(batch)[0]}
            got = list(by_path)
            if sorted(got) == sorted(self.paths):  # the same leaves, a dict's keys in another order
                flat = [by_path[path] for path in self.paths]
            else:
                flat = None
        if flat is None:
            missing = [p for p in self.paths if p not in got]
            unexpected = [p for p in got if p not in self.paths]
            detail = f"missing {', '.join(missing) or 'nothing'}; not in the example: {', '.join(unexpected) or 'nothing'}"
            raise FxShardError(f"the batch is not shaped like the example_batch the step was compiled for: {detail}; "
                               f"pass the leaves {', '.join(self.paths)}")
        for leaf, spec in zip(flat, self.leaves):
            if not isinstance(leaf, torch.Tensor):
                raise FxShardError(f"batch leaf {spec.path} is a {type(leaf).__name__}, expected a tensor")
            if tuple(leaf.shape) != spec.shape:
                raise FxShardError(
                    f"batch leaf {spec.path} has shape {tuple(leaf.shape)}, but the step was traced for shape "
                    f"{spec.shape} (static shapes); pad or crop the batch to that shape (a short last batch: drop "
                    f"it, or pad it and mask the padding in the loss), or shard() again with an example of the new "
                    f"shape, after copying step.parameters() (and step.buffers()) into the model: a new step starts "
                    f"from the model's weights, not this step's")
            if leaf.dtype != spec.dtype:
                raise FxShardError(
                    f"batch leaf {spec.path} has dtype {leaf.dtype}, but the step was traced for {spec.dtype}; "
                    f"convert it (.to({spec.dtype})) or shard() again with an example of that dtype")
            if leaf.device != self.device:
                raise FxShardError(f"batch leaf {spec.path} is on {leaf.device}, the step runs on {self.device}")
        return [leaf.contiguous() for leaf in flat]

    def split_rows(self, microbatches: int) -> int:
        """The rows of one of `microbatches` pieces cut along dim 0 of every leaf; FxShardError unless
        every leaf has that dim, the same size, divisible (a leaf without it, such as loss weights of
        shape (2,), would be cut too and silently broadcast)."""
        rows = {leaf.shape[0] if leaf.shape else None for leaf in self.leaves}
        if len(rows) != 1 or None in rows or next(iter(rows)) % microbatches:
            shapes = ", ".join(f"{leaf.path} {tuple(leaf.shape)}" for leaf in self.leaves)
            raise FxShardError(f"Config(microbatches={microbatches}) splits the batch into microbatches along dim 0 "
                               f"of every leaf, so every leaf needs the same first dimension, divisible by "
                               f"{microbatches}; got {shapes}. Pass per-batch constants another way (a buffer, or "
                               f"the loss_fn's closure)")
        return next(iter(rows)) // microbatches

    def unflatten(self, leaves):
        return pytree.tree_unflatten(list(leaves), self.treespec)
