"""The training state a program's signature asks for, built from a model on one rank, and read back."""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from ..program import EXPERT_SHARDED, FlatUnit, InputKind, Program

State = dict[tuple[InputKind, str], torch.Tensor]


class ModelTensors:
    """Initial tensors read from a model with real weights, put on `device` (the batch's: a model
    built on the host trains on the device its batches are on, as FSDP's device_id moves it)."""

    def __init__(self, model: nn.Module, device: torch.device):
        self.tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
        self.device = device

    def tensors_named(self, names: set[str]) -> dict[str, torch.Tensor]:
        # copies: the runtime updates its state in place, and the user's model must stay as it was
        return {name: self.tensors[name].detach().to(self.device, copy=True) for name in names}

    def unit_shard(self, unit: FlatUnit, rank: int | None) -> torch.Tensor:
        flat = unit.flatten(self.tensors)
        return (flat if rank is None else unit.shard(flat, rank)).to(self.device)


class ExpertSlices:
    """A source whose expert parameters are cut to this rank's experts (dim 0 split over `ep`)."""

    def __init__(self, source, experts: dict[str, int], ep_index: int):
        self.source, self.experts, self.ep_index = source, experts, ep_index  # experts: name -> local count
        self.device = source.device

    def tensors_named(self, names: set[str]) -> dict[str, torch.Tensor]:
        tensors = self.source.tensors_named(names)
        for name, local in self.experts.items():
            if name in tensors:
                tensors[name] = tensors[name][self.ep_index * local:(self.ep_index + 1) * local].clone()
        return tensors

    def unit_shard(self, unit: FlatUnit, rank: int | None) -> torch.Tensor:
        if not unit.experts:
            return self.source.unit_shard(unit, rank)
        flat = unit.flatten(self.tensors_named({m.name for m in unit.members}))
        return flat if rank is None else unit.shard(flat, rank)


def expert_parameters(program: Program) -> dict[str, int]:
    """Parameter name -> this rank's number of experts, for parameters split over `ep` along dim 0."""
    experts = {spec.name: spec.shape[0] for spec in program.inputs
               if spec.kind is InputKind.PARAM and spec.placement == EXPERT_SHARDED}
    experts.update({m.name: m.shape[0] for unit in program.units if unit.experts for m in unit.members})
    return experts


def initial_state(program: Program, source, optimizer, coords: dict[str, int],
                  device: torch.device | None = None) -> State:
    """Parameters (whole, or this rank's slice of a flat unit), optimizer slots, buffers, coordinates,
    a dynamic loss scale's state, on `device` (None: the model's).

    `source` is a model with real weights, or an object with `tensors_named(names)`, `unit_shard(unit,
    rank)` and `device` (fxshard.init.MetaInit for meta-device models)."""
    if isinstance(source, nn.Module):
        source = ModelTensors(source, device or next(iter(source.parameters())).device)
    experts = expert_parameters(program)
    if experts:
        source = ExpertSlices(source, experts, coords["ep"])
    whole = {spec.name for spec in program.inputs
             if spec.kind is InputKind.BUFFER or spec.kind is InputKind.PARAM and spec.unit is None}
    tensors = source.tensors_named(whole)
    state: State = {}
    for spec in program.inputs:
        if spec.kind is InputKind.PARAM:
            unit = program.unit_of(spec)
            if unit is None:
                value = tensors[spec.name]
            else:
                rank = coords.get(spec.placement.axis, 0) if spec.placement.kind == "sharded" else None
                value = source.unit_shard(unit, rank)
            state[spec.kind, spec.name] = value
        elif spec.kind is InputKind.OPT_STATE:
            template = torch.empty(spec.shape, dtype=spec.dtype, device=source.device)
            state[spec.kind, spec.name] = optimizer.init_state(template)[spec.slot]
        elif spec.kind is InputKind.BUFFER:
            state[spec.kind, spec.name] = tensors[spec.name]
        elif spec.kind is InputKind.COORD:
            state[spec.kind, spec.name] = torch.tensor([coords[spec.name]], device=source.device)
        elif spec.kind is InputKind.LOSS_SCALE:
            state[spec.kind, spec.name] = program.train.loss_scale.initial_state(source.device)
    return state


def gather_shard(shard: torch.Tensor, group) -> torch.Tensor:
    """The concatenation along dim 0 of every rank's `shard` over `group` (a process group), on this rank."""
    import torch.distributed as dist

    from ..ops.gloo import all_gather_single

    out = shard.new_empty((shard.shape[0] * dist.get_world_size(group), *shard.shape[1:]))
    all_gather_single(out, shard.contiguous(), group=group)
    return out


def full_parameters(program: Program, state: State, gather) -> dict[str, torch.Tensor]:
    """Parameter name -> full tensor; `gather(axis, tensor)` concatenates, along dim 0, the tensors
    that the ranks of this rank's group along mesh axis `axis` hold (shards, or expert slices)."""
    result = local_parameters(program, state, lambda spec, shard: gather(spec.placement.axis, shard))
    for name in expert_parameters(program):  # each rank holds its own experts: concatenate over ep
        result[name] = gather("ep", result[name].contiguous())
    return result


def local_parameters(program: Program, state: State, gather) -> dict[str, torch.Tensor]:
    """Parameter name -> this rank's tensor: flat units whole (`gather(spec, shard)` concatenates a
    sharded one over its axis), expert parameters still this rank's experts only."""
    result = {}
    for spec in program.inputs:
        if spec.kind is not InputKind.PARAM:
            continue
        value = state[spec.kind, spec.name]
        unit = program.unit_of(spec)
        if unit is None:
            result[spec.name] = value.clone()  # a snapshot: the state is updated in place
            continue
        flat = gather(spec, value) if spec.placement.kind == "sharded" else value
        result.update({name: tensor.clone() for name, tensor in unit.unflatten(flat).items()})
    return result


def every_stage_tensors(traced: Program, plan, local: dict[str, torch.Tensor], group,
                           device: torch.device, kind: InputKind = InputKind.PARAM) -> dict[str, torch.Tensor]:
    """Every parameter of the model (with `kind` BUFFER: every buffer some stage holds), in the traced
    program's order, on every stage of a pipeline: each stage's `local` tensors (full tensors) broadcast
    over `group` (this rank's `pp` group) by the first stage holding them (`plan`: the program's
    StagePlan), one flat buffer per stage and dtype."""
    import torch.distributed as dist

    held = {name for names in plan.params_by_stage for name in names}
    specs = {spec.name: spec for spec in traced.inputs if spec.kind is kind and spec.name in held}
    result = {}
    for stage in range(plan.stages):
        owned = [name for name in specs if plan.owner(name) == stage]
        for dtype in dict.fromkeys(specs[n].dtype for n in owned):
            members = [n for n in owned if specs[n].dtype == dtype]
            sizes = [math.prod(specs[n].shape) for n in members]
            if stage == plan.stage:
                flat = torch.cat([local[n].detach().reshape(-1) for n in members])
            else:
                flat = torch.empty(sum(sizes), dtype=dtype, device=device)
            dist.broadcast(flat, group_src=stage, group=group)
            for name, piece in zip(members, flat.split(sizes)):
                result[name] = piece.view(specs[name].shape)
    return {name: result[name] for name in specs}
