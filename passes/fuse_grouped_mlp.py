"""Fuse grouped GEMM -> activation -> grouped GEMM (an MoE expert MLP) into `fxshard::grouped_mlp`.

In the traced joint graph an expert MLP is, per microbatch:

    forward   h = grouped_mm(x, offs, w1);  a = act(h) (a few aten ops);  y = grouped_mm(a, offs, w2)
    backward  gw2 = grouped_mm_wgrad(gy, a, offs);  ga = grouped_mm(gy, offs, w2^T)
              gh = (autograd's nodes for act, from ga and the forward's intermediates)
              gw1 = grouped_mm_wgrad(gh, x, offs);  gx = grouped_mm(gh, offs, w1^T)

(a weight that is the transpose of experts stored [E, in, out] gets its gradient in that layout,
grouped_mm_wgrad(a, gy, offs) / grouped_mm_wgrad(x, gh, offs), transposed: fxshard/ops/grouped_mm.py;
its fused gradient is then copied into that layout, so what the optimizer reads stays contiguous)

The pass replaces each such group by three nodes: `grouped_mlp_fwd` where y was computed, and
`grouped_mlp_dgrad` followed by `grouped_mlp_wgrad` where the backward started (a scheduler may
move the weight-gradient node later; it is one node, so it runs once). A group is fused only when

  - act is one of fxshard.ops.grouped_mlp_backends.ACTIVATIONS, recognized by comparing the nodes
    between h and a with that activation's PyTorch definition traced the same way (op for op,
    literal for literal: a different activation, approximation or split does not match);
  - every intermediate (h, the activation's nodes, a) is read only by the group itself: an extra
    consumer keeps the unfused form;
  - the activation's backward nodes read only the group's values and feed only gw1/gx;
  - both expert weights are trained (their weight gradients exist) and no bias sits between;
  - every GEMM of the group uses the same row layout (ragged, or the same capacity slots), which
    the fused op then takes (`capacity`);
  - the shapes are the fused op's (D -> F -> D, the experts agreeing);
  - it shares no GEMM with a group fused before it (a chain of three expert GEMMs fuses its first two).

Invariant: the fused program computes the same loss, gradients and updates as its input (the fused
op's forward and backward are the same functions; CPU property tests compare them numerically).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from fxshard import meta
from fxshard.graph import Graph, call_argument, fake_mode_of, inline, lazy_module
from fxshard.errors import FxShardError
from fxshard.ops.grouped_mlp import check_arguments, grouped_mlp_dgrad, grouped_mlp_fwd, grouped_mlp_wgrad
from fxshard.ops.grouped_mlp_backends import ACTIVATIONS
from fxshard.program import Program

_GROUPED_MM = torch.ops.fxshard.grouped_mm.default
_WGRAD = torch.ops.fxshard.grouped_mm_wgrad.default
_TRANSPOSE = torch.ops.aten.transpose.int
_VIEWS_FOR_BACKWARD = {torch.ops.aten.detach.default, torch.ops.aten.alias.default}
DEFAULT_LIMIT = 7.0  # quick_geglu's clamp when the graph's own literal cannot be read


@dataclass
class _Group:
    x: fx.Node
    offsets: fx.Node
    w1: fx.Node          # the weight as fc1 reads it (the parameter, or its cast)
    w2: fx.Node
    h: fx.Node           # fc1's grouped_mm
    chain: list[fx.Node]  # the activation's forward nodes, h excluded, a included
    y: fx.Node           # fc2's grouped_mm
    activation: str
    limit: float
    grad_y: fx.Node
    grad_a: fx.Node      # grouped_mm(gy, offs, w2^T)
    grad_w2: fx.Node
    act_backward: list[fx.Node]
    grad_h: fx.Node
    grad_w1: fx.Node
    grad_x: fx.Node | None
    capacity: int | None  # the rows' layout: ragged (None) or capacity slots
    stored_w1: bool = False  # grad_w1 / grad_w2 are grouped_mm_wgrad(rows, grad): the stored [E, in, out] layout
    stored_w2: bool = False


def fuse_grouped_mlp(program: Program) -> Program:
    """`program` with every recognized expert MLP fused; `notes["fused_grouped_mlp"]` lists them."""
    graph = Graph()
    graph.output(graph.graph_copy(program.graph, {}))
    fake = fake_mode_of(graph)
    fused = []
    for group in find_groups(graph):
        _rewrite(graph, group, fake)
        fused.append(f"{meta.layer(group.y)}: {group.activation} (microbatch {meta.microbatch(group.y)})")
    graph.lint()
    notes = {**program.notes, "fused_grouped_mlp": fused}
    return program.replace(graph_module=lazy_module(program.graph_module, graph), notes=notes)


def find_groups(graph: fx.Graph) -> list[_Group]:
    """Every fusable expert MLP in `graph` (see the module docstring for the conditions)."""
    groups, owned, read = [], set(), set()
    for y in graph.nodes:
        if y.target is _GROUPED_MM and meta.phase(y) == meta.FWD:
            group = _match(y)
            if group is None:
                continue
            # a chain of three GEMMs matches twice, sharing a GEMM: fusing the first group removes nodes
            # the second one reads, so a group that overlaps one taken earlier stays unfused
            mine = _owned(group)
            if mine & (owned | read) or {group.x, group.grad_y} & owned:
                continue
            groups.append(group)
            owned |= mine
            read |= {group.x, group.grad_y}
    return groups


def _owned(group: _Group) -> set[fx.Node]:
    """The nodes fusing `group` replaces."""
    return {group.h, *group.chain, group.y, group.grad_a, group.grad_w2, *group.act_backward, group.grad_h,
            group.grad_w1, *([group.grad_x] if group.grad_x is not None else [])}


def _match(y: fx.Node) -> _Group | None:
    a, offsets, w2 = y.args[:3]
    capacity = _capacity(y)  # every GEMM of the group must use the same row layout
    found = _activation_of(a)
    if found is None:
        return None
    activation, limit, h, chain = found
    if h.target is not _GROUPED_MM or h.args[1] is not offsets or meta.phase(h) != meta.FWD or \
            _capacity(h) != capacity:
        return None
    x, _, w1 = h.args[:3]
    if not _fits_the_fused_op(x, offsets, w1, w2, activation, capacity):  # e.g. D -> F -> D2 with D2 != D
        return None
    grad_w2, stored_w2 = _wgrad_of(a, offsets, capacity)
    if grad_w2 is None:
        return None
    grad_y = grad_w2.args[0 if not stored_w2 else 1]
    grad_a = _only(u for u in grad_y.users if u.target is _GROUPED_MM and u.args[1] is offsets
                   and _is_transpose_of(u.args[2], w2) and _capacity(u) == capacity)
    grad_w1, stored_w1 = _wgrad_of(x, offsets, capacity, lambda u: meta.phase(u) == meta.BWD and
                                   meta.microbatch(u) == meta.microbatch(y))
    if grad_a is None or grad_w1 is None:
        return None
    grad_h = grad_w1.args[0 if not stored_w1 else 1]
    grad_x = _only(u for u in grad_h.users if u.target is _GROUPED_MM and _is_transpose_of(u.args[2], w1)
                   and _capacity(u) == capacity)
    act_backward = _between(sources={grad_a, h, *chain}, sink=grad_h)
    group = _Group(x, offsets, w1, w2, h, chain, y, activation, limit, grad_y, grad_a, grad_w2, act_backward,
                   grad_h, grad_w1, grad_x, capacity, stored_w1, stored_w2)
    return group if _self_contained(group) else None


def _wgrad_of(rows: fx.Node, offsets: fx.Node, capacity, also=lambda u: True) -> tuple[fx.Node | None, bool]:
    """The weight gradient read from `rows`: grouped_mm_wgrad(grad, rows) ([E, out, in]), or
    grouped_mm_wgrad(rows, grad) for a weight stored [E, in, out] (True); (None, False) if not exactly one."""
    found = [(u, u.args[0] is rows) for u in rows.users if u.target is _WGRAD and u.args[2] is offsets and
             (u.args[1] is rows) != (u.args[0] is rows) and _capacity(u) == capacity and also(u)]
    return found[0] if len(found) == 1 else (None, False)


def _fits_the_fused_op(x, offsets, w1, w2, activation, capacity) -> bool:
    """The group's shapes are ones `grouped_mlp` takes ([E, F, D] then [E, D, F]; counts agree)."""
    values = [node.meta.get("val") for node in (x, offsets, w1, w2)]
    if not all(isinstance(value, torch.Tensor) for value in values):
        return False
    try:
        check_arguments(*values, activation, capacity)
    except FxShardError:
        return False
    return True


def _capacity(node: fx.Node):
    """The `capacity` argument of a grouped_mm / grouped_mm_wgrad call (None: ragged rows)."""
    return call_argument(node, "capacity")


def _activation_of(a: fx.Node):
    """(name, limit, h, chain nodes) if the nodes producing `a` are exactly a known activation of one tensor."""
    value = a.meta.get("val")
    if not isinstance(value, torch.Tensor) or value.dim() != 2:
        return None
    for name, spec in ACTIVATIONS.items():
        width = value.shape[1] * (2 if spec.gated else 1)
        limits = _clamp_literals(a) if name == "quick_geglu" else [DEFAULT_LIMIT]
        for limit in limits or [DEFAULT_LIMIT]:
            pattern = _pattern(name, width, value.dtype, limit)
            mapping = _structural_match(pattern, a)
            if mapping is not None:
                (h,) = [mapping[p] for p in pattern.nodes if p.op == "placeholder"]
                chain = [n for p, n in mapping.items() if p.op != "placeholder"]
                return name, limit, h, chain
    return None


_PATTERNS: dict[tuple, fx.Graph] = {}


def _pattern(name, width, dtype, limit) -> fx.Graph:
    key = (name, width, dtype, limit)
    if key not in _PATTERNS:
        fn = ACTIVATIONS[name].torch
        _PATTERNS[key] = make_fx(lambda h: fn(h, limit))(torch.zeros(2, width, dtype=dtype)).graph
    return _PATTERNS[key]


def _structural_match(pattern: fx.Graph, a: fx.Node) -> dict[fx.Node, fx.Node] | None:
    """Pattern node -> graph node, matching from the pattern's output back to its one placeholder."""
    (result,) = next(n for n in pattern.nodes if n.op == "output").args
    if isinstance(result, (list, tuple)):
        (result,) = result
    mapping: dict[fx.Node, fx.Node] = {}

    def same(p, g) -> bool:
        if isinstance(p, fx.Node):
            if not isinstance(g, fx.Node):
                return False
            if p in mapping:
                return mapping[p] is g
            if g in mapping.values():
                return False
            if p.op == "placeholder":
                mapping[p] = g
                return True
            if p.target != g.target or meta.phase(g) != meta.FWD or set(p.kwargs) != set(g.kwargs):
                return False
            mapping[p] = g
            return same(list(p.args), list(g.args)) and all(same(p.kwargs[k], g.kwargs[k]) for k in p.kwargs)
        if isinstance(p, (list, tuple)):
            return isinstance(g, (list, tuple)) and len(p) == len(g) and all(map(same, p, g))
        return type(p) is type(g) and p == g

    return mapping if same(result, a) else None


def _clamp_literals(a: fx.Node) -> list[float]:
    seen, stack, found = set(), [a], []
    while stack:
        node = stack.pop()
        if node in seen or not isinstance(node, fx.Node) or len(seen) > 64:
            continue
        seen.add(node)
        if node.target is torch.ops.aten.clamp.default:
            found += [float(v) for v in node.args[1:] if isinstance(v, (int, float))]
        stack.extend(n for n in node.all_input_nodes)
    return sorted({abs(v) for v in found})


def _is_transpose_of(node, weight) -> bool:
    return (isinstance(node, fx.Node) and node.target is _TRANSPOSE and node.args[0] is weight
            and sorted(a % 3 for a in node.args[1:]) == [1, 2])


def _only(candidates):
    found = list(candidates)
    return found[0] if len(found) == 1 else None


def _between(sources: set[fx.Node], sink: fx.Node) -> list[fx.Node]:
    """Backward nodes that depend on `sources` and that `sink` depends on (sink included), in graph order."""
    ancestors, stack = set(), [sink]
    while stack:
        node = stack.pop()
        if node in ancestors or node in sources:
            continue
        ancestors.add(node)
        stack.extend(node.all_input_nodes)
    reached, stack = set(), [u for s in sources for u in s.users]
    while stack:
        node = stack.pop()
        if node in reached or node not in ancestors:
            continue
        reached.add(node)
        stack.extend(node.users)
    # constants built for these nodes alone (aten.scalar_tensor, full) belong to them
    reached |= {i for n in reached for i in n.all_input_nodes
                if i.op == "call_function" and not i.all_input_nodes and set(i.users) <= reached}
    order = {n: i for i, n in enumerate(sink.graph.nodes)}
    return sorted(reached, key=order.get)


def _self_contained(g: _Group) -> bool:
    backward = set(g.act_backward)
    forward = {g.h, *g.chain}
    a = g.y.args[0]
    # autograd's saved-value views (detach in the forward phase) belong to the backward's side
    if g.grad_h not in backward or any(meta.phase(n) != meta.BWD and n.target not in _VIEWS_FOR_BACKWARD
                                       for n in backward):
        return False
    if any(u not in backward for u in g.grad_a.users):
        return False
    for node in forward:
        allowed = forward | backward | ({g.y, g.grad_w2} if node is a else set())
        if any(u not in allowed for u in node.users):
            return False  # an extra consumer of an intermediate
    for node in backward:
        if any(i not in backward | forward | {g.grad_a} for i in node.all_input_nodes):
            return False  # reads something outside the group
        allowed = backward | {g.grad_w1} | ({g.grad_x} if g.grad_x is not None else set())
        if any(u not in allowed for u in node.users):
            return False
    return True


def _rewrite(graph: fx.Graph, g: _Group, fake) -> None:
    mb = {meta.MICROBATCH: meta.microbatch(g.y)} if meta.MICROBATCH in g.y.meta else {}
    activation, limit = g.activation, float(g.limit)

    slots = () if g.capacity is None else (g.capacity,)  # ragged programs keep their shorter calls

    def forward(x, offsets, w1, w2):
        return grouped_mlp_fwd(x, offsets, w1, w2, None, None, activation, limit, *slots)

    def backward(grad_y, h, x, offsets, w1, w2):
        grad_x, grad_h, act = grouped_mlp_dgrad(grad_y, h, offsets, w1, w2, activation, limit, *slots)
        grad_w1, grad_w2, _, _ = grouped_mlp_wgrad(grad_y, grad_h, x, act, offsets, False, *slots)
        # where the unfused graph made a weight's gradient in its stored [E, in, out] layout, so does this
        if g.stored_w1:
            grad_w1 = grad_w1.transpose(1, 2).contiguous()
        if g.stored_w2:
            grad_w2 = grad_w2.transpose(1, 2).contiguous()
        return grad_x, grad_w1, grad_w2

    with graph.inserting_before(g.y):
        y, h = inline(graph, forward, [g.x, g.offsets, g.w1, g.w2], fake_mode=fake, phase=meta.FWD,
                      layer=meta.layer(g.y), extra_meta=mb)
    first_backward = min((g.grad_a, g.grad_w2), key=lambda n: list(graph.nodes).index(n))
    with graph.inserting_before(first_backward):
        grad_x, grad_w1, grad_w2 = inline(graph, backward, [g.grad_y, h, g.x, g.offsets, g.w1, g.w2],
                                          fake_mode=fake, phase=meta.BWD, layer=meta.layer(g.grad_a),
                                          extra_meta=mb)
    replacements = [(g.y, y), (g.grad_w1, grad_w1), (g.grad_w2, grad_w2)]
    if g.grad_x is not None:
        replacements.append((g.grad_x, grad_x))
    for old, new in replacements:
        for key in (meta.PARAM,):
            if key in old.meta:
                new.meta[key] = old.meta[key]
        old.replace_all_uses_with(new)
    dead = [g.h, *g.chain, g.y, g.grad_a, g.grad_w2, *g.act_backward, g.grad_w1]
    dead += [g.grad_x] if g.grad_x is not None else []
    order = {n: i for i, n in enumerate(graph.nodes)}
    for node in sorted(set(dead), key=order.get, reverse=True):
        for user in list(node.users):
            if user.target is operator.getitem and not user.users:
                graph.erase_node(user)
        assert not node.users, f"fuse_grouped_mlp: {node.name} still read by {list(node.users)}"
        inputs = node.all_input_nodes
        graph.erase_node(node)
        for source in inputs:  # the transposed weight views that only the old backward read
            if source.target is _TRANSPOSE and not source.users:
                graph.erase_node(source)
    if grad_x is not None and g.grad_x is None:
        graph.erase_node(grad_x)  # x needs no gradient: the getitem is unused
