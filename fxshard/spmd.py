"""SPMD simulator: run per-rank programs for N ranks inside one process.

Each rank's graph runs as a generator that pauses at every functional collective
(`torch.ops._c10d_functional.*`). When every member of that collective's group is paused on it, the
simulator combines their tensors the way the real collective would and resumes them. Ranks may run
different graphs (pipeline stages), as long as their collectives match; a rank waiting on a group
whose other members never arrive is reported as a deadlock with each rank's pending collective.

    outputs = simulate([gm] * 4, [rank_inputs(r) for r in range(4)], groups={"dp": [0, 1, 2, 3]})

A group name may stand for several disjoint groups (every expert-parallel group is called "ep"):
give it a list of rank lists, e.g. `{"ep": [[0, 1], [2, 3]]}` (`Mesh.all_groups()` builds them).

Point-to-point (`fxshard::send` / `fxshard::recv`, fxshard/ops/p2p.py) is a mailbox per (sender,
receiver): a send delivers and goes on, a receive is numbered where it is issued and pauses its rank
where the program waits for it (`wait_tensor`), until its message is there. Messages between two
ranks match in issue order, and a receive checks the message's shape and dtype.
This is the lenient model (nothing but data dependencies can block); the stricter one of NCCL's
in-order streams is checked on the schedule itself (`fxshard.schedule.check_point_to_point`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.fx as fx

from .errors import FxShardError
from .ops import p2p as _p2p  # noqa: F401  (registers fxshard::send / recv)

_c10d = torch.ops._c10d_functional
_fxshard_send = torch.ops.fxshard.send.default
_fxshard_recv = torch.ops.fxshard.recv.default

_REDUCE = {
    "sum": lambda ts: torch.stack(ts).sum(0),
    "avg": lambda ts: torch.stack(ts).sum(0) / len(ts),
    "max": lambda ts: torch.stack(ts).amax(0),
    "min": lambda ts: torch.stack(ts).amin(0),
    "product": lambda ts: torch.stack(ts).prod(0),
}


@dataclass
class Collective:
    """One rank's call of a collective, paused until its group is complete, or of a send or receive."""

    op: str
    tensor: torch.Tensor
    group: str
    reduce_op: str | None = None
    output_split_sizes: Sequence[int] | None = None
    input_split_sizes: Sequence[int] | None = None
    src: int | None = None
    peer: int | None = None  # point-to-point: the other rank's index in the group
    ticket: int | None = None  # a receive: its place among the receives from its peer (set where issued)
    # a copy-engine collective (fxshard/runtime/copy_engine.py): (byte offset, workspace bytes, copied out)
    region: tuple[int, int, bool] | None = None
    out: torch.Tensor | None = None  # a gather into a given tensor (all_gather_into_tensor_out): filled and returned
    skip_own: bool = False  # a copy-engine all-to-all that leaves this rank's own rows of its region as they were

    def __str__(self):
        if self.op in ("send", "recv"):
            return f"{self.op}({tuple(self.tensor.shape)}, {'to' if self.op == 'send' else 'from'} {self.peer} of {self.group})"
        return f"{self.op}({tuple(self.tensor.shape)}, group={self.group})"


def _request(node: fx.Node, args, kwargs) -> Collective | None:
    target = node.target
    if target is _c10d.all_gather_into_tensor.default:
        tensor, _, group = args
        return Collective("all_gather_into_tensor", tensor, str(group))
    if target is _c10d.all_gather_into_tensor_out.default:
        tensor, _, group = args
        return Collective("all_gather_into_tensor", tensor, str(group), out=kwargs["out"])
    if target is _c10d.reduce_scatter_tensor.default:
        tensor, reduce_op, _, group = args
        return Collective("reduce_scatter_tensor", tensor, str(group), reduce_op=reduce_op)
    if target is _c10d.all_reduce.default:
        tensor, reduce_op, group = args
        return Collective("all_reduce", tensor, str(group), reduce_op=reduce_op)
    if target is _c10d.all_to_all_single.default:
        tensor, output_splits, input_splits, group = args
        return Collective("all_to_all_single", tensor, str(group), output_split_sizes=output_splits,
                          input_split_sizes=input_splits)
    if target is _c10d.broadcast.default:
        tensor, src, group = args
        return Collective("broadcast", tensor, str(group), src=src)
    if target is _fxshard_send:
        tensor, peer, group = args
        return Collective("send", tensor, str(group), peer=peer)
    if target is _fxshard_recv:
        shape, dtype, device, peer, group = args
        return Collective("recv", torch.empty(shape, dtype=dtype, device=device), str(group), peer=peer)
    lowered = getattr(target, "copy_engine_of", None)
    if lowered == "all_to_all_single":
        tensor, output_splits, input_splits, group, region, total, copy_out = args
        return Collective(lowered, tensor, str(group), output_split_sizes=output_splits,
                          input_split_sizes=input_splits, region=(region, total, copy_out),
                          skip_own=kwargs.get("skip_own", False))
    if lowered == "all_gather_into_tensor":  # copied out into a fresh tensor (True) or a given one
        tensor, _, group, region, total, copy_out = args
        into = copy_out if isinstance(copy_out, torch.Tensor) else None
        return Collective(lowered, tensor, str(group), region=(region, total, into is not None or copy_out), out=into)
    if lowered == "reduce_scatter_tensor":
        tensor, reduce_op, _, group, region, total = args
        return Collective(lowered, tensor, str(group), reduce_op=reduce_op, region=(region, total, True))
    if getattr(target, "namespace", None) == "_c10d_functional" and target is not _c10d.wait_tensor.default:
        raise FxShardError(f"the SPMD simulator does not implement {target}; add it to fxshard/spmd.py")
    return None


@dataclass
class _Posted:
    """A receive issued and not yet waited for: what its node holds until its `wait_tensor`."""

    request: Collective


_VIEW, _RESHAPE = torch.ops.aten.view.default, torch.ops.aten.reshape.default


def _run_rank(gm: fx.GraphModule, inputs: Sequence[Any]):
    """Generator: yields a Collective at each collective node and expects its result back (a
    receive: its ticket where it is issued, its message where it is waited for)."""
    env: dict[fx.Node, Any] = {}
    feed = iter(inputs)
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            env[node] = next(feed)
        elif node.op == "get_attr":
            value = gm
            for part in node.target.split("."):
                value = getattr(value, part)
            env[node] = value
        elif node.op == "call_function":
            args = fx.node.map_arg(node.args, env.__getitem__)
            kwargs = fx.node.map_arg(node.kwargs, env.__getitem__)
            if node.target is _c10d.wait_tensor.default:
                value = args[0]
                env[node] = (yield value.request) if isinstance(value, _Posted) else value
                continue
            if any(isinstance(a, _Posted) for a in args):
                raise FxShardError(f"{node.name} reads a received tensor before the program waits for it "
                                   f"(wait_tensor): a program fxshard's passes did not build?")
            request = _request(node, args, kwargs)
            if request is not None and request.op == "recv":
                yield request  # numbered among the receives from its peer; the rank goes on
                env[node] = _Posted(request)
                continue
            # a view runs as a reshape, as CompiledStep's aten replay runs it (graph.views_as_reshapes): the
            # same view wherever the view is valid, where a kernel's real layout is not its fake one a copy
            target = _RESHAPE if node.target is _VIEW else node.target
            env[node] = (yield request) if request is not None else target(*args, **kwargs)
        elif node.op == "call_module":  # a compiled region (fxshard/codegen.py): compute only, no collectives
            args = fx.node.map_arg(node.args, env.__getitem__)
            env[node] = gm.get_submodule(node.target)(*args)
        elif node.op == "output":
            return fx.node.map_arg(node.args[0], env.__getitem__)
        else:
            raise FxShardError(f"the SPMD simulator runs graphs of ops and regions; found {node.op} node {node.name}")


def combine(requests: list[Collective]) -> list[torch.Tensor]:
    """The per-member results of one collective, given each member's request in group order."""
    op = requests[0].op
    tensors = [r.tensor for r in requests]
    size = len(requests)
    if op == "all_gather_into_tensor":
        gathered = torch.cat(tensors, dim=0)
        return [gathered.clone() for _ in requests]
    if op == "all_reduce":
        reduced = _REDUCE[requests[0].reduce_op](tensors)
        return [reduced.clone() for _ in requests]
    if op == "reduce_scatter_tensor":
        return [chunk.clone() for chunk in _REDUCE[requests[0].reduce_op](tensors).chunk(size, dim=0)]
    if op == "broadcast":
        return [tensors[requests[0].src].clone() for _ in requests]
    if op == "all_to_all_single":
        pieces = []
        for request in requests:
            pieces.append(request.tensor.split(_rows_sent(request, size), dim=0))
        return [torch.cat([pieces[source][dest] for source in range(size)], dim=0) for dest in range(size)]
    raise AssertionError(op)


def _rows_sent(request: Collective, size: int) -> list[int]:
    """An all-to-all member's rows for each peer: its input splits, or its rows split evenly."""
    return list(request.input_split_sizes or [request.tensor.shape[0] // size] * size)


def _check_matching(group: str, requests: list[Collective]) -> None:
    """The members' requests of one collective fit together as NCCL and gloo need them to: the same op,
    reduction, dtype and copy-engine region, the same shape (an all-to-all: the same row shape, and each
    member's rows for a peer what that peer expects from it), else FxShardError, as a real job would
    hang or fail there."""
    kinds = {(r.op, r.reduce_op, r.tensor.dtype, r.region) for r in requests}
    if requests[0].op == "all_to_all_single":
        shapes = {tuple(r.tensor.shape[1:]) for r in requests}
        sent = [_rows_sent(r, len(requests)) for r in requests]
        expected = [r.output_split_sizes for r in requests]
        fits = all(expected[dest] is None or expected[dest][source] == sent[source][dest]
                   for source in range(len(requests)) for dest in range(len(requests)))
    else:
        shapes, fits = {tuple(r.tensor.shape) for r in requests}, True
    if len(kinds) != 1 or len(shapes) != 1 or not fits:
        raise FxShardError(f"mismatched collectives on group {group!r}: " + ", ".join(map(str, requests)))


def simulate(graphs: Sequence[fx.GraphModule], inputs: Sequence[Sequence[Any]],
             groups: dict[str, Sequence[int] | Sequence[Sequence[int]]], workspaces: dict | None = None) -> list[Any]:
    """Run rank r's `graphs[r]` on `inputs[r]`; `groups` maps each group name to its global ranks
    in group-rank order (or to a list of such lists). Returns each rank's outputs. `workspaces`: the
    ranks' copy-engine workspaces, (rank, group) -> bytes, kept by the caller from step to step as the
    GPUs keep theirs (a fresh one per call without it)."""
    groups = {name: [list(g) for g in members] if members and not isinstance(members[0], int) else [list(members)]
              for name, members in groups.items()}
    if len(graphs) != len(inputs):
        raise FxShardError(f"{len(graphs)} graphs but {len(inputs)} input lists: give one per rank")
    runners = [_run_rank(gm, args) for gm, args in zip(graphs, inputs)]
    pending: dict[int, Collective] = {}
    outputs: dict[int, Any] = {}
    mail: dict[tuple[int, int], list[torch.Tensor]] = {}  # (sender, receiver) -> messages in order
    posted: dict[tuple[int, int], int] = {}  # (sender, receiver) -> receives issued so far
    workspaces = {} if workspaces is None else workspaces  # (rank, group) -> its copy-engine workspace

    def advance(rank: int, value=None):
        while True:
            try:
                request = runners[rank].send(value)
            except StopIteration as done:
                outputs[rank] = done.value
                return
            if request.op == "recv" and request.ticket is None:  # issued: number it, go on
                pair = (_peer(groups, request, rank), rank)
                request.ticket = posted.get(pair, 0)
                posted[pair] = request.ticket + 1
                value = None
                continue
            if request.op != "send":
                pending[rank] = request
                return
            peer = _peer(groups, request, rank)
            mail.setdefault((rank, peer), []).append(request.tensor.clone())
            value = request.tensor.new_empty(0)

    def deliver() -> bool:
        delivered = False
        for rank, request in list(pending.items()):
            if request.op != "recv":
                continue
            messages = mail.get((_peer(groups, request, rank), rank), [])
            if len(messages) <= request.ticket:
                continue
            message, messages[request.ticket] = messages[request.ticket], None
            if message.shape != request.tensor.shape or message.dtype != request.tensor.dtype:
                raise FxShardError(f"rank {rank}: {request} got a message of shape {tuple(message.shape)}, "
                                   f"{message.dtype}: sends and receives between two ranks do not match in order")
            del pending[rank]
            advance(rank, message)
            delivered = True
        return delivered

    for rank in range(len(runners)):
        advance(rank)
    while pending:
        progressed = deliver()
        for group, member_lists in groups.items():
            for members in member_lists:
                if any(pending.get(m) is not None and pending[m].op == "recv" for m in members):
                    continue
                if not all(pending.get(m) is not None and pending[m].group == group for m in members):
                    continue
                requests = [pending.pop(m) for m in members]
                _check_matching(group, requests)
                for index, (member, result) in enumerate(zip(members, combine(requests))):
                    if requests[index].region is not None:
                        result = _through_workspace(workspaces, member, index, requests, result)
                    if requests[index].out is not None:
                        result = requests[index].out.copy_(result)
                    advance(member, result)
                progressed = True
        if not progressed:
            unknown = {r.group for r in pending.values()} - set(groups)
            if unknown:
                raise FxShardError(f"collectives name groups {sorted(unknown)} that `groups` does not define")
            waiting = "; ".join(f"rank {rank}: {request}" for rank, request in sorted(pending.items()))
            raise FxShardError(f"deadlock: no group has all its members at a collective ({waiting})")
    return [outputs[rank] for rank in range(len(runners))]


def _through_workspace(workspaces: dict, rank: int, index: int, requests: list[Collective],
                       result: torch.Tensor) -> torch.Tensor:
    """A copy-engine collective's result as the GPUs have it: what lands in this rank's region of its
    group's workspace is written there the moment every member has issued the collective (the earliest
    a copy could land), over whatever the region held; the result is the region itself, unless it is
    copied out (a returned result) or reduced (a reduce-scatter sums what landed into a new tensor). So
    a region the plan hands out while an earlier result in it is still read changes what is computed."""
    request = requests[index]
    offset, total, copied_out = request.region
    key = (rank, request.group)
    if key not in workspaces or workspaces[key].numel() < total:
        workspaces[key] = torch.zeros(total, dtype=torch.uint8, device=result.device)
    landed = result
    if request.op == "reduce_scatter_tensor":  # every member's chunk for this rank, in member order
        landed = torch.stack([r.tensor.chunk(len(requests), dim=0)[index] for r in requests])
    nbytes = landed.numel() * landed.element_size()
    region = workspaces[key][offset:offset + nbytes].view(landed.dtype).view(landed.shape)
    if request.skip_own:  # every part but this rank's own lands
        own = landed.shape[0] // len(requests)
        region[:index * own].copy_(landed[:index * own])
        region[(index + 1) * own:].copy_(landed[(index + 1) * own:])
    else:
        region.copy_(landed)
    return result if copied_out else region


def _peer(groups: dict[str, list[list[int]]], request: Collective, rank: int) -> int:
    """The global rank of a point-to-point request's peer (its index in this rank's group)."""
    if request.group not in groups:
        raise FxShardError(f"point-to-point names group {request.group!r}, which `groups` does not define")
    members = next((m for m in groups[request.group] if rank in m), None)
    if members is None or not 0 <= request.peer < len(members):
        raise FxShardError(f"rank {rank}: {request} has no such peer in group {request.group!r}")
    return members[request.peer]
