"""Pipeline schedules: every generated schedule is valid, and the simulator reproduces the closed forms."""

import dataclasses

import pytest
import torch
from hypothesis import given, settings, strategies as st

import fxshard
from fxshard import FxShardError
from fxshard import schedule as schedules
from fxshard.schedule import (Action, Schedule, gpipe, interleaved_one_f_one_b, one_f_one_b, simulate,
                              to_svg)

EQUAL = {"F": 1.0, "B": 1.0}


@given(stages=st.integers(1, 8), microbatches=st.integers(1, 16))
def test_1f1b_is_valid_bounded_by_p_and_has_the_known_bubble(stages, microbatches):
    result = simulate(one_f_one_b(stages, microbatches), EQUAL)
    assert max(result.peak_activations) <= stages  # bounded by P, not by M
    assert result.peak_activations[0] == min(stages, microbatches)
    expected = (stages - 1) / (microbatches + stages - 1)
    assert all(bubble == pytest.approx(expected) for bubble in result.bubble)


@given(stages=st.integers(1, 8), microbatches=st.integers(1, 16))
def test_gpipe_has_the_same_bubble_but_holds_every_microbatch(stages, microbatches):
    result = simulate(gpipe(stages, microbatches), EQUAL)
    assert result.bubble_fraction == pytest.approx((stages - 1) / (microbatches + stages - 1))
    assert result.peak_activations == [microbatches] * stages


@given(stages=st.integers(1, 8), virtual=st.integers(1, 4), groups=st.integers(1, 4))
def test_interleaved_1f1b_divides_the_bubble_by_v(stages, virtual, groups):
    microbatches = stages * groups
    result = simulate(interleaved_one_f_one_b(stages, microbatches, virtual), EQUAL)
    expected = (stages - 1) / (virtual * microbatches + stages - 1)
    assert result.bubble_fraction == pytest.approx(expected)


def test_interleaved_needs_microbatches_divisible_by_p():
    with pytest.raises(FxShardError, match="divisible"):
        interleaved_one_f_one_b(4, 6, 2)


def test_a_receive_order_that_deadlocks_is_rejected():
    schedule = one_f_one_b(2, 2)
    rank1 = list(schedule.ranks[1])
    # rank 0 waits for a gradient before sending the activation that gradient needs
    rank0 = list(schedule.ranks[0])
    receive = next(a for a in rank0 if a.kind == "RB")
    rank0.remove(receive)
    rank0.insert(0, receive)
    broken = Schedule((tuple(rank0), tuple(rank1)), 2, 1, 2, "broken")
    with pytest.raises(FxShardError, match="deadlock"):
        simulate(broken)


def test_a_missing_action_is_rejected():
    schedule = one_f_one_b(2, 2)
    rank1 = tuple(a for a in schedule.ranks[1] if str(a) != "B1:1")
    with pytest.raises(FxShardError, match=r"schedule missing misses compute actions, e\.g\. \['B1:1'\]"):
        simulate(Schedule((schedule.ranks[0], rank1), 2, 1, 2, "missing"))  # named before the sends it implies
    beyond = schedule.ranks[0] + (Action("F", 2, 0, None),)  # a chunk the schedule does not have
    with pytest.raises(FxShardError, match=r"has 2 chunks \(2 stages x 1 virtual\) and 2 microbatches, but names "
                                           r"actions beyond them, e\.g\. \['F2:0'\]"):
        simulate(Schedule((beyond, schedule.ranks[1]), 2, 1, 2, "beyond"))
    replaced = dataclasses.replace(fxshard.Config(schedule=one_f_one_b(2, 4)), schedule=one_f_one_b(2, 8))
    assert replaced.microbatches == 8  # a Schedule sets the sizes, whatever an earlier one set
    rank1 = tuple(a for a in schedule.ranks[1] if a.mb != 1 or a.kind not in ("B", "SB"))
    rank0 = tuple(a for a in schedule.ranks[0] if a.mb != 1 or a.kind not in ("B", "RB"))
    with pytest.raises(FxShardError, match="misses"):
        simulate(Schedule((rank0, rank1), 2, 1, 2, "missing"))
    for peer, names in ((None, "no peer"), (0, "its own rank")):  # built as Actions: parse refuses both
        rank0 = tuple(Action(a.kind, a.chunk, a.mb, peer) if str(a) == "SF0:0>1" else a for a in schedule.ranks[0])
        with pytest.raises(FxShardError, match=f"SF0:0.* on rank 0 names {names}"):
            simulate(Schedule((rank0, schedule.ranks[1]), 2, 1, 2, "bad peer"))


def test_schedules_print_serialize_and_draw():
    schedule = interleaved_one_f_one_b(2, 4, 2)
    assert str(schedule).splitlines()[0].startswith("rank 0: F0:0 SF0:0>1 F0:1 SF0:1>1 RF2:0<1 F2:0")
    assert Schedule.from_json(schedule.to_json()) == schedule
    assert str(Action.parse("SF1:3>2")) == "SF1:3>2" and Action.parse("OPT") == Action("OPT")
    svg = to_svg(schedule, simulate(schedule))
    assert svg.startswith("<svg") and svg.count("<rect") == 2 * 2 * 4 * 2


def test_per_chunk_costs_override_the_per_kind_cost():
    from fxshard.schedule import gpipe, simulate

    schedule = gpipe(2, 2)
    uniform = simulate(schedule, {"F": 1.0, "B": 1.0})
    slow_last = simulate(schedule, {"F": 1.0, "B": 1.0, "F1": 3.0, "B1": 3.0})
    assert slow_last.makespan > uniform.makespan
    assert slow_last.bubble[0] > slow_last.bubble[1]  # the fast stage waits on the slow one


@given(stages=st.integers(1, 4), microbatches=st.integers(1, 6), extra=st.floats(0.0, 5.0))
def test_an_actions_own_cost_overrides_its_chunks(stages, microbatches, extra):
    """`cost["B0:m"]` times that one action: the last microbatch's backward on rank 0 ends 1F1B's
    step, so making it `extra` longer makes the step exactly that much longer, and nothing else moves
    (but the optimizer phase after it)."""
    from fxshard.schedule import Action, one_f_one_b, simulate

    schedule = one_f_one_b(stages, microbatches)
    last = f"B0:{microbatches - 1}"
    base = simulate(schedule, {"F": 1.0, "B": 2.0})
    slow = simulate(schedule, {"F": 1.0, "B": 2.0, last: 2.0 + extra})
    assert slow.makespan == pytest.approx(base.makespan + extra)
    index = schedule.ranks[0].index(Action.parse(last))
    moved = {node for node in base.start if slow.start[node] != base.start[node]}
    assert all(schedule.ranks[r][i].kind == "OPT" for r, i in moved) and slow.end[0, index] > base.end[0, index] - 1e-9


@given(stages=st.integers(1, 6), microbatches=st.integers(1, 12))
def test_zero_bubble_h1_is_valid_and_fills_1f1b_bubbles_with_weight_gradients(stages, microbatches):
    from fxshard.schedule import one_f_one_b, simulate, zero_bubble_h1

    schedule = zero_bubble_h1(stages, microbatches)
    kinds = [a.kind for actions in schedule.ranks for a in actions]
    assert kinds.count("W") == kinds.count("B") == stages * microbatches
    split = simulate(schedule, schedules.unit_costs(schedule))   # B + W cost what 1F1B's B costs
    assert schedules.unit_costs(schedule) == {"F": 1.0, "B": 1.0, "W": 1.0}  # what the dump times it with
    assert simulate(schedule).makespan == split.makespan  # the default times W too, not as free
    whole = simulate(one_f_one_b(stages, microbatches), {"F": 1.0, "B": 2.0})
    assert split.makespan <= whole.makespan
    if stages > 1 and microbatches >= stages:
        assert split.bubble_fraction < whole.bubble_fraction
    for rank, peak in enumerate(split.peak_activations):  # live until W: at most one above 1F1B's bound
        assert peak <= min(stages - rank, microbatches) + 1


def test_build_picks_the_generator_config_names():
    from fxshard.schedule import build

    assert build("1f1b", 2, 4) == one_f_one_b(2, 4)
    assert build("1f1b", 2, 4, virtual=2) == interleaved_one_f_one_b(2, 4, 2)
    assert build("gpipe", 2, 4) == gpipe(2, 4) != build("1f1b", 2, 4)
    with pytest.raises(FxShardError, match="zb-h1"):
        build("zb-h1", 2, 4, virtual=2)


@pytest.mark.parametrize("name, stages, microbatches, virtual", [
    ("1f1b", 2, 8, 1), ("1f1b", 4, 8, 1), ("interleaved-1f1b", 2, 8, 2), ("interleaved-1f1b", 3, 6, 2),
    ("zb-h1", 3, 6, 1), ("gpipe", 4, 8, 2), ("dualpipev", 2, 4, 2)])
def test_late_receives_wait_where_their_data_is_read_and_keep_each_pairs_order(name, stages, microbatches, virtual):
    """issue_order(receives="late"): the same actions, each pair of ranks' transfers in the same order
    as the early order, sends and compute where they were; each receive right before the compute that
    reads it or the next transfer with its peer, after everything else it can follow; deadlock-free
    under the in-order model (which starts a transfer only once the compute before it is done). And a
    combined 1F1B pair's receives come before the pair."""
    schedule = schedules.build(name, stages, microbatches, virtual)
    costs = {**schedules.unit_costs(schedule), **{f"B{c}": 3.0 for c in range(schedule.chunks)}}  # B = 3x F
    early, late = schedules.issue_order(schedule, costs, "early"), schedules.issue_order(schedule, costs, "late")
    schedules.check_point_to_point(schedule, late)
    moved = 0
    for rank, (mine, theirs) in enumerate(zip(late, early)):
        assert sorted(map(str, mine)) == sorted(map(str, theirs))
        fixed = [a for a in mine if a.kind not in ("RF", "RB")]
        assert fixed == [a for a in theirs if a.kind not in ("RF", "RB")]
        for peer in range(stages):
            assert [a for a in mine if a.peer == peer] == [a for a in theirs if a.peer == peer]
        for index, action in enumerate(mine):
            if action.kind in ("RF", "RB"):
                after = mine[index + 1]
                assert after == Action(action.kind[1], action.chunk, action.mb) or after.peer == action.peer, \
                    (rank, action, after)
                moved += theirs.index(action) < index
    assert moved > 0 or name == "gpipe"  # gpipe's receives already sit where they are read
    combined, pairs = schedules.combine_pairs(schedules.build("interleaved-1f1b", 2, 8, 2, extra_warmup=1))
    late = schedules.issue_order(combined, (), "late", pairs)
    schedules.check_point_to_point(combined, late, pairs)
    read_by_seconds = 0
    for mine, rank_pairs in zip(late, pairs):
        for first, second in rank_pairs:
            for index, action in enumerate(mine):
                if action.kind in ("RF", "RB") and Action(action.kind[1], action.chunk, action.mb) == second:
                    assert index < mine.index(first), (action, first, second)
                    read_by_seconds += 1
    assert read_by_seconds  # some pair's second action reads a receive
    with pytest.raises(FxShardError, match="receives='soon'"):
        schedules.issue_order(schedule, costs, "soon")
    from fxshard.schedule.order import _receives_late
    with pytest.raises(ValueError, match="neither B0:0 nor another transfer with rank 1 follows it"):
        _receives_late([Action("RB", 0, 0, 1), Action("OPT")])  # nothing reads it: no place for it


def test_lowered_issue_order_is_deadlock_free_where_the_schedules_own_order_is_not():
    """NCCL matches a pair of ranks' sends and receives in issue order on one stream: 1F1B's own order
    has both stages sending at once (rank 0 SF0:1, rank 1 SB1:0) and would hang; issue_order's does not."""
    for name, stages, microbatches, virtual in [("1f1b", 2, 4, 1), ("interleaved-1f1b", 2, 4, 2),
                                                ("zb-h1", 3, 6, 1), ("gpipe", 4, 8, 2), ("1f1b", 4, 8, 1)]:
        schedule = schedules.build(name, stages, microbatches, virtual)
        schedules.check_point_to_point(schedule, schedules.issue_order(schedule))
    schedule = schedules.build("1f1b", 2, 4)
    with pytest.raises(FxShardError, match="out of order between ranks 0 and 1"):
        schedules.check_point_to_point(schedule, schedule.ranks)


@settings(max_examples=20)
@given(kind=st.sampled_from([("gpipe", 1), ("gpipe", 2), ("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1),
                             ("dualpipev", 2)]),
       stages=st.integers(1, 4), microbatches=st.integers(1, 8), zero=st.booleans(), combined=st.booleans(),
       times=st.lists(st.floats(0.2, 3.0), min_size=24, max_size=24))
def test_transfers_ordered_by_the_costs_wait_for_nothing_when_free(kind, stages, microbatches, zero, combined,
                                                                     times):
    """`simulate(order=...)` times transfers in issue order, one at a time per pair of ranks. With the
    early order `issue_order` makes from the same costs and free transfers, no message waits behind
    another: the makespan is the schedule's own (with the combined 1F1B's pairs too, each waiting
    for both its actions' receives). Transfers that take time only add to it."""
    name, virtual = kind
    try:
        schedule = schedules.build(name, stages, microbatches, virtual)
    except FxShardError:  # dualpipev needs 2P-1 microbatches
        return
    if zero:
        schedule = schedules.add_zero_actions(schedule, True, prefetch=1)
    cost = {f"{k}{c}": times[(3 * c + i) % len(times)] for c in range(schedule.chunks) for i, k in enumerate("FBW")}
    cost.update(U=0.3, G=0.4)
    pairs = ()
    if combined:
        schedule, pairs = schedules.combine_pairs(schedule, tuple(cost.items()), "early")
    order = schedules.issue_order(schedule, cost, "early")
    schedules.check_point_to_point(schedule, order, pairs)
    free = simulate(schedule, {**cost, "P2P": 0.0}, order=order, pairs=pairs)
    assert free.makespan == pytest.approx(simulate(schedule, cost).makespan)
    assert simulate(schedule, {**cost, "P2P": 0.3}, order=order, pairs=pairs).makespan >= free.makespan - 1e-9


def test_transfers_are_ordered_by_the_chunks_costs_not_units():
    """1F1B at P=2 with GPT 1b's per-chunk times measured on an H100 (ms; a backward is 2.7x its forward,
    not 2x): under units, the steady state's activation and gradient are produced at once and the tie
    puts the activation first, so the gradient, ready earlier, waits behind it in the pair's stream.
    With free transfers both orders take the schedule's own time."""
    schedule = schedules.build("1f1b", 2, 8)
    measured = {"F0": 4.27, "F1": 3.82, "B0": 11.97, "B1": 10.12}
    by_units, by_costs = schedules.issue_order(schedule, None, "early"), schedules.issue_order(schedule, measured, "early")
    assert by_units != by_costs
    own = simulate(schedule, measured).makespan
    for order in (by_units, by_costs):
        assert simulate(schedule, {**measured, "P2P": 0.0}, order=order).makespan == pytest.approx(own)
    slow_units = simulate(schedule, {**measured, "P2P": 0.1}, order=by_units).makespan
    slow_costs = simulate(schedule, {**measured, "P2P": 0.1}, order=by_costs).makespan
    # by units, rank 0 waits 0.2 before each steady-state backward (its gradient queued behind an
    # activation produced later); by costs it waits for no transfer there
    assert own < slow_costs < slow_units - 0.9
    with pytest.raises(FxShardError, match="not an order of"):
        simulate(schedule, measured, order=(by_costs[0][1:], by_costs[1]))
    # pairs run interleaved (the combined 1F1B): a pair's first action waits for the second's receive
    # too (without `pairs` the timing would come out 3 units shorter than the schedule's own 24)
    pairs = (tuple((Action("F", 0, m + 1), Action("B", 0, m)) for m in range(3)), ())
    combined = schedules.pair_actions(schedules.build("1f1b", 2, 4), pairs)
    order = schedules.issue_order(combined, None, "early")
    assert simulate(combined, {"P2P": 0.0}, order=order, pairs=pairs).makespan == simulate(combined).makespan == 24


def test_a_users_own_schedule_is_checked_and_lowered():
    import torch

    import fxshard
    from fxshard.models import GPT, GPTConfig
    from fxshard.passes import run_pipeline

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=24, d_model=16, n_layer=2, n_head=2, d_ff=24))
    batch = {"idx": torch.randint(0, 24, (2, 8)), "tgt": torch.randint(0, 24, (2, 8))}
    program = fxshard.trace(model, lambda m, b: m.loss(b), batch)
    # compute actions only: fxshard adds the sends and receives
    own = schedules.Schedule.from_json(
        '{"name": "mine", "stages": 2, "virtual": 1, "microbatches": 2, "ranks": '
        '[["F0:0", "F0:1", "B0:0", "B0:1"], ["F1:0", "B1:0", "F1:1", "B1:1"]]}')
    config = fxshard.Config(schedule=own)
    assert config.microbatches == 2
    stages = [run_pipeline(program, fxshard.Mesh(pp=2), config, stage=s)[-1] for s in range(2)]
    assert all(any(n.target is torch.ops.fxshard.recv.default for n in p.graph.nodes) for p in stages)
    # what shard() runs: the step's batch of M microbatches, one of them traced (not split again)
    full = {k: torch.cat([v, v]) for k, v in batch.items()}
    fxshard.check(model, lambda m, b: m.loss(b), full, mesh=fxshard.Mesh(pp=2), config=config)
    for bad, message in (({"microbatches": 0}, "microbatches must be an int >= 1, got 0"),
                         ({"stages": 3}, "a Schedule of 3 stages lists the actions of 2 ranks")):
        with pytest.raises(fxshard.FxShardError, match=message):
            schedules.Schedule(**{"ranks": own.ranks, "stages": 2, "virtual": 1, "microbatches": 2, **bad})
    broken = schedules.Schedule.from_json(
        '{"name": "broken", "stages": 2, "virtual": 1, "microbatches": 2, "ranks": '
        '[["F0:0", "B0:0", "F0:1", "B0:1"], ["F1:0", "F1:1", "B1:0", "B1:1"]]}')
    with pytest.raises(fxshard.FxShardError, match="deadlock"):
        run_pipeline(program, fxshard.Mesh(pp=2), fxshard.Config(schedule=broken), stage=0)
    with pytest.raises(fxshard.FxShardError, match="for 2 stages, but the mesh has pp=4"):
        run_pipeline(program, fxshard.Mesh(pp=4), fxshard.Config(schedule=own), stage=0)
    for mesh in (None, fxshard.Mesh(dp=2)):  # no pipeline pass runs there to notice
        with pytest.raises(fxshard.FxShardError, match="for 2 stages, but the mesh has pp=1"):
            run_pipeline(program, mesh, fxshard.Config(schedule=own))


@given(stages=st.integers(1, 4), extra=st.integers(0, 6))
def test_dualpipev_runs_each_rank_s_v_of_chunks_without_deadlock_and_beats_zb_h1(stages, extra):
    from fxshard.schedule import dualpipe_v, zero_bubble_h1

    microbatches = 2 * stages - 1 + extra  # the least it takes, and more
    schedule = dualpipe_v(stages, microbatches)
    schedules.check_point_to_point(schedule, schedules.issue_order(schedule))
    for rank, actions in enumerate(schedule.ranks):  # rank r: chunk r on the way down, 2P-1-r back up
        assert {a.chunk for a in actions if a.kind in schedules.COMPUTE} == {rank, 2 * stages - 1 - rank}
    kinds = [a.kind for actions in schedule.ranks for a in actions]
    assert kinds.count("W") == kinds.count("B") == 2 * stages * microbatches
    split = simulate(schedule, {"F": 1.0, "B": 1.0, "W": 1.0})  # simulate also checks every dependency
    zero_bubble = simulate(zero_bubble_h1(stages, microbatches), {"F": 1.0, "B": 1.0, "W": 1.0})
    assert split.makespan <= zero_bubble.makespan
    if stages > 1:
        assert split.bubble_fraction < zero_bubble.bubble_fraction
    assert max(split.peak_activations) <= 2 * stages + 1  # chunk forwards, each half a stage


def test_v_placement_puts_the_first_and_last_chunk_on_rank_0_and_survives_json():
    import fxshard
    from fxshard.passes import pipeline_schedule
    from fxshard.schedule import add_communication, dualpipe_v

    schedule = dualpipe_v(4, 8)
    assert [schedule.rank_of(c) for c in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert [one_f_one_b(4, 8).rank_of(c) for c in range(4)] == [0, 1, 2, 3]
    # the turn is local to the last rank: no transfer between chunks 3 and 4
    turn = {("SF", 3), ("RF", 4), ("SB", 4), ("RB", 3)}
    assert not [a for actions in schedule.ranks for a in actions if (a.kind, a.chunk) in turn]
    assert {a.peer for a in schedule.ranks[0] if a.peer is not None} == {1}
    assert Schedule.from_json(schedule.to_json()) == schedule
    assert Schedule.from_json(schedule.to_json().replace(', "placement": "v"', "")).placement == "loop"
    compute = [[a for a in actions if a.kind in schedules.COMPUTE] for actions in schedule.ranks]
    assert add_communication(compute, 4, 2, 8, "dualpipev", placement="v") == schedule
    own = Schedule(tuple(map(tuple, compute)), 4, 2, 8, "dualpipev", placement="v")  # a user's, compute only
    assert pipeline_schedule(fxshard.Mesh(pp=4), fxshard.Config(schedule=own)) == schedule
    with pytest.raises(FxShardError, match="placement 'w'"):
        Schedule((), 2, 2, 4, "bad", placement="w")


def test_dualpipev_config_sets_two_chunks_per_rank_and_refuses_too_few_microbatches():
    import fxshard
    from fxshard.schedule import build, dualpipe_v

    assert fxshard.Config(schedule="dualpipev").virtual_stages == 2
    assert build("dualpipev", 2, 4, virtual=2) == dualpipe_v(2, 4)
    with pytest.raises(FxShardError, match="virtual_stages=3"):
        fxshard.Config(schedule="dualpipev", virtual_stages=3)
    with pytest.raises(FxShardError, match="virtual_stages=2"):
        build("dualpipev", 2, 4)
    with pytest.raises(FxShardError, match=r"M >= 5, e.g. 6"):
        dualpipe_v(3, 4)


def zero_bracketing(schedule):
    """Independently of `check_zero_actions`: per rank, each compute action's chunk is gathered (inside a
    U..R window), and each chunk's G comes after its last gradient-producing action and before OPT."""
    for rank, actions in enumerate(schedule.ranks):
        open_windows, windows = set(), {}
        for index, action in enumerate(actions):
            if action.kind == "U":
                open_windows.add(action.chunk)
                windows[action.chunk] = windows.get(action.chunk, 0) + 1
            elif action.kind == "R":
                open_windows.remove(action.chunk)
            elif action.kind in schedules.COMPUTE and any(a.kind == "U" for a in actions):
                assert action.chunk in open_windows, (rank, index, action)
        assert not open_windows
        for chunk in {a.chunk for a in actions if a.kind in schedules.COMPUTE}:
            kind = "W" if Action("W", chunk, 0) in actions else "B"
            last = max(i for i, a in enumerate(actions) if a.kind == kind and a.chunk == chunk)
            assert actions.index(Action("G", chunk)) > last
            assert actions.index(Action("G", chunk)) < actions.index(Action("OPT"))
        yield windows


@given(kind=st.sampled_from(["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "dualpipev"]), stages=st.integers(1, 4),
       rounds=st.integers(1, 3), prefetch=st.integers(0, 3), max_unsharded=st.integers(1, 3), unshard=st.booleans())
def test_zero_actions_bracket_every_use_reduce_after_the_last_gradient_and_cost_nothing_by_default(
        kind, stages, rounds, prefetch, max_unsharded, unshard):
    from fxshard.schedule import add_zero_actions, check_point_to_point, combine_pairs, issue_order

    virtual = 2 if kind in ("interleaved-1f1b", "dualpipev") else 1
    microbatches = 2 * stages - 2 + rounds if kind == "dualpipev" else stages * rounds
    plain = schedules.build(kind, stages, microbatches, virtual)
    zero = add_zero_actions(plain, unshard, prefetch, max_unsharded)
    assert [[a for a in r if a.kind not in schedules.ZERO] for r in zero.ranks] == [list(r) for r in plain.ranks]
    for windows in zero_bracketing(zero):
        if unshard and max_unsharded >= virtual:  # each chunk gathered once a step
            assert set(windows.values()) == {1}
    assert Schedule.from_json(zero.to_json()) == zero
    # free collectives change no time: the same compute timeline as without them
    before, after = simulate(plain), simulate(zero)
    assert after.makespan == before.makespan and after.bubble == before.bubble
    compute = [(r, i) for r, actions in enumerate(zero.ranks) for i, a in enumerate(actions) if a.kind in "FBW"]
    assert sorted(after.start[n] for n in compute) == sorted(before.start[r, i] for r, actions in enumerate(plain.ranks)
                                                             for i, a in enumerate(actions) if a.kind in "FBW")
    check_point_to_point(zero, issue_order(zero))
    combined, pairs = combine_pairs(zero)  # pairs keep ZeRO's collectives outside, like the transfers
    list(zero_bracketing(combined))
    for actions, mine in zip(combined.ranks, pairs):
        for first, second in mine:
            assert actions[actions.index(first) + 1] == second


def test_collectives_show_as_bubble_only_where_compute_cannot_hide_them():
    from fxshard.schedule import add_zero_actions

    comm = {"F": 1.0, "B": 2.0, "U": 0.5, "G": 0.5}
    # 1F1B: rank 0's first gather and last reduction have nothing to hide under; every later rank
    # gathers while it waits for its first activation and reduces before rank 0's last backward ends
    plain = one_f_one_b(4, 8)
    zero = add_zero_actions(plain, unshard=True)
    assert simulate(zero, comm).makespan == simulate(plain, comm).makespan + 1.0
    assert all(b > a for a, b in zip(simulate(plain, comm).bubble, simulate(zero, comm).bubble))
    # interleaved V=2: chunk 2's gather runs under chunk 0's forwards when prefetched one action ahead;
    # without prefetch it waits, and with one chunk gathered at a time every switch of chunk waits
    plain = interleaved_one_f_one_b(2, 4, 2)
    base = simulate(plain, comm).makespan
    ahead = simulate(add_zero_actions(plain, True, prefetch=1), comm).makespan
    late = simulate(add_zero_actions(plain, True, prefetch=0), comm).makespan
    thrash = simulate(add_zero_actions(plain, True, prefetch=1, max_unsharded=1), comm).makespan
    assert ahead == base + (0.5 + 0.5) / 2  # the first chunk's gather and the last chunk's reduction
    assert base < ahead < late < thrash
    # reductions alone (ZeRO-1/2, no_shard): only the last one is exposed
    assert simulate(add_zero_actions(plain, False), comm).makespan == base + 0.5 / 2
    svg = to_svg(zero, simulate(zero, comm))
    assert svg.count("<rect") == 4 * 8 * 2 + 4 * 2  # a compute block each, a bar per U and G


def test_a_schedule_built_from_lists_or_json_without_a_name_is_a_valid_schedule():
    built = one_f_one_b(2, 2)
    from_lists = Schedule([list(actions) for actions in built.ranks], 2, 1, 2, built.name)
    assert from_lists == built and hash(from_lists) == hash(built)
    unnamed = built.to_json().replace(f'"name": "{built.name}", ', "")
    assert Schedule.from_json(unnamed).ranks == built.ranks
    with pytest.raises(FxShardError, match=r"needs \['stages'\]"):
        Schedule.from_json(built.to_json().replace('"stages": 2, ', ""))


def test_zero_actions_print_as_tokens_and_misplaced_ones_are_rejected():
    from fxshard.schedule import add_zero_actions

    assert [str(Action.parse(t)) for t in ("U1", "R12", "G0")] == ["U1", "R12", "G0"]
    assert Action.parse("U1") == Action("U", 1) and Action.parse("R1") != Action.parse("RF1:0<0")
    for bad in ("U1:0", "X1", "F1", "G", "SF0:0>x", "SF0:0>1>2", "SF0:0<1", "W0:0<1", "RF0:0", "U1>0"):
        with pytest.raises(FxShardError, match="schedule action"):
            Action.parse(bad)
    zero = add_zero_actions(one_f_one_b(2, 2), unshard=True)
    assert str(zero).splitlines() == [
        "rank 0: U0 F0:0 SF0:0>1 F0:1 SF0:1>1 RB0:0<1 B0:0 RB0:1<1 B0:1 G0 R0 OPT",
        "rank 1: U1 RF1:0<0 F1:0 B1:0 SB1:0>0 RF1:1<0 F1:1 B1:1 SB1:1>0 G1 R1 OPT"]

    def edited(rank, tokens):
        ranks = list(zero.ranks)
        ranks[rank] = tuple(map(Action.parse, tokens.split()))
        return Schedule(tuple(ranks), 2, 1, 2, "edited")

    cases = {"outside a U0..R0 window": "U0 F0:0 SF0:0>1 R0 F0:1 SF0:1>1 RB0:0<1 B0:0 RB0:1<1 B0:1 G0 OPT",
             "again before R0": "U0 F0:0 SF0:0>1 U0 F0:1 SF0:1>1 RB0:0<1 B0:0 RB0:1<1 B0:1 G0 R0 OPT",
             "which no U0 gathered": "U0 F0:0 SF0:0>1 F0:1 SF0:1>1 RB0:0<1 B0:0 RB0:1<1 B0:1 G0 R0 R0 OPT",
             "U0 has no R0": "U0 F0:0 SF0:0>1 F0:1 SF0:1>1 RB0:0<1 B0:0 RB0:1<1 B0:1 G0 OPT",
             "G0 comes before B0:1": "U0 F0:0 SF0:0>1 F0:1 SF0:1>1 RB0:0<1 B0:0 G0 RB0:1<1 B0:1 R0 OPT",
             "never reduces chunk 0": "U0 F0:0 SF0:0>1 F0:1 SF0:1>1 RB0:0<1 B0:0 RB0:1<1 B0:1 R0 OPT",
             "G0 appears twice": "U0 F0:0 SF0:0>1 F0:1 SF0:1>1 RB0:0<1 B0:0 RB0:1<1 B0:1 G0 G0 R0 OPT",
             "G0 comes after OPT": "U0 F0:0 SF0:0>1 F0:1 SF0:1>1 RB0:0<1 B0:0 RB0:1<1 B0:1 R0 OPT G0",
             "chunk 1 lives on rank 1": "U0 U1 F0:0 SF0:0>1 F0:1 SF0:1>1 RB0:0<1 B0:0 RB0:1<1 B0:1 G0 R0 R1 OPT"}
    for message, tokens in cases.items():
        with pytest.raises(FxShardError, match=message):
            simulate(edited(0, tokens))


def test_the_pass_list_adds_zero_actions_for_the_strategy_and_keeps_a_users_own():
    import fxshard
    from fxshard.passes import lowered_schedule

    def kinds(mesh, **config):
        plan, _ = lowered_schedule(mesh, fxshard.Config(microbatches=4, **config))
        return sorted({a.kind for actions in plan.ranks for a in actions} & set(schedules.ZERO))

    assert kinds(fxshard.Mesh(pp=2, dp=2), sharding="optim_grads_params") == ["G", "R", "U"]
    assert kinds(fxshard.Mesh(pp=2, dp=2), sharding="optim") == ["G"]
    assert kinds(fxshard.Mesh(pp=2, dp=2), sharding="no_shard") == ["G"]
    assert kinds(fxshard.Mesh(pp=2)) == []  # no dp axis: nothing to gather or reduce
    own = Schedule.from_json('{"name": "mine", "stages": 2, "virtual": 1, "microbatches": 2, "ranks": '
                             '[["U0", "F0:0", "F0:1", "B0:0", "B0:1", "G0", "R0"], '
                             '["U1", "F1:0", "B1:0", "F1:1", "B1:1", "R1", "G1"]]}')
    plan, _ = lowered_schedule(fxshard.Mesh(pp=2, dp=2), fxshard.Config(schedule=own, sharding="optim_grads_params"))
    assert [str(a) for a in plan.ranks[1] if a.kind in schedules.ZERO] == ["U1", "R1", "G1"]  # kept as written
    with pytest.raises(FxShardError, match=r"sharding='no_shard' over dp=2 issues \['G'\]"):
        lowered_schedule(fxshard.Mesh(pp=2, dp=2), fxshard.Config(schedule=own, sharding="no_shard"))
    compute = Schedule(tuple(tuple(a for a in r if a.kind in schedules.COMPUTE) for r in own.ranks), 2, 1, 2, "mine")
    plan, _ = lowered_schedule(fxshard.Mesh(pp=2, dp=2), fxshard.Config(schedule=compute, sharding="optim_grads_params"))
    assert plan == schedules.add_zero_actions(schedules.add_communication(
        [list(r) for r in compute.ranks], 2, 1, 2, "mine"), True)


@settings(max_examples=12, deadline=None)
@given(name=st.sampled_from(["gpipe", "1f1b", "zb-h1", "interleaved-1f1b", "dualpipev"]), stages=st.integers(2, 4),
       rounds=st.integers(1, 2))
def test_one_stream_per_rank_hangs_only_interleaved_schedules_at_three_stages_or_more(name, stages, rounds):
    """NCCL with one communicator for the stage group (init_process_group(device_id=...)) runs a rank's
    transfers in issue order across peers: the built-in order holds for every schedule but interleaved
    1F1B at P >= 3, which the checker refuses naming the model."""
    virtual = 2 if name in ("interleaved-1f1b", "dualpipev") else 1
    microbatches = stages * rounds if name != "dualpipev" else 2 * stages * rounds
    schedule = schedules.build(name, stages, microbatches, virtual)
    order = schedules.issue_order(schedule)
    schedules.check_point_to_point(schedule, order)
    if name == "interleaved-1f1b" and stages >= 3:
        with pytest.raises(FxShardError, match="every transfer of a rank on one stream"):
            schedules.check_point_to_point(schedule, order, streams="group")
    else:
        schedules.check_point_to_point(schedule, order, streams="group")


def test_a_process_group_bound_to_a_device_refuses_a_schedule_that_would_hang_on_it(monkeypatch):
    import types

    from fxshard.runtime import agreement

    monkeypatch.setattr(agreement, "_backend", lambda group: "nccl")
    bound = types.SimpleNamespace(bound_device_id=torch.device("cuda", 0))
    mesh = fxshard.Mesh(pp=4)
    interleaved = fxshard.Config(schedule="interleaved-1f1b", virtual_stages=2, microbatches=8)
    with pytest.raises(FxShardError, match=r"device_id=cuda:0.*without device_id"):
        agreement.check_pipeline_streams(bound, mesh, interleaved)
    agreement.check_pipeline_streams(bound, mesh, fxshard.Config(schedule="1f1b", microbatches=8))
    agreement.check_pipeline_streams(types.SimpleNamespace(bound_device_id=None), mesh, interleaved)


def test_a_parameter_trained_on_one_stage_and_read_without_gradient_on_another_is_refused():
    """The reading stage would never see its updates (it holds no gradient to reduce)."""
    import torch

    import fxshard
    from fxshard.passes import run_pipeline

    class DetachedReader(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inp, self.out = torch.nn.Linear(4, 8), torch.nn.Linear(8, 1)
            self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))
            self.gain = torch.nn.Parameter(torch.ones(8))

        def forward(self, x):
            h = self.inp(x) * self.gain
            for block in self.blocks:
                h = h + torch.tanh(block(h))
            return self.out(h * self.gain.detach())

    batch = {"x": torch.randn(2, 4), "y": torch.randn(2, 1)}
    program = fxshard.trace(DetachedReader(), lambda m, b: ((m(b["x"]) - b["y"]) ** 2).mean(), batch)
    with pytest.raises(fxshard.FxShardError, match=r"parameter 'gain' is trained on pipeline stage\(s\) \[0\] and "
                                                   r"also read on stage 1 with no gradient"):
        run_pipeline(program, fxshard.Mesh(pp=2), fxshard.Config(microbatches=2), stage=1)


def test_a_schedule_missing_a_w_or_sending_from_another_rank_is_refused():
    from fxshard.schedule import Action, one_f_one_b, simulate, zero_bubble_h1

    zb = zero_bubble_h1(2, 2)
    no_w = schedules.Schedule(tuple(tuple(a for a in actions if str(a) != "W1:1") for actions in zb.ranks),
                              zb.stages, zb.virtual, zb.microbatches)
    with pytest.raises(FxShardError, match=r"rank 1 splits weight gradients off .* B's with no W .* \[\(1, 1\)\]"):
        simulate(no_w)
    plain = one_f_one_b(3, 2)
    send = next(a for a in plain.ranks[0] if a.kind == "SF")
    moved = [list(actions) for actions in plain.ranks]
    moved[0].remove(send)
    moved[2].insert(0, send)
    with pytest.raises(FxShardError, match=r"SF0:0>1 runs on rank 2, but chunk 0 lives on rank 0"):
        simulate(schedules.Schedule(tuple(map(tuple, moved)), 3, 1, 2))
    wrong_peer = [list(actions) for actions in plain.ranks]
    wrong_peer[0][wrong_peer[0].index(send)] = Action("SF", 0, 0, 2)
    with pytest.raises(FxShardError, match=r"SF0:0>2 on rank 0 names peer 2, but chunk 0's next chunk 1 lives on 1"):
        simulate(schedules.Schedule(tuple(map(tuple, wrong_peer)), 3, 1, 2))


def test_the_optimizer_phase_takes_its_cost_after_every_rank_action_and_counts_as_busy():
    schedule = schedules.one_f_one_b(2, 4)
    bare = simulate(schedule, {"F": 1.0, "B": 2.0})
    timed = simulate(schedule, {"F": 1.0, "B": 2.0, "OPT": 3.0})
    assert timed.makespan == bare.makespan + 3.0  # the last rank to finish runs OPT last
    for rank, actions in enumerate(schedule.ranks):
        opt = next(i for i, a in enumerate(actions) if a.kind == "OPT")
        assert timed.start[rank, opt] == max(timed.end[rank, i] for i in range(opt))
        busy = (1 - bare.bubble[rank]) * bare.makespan + 3.0
        assert timed.bubble[rank] == pytest.approx(1 - busy / timed.makespan)
