"""The training state a program's signature asks for, built from a model on one rank, and read back."""

from __future__ import annotations

import torch
import torch.nn as nn

from ..program import FlatUnit, InputKind, Program

State = dict[tuple[InputKind, str], torch.Tensor]


def _unit(program: Program, name: str) -> FlatUnit | None:
    if not name.startswith("unit/"):
        return None
    return next(u for u in program.units if u.name == name[len("unit/"):])


def initial_state(program: Program, model: nn.Module, optimizer, coords: dict[str, int]) -> State:
    """Parameters (whole, or this rank's slice of a flat unit), optimizer slots, buffers, coordinates."""
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    state: State = {}
    for spec in program.inputs:
        if spec.kind is InputKind.PARAM:
            unit = _unit(program, spec.name)
            if unit is None:
                value = params[spec.name].detach()
            else:
                flat = unit.flatten(params)
                rank = coords.get(spec.placement.axis, 0) if spec.placement.kind == "sharded" else None
                value = flat if rank is None else unit.shard(flat, rank)
            state[spec.kind, spec.name] = value
        elif spec.kind is InputKind.OPT_STATE:
            slot, owner = spec.name.split("/", 1)
            template = torch.empty(spec.shape, dtype=spec.dtype, device=_device(model))
            state[spec.kind, spec.name] = optimizer.init_state(template)[slot]
        elif spec.kind is InputKind.BUFFER:
            state[spec.kind, spec.name] = buffers[spec.name].detach()
        elif spec.kind is InputKind.COORD:
            state[spec.kind, spec.name] = torch.tensor([coords[spec.name]], device=_device(model))
    return state


def full_parameters(program: Program, state: State, gather) -> dict[str, torch.Tensor]:
    """Parameter name -> full tensor; `gather(spec, shard)` concatenates the shards of a sharded input."""
    result = {}
    for spec in program.inputs:
        if spec.kind is not InputKind.PARAM:
            continue
        value = state[spec.kind, spec.name]
        unit = _unit(program, spec.name)
        if unit is None:
            result[spec.name] = value
            continue
        flat = gather(spec, value) if spec.placement.kind == "sharded" else value
        result.update({name: tensor.clone() for name, tensor in unit.unflatten(flat).items()})
    return result


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device
