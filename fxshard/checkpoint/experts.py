"""Expert-weight layouts and state-dict conversion between them.

An expert linear layer (E maps of [in] -> [out]) is stored in one of two key layouts:

    grouped   {prefix}weight [E, out, in],  {prefix}bias [E, out]
    indexed   {prefix}weight0 ... weight{E-1} [out, in],  bias0 ... bias{E-1} [out]
              (TransformerEngine's GroupedLinear and Megatron's TE-backed experts use these names)

and a gated fc1 (rows = [W; V], gate rows then linear rows) may have its rows GLU-interleaved in
blocks of `glu_interleave_size` rows: [W_0:s; V_0:s; W_s:2s; V_s:2s; ...]. A layout is an
`ExpertLayout`; `convert_expert_tensors` turns one layer's tensors from any layout into any other,
bit for bit (only reshapes, stacks and slices). `models.GroupedLinear` calls it from a load hook,
so a state dict saved in any layout loads into a model using any other. A state dict records its
layout in `{prefix}_extra_state`; without one, keys decide grouped vs indexed (`layout_of`: plain
rows), and a GroupedLinear loading it takes the rows as it stores them itself.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

import torch

from ..errors import FxShardError

LAYOUTS = ("grouped", "indexed")


@dataclass(frozen=True)
class ExpertLayout:
    keys: str = "grouped"                   # "grouped" | "indexed"
    glu_interleave_size: int | None = None  # None: plain [W; V] rows (or not a gated fc1)

    def __post_init__(self):
        if self.keys not in LAYOUTS:
            raise FxShardError(f"expert weight layout {self.keys!r} is not one of {LAYOUTS}")
        if self.glu_interleave_size is not None and self.glu_interleave_size < 1:
            raise FxShardError(f"glu_interleave_size must be >= 1 or None, got {self.glu_interleave_size}")

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> "ExpertLayout":
        return cls(values.get("keys", "grouped"), values.get("glu_interleave_size"))


def interleave_glu(tensor: torch.Tensor, size: int, dim: int) -> torch.Tensor:
    """Plain [W; V] along `dim` -> blocks of `size` rows alternating W and V."""
    return _regroup(tensor, size, dim, to_interleaved=True)


def deinterleave_glu(tensor: torch.Tensor, size: int, dim: int) -> torch.Tensor:
    """The inverse of interleave_glu."""
    return _regroup(tensor, size, dim, to_interleaved=False)


def _regroup(tensor, size, dim, to_interleaved):
    dim = dim % tensor.dim()
    rows = tensor.shape[dim]
    if rows % (2 * size):
        raise FxShardError(f"GLU rows {rows} are not a whole number of 2*{size}-row interleave blocks; "
                           f"glu_interleave_size must divide half the fc1 rows")
    lead, trail = tensor.shape[:dim], tensor.shape[dim + 1:]
    if to_interleaved:  # [2, blocks, size] -> [blocks, 2, size]
        split = tensor.reshape(*lead, 2, rows // (2 * size), size, *trail)
        return split.transpose(dim, dim + 1).reshape(tensor.shape).contiguous()
    split = tensor.reshape(*lead, rows // (2 * size), 2, size, *trail)
    return split.transpose(dim, dim + 1).reshape(tensor.shape).contiguous()


def layout_of(tensors: dict[str, torch.Tensor], extra_state=None) -> ExpertLayout:
    """The layout of one layer's tensors (keys relative to the layer: weight, weight3, bias, ...)."""
    if isinstance(extra_state, dict) and "keys" in extra_state:
        return ExpertLayout.from_dict(extra_state)
    grouped = "weight" in tensors
    indexed = any(re.fullmatch(r"weight\d+", k) for k in tensors)
    if grouped and indexed:
        raise FxShardError("an expert layer's state has both `weight` and `weight<i>` keys; keep one layout")
    return ExpertLayout("indexed" if indexed else "grouped")


def convert_expert_tensors(tensors: dict[str, torch.Tensor], source: ExpertLayout, target: ExpertLayout,
                           experts: int, where: str = "") -> dict[str, torch.Tensor]:
    """One layer's tensors from `source` to `target` layout (keys relative to the layer)."""
    if source == target:
        return dict(tensors)
    weight, bias = _grouped(tensors, source, experts, where)
    if source.glu_interleave_size != target.glu_interleave_size:
        if source.glu_interleave_size:
            weight = deinterleave_glu(weight, source.glu_interleave_size, dim=1)
            bias = None if bias is None else deinterleave_glu(bias, source.glu_interleave_size, dim=1)
        if target.glu_interleave_size:
            weight = interleave_glu(weight, target.glu_interleave_size, dim=1)
            bias = None if bias is None else interleave_glu(bias, target.glu_interleave_size, dim=1)
    if target.keys == "grouped":
        return {"weight": weight, **({"bias": bias} if bias is not None else {})}
    result = {f"weight{e}": weight[e].clone() for e in range(experts)}
    if bias is not None:
        result.update({f"bias{e}": bias[e].clone() for e in range(experts)})
    return result


def _grouped(tensors, layout, experts, where):
    """(weight [E, out, in], bias [E, out] or None) from tensors in `layout`'s keys."""
    if layout.keys == "grouped":
        if "weight" not in tensors:
            raise FxShardError(f"{where}weight is missing from the state dict (grouped expert layout)")
        weight = tensors["weight"]
        if weight.shape[0] != experts:
            raise FxShardError(f"{where}weight holds {weight.shape[0]} experts, the model has {experts}")
        return weight, tensors.get("bias")
    for name in ("weight", "bias"):
        present = sorted(int(k[len(name):]) for k in tensors if re.fullmatch(name + r"\d+", k))
        if name == "bias" and not present:
            continue
        if present != list(range(experts)):
            missing = sorted(set(range(experts)) - set(present))
            extra = sorted(set(present) - set(range(experts)))
            raise FxShardError(
                f"{where}{name}0..{name}{experts - 1}: the state dict has an incomplete indexed expert set "
                f"(missing {[f'{name}{i}' for i in missing]}, unexpected {[f'{name}{i}' for i in extra]}); "
                f"a partial load would leave experts untrained: save all {experts} experts")
    weight = torch.stack([tensors[f"weight{e}"] for e in range(experts)])
    has_bias = any(k.startswith("bias") for k in tensors)
    bias = torch.stack([tensors[f"bias{e}"] for e in range(experts)]) if has_bias else None
    return weight, bias
