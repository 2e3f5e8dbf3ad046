"""Fill the expert-parallel all-to-alls' windows with work that does not depend on them.

A functional collective runs from its issue to its `wait_tensor`; whatever the graph orders between
the two overlaps it. The EP pass issues each all-to-all as soon as its rows are packed and waits at
the first use, but the traced order still puts independent work on the wrong side of the window:

    backward  the weight gradients of the layer above (and a shared expert's backward) come before
              the next MoE layer's dispatch is issued, so that dispatch has nothing to hide behind
    forward   a shared expert's forward comes after the combine's wait

This pass moves such work into the windows, per (phase, microbatch), at each EP all-to-all:

    issue X   the nodes between the previous EP collective node and X that X does not need are moved
              from before X to just after it (delayed weight gradients: Megatron's delay_wgrad_compute,
              as a reordering)
    wait W    the nodes between W and the next EP collective node that do not need W are moved from
              after W to just before it

Only work worth a window moves (a GEMM, a kernel or collective outside aten, a write into a buffer:
`_worth_moving`), with what it reads (ahead of a wait) or what reads it (past an issue). Elementwise
and gather work stays next to the nodes codegen fuses it with.

FSDP's placements stand: no all-gather is issued later (nothing moves ahead of one, and what one
reads stays before it), and no other collective's wait comes earlier (work before a wait that stays
keeps running before it; a wait that moves, moves later, with the work that needs it). Gradient
reductions (reduce-scatter / all-reduce issues) may be issued a little later, after the all-to-all
they were ahead of.

In a pipeline stage's program, sends, receives and their waits are fixed points as well: nothing
moves across one, so the transfer order lower_schedule proved deadlock-free stands.

Invariant: the output graph has the same nodes with the same arguments in another topological order
(a node moves only past nodes it neither reads nor feeds), so it computes the same values bit for
bit; what changes is which compute runs while each EP all-to-all is in flight.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from fxshard import meta
from fxshard.graph import flops, mutates, reordered
from fxshard.ops.p2p import P2P_OPS
from fxshard.program import Program

_c10d = torch.ops._c10d_functional


def fill_ep_windows(program: Program) -> Program:
    """Reorder `program` so that EP all-to-alls overlap the work that does not depend on them."""
    order = [n for n in program.graph.nodes]
    issues = [n for n in order if meta.is_moe_all_to_all(n)]
    moved = 0
    for issue in issues:
        moved += _delay_past_issue(order, issue)
        for wait in [u for u in issue.users if u.target is _c10d.wait_tensor.default]:
            moved += _hoist_before_wait(order, wait)
    notes = dict(program.notes, overlap=f"{moved} nodes moved to put independent work inside "
                                        f"{len(issues)} expert-parallel all-to-all windows")
    return program.replace(graph_module=reordered(program.graph_module, order), notes=notes)


def _is_ep_node(node: fx.Node) -> bool:
    return meta.is_moe_all_to_all(node) or (node.target is _c10d.wait_tensor.default
                                            and meta.is_moe_all_to_all(node.args[0]))


def _is_point_to_point(node: fx.Node) -> bool:
    """A pipeline send or receive, or its wait: nothing moves across one (the order of transfers
    between two ranks is fixed by lower_schedule)."""
    return node.target in P2P_OPS or (node.target is _c10d.wait_tensor.default and node.args[0].target in P2P_OPS)


def _segment(order: list[fx.Node], start: int, step: int, anchor: fx.Node) -> list[fx.Node]:
    """Nodes next to order[start] (walking by `step`) up to the next EP collective node or the end of
    the anchor's phase and microbatch, in graph order."""
    key = (meta.phase(anchor), meta.microbatch(anchor))
    segment, position = [], start + step
    while 0 <= position < len(order):
        node = order[position]
        if (node.op in ("placeholder", "output") or _is_ep_node(node) or _is_point_to_point(node)
                or (meta.phase(node), meta.microbatch(node)) != key):
            break
        segment.append(node)
        position += step
    return segment if step > 0 else segment[::-1]


def _closure(seeds, segment: set[fx.Node], neighbours) -> set[fx.Node]:
    found, stack = set(), list(seeds)
    while stack:
        node = stack.pop()
        if node in found:
            continue
        found.add(node)
        stack.extend(n for n in neighbours(node) if n in segment)
    return found


def _delay_past_issue(order: list[fx.Node], issue: fx.Node) -> int:
    """Move the nodes before `issue` (since the previous EP node) that it does not read to after it:
    those worth moving (`_worth_moving`) and what reads them."""
    at = order.index(issue)
    segment = _segment(order, at, -1, issue)
    keep = _kept_before(issue, segment)
    waits = [i for i, n in enumerate(segment) if n in keep and n.target is _c10d.wait_tensor.default]
    if waits:  # nothing moves from before a wait that stays to after it: what it hides behind stays
        del segment[:waits[-1] + 1]
    free = {n for n in segment if n not in keep}
    moving = _closure([n for n in free if _worth_moving(n)], free, lambda n: n.users)
    if moving:
        start = at - len(segment)  # the segment is the stretch right before the issue
        order[start:at + 1] = [n for n in segment if n not in moving] + [issue] + [n for n in segment if n in moving]
    return len(moving)


def _kept_before(issue: fx.Node, segment: list[fx.Node]) -> set[fx.Node]:
    """What stays before `issue`: what it reads, and all-gathers with what they read."""
    members = set(segment)
    pinned = [n for n in segment if n.target is _c10d.all_gather_into_tensor.default]
    return _closure([i for i in issue.all_input_nodes if i in members] + pinned, members, lambda n: n.all_input_nodes)


def _worth_moving(node: fx.Node) -> bool:
    """Whether `node` is work to put in a window for its own sake: a GEMM-class op, an op outside
    aten (fxshard's grouped GEMMs, a collective's issue) or one that writes into a buffer. The rest is
    elementwise, gather and view work that codegen fuses with its neighbours; it moves only with such
    work (ahead of a wait: what the work reads; past an issue: what reads the work). Moved alone, it
    would part from the nodes it fuses with and cross a region boundary, written out and read back
    (an RMSNorm backward's fp32 `pow` and `mul` of saved activations hoisted before a wait; the
    combine's gathered expert outputs kept before an issue while the router-weight gradient that
    multiplies and sums them moved past it)."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return _worth_moving(node.args[0])
    if getattr(node.target, "namespace", None) not in ("aten", "prims"):
        return True
    return flops(node) > 0 or mutates(node)


def _hoist_before_wait(order: list[fx.Node], wait: fx.Node) -> int:
    """Move the nodes after `wait` (up to the next EP node) that do not read it to before it: those
    worth moving (`_worth_moving`) and what they read."""
    at = order.index(wait)
    segment = _segment(order, at, 1, wait)
    gathers = [i for i, n in enumerate(segment) if n.target is _c10d.all_gather_into_tensor.default]
    if gathers:  # nothing moves ahead of an all-gather: its prefetch point stays
        del segment[gathers[0]:]
    members = set(segment)
    pinned = [n for n in segment if n.target is _c10d.wait_tensor.default]  # other collectives' waits
    stay = _closure([u for u in wait.users if u in members] + pinned, members, lambda n: n.users)
    independent = [n for n in segment if n not in stay]
    moving = _closure([n for n in independent if _worth_moving(n)], set(independent), lambda n: n.all_input_nodes)
    earlier = [n for n in segment if n in moving]
    if earlier:
        order[at:at + 1 + len(segment)] = earlier + [wait] + [n for n in segment if n not in moving]
    return len(earlier)
