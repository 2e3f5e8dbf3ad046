"""Interleave the microbatches of an accumulating step at communication issues.

With gradient accumulation the traced step runs forward 0, backward 0, forward 1, backward 1, ...
Nodes of different microbatches do not depend on each other (until the gradients are added up), so
they may be ordered freely against each other. This pass merges two microbatches' sequences into one
that switches from one to the other right after a dispatch or combine all-to-all of the
expert-parallel pass is issued (not at other collectives, see `_switches_at`): while one
microbatch's tokens travel, the other computes. Two pairings:

    combined-1f1b  backward m with forward m+1: Megatron's combined 1F1B overlap of expert-parallel
                   all-to-alls; activations of one microbatch alive at a time, as before
    dual-batch     forward m with forward m+1, then backward m with backward m+1 (m even): DeepSeek's
                   dual-batch overlap; every all-to-all (forward ones too) has the other
                   microbatch's attention, router and experts to hide behind, and two microbatches'
                   activations are alive at once (as without accumulation)

It uses the pieces the EP pass marks (`meta.MOE_PIECE`): the switch points are its dispatches and
combines.

Invariant: the output graph has the same nodes with the same arguments, in another topological
order, so it computes the same values bit for bit. A node is only ever moved earlier together with
everything it reads (pulled up), never ahead of its inputs.
"""

from __future__ import annotations

import torch.fx as fx

from fxshard import meta
from fxshard.config import EP_INTERLEAVINGS as PAIRINGS
from fxshard.errors import FxShardError
from fxshard.graph import reordered
from fxshard.ops.p2p import P2P_OPS as _P2P
from fxshard.program import Program


def interleave_microbatches(program: Program, pairing: str = "combined-1f1b") -> Program:
    """Reorder `program` so that two microbatches alternate at communication issues (see PAIRINGS)."""
    if pairing not in PAIRINGS:
        raise FxShardError(f"microbatch interleaving {pairing!r}; choose one of {PAIRINGS}")
    nodes = list(program.graph.nodes)
    microbatches = 1 + max(meta.microbatch(n) for n in nodes)
    order, latest = nodes, _latest_microbatch(nodes)
    if pairing == "combined-1f1b":
        for m in range(microbatches - 1):
            order = _merge(order, _part(order, latest, meta.BWD, m), _part(order, latest, meta.FWD, m + 1))
    else:
        for m in range(0, microbatches - 1, 2):
            order = _merge(order, _part(order, latest, meta.FWD, m), _part(order, latest, meta.FWD, m + 1))
            order = _merge(order, _part(order, latest, meta.BWD, m), _part(order, latest, meta.BWD, m + 1))
    described = {"combined-1f1b": "backward m with forward m+1",
                 "dual-batch": "forward m with forward m+1, backward m with backward m+1"}[pairing]
    notes = dict(program.notes, interleave=f"{pairing}: {described} interleaved at communication issues, "
                                            f"{microbatches} microbatches")
    return program.replace(graph_module=reordered(program.graph_module, order), notes=notes)


def interleave_actions(program: Program, pairs: list[tuple[str, str]]) -> Program:
    """A pipeline stage's program (passes/lower_schedule.py) with each pair of schedule actions (a
    forward and a backward of another microbatch, in either order; `meta.ACTION` names them, e.g.
    ("F0:2", "B0:1")) interleaved at communication issues, the backward first: the combined 1F1B
    of a pipeline's steady state, where one microbatch's all-to-alls run under the other's compute.
    The pairs come from `fxshard.schedule.combine_pairs`, which puts no transfer between the two
    actions of a pair and has proven that order deadlock-free with both actions' receives waited
    for before the pair and both sends issued after it. ZeRO's collectives (dp all-gathers at U,
    reductions at G: not point-to-point) lie outside pairs too: `pair_actions` moves U before the
    pair and R, G after it, so both chunks' parameters are gathered before the pair runs.

    Invariant: as `interleave_microbatches` (same nodes and arguments, another topological order,
    bit-identical values), and the sequence of sends and receives is unchanged."""
    order = list(program.graph.nodes)
    transfers = [n for n in order if n.target in _P2P]
    for pair in pairs:
        backward, forward = sorted(pair, key=lambda name: not name.startswith("B"))
        first = [n for n in order if meta.action(n) == backward and n.op != "placeholder"]
        second = [n for n in order if meta.action(n) == forward and n.op != "placeholder"]
        if not first or not second:
            raise AssertionError(f"combined 1F1B pairs {forward} with {backward}, but the program lacks the nodes of "
                                 f"{forward if not second else backward}")
        position = {n: i for i, n in enumerate(order)}
        span = order[min(position[first[0]], position[second[0]]):max(position[first[-1]], position[second[-1]])]
        if any(n.target in _P2P for n in span):
            raise AssertionError(f"a send or receive lies between the nodes of {forward} and {backward}")
        order = _merge(order, first, second)
    if [n for n in order if n.target in _P2P] != transfers:
        raise AssertionError("interleaving actions reordered the stage's sends and receives")
    why_none = ("; none would leave the simulated step as short (a pair's forward activation leaves after both "
                "actions, fxshard.schedule.combine_pairs)" if not pairs else "")
    notes = dict(program.notes, interleave=f"combined-1f1b in the pipeline: {len(pairs)} forward/backward pairs "
                                            f"interleaved at communication issues ({', '.join(f'{f}+{b}' for f, b in pairs)})"
                                            f"{why_none}")
    return program.replace(graph_module=reordered(program.graph_module, order), notes=notes)


def _latest_microbatch(order: list[fx.Node]) -> dict[fx.Node, int]:
    """Each node's microbatch for merging: its own, or the latest one among what it reads in its phase.
    Nodes that passes add without a microbatch (the fsdp pass's flat gradient of a unit, built once
    the last microbatch's gradients are accumulated) count as 0; left in microbatch 0's sequence, such
    a node would be placed only after all of microbatch 0's remaining work, far from the accumulation
    it reads: codegen would then write the accumulated gradient out and read it back, instead of
    fusing the add into the flat buffer's write."""
    latest: dict[fx.Node, int] = {}
    for node in order:
        latest[node] = max([meta.microbatch(node)] + [latest[i] for i in node.all_input_nodes
                                                      if meta.phase(i) == meta.phase(node)])
    return latest


def _switches_at(node: fx.Node) -> bool:
    """Where the merge switches microbatches: right after a dispatch or combine all-to-all of the
    expert-parallel pass is issued, the one kind of collective whose result the issuing microbatch
    needs before it can go on. Not at the count exchange ("route": a few bytes per expert, its latency
    covered by the permutation work after it; with balanced routing it reads nothing of its layer, so
    it is issued right after the previous combine's wait, and a switch there took the other
    microbatch's whole combine window away). Not at ZeRO's gradient reductions and gathers: the issuing
    microbatch has work left that does not need them, and a switch at the last microbatch's gradient
    reduction sent it away before its own next dispatch, so the two fell out of step."""
    return meta.is_moe_all_to_all(node) and node.meta.get(meta.MOE_PIECE) != meta.MOE_ROUTE


def _part(order: list[fx.Node], latest: dict[fx.Node, int], phase: str, m: int) -> list[fx.Node]:
    return [n for n in order if meta.phase(n) == phase and latest[n] == m and n.op != "placeholder"]


def _merge(order: list[fx.Node], first: list[fx.Node], second: list[fx.Node]) -> list[fx.Node]:
    """`order` with the nodes of `first` and `second` (two independent sequences) alternating at
    communication issues, from where the first of them begins."""
    if not first or not second:
        return order
    start = min(order.index(first[0]), order.index(second[0]))
    placed: list[fx.Node] = []
    done: set[fx.Node] = set(order[:start])

    def place(node):  # with whatever it reads that is not placed yet (pulled up, in their order)
        stack, pending = [node], []
        while stack:
            current = stack.pop()
            if current in done:
                continue
            missing = [i for i in current.all_input_nodes if i not in done]
            if missing:
                stack.append(current)
                stack.extend(missing)
                continue
            done.add(current)
            pending.append(current)
        placed.extend(pending)

    queues, turn = [first, second], 0
    positions = [0, 0]
    while positions[0] < len(first) or positions[1] < len(second):
        if positions[turn] >= len(queues[turn]):
            turn = 1 - turn
        node = queues[turn][positions[turn]]
        positions[turn] += 1
        if node in done:
            continue
        place(node)
        if _switches_at(node):
            turn = 1 - turn
    placed += [n for n in order[start:] if n not in done]
    return order[:start] + placed
