"""GroupedLinear: E per-expert linear maps with a choice of storage layout (fxshard.checkpoint).

`weight()` / `bias_()` always return the grouped, plain-row tensors ([E, out, in], [E, out]) that
`fxshard::grouped_mm` and the fused grouped MLP read, whatever the storage: indexed parameters are
stacked and GLU-interleaved rows put back in [W; V] order inside the traced step (a copy of the
weight per step, which the fused kernels could avoid by reading interleaved rows; they do not yet).
Loading a state dict converts it from the layout it was saved in (its `_extra_state`, or its keys)
to this module's layout first, so checkpoints move between layouts freely. A state dict with no
`_extra_state` (a dict of `named_parameters()` or `step.parameters()`) has its rows taken as this
module stores them: its own parameters load unchanged.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from fxshard.checkpoint import ExpertLayout, convert_expert_tensors, deinterleave_glu, layout_of
from fxshard.errors import FxShardError


class GroupedLinear(nn.Module):
    def __init__(self, experts: int, in_features: int, out_features: int, bias: bool = False,
                 layout: ExpertLayout | str = "grouped", glu: bool = False, init_std: float | None = None):
        super().__init__()
        self.init_std = init_std  # None: 1/sqrt(in_features)
        layout = ExpertLayout(layout) if isinstance(layout, str) else layout
        if layout.glu_interleave_size is not None and not glu:
            raise FxShardError("glu_interleave_size applies to a gated fc1 only (glu=True)")
        if layout.glu_interleave_size is not None and out_features % (2 * layout.glu_interleave_size):
            raise FxShardError(f"glu_interleave_size={layout.glu_interleave_size} must divide half of fc1's "
                               f"{out_features} rows")
        self.experts, self.in_features, self.out_features = experts, in_features, out_features
        self.layout, self.glu, self.has_bias = layout, glu, bias
        if layout.keys == "grouped":
            self.weight = nn.Parameter(torch.empty(experts, out_features, in_features))
            self.bias = nn.Parameter(torch.empty(experts, out_features)) if bias else None
        else:
            for e in range(experts):
                self.register_parameter(f"weight{e}", nn.Parameter(torch.empty(out_features, in_features)))
                self.register_parameter(f"bias{e}", nn.Parameter(torch.empty(out_features)) if bias else None)
        self._register_load_state_dict_pre_hook(self._convert_incoming)
        if not any(p.is_meta for p in self.parameters()):
            self.reset_parameters()

    def reset_parameters(self) -> None:
        std = self.init_std if self.init_std is not None else 1 / math.sqrt(self.in_features)
        for name, p in self.named_parameters(recurse=False):
            nn.init.normal_(p, std=std) if name.startswith("weight") else nn.init.zeros_(p)

    def weight_grouped(self) -> torch.Tensor:
        """[E, out, in] in plain row order."""
        weight = (self.weight if self.layout.keys == "grouped"
                  else torch.stack([getattr(self, f"weight{e}") for e in range(self.experts)]))
        if self.layout.glu_interleave_size:
            weight = deinterleave_glu(weight, self.layout.glu_interleave_size, dim=1)
        return weight

    def bias_grouped(self) -> torch.Tensor | None:
        if not self.has_bias:
            return None
        bias = (self.bias if self.layout.keys == "grouped"
                else torch.stack([getattr(self, f"bias{e}") for e in range(self.experts)]))
        if self.layout.glu_interleave_size:
            bias = deinterleave_glu(bias, self.layout.glu_interleave_size, dim=1)
        return bias

    def get_extra_state(self):
        return self.layout.as_dict()

    def set_extra_state(self, state) -> None:
        pass  # the pre-hook already converted the incoming tensors to this module's layout

    def _convert_incoming(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                          error_msgs):
        own = [k for k in state_dict if k.startswith(prefix) and "." not in k[len(prefix):]]
        tensors = {k[len(prefix):]: state_dict[k] for k in own if not k.endswith("_extra_state")}
        if not tensors:
            return  # nothing saved for this layer: load_state_dict reports the missing keys
        record = state_dict.get(prefix + "_extra_state")
        source = layout_of(tensors, record)
        if not isinstance(record, dict):  # no layout record: rows as this module stores them (its own
            # named_parameters() / step.parameters() load as they are; a record says otherwise)
            source = ExpertLayout(source.keys, self.layout.glu_interleave_size)
        if source == self.layout and source.keys == layout_of(tensors).keys:
            return  # already in this module's layout
        converted = convert_expert_tensors(tensors, source, self.layout, self.experts, where=prefix)
        for key in own:
            if not key.endswith("_extra_state"):
                del state_dict[key]
        state_dict.update({prefix + k: v for k, v in converted.items()})
        state_dict[prefix + "_extra_state"] = self.layout.as_dict()

    def extra_repr(self) -> str:
        return (f"experts={self.experts}, in={self.in_features}, out={self.out_features}, "
                f"bias={self.has_bias}, layout={self.layout}")
