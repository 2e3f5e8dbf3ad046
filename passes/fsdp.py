"""FSDP: shard parameters, gradients and optimizer state over the data-parallel axis, in the graph.

Parameters are grouped into units (one per layer, plus "pre" and "post"), each laid out as one flat
buffer padded to split evenly over the `world` ranks (`FlatUnit`), so a unit costs one all-gather
and one reduce-scatter. Strategies, with Megatron's names:

    no_shard            full params and state; gradients all-reduced (DDP)
    optim               ZeRO-1: state sharded; gradients reduce-scattered; each rank updates its
                        shard, the updated shards are all-gathered into the full params
    optim_grads         ZeRO-2: today the same program as optim, with or without microbatches
                        (gradients are accumulated whole and reduce-scattered once a step; a ZeRO-2
                        that reduce-scatters each microbatch to hold only a shard is not built)
    optim_grads_params  ZeRO-3: params stay sharded; all-gathered before the forward uses a unit and
                        again before the backward does (the forward's copy is dead by then), except
                        the unit the forward ends with, which the backward begins with: nothing is
                        gathered between its two uses, so its forward copy serves both

A unit on an axis of one rank (expert units when N = K) is its own shard: it gets no collectives.

Overlap is graph order: a unit's all-gather is issued `prefetch` units ahead of its first use (units
under 1/SMALL_UNIT of the median all-gather's bytes are not counted: they ride along) and waited on just
before it; a unit's reduce-scatter is issued as soon as its last gradient exists and
waited on only when the optimizer phase starts. In a pipeline stage, a unit on an axis of one rank
has nothing to reduce: its gradient is laid out flat where the optimizer phase starts, not in its
chunk's last backward, which would send its input gradient on only after the flattening (GPT 1b,
2x H200: ~0.5 ms a chunk on the cooldown's critical path). Elsewhere it stays next to its last
accumulation, whose add codegen fuses into the flat buffer's write. (The runtime then has the weight
gradients' GEMMs accumulate into the flat buffer itself: runtime/flat_gradients.py.) Under a sharded
optimizer without clipping or pipeline, the units (not experts) whose last gradient the backward makes
once its last layer has begun (that layer and "pre") are reduced by the optimizer phase instead,
issued before any update and waited after the other units' updates, which run under them
(`deferred_units`; optimizer_graph.Deferred says how the non-finite guard decides first). ZeRO-1/2
update the units whose updated shard is all-gathered first, each gather issued right after its update.

A pipeline stage's program (passes/lower_schedule.py) whose actions hold ZeRO's collectives
(fxshard.schedule.add_zero_actions; `StagePlan.actions`) gets them where the schedule says: under
ZeRO-3 a unit is gathered once per U..R window of the chunk reading it, every unit of the chunk
issued at the U (the schedule's prefetch) and each waited on just before its first use in the
window, and that copy serves every F / B / W of the chunk until the window's R (R itself is no
node: the copy is dead after its last reader). A unit's reduction is issued at its chunk's G.
Without such actions (no dp axis in the schedule, or no pipeline) a unit is gathered once per
(phase, microbatch) region as described above.

After the expert-parallel pass (Mesh(dp=N, ep=K)), expert parameters (placed `sharded(ep)`: this
rank's E/K experts) form units of their own on axis `edp`, the N/K ranks that own the same experts;
their gradients, which already sum the ep group's contributions, are divided by K and averaged over
`edp`, which makes them the mean over all N ranks like every other gradient.
"""

from __future__ import annotations

import math
import re
import statistics
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback

from fxshard import meta
from fxshard.balance import DATA_SUM
from fxshard.config import SHARDING_STRATEGIES
from fxshard.errors import FxShardError
from fxshard.graph import Graph, fake_mode_of, inline, lazy_module
from fxshard.loss_scale import NAME as LOSS_SCALE
from fxshard.optimizer_graph import Deferred, append_update
from fxshard.program import (EXPERT_SHARDED, OWN_INPUTS, REPLICATED, FlatUnit, Input, InputKind, Output, OutputKind, Placement,
                             Program, Update)
from fxshard.schedule import COMPUTE

STRATEGIES = SHARDING_STRATEGIES
_c10d = torch.ops._c10d_functional
ALL = (meta.FWD, 0)  # the one region of strategies that keep full parameters
SMALL_UNIT = 10  # under 1/SMALL_UNIT of the median all-gather's bytes: prefetch does not count it (a block's: merged)
# Ops that only re-view or cast a parameter: the backward recomputes them from its own all-gather
# instead of keeping the forward's gathered copy alive.
_CHEAP = {torch.ops.aten.t.default, torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default,
          torch.ops.aten.permute.default, torch.ops.aten.transpose.int, torch.ops.aten.expand.default,
          torch.ops.aten.slice.Tensor, torch.ops.aten.unsqueeze.default, torch.ops.aten.select.int,
          torch.ops.aten._to_copy.default, torch.ops.aten.detach.default, torch.ops.aten.alias.default}


@dataclass(frozen=True)
class FSDPConfig:
    world: int
    strategy: str = "optim_grads_params"
    prefetch: int = 1
    axis: str = "dp"
    ep: int = 1              # expert-parallel group size (units of `sharded(ep)` parameters go on "edp")

    def __post_init__(self):
        if self.strategy not in STRATEGIES:
            raise FxShardError(f"sharding={self.strategy!r} is not one of {STRATEGIES}")
        if self.prefetch < 0:
            raise FxShardError(f"fsdp_prefetch must be >= 0, got {self.prefetch}")

    @property
    def shards_params(self) -> bool:
        return self.strategy == "optim_grads_params"

    @property
    def shards_optimizer(self) -> bool:
        return self.strategy != "no_shard"

    @property
    def gathers_updates(self) -> bool:
        """ZeRO-1/2: full parameters, sharded optimizer: each updated shard is all-gathered."""
        return self.shards_optimizer and not self.shards_params


def fsdp(program: Program, cfg: FSDPConfig) -> Program:
    """Shard `program` over `cfg.world` data-parallel ranks.

    Invariant: run on every rank with that rank's local batch, the result returns the mean over
    ranks of `program`'s loss on each local batch (and the sum over ranks of each reported metric,
    such as MoE dropped tokens), and leaves on every rank the full parameters that
    `program`'s update would produce from the gradient of that mean. For a batch-mean loss with
    equal local batches this is exactly one device training on the concatenated batch; terms with
    batch statistics (MoE load balancing, BatchNorm) are per local batch, as in any data parallelism.
    The non-finite guard skips the steps `program`'s skips, and with deferred reductions also those
    whose unreduced gradients' squares overflow float32 (optimizer_graph.Deferred).
    """
    units = group_into_units(program, cfg.world, include_frozen=cfg.shards_params, ep=cfg.ep,
                             apart=frozenset(u.name for u in program.updates if not u.counted))
    return _Rewrite(program, units, cfg).run()


def group_into_units(program: Program, world: int, include_frozen: bool = False, ep: int = 1,
                     apart: frozenset[str] = frozenset()) -> list[FlatUnit]:
    """One unit per (layer, dtype) of trainable parameters, in order of first appearance; with
    `include_frozen` (ZeRO-3), frozen parameters get units of their own (gathered, never reduced);
    expert parameters (placed sharded(ep)) get units of their own over the `world // ep` ranks of `edp`;
    parameters in `apart` (another stage counts them in the gradient norm) too, and so do those whose
    update applies no weight decay (`Update.decay`: the optimizer's `no_decay`), one update per unit.
    Where they are a small part of their numbered block (norm gains, biases: under a tenth of its
    elements), the blocks' share one unit across the blocks ("layers:no_decay"): a small unit per block
    would add three collectives per block a step and (before prefetch counted bytes) took the big
    unit's prefetch slot (GPT 1b ZeRO-3 on 2 H200s: 4.6% slower with the 36 norm gains in 18 units than
    without no_decay, 0.5% with one; bench/RESULTS.md, session 48). A larger exempt part keeps a unit
    per block, which ZeRO-3 gathers with its block rather than for the whole phase."""
    no_decay = frozenset(u.name for u in program.updates if not u.decay)
    held = [(spec, node) for spec, node in zip(program.inputs, program.placeholders())
            if spec.kind is InputKind.PARAM and (spec.requires_grad or include_frozen)]
    block_numel, exempt_numel = {}, {}
    for spec, node in held:
        numel = math.prod(spec.shape)
        block_numel[meta.layer(node)] = block_numel.get(meta.layer(node), 0) + numel
        if spec.name in no_decay:
            exempt_numel[meta.layer(node)] = exempt_numel.get(meta.layer(node), 0) + numel
    members: dict[tuple[str, torch.dtype, bool, bool, bool, bool], list[tuple[str, tuple[int, ...]]]] = {}
    for spec, node in held:
        experts = spec.placement == EXPERT_SHARDED
        layer = meta.layer(node)
        if spec.name in no_decay and SMALL_UNIT * exempt_numel[layer] < block_numel[layer]:
            layer = re.sub(r"\.\d+$", "", layer)  # "layers.3" -> "layers"; pre and post stay
        members.setdefault((layer, spec.dtype, spec.requires_grad, experts, spec.name in apart,
                            spec.name in no_decay), []).append((spec.name, spec.shape))
    dtypes_per_layer = {}
    for layer_name, dtype, *_ in members:
        dtypes_per_layer.setdefault(layer_name, set()).add(dtype)
    units = []
    for (layer_name, dtype, trainable, experts, is_apart, undecayed), params in members.items():
        name = layer_name if len(dtypes_per_layer[layer_name]) == 1 else f"{layer_name}:{dtype}".replace("torch.", "")
        name += (":experts" if experts else "") + ("" if trainable else ":frozen") + (":tied" if is_apart else "")
        name += ":no_decay" if undecayed else ""
        units.append(FlatUnit.laid_out(name, params, dtype, world // ep if experts else world, trainable,
                                       "edp" if experts else "dp"))
    return units


class ZeroActions:
    """Where a pipeline stage's ZeRO actions (`StagePlan.actions`) put the pass's collectives: the
    window (chunk, how many U's of that chunk came before) of each compute action, the position of
    each U window's opening and of each chunk's G."""

    def __init__(self, actions: tuple):
        self.actions, self.count = actions, len(actions)
        self.window: dict[int, tuple[int, int]] = {}    # compute action position -> (chunk, U window)
        self.opened: dict[tuple[int, int], int] = {}    # (chunk, U window) -> position of its U
        self.reduced: dict[int, int] = {}               # chunk -> position of its G
        self.chunk = {index: a.chunk for index, a in enumerate(actions)}
        windows: dict[int, int] = {}
        for index, action in enumerate(actions):
            if action.kind == "U":
                windows[action.chunk] = windows.get(action.chunk, -1) + 1
                self.opened[action.chunk, windows[action.chunk]] = index
            elif action.kind in COMPUTE and action.chunk in windows:
                self.window[index] = (action.chunk, windows[action.chunk])
            elif action.kind == "G":
                self.reduced[action.chunk] = index

    @classmethod
    def of(cls, program: Program) -> "ZeroActions | None":
        actions = program.stage.actions if program.stage is not None else ()
        return cls(actions) if any(a.kind in ("U", "G") for a in actions) else None

    def position(self, node: fx.Node) -> int:
        """The position of the action that made `node`; nodes made after every action come last."""
        index = meta.action_index(node)
        return self.count if index is None else index


class _Rewrite:
    """Builds the per-rank graph in one walk over the single-device graph."""

    def __init__(self, program: Program, units: list[FlatUnit], cfg: FSDPConfig):
        self.program, self.units, self.cfg = program, units, cfg
        self.old = program.graph
        self.graph = Graph()
        self.fake = fake_mode_of(self.old)
        self.unit_of = {m.name: unit for unit in units for m in unit.members}
        # by name: parameters, buffers, state, batch (the step's own LR / STEP / LOSS_SCALE inputs are found
        # by kind, Program.placeholder_of: a parameter may share their name)
        self.old_placeholders = {spec.name: node for spec, node in zip(program.inputs, program.placeholders())
                                 if spec.kind not in OWN_INPUTS}
        self.member_of_node = {self.old_placeholders[name]: name for name in self.unit_of}
        self.compute_dtype = self.hoist_casts() if cfg.shards_params else {}
        self.cast_shards: dict[str, fx.Node] = {}  # unit name -> its shard in the compute dtype
        self.env: dict[fx.Node, fx.Node] = {}
        self.inputs: list[Input] = []
        self.zero = ZeroActions.of(program)
        self.windows = cfg.shards_params and self.zero is not None and bool(self.zero.opened)
        # A region is (phase, microbatch), or with ZeRO actions a U window (chunk, window): each gets
        # its own all-gather under ZeRO-3.
        self.views: dict[tuple, dict[str, fx.Node]] = {}   # region -> param name -> view node
        self.remat: dict[tuple, fx.Node] = {}              # (forward node, region) -> recomputed copy
        self.derived: dict[fx.Node, set[str]] = {}         # set by plan_gathers under ZeRO-3
        self.kept: dict[tuple, tuple] = {}                 # (region, unit name) -> region whose copy it reads
        self.riders: list[str] = []                        # units the prefetch distance does not count

    def hoist_casts(self) -> dict[str, torch.dtype]:
        """Units whose every parameter is only used through one cast (mixed precision) are gathered
        already cast: the cast runs on the shard, before the all-gather, and moves fewer bytes. The
        cast nodes then stand for the parameters (they are the nodes the views replace)."""
        dtypes = {}
        for unit in self.units:
            casts = []
            for member in unit.members:
                users = [u for u in self.old_placeholders[member.name].users if meta.phase(u) != meta.OPTIM]
                if (len(users) != 1 or users[0].target is not torch.ops.aten._to_copy.default
                        or set(users[0].kwargs) != {"dtype"}):
                    break
                casts.append(users[0])
            if len(casts) == len(unit.members) and len({c.kwargs["dtype"] for c in casts}) == 1:
                dtypes[unit.name] = casts[0].kwargs["dtype"]
                for member, cast in zip(unit.members, casts):
                    del self.member_of_node[self.old_placeholders[member.name]]
                    self.member_of_node[cast] = member.name
        return dtypes

    # ---- inputs -------------------------------------------------------------------------------
    def placeholder(self, spec: Input, value: torch.Tensor, layer=None, unit=None) -> fx.Node:
        node = self.graph.placeholder("".join(c if c.isalnum() else "_" for c in f"{spec.kind.value}_{spec.name}"))
        node.meta.update({"val": value, meta.PHASE: meta.FWD, meta.LAYER: layer or meta.PRE})
        if unit is not None:
            node.meta[meta.UNIT] = unit
        self.inputs.append(spec)
        return node

    def make_inputs(self):
        cfg = self.cfg
        self.unit_inputs, self.state_inputs, seen = {}, {}, set()
        for spec, old in zip(self.program.inputs, self.program.placeholders()):
            unit = (self.unit_of.get(spec.owner) if spec.kind is InputKind.OPT_STATE else
                    self.unit_of.get(spec.name) if spec.kind is InputKind.PARAM else None)
            if unit is None:
                self.env[old] = self.placeholder(spec, old.meta["val"], meta.layer(old))
                continue
            size = unit.shard_numel if (cfg.shards_params or spec.kind is InputKind.OPT_STATE and
                                        cfg.shards_optimizer) else unit.padded_numel
            with self.fake:
                value = torch.empty(size, dtype=unit.dtype, device=old.meta["val"].device)
            layer = meta.layer(self.old_placeholders[unit.members[0].name])
            shard_param = Placement("sharded", unit.axis) if cfg.shards_params else REPLICATED
            shard_state = Placement("sharded", unit.axis) if cfg.shards_optimizer else REPLICATED
            if spec.kind is InputKind.PARAM and unit.name not in seen:
                seen.add(unit.name)
                self.unit_inputs[unit.name] = self.placeholder(
                    Input.flat_unit(unit, (size,), shard_param), value, layer, unit.name)
            elif spec.kind is InputKind.OPT_STATE and (unit.name, spec.slot) not in self.state_inputs:
                self.state_inputs[unit.name, spec.slot] = self.placeholder(
                    Input.optimizer_slot(spec.slot, unit, (size,), unit.dtype, shard_state), value, layer, unit.name)
        self.coords = {}  # ZeRO-1/2: each unit axis's coordinate picks this rank's slice
        if cfg.gathers_updates and self.unit_inputs:  # none: a pipeline stage whose parameters are all frozen
            device = next(iter(self.unit_inputs.values())).meta["val"].device
            for axis in dict.fromkeys(unit.axis for unit in self.units):
                with self.fake:
                    value = torch.zeros(1, dtype=torch.long, device=device)
                self.coords[axis] = self.placeholder(Input(InputKind.COORD, axis, (1,), torch.long), value)

    # ---- collectives --------------------------------------------------------------------------
    def unit_meta(self, unit: FlatUnit, region: tuple | None = None) -> dict:
        """A unit's collective and view nodes' metadata; with a (phase, microbatch) region, its microbatch
        too (passes/interleave.py moves a microbatch's gathers with its compute, not with microbatch 0's)."""
        found = {meta.UNIT: unit.name, meta.LAYER: meta.layer(self.old_placeholders[unit.members[0].name])}
        if region is not None and not self.windows and region[1]:
            found[meta.MICROBATCH] = region[1]
        return found

    def issue_all_gather(self, unit: FlatUnit, phase: str, shard: fx.Node | None = None,
                         region: tuple | None = None) -> fx.Node:
        """All-gather `shard` (default: the unit's parameter shard, cast to its compute dtype) for
        `region`."""
        world, axis = unit.world, unit.axis
        if shard is None:  # gathering the parameters for compute: in their compute dtype
            shard = self.cast_shard(unit, phase, region)

        if world == 1:  # one rank on the axis: its shard is the whole unit
            return shard

        def gather(s):
            return [_c10d.all_gather_into_tensor(s, world, axis)]

        (gathered,) = inline(self.graph, gather, [shard], fake_mode=self.fake, phase=phase,
                             extra_meta=self.unit_meta(unit, region))
        if world > 1:
            gathered.meta[meta.COMM_BYTES] = unit.shard_numel * gathered.meta["val"].element_size()
        return gathered

    def cast_shard(self, unit: FlatUnit, phase: str, region: tuple | None) -> fx.Node:
        """The unit's parameter shard in its compute dtype (hoist_casts). Sharded over several ranks,
        it is cast once a step: every all-gather of the unit reads this one cast (ZeRO-3's backward
        gathers again), which lives until the last of them, 1/world of the unit in the compute dtype
        (GPT 1b at dp=2: 18 fewer casts a step, each a 54 us kernel in the 2x H100 profile; +0.81 GiB
        of static peak). On a one-rank axis (an expert unit at dp = ep) the cast is the whole unit, the
        gathered copy itself: each region casts its own, freed after it, as a gather's copy is."""
        dtype = self.compute_dtype.get(unit.name)
        if dtype is None:
            return self.unit_inputs[unit.name]

        def cast():
            (node,) = inline(self.graph, lambda s: [s.to(dtype)], [self.unit_inputs[unit.name]],
                             fake_mode=self.fake, phase=phase, extra_meta=self.unit_meta(unit, region))
            return node

        if unit.world == 1:
            return cast()
        if unit.name not in self.cast_shards:
            self.cast_shards[unit.name] = cast()
        return self.cast_shards[unit.name]

    def wait_and_view(self, unit: FlatUnit, issued: fx.Node | None, flat: fx.Node, region: tuple, phase: str) -> None:
        """Wait for `issued` (if a collective), then view each member out of the flat buffer."""
        members = unit.members

        collective = issued is not None and issued.target in meta.COLLECTIVE_ISSUES

        def views(full):
            if collective:
                full = _c10d.wait_tensor(full)
            return [full[m.offset:m.offset + m.numel].view(m.shape) for m in members]

        nodes = inline(self.graph, views, [issued if issued is not None else flat], fake_mode=self.fake,
                       phase=phase, extra_meta=self.unit_meta(unit, region))
        for member, node in zip(members, nodes):
            node.meta[meta.PARAM] = member.name
            self.views.setdefault(region, {})[member.name] = node

    def flatten_gradient(self, unit: FlatUnit, grads: list[fx.Node]) -> fx.Node:
        """`unit`'s gradient as one flat buffer laid out like the unit (expert gradients scaled by 1/K)."""
        padding = unit.padding
        scale = 1 / self.cfg.ep if unit.experts else None  # expert grads already sum their ep group

        def flatten(*grads):
            flat = torch.cat([g.reshape(-1) for g in grads] + ([grads[0].new_zeros(padding)] if padding else []))
            return [flat if scale is None else flat * scale]

        (flat,) = inline(self.graph, flatten, grads, fake_mode=self.fake, phase=meta.BWD,
                         extra_meta=self.unit_meta(unit))
        return flat

    def reduction(self, unit: FlatUnit):
        """The traceable issue of `unit`'s gradient reduction: the mean over the ranks of its axis,
        reduce-scattered where the optimizer is sharded (nothing on a one-rank axis)."""
        world, axis, shards = unit.world, unit.axis, self.cfg.shards_optimizer

        def issue(flat):
            if world == 1:
                return flat
            if shards:
                return _c10d.reduce_scatter_tensor(flat, "avg", world, axis)
            return _c10d.all_reduce(flat, "avg", axis)
        return issue

    def reduction_meta(self, unit: FlatUnit, flat: fx.Node) -> dict:
        return {**self.unit_meta(unit), meta.COMM_BYTES: unit.padded_numel * flat.meta["val"].element_size()}

    def issue_gradient_reduction(self, unit: FlatUnit, grads: list[fx.Node]) -> fx.Node:
        flat = self.flatten_gradient(unit, grads)
        issue = self.reduction(unit)
        (issued,) = inline(self.graph, lambda f: [issue(f)], [flat], fake_mode=self.fake, phase=meta.BWD,
                           extra_meta=self.unit_meta(unit))
        if unit.world > 1:
            issued.meta.update(self.reduction_meta(unit, flat))
        return issued

    def wait(self, issued: fx.Node, phase: str, layer: str) -> fx.Node:
        if issued.target not in meta.COLLECTIVE_ISSUES:  # a unit on a one-rank axis: nothing was issued
            return issued
        (done,) = inline(self.graph, lambda t: [_c10d.wait_tensor(t)], [issued], fake_mode=self.fake,
                         phase=phase, layer=layer,
                         extra_meta={meta.UNIT: issued.meta[meta.UNIT]} if meta.UNIT in issued.meta else None)
        return done

    # ---- the schedule -------------------------------------------------------------------------
    def derived_units(self) -> dict[fx.Node, set[str]]:
        """For each forward node computed from parameters by cheap ops only: the units it reads."""
        derived: dict[fx.Node, set[str]] = {}
        for node in self.old.nodes:
            if node in self.member_of_node:
                derived[node] = {self.unit_of[self.member_of_node[node]].name}
            elif (meta.phase(node) == meta.FWD and node.op == "call_function" and node.target in _CHEAP
                  and node.all_input_nodes and all(i in derived for i in node.all_input_nodes)):
                derived[node] = set().union(*(derived[i] for i in node.all_input_nodes))
        return derived

    def region(self, node: fx.Node) -> tuple | None:
        """The region whose all-gather `node` reads parameters from: its U window with ZeRO actions
        (None outside compute actions), else its (phase, microbatch)."""
        if self.windows:
            return self.zero.window.get(self.zero.position(node))
        return meta.phase(node), meta.microbatch(node)

    def rematerializes(self, derived: fx.Node, region: tuple) -> bool:
        """Whether a read of `derived` (a view or cast of parameters) from `region` recomputes it
        from that region's all-gather instead of keeping the gathered copy it was made from alive."""
        if self.windows:
            return region != self.region(derived)
        if all((region, unit) in self.kept for unit in self.derived.get(derived, ())):
            return False  # the forward's copy of every unit it reads is kept into this region
        return region[0] == meta.BWD

    def plan_gathers(self, walk: list[fx.Node], anchors: dict[int, fx.Node | None]):
        """(issue_before, wait_before): old node -> [(unit, region, phase)] to emit just before copying it.

        Every (region, unit) that reads parameters is one gather, in order of first use, waited on at
        that use. It is issued at the first use of the one `prefetch` places earlier, or, with ZeRO
        actions, at the U that opens the window (`anchors`: U position -> the first node after it)."""
        issue_before, wait_before = {}, {}
        if not self.cfg.shards_params:
            return issue_before, wait_before
        self.derived = derived = self.derived_units()
        first_use: dict[tuple, fx.Node] = {}   # (region, unit name) -> node, in first-use order
        for node in walk:
            if meta.phase(node) not in (meta.FWD, meta.BWD):
                continue
            region = self.region(node)
            for source in node.all_input_nodes:
                if source in self.member_of_node or (source in derived and self.rematerializes(source, region)):
                    if region is None:
                        raise AssertionError(f"{node.name} reads parameters outside the schedule's compute actions")
                    for unit_name in sorted(derived[source]):
                        first_use.setdefault((region, unit_name), node)
        units = {u.name: u for u in self.units}
        events = list(first_use)
        if not self.windows:  # a unit gathered twice in a row: the second use reads the first copy
            for previous, (region, unit_name) in zip(list(events), list(events)[1:]):
                if previous[1] == unit_name and previous[0] == (meta.FWD, region[1]) and region[0] == meta.BWD:
                    self.kept[region, unit_name] = previous[0]
                    events.remove((region, unit_name))
        first_node = next((n for n in walk if meta.phase(n) in (meta.FWD, meta.BWD)), None)
        ahead = None if self.windows else self.prefetch_from(events, units)
        for index, (region, unit_name) in enumerate(events):
            if self.windows:
                anchor = anchors[self.zero.opened[region]]
            else:
                anchor = first_use[events[ahead[index]]] if ahead[index] is not None else first_node
            use = first_use[region, unit_name]
            issue_before.setdefault(anchor, []).append((units[unit_name], region, meta.phase(use)))
            wait_before.setdefault(use, []).append((units[unit_name], region, meta.phase(use)))
        return issue_before, wait_before

    def prefetch_from(self, events: list[tuple], units: dict[str, FlatUnit]) -> list[int | None]:
        """For each gather event, the earlier event at whose first use it is issued (None: at the
        first compute node): `prefetch` events back, counting only units of at least a tenth of the
        median gather's bytes. A small unit (a norm gain's `layers:no_decay`, a frozen or tied unit)
        rides along with the others instead of taking a big unit's place, so the next block's gather
        is still issued under the block before it. The median over the events, not the largest unit:
        an embedding many times a block's size (Gemma's) must not make every block a rider, which
        would gather them all at once; a block is gathered in the forward and again in the backward,
        so the blocks outweigh `pre` and `post` even in a model of two blocks."""
        size = {name: unit.padded_numel * unit.dtype.itemsize for name, unit in units.items()}
        typical = statistics.median_high([size[name] for _, name in events] or [0])  # blocks: twice each
        counts = [size[name] * SMALL_UNIT >= typical for _, name in events]
        self.riders = sorted({name for (_, name), counted in zip(events, counts) if not counted})
        found = []
        for index in range(len(events)):
            back, counted = index, 0
            while counted < self.cfg.prefetch and back > 0:
                back -= 1
                counted += counts[back]
            found.append(back if counted == self.cfg.prefetch else None)
        return found

    def plan_reductions(self, anchors: dict[int, fx.Node | None]):
        """(reduce_after, reduce_before): old node -> units whose gradient reduction is issued right
        after copying it (the unit's last gradient) or, with ZeRO actions, just before it (the first
        node after the G of the chunk whose action made the last gradient; None: after every node)."""
        self.grad_nodes = {meta.param(n): n for n in self.old.nodes if meta.phase(n) == meta.BWD and meta.param(n)}
        position = {n: i for i, n in enumerate(self.old.nodes)}
        reduce_after, reduce_before = {}, {}
        self.reduced_at: dict[str, int] = {}  # unit -> the position of the G its reduction carries out
        for unit in self.units:
            if not unit.trainable:
                continue
            last = max((self.grad_nodes[m.name] for m in unit.members), key=position.get)
            if self.zero is not None:
                made_by = self.zero.position(last)
                reduced = self.zero.reduced.get(self.zero.chunk.get(made_by))
                if reduced is not None and reduced >= made_by:
                    reduce_before.setdefault(anchors[reduced], []).append(unit)
                    self.reduced_at[unit.name] = reduced
                    continue
            reduce_after.setdefault(last, []).append(unit)
        return reduce_after, reduce_before

    def deferred_units(self, walk: list[fx.Node], reduce_after: dict) -> dict[str, FlatUnit]:
        """The units whose gradient reductions are issued in the optimizer phase instead
        (optimizer_graph.Deferred): those whose last gradient is made once the backward of the layer
        it ends with has begun. Such a reduction has little compute left to hide behind; issued
        with the others' updates after it, it runs under them, and the non-finite guard decides the
        skip from the unreduced gradients first. Only where no update needs the reduced norm first:
        a sharded optimizer (each unit's norm sums over dp), no clipping, no pipeline; and not for
        gradients reduced in fp16, whose range is narrow (bf16's is float32's): an fp16 sum over the ranks
        overflows (65504) where each rank's gradient and the bound are finite, and the guard would
        apply the update that made it inf."""
        if (not self.cfg.shards_optimizer or self.zero is not None or self.program.stage is not None
                or self.program.train.clip_grad_norm is not None):
            return {}

        def wide(unit):  # bf16's largest (3.39e38) is a hair under fp32's: range, not equality
            return all(self.grad_nodes[m.name].meta["val"].dtype is not torch.float16 for m in unit.members)
        order = [unit for node in walk for unit in reduce_after.get(node, [])
                 if unit.world > 1 and not unit.experts and wide(unit)]
        if not order:
            return {}
        layer_of = {unit.name: meta.layer(self.old_placeholders[unit.members[0].name]) for unit in order}
        layered = [unit for unit in order if layer_of[unit.name] not in (meta.PRE, meta.POST)]
        last = layer_of[(layered or order)[-1].name]
        start = next(i for i, unit in enumerate(order) if layer_of[unit.name] == last)
        return {unit.name: unit for unit in order[start:]}

    def anchors(self, walk: list[fx.Node]) -> dict[int, fx.Node | None]:
        """ZeRO action position -> the first node of the walk made by a later action (None: none is)."""
        if self.zero is None:
            return {}
        positions = sorted([*self.zero.opened.values(), *self.zero.reduced.values()])
        found: dict[int, fx.Node | None] = {}
        previous = -1
        for node in walk:
            made_by = self.zero.position(node)
            if made_by < previous:
                raise AssertionError(f"{node.name} (action {meta.action(node)}) comes after nodes of a later action")
            previous = made_by
            while positions and positions[0] < made_by:
                found[positions.pop(0)] = node
        found.update({p: None for p in positions})
        return found

    def lookup(self, node: fx.Node, region: tuple, phase: str) -> fx.Node:
        """The copy of `node` that a node of `region` (and `phase`) reads."""
        if node in self.member_of_node:
            name = self.member_of_node[node]
            if not self.cfg.shards_params:
                region = ALL
            elif (region, self.unit_of[name].name) in self.kept:
                region = self.kept[region, self.unit_of[name].name]
            return self.views[region][name]
        if self.cfg.shards_params and node in self.derived and self.rematerializes(node, region):
            if (node, region) not in self.remat:  # recompute the view/cast from this region's all-gather
                copy = self.graph.node_copy(node, lambda n: self.lookup(n, region, phase))
                copy.meta[meta.PHASE] = phase
                copy.meta.pop(meta.ACTION, None)  # not the forward action's node any more
                copy.meta.pop(meta.ACTION_INDEX, None)
                self.remat[node, region] = copy
            return self.remat[node, region]
        return self.env[node]

    # ---- the walk -----------------------------------------------------------------------------
    def run(self) -> Program:
        self.make_inputs()
        if not self.cfg.shards_params:
            for unit in self.units:
                self.wait_and_view(unit, None, self.unit_inputs[unit.name], ALL, meta.FWD)
        walk = [n for n in self.old.nodes if n.op not in ("placeholder", "output") and meta.phase(n) != meta.OPTIM
                and n not in self.member_of_node]  # a hoisted cast: the gathered views replace it
        anchors = self.anchors(walk)
        issue_before, wait_before = self.plan_gathers(walk, anchors)
        reduce_after, reduce_before = self.plan_reductions(anchors)
        self.deferred = self.deferred_units(walk, reduce_after)
        old_output = next(n for n in self.old.nodes if n.op == "output")
        old_values = list(old_output.args[0])
        loss_node = old_values[0]
        metric_values = {value for spec, value in zip(self.program.outputs, old_values) if spec.kind is OutputKind.METRIC}
        issued_gathers, reductions, self.metric_sums = {}, {}, {}
        loss_reduce = None
        local = []  # a pipeline stage's units with nothing to reduce: flattened where the optimizer phase starts

        def reduce(unit):
            if unit.world == 1 and unit.name not in self.deferred and self.program.stage is not None:
                local.append(unit)
            else:
                reductions[unit.name] = self.reduce(unit)

        for node in walk:
            for unit in reduce_before.get(node, []):
                reduce(unit)
            for unit, region, phase in issue_before.get(node, []):
                issued_gathers[unit.name, region] = self.issue_all_gather(unit, phase, region=region)
                if self.windows:
                    self.tag(issued_gathers[unit.name, region], self.zero.opened[region])
            for unit, region, phase in wait_before.get(node, []):
                self.wait_and_view(unit, issued_gathers.pop((unit.name, region)), None, region, phase)
            region = self.region(node)
            if node.target is DATA_SUM and self.cfg.world > 1:  # torchtitan's balancing counts: over the ranks
                copy = self.sum_over_ranks(self.lookup(node.args[0], region, meta.phase(node)), node)
            else:
                copy = self.graph.node_copy(node, lambda n: self.lookup(n, region, meta.phase(node)))
            self.env[node] = copy
            if node is loss_node:
                (loss_reduce,) = inline(self.graph, lambda t: [_c10d.all_reduce(t, "avg", self.cfg.axis)], [copy],
                                        fake_mode=self.fake, phase=meta.FWD, layer=meta.POST)
                loss_reduce.meta[meta.COMM_BYTES] = copy.meta["val"].element_size()
            if node in metric_values:  # summed over the ranks, issued as soon as it exists
                self.metric_sums[node] = self.sum_metric(copy, meta.phase(copy) or meta.FWD)
            for unit in reduce_after.get(node, []):
                if unit.name in self.deferred:  # reduced in the optimizer phase: only laid out here
                    reductions[unit.name] = self.flatten_gradient(
                        unit, [self.env[self.grad_nodes[m.name]] for m in unit.members])
                else:
                    reduce(unit)
        for unit in reduce_before.get(None, []):  # a G after every node of the walk
            reduce(unit)
        for unit in local:
            grads = [self.env[self.grad_nodes[m.name]] for m in unit.members]
            reductions[unit.name] = self.flatten_gradient(unit, grads)
        return self.finish(old_values, loss_reduce, reductions)

    def sum_over_ranks(self, value: fx.Node, node: fx.Node) -> fx.Node:
        """`fxshard::data_sum(value)` (fxshard/balance.py) lowered: the sum over the data-parallel
        ranks, issued and waited where the program computed it (tiny: one count per expert and layer)."""
        (issued,) = inline(self.graph, lambda t: [_c10d.all_reduce(t, "sum", self.cfg.axis)], [value],
                           fake_mode=self.fake, phase=meta.phase(node), layer=meta.layer(node))
        issued.meta[meta.COMM_BYTES] = value.meta["val"].element_size() * value.meta["val"].numel()
        return self.wait(issued, meta.phase(node), meta.layer(node))

    def sum_metric(self, value: fx.Node, phase: str) -> fx.Node:
        """Issue the sum over the ranks of a metric loss_fn reports (waited at the end of the step)."""
        (issued,) = inline(self.graph, lambda t: [_c10d.all_reduce(t, "sum", self.cfg.axis)], [value],
                           fake_mode=self.fake, phase=phase, layer=meta.POST)
        issued.meta[meta.COMM_BYTES] = value.meta["val"].element_size() * value.meta["val"].numel()
        return issued

    def reduce(self, unit: FlatUnit) -> fx.Node:
        """Issue `unit`'s gradient reduction (at its chunk's G, where the schedule has one)."""
        issued = self.issue_gradient_reduction(unit, [self.env[self.grad_nodes[m.name]] for m in unit.members])
        if unit.name in self.reduced_at:
            self.tag(issued, self.reduced_at[unit.name])
        return issued

    def tag(self, node: fx.Node, position: int) -> None:
        """Mark a collective with the ZeRO action it carries out (U or G; a unit's own shard is no node)."""
        if node.op == "call_function":
            node.meta[meta.ACTION] = str(self.zero.actions[position])
            node.meta[meta.ACTION_INDEX] = position

    def finish(self, old_values, loss_reduce, reductions) -> Program:
        cfg = self.cfg
        trained = [unit for unit in self.units if unit.trainable]
        updates = self.unit_updates(trained)
        # ZeRO-1/2 all-gather each updated shard: those units are updated first, each gather issued
        # right after its update, so that it runs under the updates that follow
        gathers = cfg.gathers_updates
        first = sorted(trained, key=lambda unit: not (gathers and unit.world > 1))
        grads = [reductions[u.name] if u.name in self.deferred else
                 self.wait(reductions[u.name], meta.OPTIM, meta.layer(reductions[u.name])) for u in trained]
        params = [self.own_shard(unit) for unit in trained]
        states = {key: node for key, node in self.state_inputs.items()}
        lr, step = (self.env[self.program.placeholder_of(kind)] for kind in (InputKind.LR, InputKind.STEP))
        scale = self.program.placeholder_of(InputKind.LOSS_SCALE)
        grad_norm, new_params, new_states, nonfinite, next_scale = append_update(
            self.graph, self.program.train, self.fake, updates, params, grads, states, lr, step,
            norm_groups=self.norm_groups(), deferred=self.deferred_reductions(reductions),
            order=[unit.name for unit in first], loss_scale=self.env[scale] if scale is not None else None)
        gathered = {}
        for unit in first if gathers else ():
            new = new_params[unit.name]
            gathered[unit.name] = self.issue_all_gather(unit, meta.OPTIM, new)
            if gathered[unit.name].target in meta.COLLECTIVE_ISSUES:
                new.append(gathered[unit.name])  # moved up: issued as soon as the update exists
        outputs, values = [Output(OutputKind.LOSS, "loss"), Output(OutputKind.GRAD_NORM, "grad_norm")], []
        values += [self.wait(loss_reduce, meta.OPTIM, meta.POST), grad_norm]
        for unit in trained:
            new = new_params[unit.name]
            if gathers:
                new = self.wait(gathered[unit.name], meta.OPTIM, new.meta.get(meta.LAYER))
            placement = Placement("sharded", unit.axis) if cfg.shards_params else REPLICATED
            outputs.append(Output.flat_unit(unit, placement))
            values.append(new)
        units_by_name = {unit.name: unit for unit in trained}
        for (unit_name, slot), node in new_states.items():
            unit = units_by_name[unit_name]
            placement = Placement("sharded", unit.axis) if cfg.shards_optimizer else REPLICATED
            outputs.append(Output.optimizer_slot(slot, unit, placement))
            values.append(node)
        for spec, value in zip(self.program.outputs, old_values):
            if spec.kind is OutputKind.BUFFER:
                outputs.append(spec)
                values.append(self.env[value])
            elif spec.kind is OutputKind.METRIC:  # reported metrics are summed over the ranks
                issued = self.metric_sums[value] if value in self.metric_sums else \
                    self.sum_metric(self.env[value], meta.OPTIM)
                outputs.append(spec)
                values.append(self.wait(issued, meta.OPTIM, meta.POST))
        if nonfinite is not None:
            outputs.append(Output(OutputKind.NONFINITE, "nonfinite"))
            values.append(nonfinite)
        if next_scale is not None:
            outputs.append(Output(OutputKind.LOSS_SCALE, LOSS_SCALE))
            values.append(next_scale)
        self.graph.output(tuple(values))
        self.graph.lint()
        gm = lazy_module(self.program.graph_module, self.graph)
        riders = f" (not counted: {', '.join(self.riders)})" if self.riders else ""
        strategy = f"{cfg.strategy} (the same program as optim)" if cfg.strategy == "optim_grads" else cfg.strategy
        notes = dict(self.program.notes, fsdp=f"{strategy}, world {cfg.world}, prefetch {cfg.prefetch}{riders}, "
                                              f"{len(self.units)} units")
        return self.program.replace(graph_module=gm, inputs=tuple(self.inputs), outputs=tuple(outputs),
                                    units=tuple(self.units), notes=notes, updates=updates)

    def deferred_reductions(self, flats: dict[str, fx.Node]) -> Deferred | None:
        """The deferred units' reductions, issued by the optimizer phase (each marked like the others).
        Under ZeRO-1/2 the deferred units' updated shards are all-gathered: the units with no
        collective (one-rank axes: experts at N = K) are updated after them, under those gathers."""
        if not self.deferred:
            return None
        after = frozenset(unit.name for unit in self.units
                          if self.cfg.gathers_updates and unit.trainable and unit.world == 1)

        def issue(name, flat):
            with fx_traceback.annotate(self.reduction_meta(self.deferred[name], flats[name])):
                return self.reduction(self.deferred[name])(flat)

        def wait(name, issued):
            with fx_traceback.annotate(self.unit_meta(self.deferred[name])):
                return _c10d.wait_tensor(issued)
        return Deferred(frozenset(self.deferred), issue, wait, after)

    def unit_updates(self, units: list[FlatUnit]) -> tuple[Update, ...]:
        """The input program's updates of each unit's members, mapped to one update of the unit.
        Its gradient norm sums where the members' did (pipeline stages) and where the unit's gradient
        is split: sharded, the units partition all parameters over `dp` (expert shards over
        edp x ep = dp too); replicated, only expert units are split (over `ep`). It counts on this
        rank unless none of its members did (group_into_units gives such parameters units of their
        own: a weight tied across stages)."""
        updates = []
        for unit in units:
            members = [self.program.update_of(m.name) for m in unit.members]
            outer = members[0].norm_axes
            if any(m.norm_axes != outer for m in members):
                raise AssertionError(f"unit {unit.name}'s members sum their norms over different axes")
            if self.cfg.shards_optimizer:
                axes = (*outer, self.cfg.axis)
            else:
                axes = (*outer, "ep") if unit.experts else outer
            if any(m.decay != members[0].decay for m in members):
                raise AssertionError(f"unit {unit.name}'s members differ in weight decay")
            updates.append(Update(unit.name, axes, counted=any(m.counted for m in members), decay=members[0].decay))
        return tuple(updates)

    def norm_groups(self) -> tuple[tuple[str, ...], ...]:
        """Every group of axes some rank sums its units' gradient norms over (`unit_updates`), whether or
        not this rank holds such units: replicated expert units sum over `ep`, and a pipeline stage
        without experts must still take part in that all-reduce (every rank of `pp` issues the same)."""
        outer = ("pp",) if self.program.stage is not None else ()
        if self.cfg.shards_optimizer:
            return ((*outer, self.cfg.axis),)
        return (outer, (*outer, "ep")) if self.cfg.ep > 1 else (outer,)

    def own_shard(self, unit: FlatUnit) -> fx.Node:
        """The tensor this rank's optimizer updates: the shard, or for ZeRO-1/2 its slice of the full flat."""
        flat = self.unit_inputs[unit.name]
        if not self.cfg.gathers_updates or unit.world == 1:
            return flat
        world, size = unit.world, unit.shard_numel
        (shard,) = inline(self.graph, lambda full, coord: [full.view(world, size).index_select(0, coord).view(size)],
                          [flat, self.coords[unit.axis]], fake_mode=self.fake, phase=meta.OPTIM,
                          layer=meta.layer(flat), extra_meta={meta.UNIT: unit.name})
        return shard
