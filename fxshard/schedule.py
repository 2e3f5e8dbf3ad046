"""Pipeline schedules as data: per-rank action lists, their generators, and a simulator.

An action is one short token: `F1:3` (forward of chunk 1, microbatch 3), `B1:3` (its input
gradient, or the whole backward when W is not split off), `W1:3` (weight gradient), `SF1:3>2` /
`RF1:3<0` (send / receive of chunk 1's microbatch-3 activation to / from rank 2 / 0), `SB…`/`RB…`
for activation gradients, and `OPT`. P×V chunks for V virtual stages; the schedule's placement says which
rank holds each (`Schedule.rank_of`).

ZeRO over the data-parallel axis adds per-chunk collectives of the dp group (torch.distributed.
pipelining's UNSHARD / RESHARD / REDUCE_GRAD): `U1` all-gathers chunk 1's parameters, `R1` frees
the gathered copy, `G1` reduces chunk 1's gradients (reduce-scatter, or all-reduce without sharded
optimizer state). `add_zero_actions` places them; `simulate` runs U and G on a communication
stream of their own, concurrent with compute.

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
TRANSFERS = ("SF", "RF", "SB", "RB")
ZERO = ("U", "R", "G")   # per-chunk collectives over dp: unshard, reshard, reduce-grad
PLACEMENTS = ("loop", "v")


@dataclass(frozen=True)
class Action:
    kind: str                # F, B, W, SF, RF, SB, RB, U, R, G, OPT
    chunk: int = -1
    mb: int = -1             # -1 for U / R / G: they act on a chunk once, not per microbatch
    peer: int | None = None  # the other rank of a send / receive

    def __str__(self) -> str:
        if self.kind == "OPT":
            return "OPT"
        if self.kind in ZERO:
            return f"{self.kind}{self.chunk}"
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
        kind = next((k for k in (*TRANSFERS, *COMPUTE, *ZERO) if token.startswith(k)), None)
        rest = token[len(kind or ""):]
        if kind in ZERO and rest.isdigit() and peer is None:
            return cls(kind, int(rest))
        chunk, _, mb = rest.partition(":")
        if kind is None or kind in ZERO or not (chunk.isdigit() and mb.isdigit()):
            raise FxShardError(f"schedule action {token!r}: write F1:3, B1:3, W1:3 (chunk:microbatch), SF1:3>2, "
                               f"RF1:3<0, SB / RB likewise (>peer, <peer), U1 / R1 / G1 (chunk) or OPT")
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


MAX_UNSHARDED = 2  # chunks a rank keeps gathered at once: 1F1B's steady state runs a forward and a backward


def add_zero_actions(schedule: Schedule, unshard: bool, prefetch: int = 1,
                     max_unsharded: int = MAX_UNSHARDED) -> Schedule:
    """`schedule` with the collectives ZeRO needs over dp as actions, per chunk and rank:

    G c   after chunk c's last gradient-producing action of the step (its last W, or its last B when
          the schedule does not split W off), once: the chunk's gradients are final there
    U c   with `unshard` (ZeRO-3): before chunk c's use, `prefetch` compute actions early, so that
          its all-gather runs under them; the chunk stays gathered (one U per step) unless more than
          `max_unsharded` chunks would be at once. Then the unsharded chunk used again latest is
          resharded (Belady's choice; a chunk is only evicted for one that is used sooner, and only
          after it was used), like torch.distributed.pipelining's max_active_stages
    R c   after the last use of each U c window: the gathered copy is free

    U goes before the receives that lead into its compute action, R and G after the sends that
    follow theirs: ZeRO's collectives never sit between a compute action and its transfers."""
    if prefetch < 0 or max_unsharded < 1:
        raise FxShardError(f"ZeRO actions need prefetch >= 0 and max_unsharded >= 1, got {prefetch} and "
                           f"{max_unsharded}")
    ranks = []
    for actions in schedule.ranks:
        compute = [i for i, a in enumerate(actions) if a.kind in COMPUTE]
        before: dict[int, list[Action]] = {}  # action position -> ZeRO actions right before / after it
        after: dict[int, list[Action]] = {}
        ends = []
        for chunk in dict.fromkeys(actions[i].chunk for i in compute):
            produces = "W" if any(actions[i].kind == "W" and actions[i].chunk == chunk for i in compute) else "B"
            ends.append((max(k for k, i in enumerate(compute) if actions[i].kind == produces and
                             actions[i].chunk == chunk), 0, Action("G", chunk)))
        if unshard:
            for chunk, opened, last in unshard_windows([actions[i].chunk for i in compute], prefetch, max_unsharded):
                before.setdefault(_lead_in(actions, compute[opened]), []).append(Action("U", chunk))
                ends.append((last, 1, Action("R", chunk)))
        for last, _, action in sorted(ends, key=lambda item: item[:2]):
            after.setdefault(_follow_up(actions, compute[last]), []).append(action)
        out = []
        for index, action in enumerate(actions):
            out += before.get(index, []) + [action] + after.get(index, [])
        ranks.append(tuple(out))
    return dataclasses.replace(schedule, ranks=tuple(ranks))


def unshard_windows(chunks: list[int], prefetch: int, max_unsharded: int) -> list[tuple[int, int, int]]:
    """For a rank's compute actions (the chunk of each, in order): the windows in which a chunk is
    gathered, as (chunk, index of the compute action it is gathered before, index of its last use in
    the window), in order of opening. See `add_zero_actions`."""
    uses: dict[int, list[int]] = {}
    for index, chunk in enumerate(chunks):
        uses.setdefault(chunk, []).append(index)

    def next_use(chunk: int, index: int) -> float:
        return next((u for u in uses[chunk] if u >= index), float("inf"))

    active: dict[int, int] = {}  # unsharded chunk -> where its window opened
    windows = []
    for index in range(len(chunks)):
        for chunk in dict.fromkeys(chunks[index:index + prefetch + 1]):  # needed now, then soonest first
            if chunk in active:
                continue
            if len(active) >= max_unsharded:
                used = [c for c in active if any(active[c] <= u < index for u in uses[c])]
                victim = max(used, key=lambda c: next_use(c, index), default=None)
                if victim is None or next_use(victim, index) <= next_use(chunk, index):
                    break  # the unsharded chunks are all needed sooner: gather this one later
                windows.append((victim, active.pop(victim), max(u for u in uses[victim] if u < index)))
            active[chunk] = index
    windows += [(chunk, opened, uses[chunk][-1]) for chunk, opened in active.items()]
    return sorted(windows, key=lambda window: window[1])


def _lead_in(actions, index: int) -> int:
    """The position of the first of the receives that lead into compute action `index`."""
    while index > 0 and actions[index - 1].kind in ("RF", "RB"):
        index -= 1
    return index


def _follow_up(actions, index: int) -> int:
    """The position of the last of the sends that follow compute action `index`."""
    while index + 1 < len(actions) and actions[index + 1].kind in ("SF", "SB"):
        index += 1
    return index


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


def check_zero_actions(schedule: Schedule) -> None:
    """Raise FxShardError unless the schedule's ZeRO actions (if any) are well placed: with U
    actions, every compute action of a chunk lies inside a U..R window of that chunk on its rank
    (each U closed by an R before the next U of the chunk); with G actions, each rank reduces each
    of its chunks once, after the chunk's last gradient-producing action (B, or W where split off)."""
    kinds = {a.kind for actions in schedule.ranks for a in actions}
    for rank, actions in enumerate(schedule.ranks):
        unsharded: set[int] = set()
        last_gradient: dict[int, int] = {}
        reduced: dict[int, int] = {}
        split = {a.chunk for a in actions if a.kind == "W"}  # chunks whose W actions produce the gradients
        for index, action in enumerate(actions):
            c = action.chunk
            if action.kind in ZERO and schedule.rank_of(c) != rank:
                raise FxShardError(f"{action} runs on rank {rank}, but chunk {c} lives on rank {schedule.rank_of(c)}")
            if action.kind == "U":
                if c in unsharded:
                    raise FxShardError(f"rank {rank}: U{c} at position {index} gathers chunk {c} again before R{c}")
                unsharded.add(c)
            elif action.kind == "R":
                if c not in unsharded:
                    raise FxShardError(f"rank {rank}: R{c} at position {index} frees chunk {c}, which no U{c} gathered")
                unsharded.remove(c)
            elif action.kind in COMPUTE:
                if "U" in kinds and c not in unsharded:
                    raise FxShardError(f"rank {rank}: {action} runs outside a U{c}..R{c} window, on chunk {c}'s sharded "
                                       f"parameters; gather them before it (U{c}) and free them after (R{c})")
                if action.kind == ("W" if c in split else "B"):
                    last_gradient[c] = index
            elif action.kind == "G":
                if c in reduced:
                    raise FxShardError(f"rank {rank}: G{c} appears twice; chunk {c}'s gradients are reduced once a step")
                reduced[c] = index
        if unsharded:
            raise FxShardError(f"rank {rank}: U{min(unsharded)} has no R{min(unsharded)} after it")
        if "G" not in kinds:
            continue
        for c, index in last_gradient.items():
            if c not in reduced:
                raise FxShardError(f"rank {rank} never reduces chunk {c}'s gradients: add G{c} after its last "
                                   f"{actions[index]}")
            if reduced[c] < index:
                raise FxShardError(f"rank {rank}: G{c} comes before {actions[index]}, which still adds to chunk "
                                   f"{c}'s gradients; move G{c} after it")
        opt = next((i for i, a in enumerate(actions) if a.kind == "OPT"), len(actions))
        late = [c for c, index in reduced.items() if index > opt]
        if late:
            raise FxShardError(f"rank {rank}: G{late[0]} comes after OPT, which updates with its gradients")


def simulate(schedule: Schedule, cost: dict[str, float] | None = None) -> Simulation:
    """Check `schedule` and time it. `cost[kind]` is the time of one action of a stage (split over
    its V chunks); `cost[f"{kind}{chunk}"]`, where given, is one chunk's own time (measured costs).
    Point-to-point communication is free and sends never block; a receive waits for its send.

    ZeRO's collectives (U, G; `add_zero_actions`) run on a communication stream of their own per
    rank, one after the other, each issued once the compute action before it in the rank's list is
    done (`cost["U"]`, `cost["G"]`, default 0: free); R is free. A compute action of chunk c waits
    for the all-gather of its U c, and OPT for every collective of its rank. Only compute counts
    as busy: a collective that compute cannot hide shows as bubble."""
    cost = {"F": 1.0, "B": 2.0, "W": 0.0, **(cost or {})}
    check_zero_actions(schedule)
    graph = nx.DiGraph()
    where: dict[tuple, tuple[int, int]] = {}
    for rank, actions in enumerate(schedule.ranks):
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
            if previous is not None:
                graph.add_edge(previous, node)
            previous = node
            if action.kind in COMPUTE:
                computed = node
                if action.chunk in gathered:
                    graph.add_edge(gathered[action.chunk], node)
            if action.kind == "OPT" and collective is not None:
                graph.add_edge(collective, node)
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
        if action.kind not in COMPUTE + ("U", "G"):
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
        busy = sum(end[rank, i] - start[rank, i] for i, a in enumerate(actions) if a.kind in COMPUTE)
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
    pair and sends after it; likewise ZeRO's actions, U before the pair (both actions' chunks are
    gathered while it runs), R and G after it."""
    ranks = []
    for actions, rank_pairs in zip(schedule.ranks, pairs):
        actions = list(actions)
        for first, second in rank_pairs:
            start, end = actions.index(first), actions.index(second)
            while start > 0 and actions[start - 1].kind in ("RF", "RB"):  # the first one's receive
                start -= 1
            between = actions[start:end + 1]
            receives = [a for a in between if a.kind in ("RF", "RB", "U")]  # and gathers: before the pair
            sends = [a for a in between if a.kind in ("SF", "SB", "R", "G")]  # and frees, reductions: after
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


def check_point_to_point(schedule: Schedule, order: tuple[tuple[Action, ...], ...], pairs=(),
                         streams: str = "pair") -> None:
    """Raise FxShardError unless `order` (each rank's actions in issue order) runs to the end when
    every pair of ranks matches its transfers in issue order, one at a time (a send completes only
    together with its receive, and only once its value is computed), and each rank computes in
    order, waiting for the receives its compute reads: the model of NCCL point-to-point. A send is
    issued after the compute before it in the rank's order. `pairs` (each rank's pairs of actions
    from `combine_pairs`, run interleaved): the first action of a pair waits for both actions'
    receives.

    `streams`: "pair", one in-order stream per pair of ranks (NCCL's default: a communicator per
    pair); "group", one in-order stream per rank for all its transfers (a process group initialized
    with `device_id`, whose one communicator carries every send and receive): a transfer then also
    waits for every transfer the rank issued before it, to any peer."""
    if streams not in ("pair", "group"):
        raise ValueError(f"streams={streams!r}; 'pair' or 'group'")
    chunks = schedule.chunks
    compute = [[a for a in actions if a.kind in COMPUTE] for actions in order]
    transfers = {(rank, peer): [a for a in actions if a.peer == peer and a.kind in ("SF", "SB", "RF", "RB")]
                 for rank, actions in enumerate(order) for peer in range(schedule.stages)}
    done: set[tuple[int, str, int, int]] = set()  # (rank, kind, chunk, mb)
    position = {key: 0 for key in [*transfers, *range(len(order))]}
    # "group": each rank's transfers to every peer, in issue order; only the first not done can run
    issued = [[a for a in actions if a.kind in ("SF", "SB", "RF", "RB")] for actions in order]
    head = [0] * len(order)

    def at_head(rank: int, action: Action) -> bool:
        return streams == "pair" or issued[rank][head[rank]] == action

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
            if not (at_head(rank, mine) and at_head(peer, theirs)):
                continue
            if _matching(mine) != (theirs.kind, theirs.chunk, theirs.mb):
                raise FxShardError(f"point-to-point out of order between ranks {rank} and {peer}: rank {rank}'s "
                                   f"next transfer is {mine}, rank {peer}'s is {theirs}")
            send, sender = (mine, rank) if mine.kind.startswith("S") else (theirs, peer)
            issued_after = gate[sender, send]
            if issued_after is None or (sender, issued_after.kind, issued_after.chunk, issued_after.mb) in done:
                for side, action in ((rank, mine), (peer, theirs)):
                    done.add((side, action.kind, action.chunk, action.mb))
                    head[side] += 1
                position[rank, peer] += 1
                position[peer, rank] += 1
                progressed = True
        if not progressed:
            break
    stuck = [f"rank {r}: {compute[r][position[r]]}" for r in range(len(order)) if position[r] < len(compute[r])]
    stuck += [f"rank {r} -> {p}: {q[position[r, p]]}" for (r, p), q in transfers.items() if position[r, p] < len(q)]
    if stuck:
        model = "in-order point-to-point" if streams == "pair" else "every transfer of a rank on one stream"
        raise FxShardError(f"pipeline schedule {schedule.name} deadlocks with {model}: " + "; ".join(stuck))


_COLORS = {"F": "#6fa8dc", "B": "#e69138", "W": "#93c47d"}
_COLLECTIVE_COLORS = {"U": "#8e7cc3", "G": "#c27ba0"}


def to_svg(schedule: Schedule, simulation: Simulation, scale: float = 24.0) -> str:
    """A timeline: one lane per rank, one block per compute action, labelled with its microbatch; a
    ZeRO collective that takes time (U, G) is a thin bar under the lane (its communication stream)."""
    lane, width = 28, simulation.makespan * scale + 70
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" '
             f'height="{lane * len(schedule.ranks) + 30}" font-family="monospace" font-size="10">',
             f'<text x="4" y="{lane * len(schedule.ranks) + 20}">{schedule.name}: makespan '
             f'{simulation.makespan:g}, bubble {simulation.bubble_fraction:.1%}</text>']
    for rank, actions in enumerate(schedule.ranks):
        y = rank * lane + 4
        parts.append(f'<text x="2" y="{y + 16}">r{rank}</text>')
        for index, action in enumerate(actions):
            x0, x1 = simulation.start[rank, index] * scale + 30, simulation.end[rank, index] * scale + 30
            if action.kind in _COLLECTIVE_COLORS and x1 > x0:
                parts.append(f'<rect x="{x0:.1f}" y="{y + lane - 7}" width="{x1 - x0:.1f}" height="3" '
                             f'fill="{_COLLECTIVE_COLORS[action.kind]}"><title>{action}</title></rect>')
            if action.kind not in _COLORS:
                continue
            x0, x1 = simulation.start[rank, index] * scale + 30, simulation.end[rank, index] * scale + 30
            parts.append(f'<rect x="{x0:.1f}" y="{y}" width="{max(x1 - x0, 1):.1f}" height="{lane - 6}" '
                         f'fill="{_COLORS[action.kind]}" stroke="#333"><title>{action}</title></rect>')
            parts.append(f'<text x="{x0 + 2:.1f}" y="{y + 15}">{action.kind}{action.mb}</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"
