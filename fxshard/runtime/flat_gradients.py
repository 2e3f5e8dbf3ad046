"""Lowering for execution: a unit's flat gradient is accumulated where it lies, not gathered by a cat.

The fsdp pass lays each unit's gradient out as one flat buffer, `cat([total.reshape(-1), ...])` of its
members' totals, for the reduction and the optimizer (passes/fsdp.py `flatten_gradient`). With
microbatches, most totals are sums the fused weight-gradient GEMMs accumulate in place
(`fxshard::matmul_wide` for the first microbatch, then `fxshard::matmul_accumulate_`;
runtime/reinplace.py `accumulate_in_place`): the cat then copies every one of them once more, a pass
of 8 bytes per parameter (GPT 1b at pp=2, 2x H200: ~95 us per block, ~0.5 ms per chunk of five
blocks, at the end of the step; bench/RESULTS.md session 40). `flat_gradients_in_place` allocates
the flat buffer where the unit's first such GEMM runs (`fxshard::flat_buffer`) and has the GEMMs
write and accumulate into their slices of it (`fxshard::matmul_wide_at_`,
`fxshard::matmul_accumulate_at_`, which view the slice inside the op: the program holds no aliasing
view for codegen to see); the cat's other parts (a norm weight's total, padding) are copied into
their slices where the cat was (`fxshard::copy_at_`), and the cat's readers read the buffer.

A cat is lowered only where every part is a 1-D view of a whole contiguous tensor or a small tensor
of its own (padding), and the totals it can accumulate in place (a `matmul_wide` read by nothing but
in-place accumulations into it and the cat's view, all before the cat, in the cat's dtype) hold at
least `MIN_IN_PLACE` of its elements: the copies of the rest then cost less than the cat did. (The
last microbatch's add of a total that is not a GEMM's, which codegen fused into the cat's write, is
a pass of its own again.)

Invariant: the lowered graph computes the same outputs as its input: the buffer holds, at the cat's
position, each part's elements in the cat's order, bit for bit (the same GEMMs with the same inputs,
writing the same slices their outputs were), and nothing writes the buffer after that position.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ..graph import Graph, lazy_module
from ..ops import matmul_accumulate  # noqa: F401  (registers the ops)
from .reinplace import _move_to_run_end

_aten = torch.ops.aten
_CAT = _aten.cat.default
_FLATTENS = (_aten.view.default, _aten._unsafe_view.default, _aten.reshape.default)
_WIDE = torch.ops.fxshard.matmul_wide.default
_ACCUMULATE_ = torch.ops.fxshard.matmul_accumulate_.default
_BUFFER = torch.ops.fxshard.flat_buffer.default
_WIDE_AT = torch.ops.fxshard.matmul_wide_at_.default
_ACCUMULATE_AT = torch.ops.fxshard.matmul_accumulate_at_.default
_COPY_AT = torch.ops.fxshard.copy_at_.default
MIN_IN_PLACE = 0.9  # of a flat gradient's elements that must be accumulated in place for the cat to go


def flat_gradients_in_place(graph_module: fx.GraphModule) -> tuple[fx.GraphModule, int]:
    """A copy of `graph_module` with each such cat's buffer accumulated in place (see the module
    docstring); and how many cats were lowered. Run after `accumulate_in_place`. A graph with no such
    cat is returned as it is, not copied (every step's construction runs this)."""
    order = {node: position for position, node in enumerate(graph_module.graph.nodes)}
    if not any(node.op == "call_function" and node.target is _CAT and _plan(node, order) is not None
               for node in graph_module.graph.nodes):
        return graph_module, 0
    graph = Graph()
    graph.output(graph.graph_copy(graph_module.graph, {}))
    order = {node: position for position, node in enumerate(graph.nodes)}
    lowered = 0
    for cat in [node for node in graph.nodes if node.op == "call_function" and node.target is _CAT]:
        plan = _plan(cat, order)
        if plan is not None:
            _lower(graph, cat, plan, order)
            lowered += 1
    graph.lint()
    return lazy_module(graph_module, graph), lowered


def _plan(cat: fx.Node, order: dict) -> list[tuple[str, fx.Node, fx.Node, int]] | None:
    """Per part of `cat`, in order: ("gemm" | "copy", the part, the tensor it holds, its offset);
    None where the cat is not one to lower."""
    if cat.kwargs or (len(cat.args) > 1 and cat.args[1] not in (0, -1)):
        return None
    out = cat.meta.get("val")
    if not isinstance(out, torch.Tensor) or out.dim() != 1:
        return None
    plan, offset, in_place = [], 0, 0
    for part in cat.args[0]:
        value = part.meta.get("val") if isinstance(part, fx.Node) else None
        if not isinstance(value, torch.Tensor) or value.dim() != 1 or value.dtype != out.dtype:
            return None
        held = part
        if part.target in _FLATTENS and len(part.users) == 1:
            source = part.args[0].meta.get("val") if isinstance(part.args[0], fx.Node) else None
            if isinstance(source, torch.Tensor) and source.is_contiguous() and source.numel() == value.numel():
                held = part.args[0]
        kind = "gemm" if held is not part and _accumulated_in_place(held, part, cat, out.dtype, order) else "copy"
        plan.append((kind, part, held, offset))
        in_place += value.numel() if kind == "gemm" else 0
        offset += value.numel()
    if offset != out.numel() or in_place < MIN_IN_PLACE * offset:
        return None
    return plan


def _accumulated_in_place(total: fx.Node, part: fx.Node, cat: fx.Node, dtype: torch.dtype, order: dict) -> bool:
    """`total` is a first microbatch's wide GEMM in `dtype` that only in-place accumulations into it
    and `part` (the cat's view of it) read, all before the cat."""
    if total.target is not _WIDE or total.kwargs or total.args[2] != dtype:
        return False
    for user in total.users:
        if user is part:
            continue
        if user.target is not _ACCUMULATE_ or user.kwargs or user.args[0] is not total or total in user.args[1:]:
            return False
        if order[user] > order[cat]:
            return False
    return True


def _lower(graph: Graph, cat: fx.Node, plan: list, order: dict) -> None:
    gemms = [(part, total, offset) for kind, part, total, offset in plan if kind == "gemm"]
    first = min((total for _, total, _ in gemms), key=order.__getitem__)
    layout = cat.meta["val"]
    with graph.inserting_before(first):
        flat = graph.call_function(_BUFFER, (layout.numel(), layout.dtype, layout.device))
    flat.meta.update({key: value for key, value in first.meta.items() if key != "val"})
    flat.meta["val"] = layout
    writes = []
    for part, total, offset in gemms:
        with graph.inserting_before(total):
            written = graph.call_function(_WIDE_AT, (flat, offset, *total.args[:2]))
        written.meta.update({key: value for key, value in total.meta.items() if key != "val"})
        writes.append(written)
        for user in list(total.users):
            if user is part:
                continue
            with graph.inserting_before(user):
                added = graph.call_function(_ACCUMULATE_AT, (flat, offset, *user.args[1:]))
            added.meta.update({key: value for key, value in user.meta.items() if key != "val"})
            graph.erase_node(user)
    with graph.inserting_before(cat):
        for kind, part, held, offset in plan:
            if kind == "copy":
                copied = graph.call_function(_COPY_AT, (flat, offset, held))
                copied.meta.update({key: value for key, value in cat.meta.items() if key != "val"})
    cat.replace_all_uses_with(flat)
    graph.erase_node(cat)
    for kind, part, held, _ in plan:
        if kind == "copy" and held is not part and not part.users:
            graph.erase_node(part)
        if kind == "gemm":
            graph.erase_node(part)
            graph.erase_node(held)
    for written in writes:  # to the end of its layer's run, as accumulate_in_place places its GEMMs
        _move_to_run_end(written, flat)
