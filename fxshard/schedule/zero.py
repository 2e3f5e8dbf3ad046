"""ZeRO over dp as schedule actions: where `add_zero_actions` places each chunk's U / R / G, and
what `check_zero_actions` requires of them."""

from __future__ import annotations

import dataclasses

from ..errors import FxShardError
from .model import COMPUTE, ZERO, Action, Schedule


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
