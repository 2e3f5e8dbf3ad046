"""`simulate`: checks a schedule (every dependency satisfied, no deadlock) and times it under unit or
measured costs, ZeRO's collectives on a communication stream of their own."""

from __future__ import annotations

from dataclasses import dataclass

import networkx as nx

from ..errors import FxShardError
from .model import COMPUTE, TRANSFERS, ZERO, Action, Schedule, matching
from .zero import check_zero_actions


@dataclass
class Simulation:
    makespan: float
    bubble: list[float]            # idle fraction of the makespan, per rank
    peak_activations: list[int]    # most forwards whose backward has not run yet, per rank
    start: dict                    # (rank, index) -> start time
    end: dict

    @property
    def bubble_fraction(self) -> float:
        return sum(self.bubble) / len(self.bubble)


def unit_costs(schedule: Schedule) -> dict[str, float]:
    """Textbook action times: F=1, B=2 (B is the whole backward); F=B=W=1 where W is split off, so a
    zero-bubble schedule's bubble is not timed as if its weight gradients were free."""
    splits_w = any(a.kind == "W" for actions in schedule.ranks for a in actions)
    return {"F": 1.0, "B": 1.0, "W": 1.0} if splits_w else {"F": 1.0, "B": 2.0}


def simulate(schedule: Schedule, cost: dict[str, float] | None = None, order=None, pairs=()) -> Simulation:
    """Check `schedule` and time it. `cost[kind]` is the time of one action of a stage (split over
    its V chunks); `cost[f"{kind}{chunk}"]`, where given, is one chunk's own time (measured costs), and
    `cost[str(action)]` ("B0:7"), where given, that one action's.

    Point-to-point, without `order`: free, sends never block, and a receive waits for its send
    where the schedule has it. With `order` (each rank's actions in the order its program issues
    them, `issue_order`), transfers are timed as NCCL runs them: each message takes `cost["P2P"]`
    (default 0); the messages between two ranks go one at a time, in issue order (one stream per
    pair of ranks; `check_point_to_point` proves the order matches); each end starts its transfer
    only once the compute issued before it on that rank is done; and compute that reads a received
    value waits for its transfer where it first reads it, not where the receive was issued. `pairs` (each
    rank's pairs of actions that run interleaved, `combine_pairs`): the first of a pair also waits
    for everything the second waits for, its receives included, as `check_point_to_point` has it.

    ZeRO's collectives (U, G; `add_zero_actions`) run on a communication stream of their own per
    rank, one after the other, each issued once the compute action before it in the rank's list is
    done (`cost["U"]`, `cost["G"]`, default 0: free); R is free. A compute action of chunk c waits
    for the all-gather of its U c, and OPT for every collective of its rank. OPT, the optimizer
    phase, takes `cost["OPT"]` (default 0; the same on every rank). Only compute (F, B, W, OPT)
    counts as busy: communication that compute cannot hide shows as bubble. A kind of compute that
    `cost` does not give takes its `unit_costs(schedule)` time."""
    cost = {"W": 0.0, **unit_costs(schedule), **(cost or {})}  # a kind `cost` does not give: textbook
    check_zero_actions(schedule)
    ranks = schedule.ranks if order is None else tuple(order)
    if order is not None and [sorted(map(str, a)) for a in ranks] != [sorted(map(str, a)) for a in schedule.ranks]:
        raise FxShardError(f"the issue order given is not an order of {schedule.name or 'the schedule'}'s own "
                           f"actions on every rank (issue_order(schedule) makes one)")
    graph = nx.DiGraph()
    where, streams, gates = _chain_ranks(graph, ranks, timed_transfers=order is not None)
    _check_compute_actions(schedule, where)  # first: the checks below name transfers a missing chunk implies
    _add_data_dependencies(graph, schedule, where)
    _add_pairs_and_streams(graph, where, pairs, streams, gates)
    _check_complete(graph, schedule, where)
    start, end = _times(graph, schedule, cost, timed_transfers=order is not None)
    makespan = max(end.values())
    bubble, peaks = [], []
    for rank, actions in enumerate(ranks):
        busy = sum(end[rank, i] - start[rank, i] for i, a in enumerate(actions) if a.kind in COMPUTE + ("OPT",))
        bubble.append(1 - busy / makespan if makespan else 0.0)
        frees = "W" if any(a.kind == "W" for a in actions) else "B"  # activations live until the weight gradient
        live = peak = 0
        for action in actions:
            live += action.kind == "F"
            live -= action.kind == frees
            peak = max(peak, live)
        peaks.append(peak)
    return Simulation(makespan, bubble, peaks, start, end)


def _chain_ranks(graph: nx.DiGraph, ranks, timed_transfers: bool):
    """Add every rank's actions to `graph` as nodes (rank, index), each compute action after the one
    before it on its rank, each U / G on the rank's communication stream after the collective and
    the compute action before it, each compute action after its chunk's latest U, OPT after the
    rank's last collective. With `timed_transfers`, sends and receives stay out of the compute chain:
    they are queued on their pair's stream, gated by the compute issued before them.
    Returns (where: action key -> node, streams: (rank, peer) -> transfers in issue order, gates:
    transfer -> the compute node issued before it)."""
    where: dict[tuple, tuple[int, int]] = {}
    streams: dict[tuple[int, int], list[tuple[int, int]]] = {}
    gates: dict[tuple[int, int], tuple[int, int]] = {}
    for rank, actions in enumerate(ranks):
        previous = collective = computed = None  # the rank's last action in order, collective, compute action
        gathered: dict[int, tuple[int, int]] = {}  # chunk -> the node of its latest U
        seen: dict[Action, int] = {}
        for index, action in enumerate(actions):
            node = (rank, index)
            if action.kind in ZERO:  # once per chunk and window: keyed by how many came before on the rank
                seen[action] = seen.get(action, -1) + 1
                key = (action.kind, action.chunk, seen[action], rank)
            else:
                key = (action.kind, action.chunk, action.mb, rank if action.kind == "OPT" else None)
            if key in where:
                raise FxShardError(f"{action} appears twice (rank {rank} and rank {where[key][0]})")
            where[key] = node
            graph.add_node(node, action=action)
            if action.kind in ("U", "G"):  # the communication stream
                for source in (collective, computed):
                    if source is not None:
                        graph.add_edge(source, node)
                collective = node
                if action.kind == "U":
                    gathered[action.chunk] = node
                continue
            if timed_transfers and action.kind in TRANSFERS:  # on the pair's stream, not in the compute chain
                streams.setdefault((rank, action.peer), []).append(node)
                if computed is not None:
                    gates[node] = computed
                continue
            if previous is not None:
                graph.add_edge(previous, node)
            previous = node
            if action.kind in COMPUTE:
                computed = node
                if action.chunk in gathered:
                    graph.add_edge(gathered[action.chunk], node)
            if action.kind == "OPT" and collective is not None:
                graph.add_edge(collective, node)
    return where, streams, gates


def _add_data_dependencies(graph: nx.DiGraph, schedule: Schedule, where: dict) -> None:
    """Check that each action runs on its chunk's rank and each send or receive names the rank of the
    chunk on its other end; add an edge from what each action reads (its input activation, its
    output gradient, its own forward, the matching send) to it."""
    chunks = schedule.chunks

    def need(node, kind, chunk, mb, why):
        source = where.get((kind, chunk, mb, None))
        if source is None:
            raise FxShardError(f"{graph.nodes[node]['action']} on rank {node[0]} needs {kind}{chunk}:{mb} "
                               f"({why}), which no rank runs")
        graph.add_edge(source, node)

    for node, data in list(graph.nodes(data=True)):
        action, rank = data["action"], node[0]
        c, mb = action.chunk, action.mb
        if action.kind in COMPUTE + ("SF", "SB", "RF", "RB") and schedule.rank_of(c) != rank:
            raise FxShardError(f"{action} runs on rank {rank}, but chunk {c} lives on rank {schedule.rank_of(c)}")
        if action.kind in ("SF", "SB", "RF", "RB") and (action.peer is None or action.peer == rank):
            raise FxShardError(f"{action} on rank {rank} names {'no peer' if action.peer is None else 'its own rank'}: "
                               f"a send or receive moves a chunk's activation or gradient to or from the rank "
                               f"of the next or previous chunk (add_communication inserts them)")
        if action.kind in ("SF", "SB", "RF", "RB"):
            other = c + 1 if action.kind in ("SF", "RB") else c - 1  # the chunk on the other end
            if not 0 <= other < chunks or action.peer != schedule.rank_of(other):
                raise FxShardError(f"{action} on rank {rank} names peer {action.peer}, but chunk {c}'s "
                                   f"{'next' if action.kind in ('SF', 'RB') else 'previous'} chunk "
                                   f"{other if 0 <= other < chunks else '(none)'} lives on "
                                   f"{schedule.rank_of(other) if 0 <= other < chunks else 'no rank'}")
        if action.kind == "F" and c > 0:
            if schedule.rank_of(c - 1) != rank:
                need(node, "RF", c, mb, "its input activation")
            else:
                need(node, "F", c - 1, mb, "its input activation")
        elif action.kind == "B":
            need(node, "F", c, mb, "its own forward")
            if c < chunks - 1:
                if schedule.rank_of(c + 1) != rank:
                    need(node, "RB", c, mb, "the output gradient")
                else:
                    need(node, "B", c + 1, mb, "the output gradient")
        elif action.kind == "W":
            need(node, "B", c, mb, "its input-gradient pass")
        elif action.kind == "RF":
            need(node, "SF", c - 1, mb, "the matching send")
        elif action.kind == "RB":
            need(node, "SB", c + 1, mb, "the matching send")
        elif action.kind == "SF":
            need(node, "F", c, mb, "the value it sends")
        elif action.kind == "SB":
            need(node, "B", c, mb, "the value it sends")


def _add_pairs_and_streams(graph: nx.DiGraph, where: dict, pairs, streams: dict, gates: dict) -> None:
    """The first action of each interleaved pair waits for everything the second waits for; the
    messages between two ranks go one at a time in issue order (a message is its receive: it ends
    when the data is there), each starting once the compute issued before its transfer is done."""
    for mine in pairs:
        for first, second in mine:
            head, tail = (where[(a.kind, a.chunk, a.mb, None)] for a in (first, second))
            for source in list(graph.predecessors(tail)):
                if source != head:
                    graph.add_edge(source, head)
    for (rank, peer), transfers in streams.items():
        message = [node if graph.nodes[node]["action"].kind in ("RF", "RB") else _receive_of(where, graph, node)
                   for node in transfers]
        for node, arrives in zip(transfers, message):
            if node in gates:
                graph.add_edge(gates[node], arrives if node == arrives else node)
        for earlier, later in zip(message, message[1:]):
            graph.add_edge(earlier, later)


def _check_compute_actions(schedule: Schedule, where: dict) -> None:
    """Every chunk's F and B of every microbatch is run, and no compute action names a chunk or
    microbatch the schedule does not have (its `virtual` x stages chunks, its `microbatches`)."""
    chunks, microbatches = schedule.chunks, schedule.microbatches
    named = f"schedule {schedule.name}" if schedule.name else "the schedule"
    expected = {(k, c, mb) for k in ("F", "B") for c in range(chunks) for mb in range(microbatches)}
    present = {(k, c, mb) for (k, c, mb, _) in where if k in ("F", "B", "W")}
    beyond = sorted(f"{k}{c}:{mb}" for k, c, mb in present if not (0 <= c < chunks and 0 <= mb < microbatches))
    if beyond:
        raise FxShardError(f"{named} has {chunks} chunks ({schedule.stages} stages x "
                           f"{schedule.virtual} virtual) and {microbatches} microbatches, but names actions beyond "
                           f"them, e.g. {beyond[:5]}: give the Schedule the sizes its actions use")
    missing = sorted(f"{k}{c}:{mb}" for k, c, mb in expected - present)
    if missing:
        raise FxShardError(f"{named} misses compute actions, e.g. {missing[:5]} (every chunk "
                           f"of its {chunks} runs F and B for each of its {microbatches} microbatches)")


def _check_complete(graph: nx.DiGraph, schedule: Schedule, where: dict) -> None:
    """A rank with W's has one W per B, and the dependencies have no cycle (a cycle is a deadlock:
    it is named)."""
    for rank, actions in enumerate(schedule.ranks):  # a rank with W's computes every weight gradient in a W
        weights = sorted((a.chunk, a.mb) for a in actions if a.kind == "W")
        inputs = sorted((a.chunk, a.mb) for a in actions if a.kind == "B")
        if weights and weights != inputs:
            lacking = sorted(set(inputs) - set(weights))[:5]
            extra = sorted(w for w in set(weights) if weights.count(w) > 1 or w not in inputs)[:5]
            raise FxShardError(f"rank {rank} splits weight gradients off its B's (it has W actions), but not one W per "
                               f"B: B's with no W (chunk, microbatch) {lacking}, W's duplicated or without a B {extra}")
    if not nx.is_directed_acyclic_graph(graph):
        cycle = nx.find_cycle(graph)
        raise FxShardError("deadlock: " + " -> ".join(f"r{r}:{graph.nodes[(r, i)]['action']}" for (r, i), _ in cycle))


def _times(graph: nx.DiGraph, schedule: Schedule, cost: dict, timed_transfers: bool):
    """(start, end): node -> time, each node starting when its last predecessor ends. An action takes
    its own time (`cost["F0:3"]`), else its chunk's (`cost["F0"]`), else its kind's split over the V
    chunks; OPT `cost["OPT"]`, a timed receive `cost["P2P"]`, anything else nothing."""
    start, end = {}, {}
    for node in nx.topological_sort(graph):
        action = graph.nodes[node]["action"]
        own = f"{action.kind}{action.chunk}"
        if action.kind == "OPT":
            duration = cost.get("OPT", 0.0)
        elif action.kind in ("RF", "RB") and timed_transfers:
            duration = cost.get("P2P", 0.0)
        elif action.kind not in COMPUTE + ("U", "G"):
            duration = 0.0
        elif str(action) in cost:  # one action's own time ("F0:3": measured, microbatch by microbatch)
            duration = cost[str(action)]
        elif own in cost:
            duration = cost[own]
        else:
            duration = cost.get(action.kind, 0.0) / schedule.virtual
        start[node] = max((end[p] for p in graph.predecessors(node)), default=0.0)
        end[node] = start[node] + duration
    return start, end


def _receive_of(where: dict, graph: nx.DiGraph, send: tuple[int, int]) -> tuple[int, int]:
    """The node of the receive that matches `send`."""
    action = graph.nodes[send]["action"]
    kind, chunk, mb = matching(action)
    receive = where.get((kind, chunk, mb, None))
    if receive is None:
        raise FxShardError(f"{action} on rank {send[0]} has no matching receive {kind}{chunk}:{mb} on any rank")
    return receive
