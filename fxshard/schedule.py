"""Pipeline schedules as data: per-rank action lists, their generators, and a simulator.

An action is one short token: `F1:3` (forward of chunk 1, microbatch 3), `B1:3` (its input
gradient, or the whole backward when W is not split off), `W1:3` (weight gradient), `SF1:3>2` /
`RF1:3<0` (send / receive of chunk 1's microbatch-3 activation to / from rank 2 / 0), `SB…`/`RB…`
for activation gradients, and `OPT`. P×V chunks for V virtual stages; the schedule's placement says which
rank holds each (`Schedule.rank_of`).

Generators: `gpipe`, `one_f_one_b`, `interleaved_one_f_one_b` (Megatron's order), `zero_bubble_h1`,
`dualpipe_v` (V placement). `simulate` checks
a schedule without running a model (every dependency satisfied, no deadlock) and reports makespan,
bubble fraction and peak live activations per rank.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass

import networkx as nx

from .errors import FxShardError

COMPUTE = ("F", "B", "W")
PLACEMENTS = ("loop", "v")


@dataclass(frozen=True)
class Action:
    kind: str                # F, B, W, SF, RF, SB, RB, OPT
    chunk: int = -1
    mb: int = -1
    peer: int | None = None  # the other rank of a send / receive

    def __str__(self) -> str:
        if self.kind == "OPT":
            return "OPT"
        token = f"{self.kind}{self.chunk}:{self.mb}"
        if self.peer is not None:
            token += (">" if self.kind.startswith("S") else "<") + str(self.peer)
        return token

    @classmethod
    def parse(cls, token: str) -> "Action":
        if token == "OPT":
            return cls("OPT")
        peer = None
        for mark in "<>":
            if mark in token:
                token, peer_text = token.split(mark)
                peer = int(peer_text)
        kind = next(k for k in ("SF", "RF", "SB", "RB", "F", "B", "W") if token.startswith(k))
        chunk, mb = token[len(kind):].split(":")
        return cls(kind, int(chunk), int(mb), peer)


def place(chunk: int, stages: int, placement: str) -> int:
    """The rank holding `chunk` = v*P + i: rank i under "loop"; under "v" the odd rounds walk back,
    rank P-1-i, so with V=2 rank r holds chunks r and 2P-1-r (first and last chunk on rank 0)."""
    v, i = divmod(chunk, stages)
    return stages - 1 - i if placement == "v" and v % 2 else i


@dataclass(frozen=True)
class Schedule:
    """`ranks[r]` is rank r's ordered actions; P ranks, V chunks per rank, M microbatches, and the
    placement of chunks on ranks ("loop" or "v", see `place`); `rank_of` is the one source of it."""

    ranks: tuple[tuple[Action, ...], ...]
    stages: int
    virtual: int
    microbatches: int
    name: str = ""
    placement: str = "loop"

    def __post_init__(self):
        if self.placement not in PLACEMENTS:
            raise FxShardError(f"Schedule placement {self.placement!r}; choose one of {PLACEMENTS} (\"v\": rank r "
                               f"holds chunks r and 2P-1-r)")

    @property
    def chunks(self) -> int:
        return self.stages * self.virtual

    def rank_of(self, chunk: int) -> int:
        return place(chunk, self.stages, self.placement)

    def __str__(self) -> str:
        return "\n".join(f"rank {r}: " + " ".join(map(str, actions)) for r, actions in enumerate(self.ranks))

    def to_json(self) -> str:
        return json.dumps({"name": self.name, "stages": self.stages, "virtual": self.virtual,
                           "microbatches": self.microbatches, "placement": self.placement,
                           "ranks": [[str(a) for a in actions] for actions in self.ranks]})

    @classmethod
    def from_json(cls, text: str) -> "Schedule":
        data = json.loads(text)
        return cls(tuple(tuple(Action.parse(t) for t in actions) for actions in data["ranks"]),
                   data["stages"], data["virtual"], data["microbatches"], data["name"],
                   data.get("placement", "loop"))  # written before placements existed: loop


def _check(stages: int, virtual: int, microbatches: int) -> None:
    if stages < 1 or virtual < 1 or microbatches < 1:
        raise FxShardError(f"pipeline sizes must be >= 1, got P={stages}, V={virtual}, M={microbatches}")


def add_communication(order: list[list[Action]], stages: int, virtual: int, microbatches: int,
                      name: str, placement: str = "loop") -> Schedule:
    """Insert the receive before and the send after every compute action whose neighbour chunk lives
    on another rank (under `placement`), and the optimizer step at the end."""
    chunks = stages * virtual
    ranks = []
    for rank, actions in enumerate(order):
        out = []
        for action in actions:
            c, mb = action.chunk, action.mb
            before, after = place(c - 1, stages, placement), place(c + 1, stages, placement)
            if action.kind == "F" and c > 0 and before != rank:
                out.append(Action("RF", c, mb, before))
            if action.kind == "B" and c < chunks - 1 and after != rank:
                out.append(Action("RB", c, mb, after))
            out.append(action)
            if action.kind == "F" and c < chunks - 1 and after != rank:
                out.append(Action("SF", c, mb, after))
            if action.kind == "B" and c > 0 and before != rank:
                out.append(Action("SB", c, mb, before))
        out.append(Action("OPT"))
        ranks.append(tuple(out))
    return Schedule(tuple(ranks), stages, virtual, microbatches, name, placement)


def gpipe(stages: int, microbatches: int, virtual: int = 1) -> Schedule:
    """All forwards (chunk by chunk), then all backwards in reverse."""
    _check(stages, virtual, microbatches)
    order = []
    for rank in range(stages):
        local = [v * stages + rank for v in range(virtual)]
        order.append([Action("F", c, mb) for c in local for mb in range(microbatches)] +
                     [Action("B", c, mb) for c in reversed(local) for mb in range(microbatches)])
    return add_communication(order, stages, virtual, microbatches, "gpipe")


def one_f_one_b(stages: int, microbatches: int) -> Schedule:
    """Rank r runs P-r-1 warm-up forwards, then alternates one forward and one backward."""
    _check(stages, 1, microbatches)
    order = []
    for rank in range(stages):
        warmup = min(stages - rank - 1, microbatches)
        actions = [Action("F", rank, mb) for mb in range(warmup)]
        for mb in range(microbatches - warmup):
            actions += [Action("F", rank, warmup + mb), Action("B", rank, mb)]
        actions += [Action("B", rank, mb) for mb in range(microbatches - warmup, microbatches)]
        order.append(actions)
    return add_communication(order, stages, 1, microbatches, "1f1b")


def interleaved_one_f_one_b(stages: int, microbatches: int, virtual: int) -> Schedule:
    """Megatron's interleaved 1F1B: microbatches advance through a rank's V chunks in groups of P;
    warm-up (P-r-1)*2 + (V-1)*P forwards, then 1F1B, then the remaining backwards."""
    _check(stages, virtual, microbatches)
    if virtual > 1 and microbatches % stages:
        raise FxShardError(f"interleaved 1F1B needs microbatches ({microbatches}) divisible by the "
                           f"pipeline size ({stages}); use M in {[stages * k for k in range(1, 5)]}")
    total = microbatches * virtual

    def unit(k: int, forward: bool) -> tuple[int, int]:
        group = k // stages
        v = group % virtual if forward else virtual - 1 - group % virtual
        return v, (group // virtual) * stages + k % stages

    order = []
    for rank in range(stages):
        def forward(k):
            v, mb = unit(k, True)
            return Action("F", v * stages + rank, mb)

        def backward(k):
            v, mb = unit(k, False)
            return Action("B", v * stages + rank, mb)

        warmup = min((stages - rank - 1) * 2 + (virtual - 1) * stages, total) if virtual > 1 else \
            min(stages - rank - 1, total)
        actions = [forward(k) for k in range(warmup)]
        for k in range(total - warmup):
            actions += [forward(warmup + k), backward(k)]
        actions += [backward(k) for k in range(total - warmup, total)]
        order.append(actions)
    return add_communication(order, stages, virtual, microbatches, f"interleaved-1f1b(V={virtual})")


def zero_bubble_h1(stages: int, microbatches: int) -> Schedule:
    """A ZB-H1-style schedule (Qi et al., "Zero Bubble Pipeline Parallelism"): 1F1B's order of F and
    B, with each backward split into B (input gradient, which the previous stage waits for) and W
    (weight gradient, which nobody waits for). A rank runs a pending W whenever its next F or B
    would otherwise wait, and keeps at most P - r - 1 W's pending so its live activations stay
    within 1F1B's bound. Built greedily under unit costs (F = B = W = 1, communication free)."""
    _check(stages, 1, microbatches)
    plans = [[a for a in one_f_one_b(stages, microbatches).ranks[r] if a.kind in ("F", "B")] for r in range(stages)]
    done: dict[tuple[str, int, int], float] = {}
    clock, position = [0.0] * stages, [0] * stages
    pending: list[list[int]] = [[] for _ in range(stages)]
    order: list[list[Action]] = [[] for _ in range(stages)]

    def ready_at(rank: int) -> float:
        action = plans[rank][position[rank]]
        c, mb = action.chunk, action.mb
        needs = [("F", c - 1, mb)] if action.kind == "F" and c > 0 else []
        if action.kind == "B":
            needs = [("F", c, mb)] + ([("B", c + 1, mb)] if c + 1 < stages else [])
        times = [done.get(key) for key in needs]
        return float("inf") if None in times else max(times, default=0.0)

    while any(position[r] < len(plans[r]) for r in range(stages)):
        choices = []
        for rank in range(stages):
            if position[rank] >= len(plans[rank]):
                continue
            start = max(clock[rank], ready_at(rank))
            must_drain = len(pending[rank]) > max(stages - rank - 1, 0)
            if pending[rank] and (start > clock[rank] or must_drain):
                choices.append((clock[rank], rank, "W"))
            elif start < float("inf"):
                choices.append((start, rank, "next"))
        start, rank, what = min(choices)
        if what == "W":
            mb = pending[rank].pop(0)
            order[rank].append(Action("W", rank, mb))
        else:
            action = plans[rank][position[rank]]
            position[rank] += 1
            order[rank].append(action)
            done[action.kind, action.chunk, action.mb] = start + 1.0
            if action.kind == "B":
                pending[rank].append(action.mb)
        clock[rank] = start + 1.0
    for rank in range(stages):
        order[rank] += [Action("W", rank, mb) for mb in pending[rank]]
    return add_communication(order, stages, 1, microbatches, "zb-h1")


def dualpipe_v(stages: int, microbatches: int) -> Schedule:
    """DualPipeV (DeepSeek's DualPipe folded into a V; torch.distributed.pipelining's
    ScheduleDualPipeV) with B / W split as in zero bubble. Two chunks per rank in V placement: rank r
    runs chunk r on the way down and chunk 2P-1-r on the way back up (phases 0 and 1), so the first
    and last chunk (embedding and loss) share rank 0 and the turn (chunks P-1, P) is local to rank
    P-1. Rank r's actions, phase by phase (`F0` a forward of phase 0's chunk; `B1` a whole backward,
    B then its W at once; `I1` a B whose W is queued; `W` the oldest queued W):

        2(P-r-1) x  F0            fill the way down
        r+1      x  F0 F1         reach the turn
        P-r-1    x  I1 W F1       first backwards; a W runs while the next activation arrives
        M-2P+r+1 x  F0 B1 F1 B0   steady state: each forward next to a backward of the other phase
                                  (DualPipe overlaps the pair; here they run one after the other)
        P-r-1    x  B1 F1 B0      the way down has no forwards left
        r+1      x  B1 B0         drain; the last r+1 of these 2(r+1) backwards are I, not B
        P-r-1    x  W I0
        r+1      x  W             the queued W's fill the tail

    Each phase's microbatches run in order 0..M-1. Needs M >= 2P-1, so that rank 0's steady state
    runs M-2P+1 >= 0 times (DeepSeek's and torch's DualPipeV ask for M >= 2P; 2P-1 passes the same
    checks). Live activations: at most 2P+1 chunk forwards per rank, a chunk being half a 1F1B
    stage (1F1B's first rank holds P stages' worth)."""
    _check(stages, 2, microbatches)
    if microbatches < 2 * stages - 1:
        raise FxShardError(f"dualpipev needs at least 2 x pp - 1 microbatches, got M={microbatches} for "
                           f"pp={stages}; use Config(microbatches=M) with M >= {2 * stages - 1}, e.g. {2 * stages}")
    order = []
    for rank in range(stages):
        rest, turn = stages - rank - 1, rank + 1
        drain = ["B1", "B0"] * turn
        drain[turn:] = ["I" + token[1] for token in drain[turn:]]
        tokens = (["F0"] * 2 * rest + ["F0", "F1"] * turn + ["I1", "W", "F1"] * rest
                  + ["F0", "B1", "F1", "B0"] * (microbatches - 2 * stages + turn) + ["B1", "F1", "B0"] * rest
                  + drain + ["W", "I0"] * rest + ["W"] * turn)
        order.append(_expand_phases(tokens, (rank, 2 * stages - 1 - rank)))
    return add_communication(order, stages, 2, microbatches, "dualpipev", placement="v")


def _expand_phases(tokens: list[str], chunks: tuple[int, int]) -> list[Action]:
    """`dualpipe_v`'s tokens as actions: each phase's forwards and backwards take its microbatches in
    order; a `W` takes the oldest weight gradient an `I` left queued."""
    forwards, backwards, queued, actions = [0, 0], [0, 0], [], []
    for token in tokens:
        if token == "W":
            actions.append(Action("W", *queued.pop(0)))
            continue
        phase = int(token[1])
        chunk = chunks[phase]
        if token[0] == "F":
            actions.append(Action("F", chunk, forwards[phase]))
            forwards[phase] += 1
            continue
        mb = backwards[phase]
        backwards[phase] += 1
        actions.append(Action("B", chunk, mb))
        if token[0] == "B":
            actions.append(Action("W", chunk, mb))
        else:
            queued.append((chunk, mb))
    return actions


def build(name: str, stages: int, microbatches: int, virtual: int = 1) -> Schedule:
    """The schedule `Config(schedule=name)` names (fxshard.config.PIPELINE_SCHEDULES)."""
    if name == "gpipe":
        return gpipe(stages, microbatches, virtual)
    if name == "zb-h1":
        if virtual != 1:
            raise FxShardError("schedule='zb-h1' runs one chunk per rank; leave virtual_stages=1")
        return zero_bubble_h1(stages, microbatches)
    if name == "dualpipev":
        if virtual != 2:
            raise FxShardError(f"schedule='dualpipev' runs two chunks per rank (V placement), got virtual_stages="
                               f"{virtual}; use virtual_stages=2 (Config sets it when left at 1)")
        return dualpipe_v(stages, microbatches)
    if name == "1f1b" and virtual == 1:
        return one_f_one_b(stages, microbatches)
    if name in ("1f1b", "interleaved-1f1b"):
        return interleaved_one_f_one_b(stages, microbatches, virtual)
    raise FxShardError(f"unknown pipeline schedule {name!r}")


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


def simulate(schedule: Schedule, cost: dict[str, float] | None = None) -> Simulation:
    """Check `schedule` and time it. `cost[kind]` is the time of one action of a stage (split over
    its V chunks); `cost[f"{kind}{chunk}"]`, where given, is one chunk's own time (measured costs).
    Communication is free and sends never block; a receive waits for its send."""
    cost = {"F": 1.0, "B": 2.0, "W": 0.0, **(cost or {})}
    graph = nx.DiGraph()
    where: dict[Action, tuple[int, int]] = {}
    for rank, actions in enumerate(schedule.ranks):
        for index, action in enumerate(actions):
            key = (action.kind, action.chunk, action.mb, rank if action.kind == "OPT" else None)
            if key in where:
                raise FxShardError(f"{action} appears twice (rank {rank} and rank {where[key][0]})")
            where[key] = (rank, index)
            graph.add_node((rank, index), action=action)
            if index:
                graph.add_edge((rank, index - 1), (rank, index))
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
        if action.kind in COMPUTE and schedule.rank_of(c) != rank:
            raise FxShardError(f"{action} runs on rank {rank}, but chunk {c} lives on rank {schedule.rank_of(c)}")
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
    expected = {(k, c, mb) for k in ("F", "B") for c in range(chunks) for mb in range(schedule.microbatches)}
    present = {(k, c, mb) for (k, c, mb, _) in where if k in ("F", "B")}
    if present != expected:
        missing = sorted(expected - present)[:5]
        raise FxShardError(f"schedule misses compute actions, e.g. {missing}")
    if not nx.is_directed_acyclic_graph(graph):
        cycle = nx.find_cycle(graph)
        raise FxShardError("deadlock: " + " -> ".join(f"r{r}:{graph.nodes[(r, i)]['action']}" for (r, i), _ in cycle))
    start, end = {}, {}
    for node in nx.topological_sort(graph):
        action = graph.nodes[node]["action"]
        own = f"{action.kind}{action.chunk}"
        if action.kind not in COMPUTE:
            duration = 0.0
        elif own in cost:
            duration = cost[own]
        else:
            duration = cost.get(action.kind, 0.0) / schedule.virtual
        start[node] = max((end[p] for p in graph.predecessors(node)), default=0.0)
        end[node] = start[node] + duration
    makespan = max(end.values())
    bubble, peaks = [], []
    for rank, actions in enumerate(schedule.ranks):
        busy = sum(end[rank, i] - start[rank, i] for i in range(len(actions)))
        bubble.append(1 - busy / makespan if makespan else 0.0)
        frees = "W" if any(a.kind == "W" for a in actions) else "B"  # activations live until the weight gradient
        live = peak = 0
        for action in actions:
            live += action.kind == "F"
            live -= action.kind == frees
            peak = max(peak, live)
        peaks.append(peak)
    return Simulation(makespan, bubble, peaks, start, end)


def _matching(action: Action) -> tuple[str, int, int]:
    """The (kind, chunk, mb) of the other side of a transfer: SF c:m pairs with RF c+1:m, SB c:m with RB c-1:m."""
    kind, c, mb = action.kind, action.chunk, action.mb
    return {"SF": ("RF", c + 1, mb), "RF": ("SF", c - 1, mb), "SB": ("RB", c - 1, mb), "RB": ("SB", c + 1, mb)}[kind]


def issue_order(schedule: Schedule) -> tuple[tuple[Action, ...], ...]:
    """Each rank's actions in the order its lowered program issues them.

    Compute and sends stay where the schedule has them. Between two ranks, transfers follow one
    order on both sides: messages sorted by when their sender produces them (`simulate`'s times;
    a message whose producer depends on another message is produced strictly after it). Each
    receive moves up to right after the previous transfer with the same peer in that order: issued
    early, waited on where its data is first read. That is what in-order matching per pair of
    ranks needs (NCCL runs a pair's sends and receives on one stream, in issue order);
    `check_point_to_point` proves the result deadlock-free."""
    timing = simulate(schedule)
    messages: dict[frozenset, list] = {}
    for rank, actions in enumerate(schedule.ranks):
        for index, action in enumerate(actions):
            if action.kind in ("SF", "SB"):
                key = (timing.end[rank, index], rank, index)  # a sender's sends in the order it issues them
                messages.setdefault(frozenset((rank, action.peer)), []).append((key, rank, action))
    after: dict[tuple[int, Action | None], list[Action]] = {}  # (rank, anchor send or None) -> receives
    for pair, sends in messages.items():
        anchors = {rank: None for rank in pair}
        for _, sender, action in sorted(sends, key=lambda item: item[0]):
            (receiver,) = pair - {sender} if len(pair) == 2 else (sender,)
            kind, chunk, mb = _matching(action)
            after.setdefault((receiver, anchors[receiver]), []).append(Action(kind, chunk, mb, sender))
            anchors[sender] = action
    order = []
    for rank, actions in enumerate(schedule.ranks):
        out = list(after.get((rank, None), []))
        for action in actions:
            if action.kind in ("RF", "RB"):
                continue
            out.append(action)
            out.extend(after.get((rank, action), []))
        order.append(tuple(out))
    return tuple(order)


def _pairable(first: Action, second: Action) -> bool:
    """A forward and a backward of different microbatches (neither reads the other), in either order."""
    return {first.kind, second.kind} == {"F", "B"} and first.mb != second.mb


def pair_actions(schedule: Schedule, pairs) -> Schedule:
    """`schedule` with each rank's `pairs` (two compute actions that follow each other among its
    compute actions) made adjacent: the transfers between them move out, receives before the
    pair and sends after it."""
    ranks = []
    for actions, rank_pairs in zip(schedule.ranks, pairs):
        actions = list(actions)
        for first, second in rank_pairs:
            start, end = actions.index(first), actions.index(second)
            while start > 0 and actions[start - 1].kind in ("RF", "RB"):  # the first one's receive
                start -= 1
            between = actions[start:end + 1]
            receives = [a for a in between if a.kind in ("RF", "RB")]
            sends = [a for a in between if a.kind in ("SF", "SB")]
            actions[start:end + 1] = [*receives, first, second, *sends]
        ranks.append(tuple(actions))
    return dataclasses.replace(schedule, ranks=tuple(ranks))


@functools.lru_cache(maxsize=16)
def combine_pairs(schedule: Schedule) -> tuple[Schedule, tuple[tuple[tuple[Action, Action], ...], ...]]:
    """Megatron's combined 1F1B inside a pipeline: on each rank, a forward and a backward of another
    microbatch that follow each other among its compute actions (1F1B's steady state: F m+w next
    to B m, or B m next to F m+1 on the last stage) become a pair, which the `interleave` pass runs
    interleaved at the MoE all-to-alls so that each one's all-to-alls run under the other's compute.

    The pair's transfers move out of it (`pair_actions`): both receives before it, both sends after
    it, so a forward's activation now leaves after the pair. Returns the reordered schedule (named
    "<name>+combined") and each rank's pairs in order. A pair is only made where
    `check_point_to_point` still proves the whole order deadlock-free with both receives waited on
    before the pair starts: pairs are taken greedily, rank by rank (a rank's pairs at once where
    they hold, else one by one), and one that would close a cycle (GPipe's turn, 1F1B's last
    stage) is left unpaired."""
    candidates = []
    for actions in schedule.ranks:
        compute, mine, index = [a for a in actions if a.kind in COMPUTE], [], 0
        while index + 1 < len(compute):
            if _pairable(compute[index], compute[index + 1]):
                mine.append((compute[index], compute[index + 1]))
                index += 2
            else:
                index += 1
        candidates.append(mine)

    def holds(pairs) -> bool:
        combined = pair_actions(schedule, pairs)
        try:
            check_point_to_point(combined, issue_order(combined), pairs)
        except FxShardError:
            return False
        return True

    chosen = candidates
    if not holds(candidates):  # a rank's candidates as a block where they hold, else one by one
        chosen = [[] for _ in candidates]
        for rank, mine in enumerate(candidates):
            chosen[rank] = list(mine)
            if holds(chosen):
                continue
            chosen[rank] = []
            for pair in mine:
                chosen[rank].append(pair)
                if not holds(chosen):
                    chosen[rank].pop()
    pairs = tuple(tuple(mine) for mine in chosen)
    combined = pair_actions(schedule, pairs)
    return dataclasses.replace(combined, name=f"{schedule.name}+combined"), pairs


def check_point_to_point(schedule: Schedule, order: tuple[tuple[Action, ...], ...], pairs=()) -> None:
    """Raise FxShardError unless `order` (each rank's actions in issue order) runs to the end when
    every pair of ranks matches its transfers in issue order, one at a time (a send completes only
    together with its receive, and only once its value is computed), and each rank computes in
    order, waiting for the receives its compute reads: the model of NCCL point-to-point. A send is
    issued after the compute before it in the rank's order. `pairs` (each rank's pairs of actions
    from `combine_pairs`, run interleaved): the first action of a pair waits for both actions'
    receives."""
    chunks = schedule.chunks
    compute = [[a for a in actions if a.kind in COMPUTE] for actions in order]
    transfers = {(rank, peer): [a for a in actions if a.peer == peer and a.kind in ("SF", "SB", "RF", "RB")]
                 for rank, actions in enumerate(order) for peer in range(schedule.stages)}
    done: set[tuple[int, str, int, int]] = set()  # (rank, kind, chunk, mb)
    position = {key: 0 for key in [*transfers, *range(len(order))]}

    partner = {(rank, first): second for rank, mine in enumerate(pairs) for first, second in mine}
    gate = {}  # (rank, send) -> the compute action before it in the rank's order (None: nothing)
    for rank, actions in enumerate(order):
        last = None
        for action in actions:
            if action.kind in COMPUTE:
                last = action
            elif action.kind in ("SF", "SB"):
                gate[rank, action] = last

    def ready(rank: int, action: Action) -> bool:
        return all((rank, *need) in done for need in needs_of(rank, action) + (
            needs_of(rank, partner[rank, action]) if (rank, action) in partner else []))

    def needs_of(rank: int, action: Action) -> list[tuple[str, int, int]]:
        c, mb = action.chunk, action.mb
        needs = []
        if action.kind == "F" and c > 0:
            needs.append(("F", c - 1, mb) if schedule.rank_of(c - 1) == rank else ("RF", c, mb))
        if action.kind == "B":
            needs.append(("F", c, mb))
            if c < chunks - 1:
                needs.append(("B", c + 1, mb) if schedule.rank_of(c + 1) == rank else ("RB", c, mb))
        if action.kind == "W":
            needs.append(("B", c, mb))
        return needs

    while True:
        progressed = False
        for rank, actions in enumerate(compute):
            while position[rank] < len(actions) and ready(rank, actions[position[rank]]):
                action = actions[position[rank]]
                done.add((rank, action.kind, action.chunk, action.mb))
                position[rank] += 1
                progressed = True
        for (rank, peer), queue in transfers.items():
            if rank > peer or position[rank, peer] >= len(queue):
                continue
            other = transfers[peer, rank]
            mine = queue[position[rank, peer]]
            if position[peer, rank] >= len(other):
                continue
            theirs = other[position[peer, rank]]
            if _matching(mine) != (theirs.kind, theirs.chunk, theirs.mb):
                raise FxShardError(f"point-to-point out of order between ranks {rank} and {peer}: rank {rank}'s "
                                   f"next transfer is {mine}, rank {peer}'s is {theirs}")
            send, sender = (mine, rank) if mine.kind.startswith("S") else (theirs, peer)
            issued_after = gate[sender, send]
            if issued_after is None or (sender, issued_after.kind, issued_after.chunk, issued_after.mb) in done:
                for side, action in ((rank, mine), (peer, theirs)):
                    done.add((side, action.kind, action.chunk, action.mb))
                position[rank, peer] += 1
                position[peer, rank] += 1
                progressed = True
        if not progressed:
            break
    stuck = [f"rank {r}: {compute[r][position[r]]}" for r in range(len(order)) if position[r] < len(compute[r])]
    stuck += [f"rank {r} -> {p}: {q[position[r, p]]}" for (r, p), q in transfers.items() if position[r, p] < len(q)]
    if stuck:
        raise FxShardError(f"pipeline schedule {schedule.name} deadlocks with in-order point-to-point: "
                           + "; ".join(stuck))


_COLORS = {"F": "#6fa8dc", "B": "#e69138", "W": "#93c47d"}


def to_svg(schedule: Schedule, simulation: Simulation, scale: float = 24.0) -> str:
    """A timeline: one lane per rank, one block per compute action, labelled with its microbatch."""
    lane, width = 28, simulation.makespan * scale + 70
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" '
             f'height="{lane * len(schedule.ranks) + 30}" font-family="monospace" font-size="10">',
             f'<text x="4" y="{lane * len(schedule.ranks) + 20}">{schedule.name}: makespan '
             f'{simulation.makespan:g}, bubble {simulation.bubble_fraction:.1%}</text>']
    for rank, actions in enumerate(schedule.ranks):
        y = rank * lane + 4
        parts.append(f'<text x="2" y="{y + 16}">r{rank}</text>')
        for index, action in enumerate(actions):
            if action.kind not in _COLORS:
                continue
            x0, x1 = simulation.start[rank, index] * scale + 30, simulation.end[rank, index] * scale + 30
            parts.append(f'<rect x="{x0:.1f}" y="{y}" width="{max(x1 - x0, 1):.1f}" height="{lane - 6}" '
                         f'fill="{_COLORS[action.kind]}" stroke="#333"><title>{action}</title></rect>')
            parts.append(f'<text x="{x0 + 2:.1f}" y="{y + 15}">{action.kind}{action.mb}</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"
