"""The order a rank's lowered program issues its actions in (`issue_order`), the combined 1F1B's
forward/backward pairs (`combine_pairs`), and the model of NCCL's in-order point-to-point that
proves an order deadlock-free (`check_point_to_point`)."""

from __future__ import annotations

import dataclasses
import functools

from ..config import P2P_RECEIVES as RECEIVES  # where issue_order issues a receive
from ..errors import FxShardError
from .model import COMPUTE, TRANSFERS, Action, Schedule, matching
from .simulator import simulate, unit_costs

MIN_COST = 1e-3  # the least time issue_order gives an action (costs are ~1 per stage's forward)


def issue_order(schedule: Schedule, cost=None, receives: str = "late", pairs=()) -> tuple[tuple[Action, ...], ...]:
    """Each rank's actions in the order its lowered program issues them.

    Compute and sends stay where the schedule has them. Between two ranks, transfers follow one
    order on both sides: messages sorted by when their sender produces them, as `simulate` times
    the schedule under `cost` (a dict or its items; the chunks' FLOP costs, `StagePlan.costs`;
    default `unit_costs`). A message whose producer depends on another message is produced
    strictly after it (every action is timed at least `MIN_COST`). With `receives="early"` each
    receive moves up to right after the previous transfer with the same peer in that order: issued
    early, waited on where its data is first read. That is what in-order matching per pair of ranks needs (NCCL runs a pair's
    sends and receives on one stream, in issue order); `check_point_to_point` proves the result
    deadlock-free.

    Costs matter once transfers take time: a message queued behind one its sender produces later
    waits for it. Under unit costs 1F1B's steady state produces a forward's activation and the
    next stage's gradient at the same time (F=1, B=2) and the tie goes to the lower rank; where a
    backward really takes 2.7x a forward (GPT 1b on an H100) the gradient is ready first and waits.
    `simulate(schedule, cost, order)` times an order with transfers.

    `receives="late"` (the default, as Config(p2p_receives)) moves each receive as late as the pair's
    order allows instead: just before the
    compute that reads it (the first action of its pair, where `pairs` from `combine_pairs` run two
    actions interleaved) or the rank's next transfer with the same peer, whichever comes first. An
    NCCL receive holds its SMs from when the device reaches it until its peer's data has come, and
    the compute the rank runs meanwhile goes slower (2x H200: a backward's GEMMs 1.4-1.8x,
    bench/RESULTS.md session 26); issued late, it waits where the rank would wait for the data
    anyway. Messages that fit NCCL's buffers complete on the sender's side without the receive; a
    larger one holds the sender's send until the receive is issued (the in-order model of `simulate`
    counts that: with free transfers the late order may take longer than the schedule's own time, the
    early order never does). `check_point_to_point` checks either order; with `pairs`, pass them here
    too, so that a pair's receives come before it."""
    if receives not in RECEIVES:
        raise FxShardError(f"receives={receives!r}; choose one of {RECEIVES}")
    cost = {**unit_costs(schedule), **dict(cost or {})}
    timing = simulate(schedule, {key: max(value, MIN_COST) for key, value in cost.items()})
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
            kind, chunk, mb = matching(action)
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
        order.append(tuple(out) if receives == "early" else _receives_late(out, pairs[rank] if pairs else ()))
    return tuple(order)


def _receives_late(actions: list[Action], rank_pairs=()) -> tuple[Action, ...]:
    """One rank's issue order with each receive moved just before the compute that reads it (the first
    of a pair run interleaved) or the next transfer with the same peer, whichever comes first."""
    first_of = {second: first for first, second in rank_pairs}
    out = list(actions)
    for receive in reversed([a for a in actions if a.kind in ("RF", "RB")]):  # later ones are in place
        index = out.index(receive)
        del out[index]
        reader = Action(receive.kind[1], receive.chunk, receive.mb)
        reader = first_of.get(reader, reader)
        stop = next((i for i in range(index, len(out))
                     if out[i] == reader or (out[i].kind in TRANSFERS and out[i].peer == receive.peer)), None)
        if stop is None:  # a schedule the simulator accepted always reads what it receives, after receiving it
            raise ValueError(f"{receive}: neither {reader} nor another transfer with rank {receive.peer} follows it")
        out.insert(stop, receive)
    return tuple(out)


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


def pair_candidates(schedule: Schedule) -> list[list[tuple[Action, Action]]]:
    """Each rank's pairs a combined 1F1B could make: left to right among its compute actions, a
    forward and a backward of another microbatch that follow each other (`combine_pairs` keeps those
    that hold)."""
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
    return candidates


@functools.lru_cache(maxsize=16)
def combine_pairs(schedule: Schedule, cost: tuple = (),
                  receives: str = "late") -> tuple[Schedule, tuple[tuple[tuple[Action, Action], ...], ...]]:
    """Megatron's combined 1F1B inside a pipeline: on each rank, a forward and a backward of another
    microbatch that follow each other among its compute actions (1F1B's steady state: F m+w next
    to B m, or B m next to F m+1 on the last stage) become a pair, which the `interleave` pass runs
    interleaved at the MoE all-to-alls so that each one's all-to-alls run under the other's compute.

    The pair's transfers move out of it (`pair_actions`): both receives before it, both sends after
    it, so a forward's activation now leaves after the pair. Returns the reordered schedule (named
    "<name>+combined") and each rank's pairs in order. A pair is only made where
    `check_point_to_point` still proves the whole order deadlock-free with both receives waited on
    before the pair starts, and where the schedule, timed by `simulate` under `cost` (textbook units
    by default), takes no longer than without pairs: a pair only hides its all-to-alls, which the
    simulator does not count, while a forward held back until its pair's backward is done can stall
    the next stage for a whole action. In 1F1B that is nearly every pair (pairing its steady state doubles the period at P=2); in
    interleaved 1F1B with one extra warm-up forward per rank (`build(..., extra_warmup=1)`, as
    Megatron schedules its combined 1F1B) nearly every steady-state action pairs at no cost. Pairs
    are taken greedily, rank by rank (a rank's pairs at once where they hold, else one by one).
    `cost` (the items of the costs the lowering orders transfers by, `StagePlan.costs`) and `receives`
    (Config(p2p_receives)) make the proof hold for the order that runs:
    `issue_order(combined, cost, receives, pairs)`."""
    candidates = pair_candidates(schedule)
    timing = {**unit_costs(schedule), **dict(cost)}
    bound = simulate(schedule, timing).makespan * (1 + 1e-9)

    def holds(pairs) -> bool:
        combined = pair_actions(schedule, pairs)
        try:
            check_point_to_point(combined, issue_order(combined, cost, receives, pairs), pairs)
        except FxShardError:
            return False
        return simulate(combined, timing).makespan <= bound

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
    together with its receive), and each rank computes in order, waiting for the receives its
    compute reads: the model of NCCL point-to-point. A transfer, send or receive, starts only once
    the compute before it in the rank's order is done (NCCL's stream waits for the compute stream
    where the transfer is issued), which is what makes where a receive is issued matter. `pairs` (each rank's pairs of actions
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
    gate = {}  # (rank, transfer) -> the compute action before it in the rank's order (None: nothing)
    for rank, actions in enumerate(order):
        last = None
        for action in actions:
            if action.kind in COMPUTE:
                last = action
            elif action.kind in ("SF", "SB", "RF", "RB"):
                gate[rank, action] = last

    def reached(rank: int, action: Action) -> bool:
        """Whether the device has reached `action`: NCCL's stream waits for the compute issued before it."""
        after = gate[rank, action]
        return after is None or (rank, after.kind, after.chunk, after.mb) in done

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
            if matching(mine) != (theirs.kind, theirs.chunk, theirs.mb):
                raise FxShardError(f"point-to-point out of order between ranks {rank} and {peer}: rank {rank}'s "
                                   f"next transfer is {mine}, rank {peer}'s is {theirs}")
            if reached(rank, mine) and reached(peer, theirs):
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
