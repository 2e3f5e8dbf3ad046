"""Program: a GraphModule plus a typed signature (what each input and output means, and where it lives).

Passes take a Program and return a new one; they never mutate their input.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.fx as fx

if TYPE_CHECKING:
    from .balance import Balance
    from .optimizer_graph import TrainSpec

from . import meta


class InputKind(enum.Enum):
    PARAM = "param"          # a trainable or frozen parameter
    OPT_STATE = "opt_state"  # one optimizer slot of one parameter or flat unit (Input.optimizer_slot)
    BUFFER = "buffer"        # a module buffer
    BATCH = "batch"          # one leaf of the batch pytree
    LR = "lr"                # learning rate, a 0-d float32 tensor
    STEP = "step"            # optimizer step count (1-based), a 0-d float32 tensor
    COORD = "coord"          # this rank's index along a mesh axis (name = axis), a [1] int64 tensor
    LOSS_SCALE = "loss_scale"  # a dynamic loss scale's state, [scale, good steps] float32 (fxshard/loss_scale.py)


# the step's own inputs, one of each at most: found by kind (Program.placeholder_of), never by name
OWN_INPUTS = (InputKind.LR, InputKind.STEP, InputKind.LOSS_SCALE)


class OutputKind(enum.Enum):
    LOSS = "loss"
    GRAD_NORM = "grad_norm"
    PARAM = "param"          # the updated parameter
    OPT_STATE = "opt_state"  # the updated optimizer slot
    BUFFER = "buffer"        # the new value of a buffer the forward mutated
    METRIC = "metric"        # a scalar loss_fn reported next to the loss ((loss, {name: value}))
    LOSS_SCALE = "loss_scale"  # the dynamic loss scale's new state (InputKind.LOSS_SCALE's)
    NONFINITE = "nonfinite"  # Config(nonfinite): bool vector, whether the update was skipped, then which
                             # of this rank's gradients are not finite (the output node's
                             # meta[meta.NONFINITE_TENSORS] names them)


@dataclass(frozen=True)
class Placement:
    """Where a value lives on the mesh. `Replicated()` is the single-device default."""

    kind: str = "replicated"     # "replicated" | "sharded" | "stage_local" (only this pipeline stage has it)
    axis: str | None = None      # mesh axis for "sharded" ("dp", "ep") or "pp" for "stage_local"

    def __str__(self) -> str:
        return self.kind if self.axis is None else f"{self.kind}({self.axis})"


REPLICATED = Placement()
EXPERT_SHARDED = Placement("sharded", "ep")  # this rank's experts: dim 0 split over the ep axis
STAGE_LOCAL = Placement("stage_local", "pp")  # held by this pipeline stage only (its chunks' parameters)


@dataclass(frozen=True)
class Input:
    """One input of a Program. An optimizer slot says which parameter input it belongs to (`owner`)
    and which of the optimizer's slots it is (`slot`); a flat unit's parameter input and its slots
    say which unit of `Program.units` they hold (`unit`). `name` keys the state, checkpoints and
    dumps ("exp_avg/layers.0.weight", "unit/layers.0", "exp_avg/unit/layers.0"): build these inputs
    with `flat_unit` and `optimizer_slot`, and read the fields, never the name."""

    kind: InputKind
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool = False
    placement: Placement = REPLICATED
    owner: str | None = None  # OPT_STATE: the name of the PARAM input this slot belongs to
    slot: str | None = None   # OPT_STATE: the optimizer's name for it ("exp_avg", "momentum_buffer")
    unit: str | None = None   # a flat unit's PARAM and OPT_STATE inputs: the FlatUnit's name

    def __post_init__(self):
        _check_fields(self)

    @classmethod
    def flat_unit(cls, unit: FlatUnit, shape: tuple[int, ...], placement: Placement = REPLICATED) -> Input:
        """The PARAM input holding `unit` (whole, or this rank's shard: `shape`), "unit/<unit>"."""
        return cls(InputKind.PARAM, _unit_name(unit.name), tuple(shape), unit.dtype, unit.trainable, placement,
                   unit=unit.name)

    @classmethod
    def optimizer_slot(cls, slot: str, owner: str | FlatUnit, shape: tuple[int, ...], dtype: torch.dtype,
                       placement: Placement = REPLICATED) -> Input:
        """The OPT_STATE input of optimizer slot `slot` of `owner` (a parameter's name, or a flat unit),
        "<slot>/<owner's input>"."""
        return cls(InputKind.OPT_STATE, shape=tuple(shape), dtype=dtype, placement=placement,
                   **_slot_fields(slot, owner))


@dataclass(frozen=True)
class Routing:
    """What a METRIC output reports of an MoE layer's routing (the expert-parallel pass's outputs,
    summed over the ranks): `what` is "tokens_per_expert" (rows kept per expert) or "dropped"."""

    layer: str
    what: str

    @property
    def name(self) -> str:
        return f"moe/{self.layer}/{self.what}"


@dataclass(frozen=True)
class Output:
    """One output of a Program; `owner`, `slot` and `unit` as on `Input` (an updated optimizer slot
    or flat unit is named like the input it replaces); `routing` on an MoE layer's routing metric
    (`Output.moe_routing`, named "moe/<layer>/<what>"; `Program.routing` reads it)."""

    kind: OutputKind
    name: str
    placement: Placement = REPLICATED
    owner: str | None = None
    slot: str | None = None
    unit: str | None = None
    routing: Routing | None = None

    def __post_init__(self):
        _check_fields(self)

    @classmethod
    def moe_routing(cls, layer: str, what: str) -> Output:
        """The METRIC output of MoE layer `layer`'s routing `what` ("tokens_per_expert", "dropped")."""
        routing = Routing(layer, what)
        return cls(OutputKind.METRIC, routing.name, routing=routing)

    @classmethod
    def flat_unit(cls, unit: FlatUnit, placement: Placement = REPLICATED) -> Output:
        """The updated `unit` (whole, or this rank's shard), named like its input."""
        return cls(OutputKind.PARAM, _unit_name(unit.name), placement, unit=unit.name)

    @classmethod
    def optimizer_slot(cls, slot: str, owner: str | FlatUnit, placement: Placement = REPLICATED) -> Output:
        """The updated optimizer slot `slot` of `owner`, named like its input."""
        return cls(OutputKind.OPT_STATE, placement=placement, **_slot_fields(slot, owner))


def _unit_name(unit: str) -> str:
    return f"unit/{unit}"


def _slot_fields(slot: str, owner: str | FlatUnit) -> dict:
    unit = owner.name if isinstance(owner, FlatUnit) else None
    owner = _unit_name(unit) if unit is not None else owner
    return {"name": f"{slot}/{owner}", "owner": owner, "slot": slot, "unit": unit}


def _check_fields(spec: Input | Output) -> None:
    """An optimizer slot has `slot` and `owner` and a flat unit's tensors their `unit`, and the name
    is the one those give (the name keys state and checkpoints; the fields are what code reads)."""
    owner = _unit_name(spec.unit) if spec.unit is not None else spec.owner
    routing = getattr(spec, "routing", None)
    if routing is not None:
        matches = (spec.kind is OutputKind.METRIC and spec.name == routing.name
                   and (spec.slot, spec.owner, spec.unit) == (None, None, None))
    elif spec.kind in (InputKind.OPT_STATE, OutputKind.OPT_STATE):
        matches = None not in (spec.slot, owner) and spec.owner == owner and spec.name == f"{spec.slot}/{owner}"
    elif spec.unit is not None:
        matches = (spec.kind in (InputKind.PARAM, OutputKind.PARAM) and spec.slot is None and spec.owner is None
                   and spec.name == owner)
    else:
        matches = spec.slot is None and spec.owner is None
    if not matches:
        raise ValueError(f"{spec.kind.value} input or output {spec.name!r} does not match its fields (owner "
                         f"{spec.owner!r}, slot {spec.slot!r}, unit {spec.unit!r}, routing {routing!r}): build "
                         f"it with optimizer_slot, flat_unit or moe_routing")


@dataclass(frozen=True)
class FlatMember:
    name: str
    shape: tuple[int, ...]
    offset: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class FlatUnit:
    """A unit's parameters laid end to end in one flat buffer, zero-padded to split evenly over
    `world` ranks of mesh axis `axis`: rank r's shard is elements [r * shard_numel, (r + 1) * shard_numel).
    A unit on axis "edp" holds expert parameters: its members are this rank's experts (dim 0 split
    over "ep"), replicated or sharded over the ranks that own the same experts."""

    name: str
    members: tuple[FlatMember, ...]
    dtype: torch.dtype
    world: int
    trainable: bool = True   # False: frozen parameters, gathered for use, never reduced or updated
    axis: str = "dp"

    @property
    def experts(self) -> bool:
        return self.axis == "edp"

    @classmethod
    def laid_out(cls, name: str, params: list[tuple[str, tuple[int, ...]]], dtype: torch.dtype, world: int,
                 trainable: bool = True, axis: str = "dp") -> "FlatUnit":
        """The unit holding `params` ((name, shape) pairs) end to end, in this order."""
        members, offset = [], 0
        for param_name, shape in params:
            members.append(FlatMember(param_name, tuple(shape), offset))
            offset += members[-1].numel
        return cls(name, tuple(members), dtype, world, trainable, axis)

    @property
    def numel(self) -> int:
        return sum(m.numel for m in self.members)

    @property
    def shard_numel(self) -> int:
        return -(-self.numel // self.world)

    @property
    def padded_numel(self) -> int:
        return self.shard_numel * self.world

    @property
    def padding(self) -> int:
        return self.padded_numel - self.numel

    def flatten(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        parts = [tensors[m.name].detach().reshape(-1).to(self.dtype) for m in self.members]
        return torch.cat(parts + [parts[0].new_zeros(self.padding)])

    def shard(self, flat: torch.Tensor, rank: int) -> torch.Tensor:
        return flat[rank * self.shard_numel:(rank + 1) * self.shard_numel].clone()

    def unflatten(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        return {m.name: flat[m.offset:m.offset + m.numel].view(m.shape) for m in self.members}


@dataclass(frozen=True)
class Update:
    """One entry of the optimizer phase: the tensor `name` (a parameter, or an FSDP unit's flat shard
    on this rank) is updated from its gradient with the program's optimizer (`Program.train`, the
    state slots its optimizer names). Its squared gradient norm is summed over the ranks along
    `norm_axes` (they hold other parts of the gradient: pipeline stages, ZeRO shards, expert ranks),
    and this rank counts it in the norm unless `counted` is False (another rank does: a weight tied
    across pipeline stages). Passes that change what the optimizer sees map a program's updates to
    theirs (lower_schedule keeps its stage's and sums over `pp`; fsdp makes one per unit) and
    rebuild the phase from them (fxshard.optimizer_graph.append_update). `decay`: the update applies
    the optimizer's weight decay (False for the parameters its `no_decay` names; fsdp gives those units
    of their own, so a unit's members agree)."""

    name: str
    norm_axes: tuple[str, ...] = ()
    counted: bool = True
    decay: bool = True


@dataclass(frozen=True)
class StagePlan:
    """What a per-rank pipeline program needs to know about the other stages (passes/lower_schedule.py):
    this rank's `stage` of `stages`, the parameters (and buffers) each stage holds, the process
    groups of stage subsets its collectives name (axis -> stage indices), besides "pp" itself, and
    this rank's actions (fxshard.schedule.Action) in the order the program runs them, ZeRO's U / R /
    G included: a node made by an action carries its position here (`meta.ACTION_INDEX`), and the
    fsdp pass issues its all-gathers and reductions where the U and G actions are. `costs` are what the
    simulator times each chunk's actions with (passes/pipeline.py `chunk_costs`: from their FLOPs)."""

    stage: int
    stages: int
    params_by_stage: tuple[tuple[str, ...], ...]
    groups: tuple[tuple[str, tuple[int, ...]], ...] = ()
    actions: tuple = ()
    costs: tuple[tuple[str, float], ...] = ()

    def owner(self, name: str) -> int:
        """The first stage holding `name` (a tied parameter is equal on every stage holding it)."""
        return next(s for s, names in enumerate(self.params_by_stage) if name in names)


@dataclass(frozen=True)
class Program:
    """One traced training step: `graph_module(*inputs) -> outputs`, both described by the signature.

    `name` is what the dump calls it ("traced", or the pass that produced it).
    """

    graph_module: fx.GraphModule
    inputs: tuple[Input, ...]
    outputs: tuple[Output, ...]
    train: "TrainSpec | None" = None           # what the optim phase does (optimizer, clipping)
    units: tuple["FlatUnit", ...] = ()         # flat parameter buffers, once a pass made them
    name: str = "traced"
    notes: dict = field(default_factory=dict)  # free-form facts a pass wants in the dump
    updates: tuple[Update, ...] = ()           # the optimizer phase, one entry per tensor it updates
    stage: StagePlan | None = None             # set by lower_schedule: one stage of a pipeline
    # torchtitan's MoE load balancing (fxshard/balance.py), one record per layer: the traced program
    # updates bias and counts itself, except a pipeline's, whose lower_schedule adds each stage's
    balances: tuple["Balance", ...] = ()

    def replace(self, **changes) -> "Program":
        return dataclasses.replace(self, **changes)

    @property
    def graph(self) -> fx.Graph:
        return self.graph_module.graph

    @property
    def code(self) -> str:
        return self.graph_module.code

    def update_of(self, name: str) -> Update:
        return next(u for u in self.updates if u.name == name)

    def unit_of(self, spec: Input | Output) -> "FlatUnit | None":
        """The flat unit `spec` holds (a unit's PARAM, or one of its optimizer slots), or None."""
        if spec.unit is None:
            return None
        return next(u for u in self.units if u.name == spec.unit)

    def inputs_of(self, kind: InputKind) -> list[Input]:
        return [i for i in self.inputs if i.kind is kind]

    def outputs_of(self, kind: OutputKind) -> list[Output]:
        return [o for o in self.outputs if o.kind is kind]

    def routing(self, metrics: dict) -> dict[str, dict[str, torch.Tensor]]:
        """Each MoE layer's routing in `metrics` (a step's metrics, keyed by output name):
        {layer: {"tokens_per_expert": ..., "dropped": ...}}, from the outputs' `routing` records;
        empty where the program reports none (no expert parallelism)."""
        table: dict[str, dict[str, torch.Tensor]] = {}
        for spec in self.outputs:
            if spec.routing is not None and spec.name in metrics:
                table.setdefault(spec.routing.layer, {})[spec.routing.what] = metrics[spec.name]
        return table

    def placeholders(self) -> list[fx.Node]:
        return [n for n in self.graph.nodes if n.op == "placeholder"]

    def placeholder_of(self, kind: InputKind) -> fx.Node | None:
        """The placeholder of the program's one input of `kind` (one of OWN_INPUTS), or None:
        found by kind, never by name (a parameter may share the name)."""
        found = [node for spec, node in zip(self.inputs, self.placeholders()) if spec.kind is kind]
        if len(found) > 1:
            raise AssertionError(f"{len(found)} inputs of kind {kind.name}; placeholder_of finds the one")
        return found[0] if found else None

    def output_nodes(self) -> list[fx.Node]:
        (out,) = [n for n in self.graph.nodes if n.op == "output"]
        return list(out.args[0])

    def __call__(self, *args):
        return self.graph_module(*args)

    def dump(self, directory, index: int = 0) -> list[str]:
        from .dump import dump_program

        return dump_program(self, directory, index)

    def summary(self) -> str:
        from .dump import summarize

        return summarize(self)

    def __str__(self) -> str:
        return self.summary()

    def __repr__(self) -> str:
        counts = Counter(meta.phase(n) for n in self.graph.nodes if n.op == "call_function")
        return (f"Program({self.name!r}, {len(self.inputs)} inputs, {len(self.outputs)} outputs, "
                f"nodes={dict(counts)})")
