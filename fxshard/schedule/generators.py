"""The named schedules: GPipe, 1F1B, interleaved 1F1B, ZB-H1 and DualPipeV as per-rank compute
orders with their transfers; `build` picks one by the name `Config(schedule=...)` uses."""

from __future__ import annotations

from ..errors import FxShardError
from .model import Action, Schedule, add_communication


def _check(stages: int, virtual: int, microbatches: int) -> None:
    if stages < 1 or virtual < 1 or microbatches < 1:
        raise FxShardError(f"pipeline sizes must be >= 1, got P={stages}, V={virtual}, M={microbatches}")


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


def interleaved_one_f_one_b(stages: int, microbatches: int, virtual: int, extra_warmup: int = 0) -> Schedule:
    """Megatron's interleaved 1F1B: microbatches advance through a rank's V chunks in groups of P;
    warm-up (P-r-1)*2 + (V-1)*P forwards, then 1F1B, then the remaining backwards. `extra_warmup`
    more warm-up forwards per rank (V > 1): what the combined 1F1B needs (`combine_pairs`; Megatron
    adds 1 when it overlaps the expert-parallel all-to-alls) so that a pair's forward, whose
    activation leaves only after the pair, is not one the next stage waits for; each costs one more
    microbatch of live activations."""
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

        warmup = min((stages - rank - 1) * 2 + (virtual - 1) * stages + extra_warmup, total) if virtual > 1 else \
            min(stages - rank - 1, total)
        actions = [forward(k) for k in range(warmup)]
        for k in range(total - warmup):
            actions += [forward(warmup + k), backward(k)]
        actions += [backward(k) for k in range(total - warmup, total)]
        order.append(actions)
    name = f"interleaved-1f1b(V={virtual})" + (f"+{extra_warmup} warm-up" if extra_warmup and virtual > 1 else "")
    return add_communication(order, stages, virtual, microbatches, name)


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


def build(name: str, stages: int, microbatches: int, virtual: int = 1, extra_warmup: int = 0) -> Schedule:
    """The schedule `Config(schedule=name)` names (fxshard.config.PIPELINE_SCHEDULES); `extra_warmup`
    applies to interleaved 1F1B (V > 1) only."""
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
        return interleaved_one_f_one_b(stages, microbatches, virtual, extra_warmup)
    raise FxShardError(f"unknown pipeline schedule {name!r}")
