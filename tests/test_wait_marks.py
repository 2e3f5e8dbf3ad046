"""runtime/wait_marks.py on CPU: the marks change no value (the SPMD simulator trains the marked and the
unmarked programs alike), come one before each wait for an NCCL collective or transfer, in program
order, and say what a stalled stream waits for. The words a real device writes are host memory: here
the marks' writer is recorded and the host writes the words itself."""

import contextlib
import re
import weakref
from unittest import mock

import pytest
import torch
import torch.fx as fx
from hypothesis import given, strategies as st

import fxshard
from fxshard.models import GPT, GPTConfig
from fxshard.passes import run_pipeline
from fxshard.passes.fsdp import STRATEGIES, FSDPConfig, fsdp
from fxshard.runtime import wait_marks
from fxshard.runtime.replay_watch import ReplayWatch
from fxshard.runtime.wait_marks import WaitMarks, mark_waits
from fxshard.testing import SimulatedRanks
from strategies import MLPStack, mse, regression_batch, widths

c10d = torch.ops._c10d_functional
ADAMW = fxshard.optim.AdamW(lr=1e-2)


@contextlib.contextmanager
def recorded():
    """The marks each simulated rank's stream would write, in the order it runs them (rank, lowering, wait)."""
    seen = []
    with mock.patch.object(wait_marks, "wait_mark", lambda index, lowering, wait: seen.append((index, lowering, wait))):
        yield seen


def train_both(program, model, mesh, batches):
    """Losses and states of `program` trained on the simulator unmarked and marked (each rank's graph
    through mark_waits with its rank as the device), and every rank's WaitMarks."""
    reports = {}

    def marked(gm, rank, places):
        gm, reports[rank] = mark_waits(gm, rank, {})
        return gm

    runs = []
    for lowering in (lambda gm, rank, places: gm, marked):
        ranks = SimulatedRanks(program, model, ADAMW, mesh, rank_lowering=lowering)
        runs.append(([[m["loss"] for m in ranks.step(batch)] for batch in batches], ranks.states))
    return runs, reports


def assert_identical(runs):
    (losses, states), (marked_losses, marked_states) = runs
    assert all(torch.equal(a, b) for step, other in zip(losses, marked_losses) for a, b in zip(step, other))
    for state, other in zip(states, marked_states):
        assert state.keys() == other.keys() and all(torch.equal(state[k], other[k]) for k in state)


def assert_marked_in_order(written, reports, steps):
    """Each rank ran 0, 1, ..., n every step, with its own lowering's number."""
    for rank, report in reports.items():
        mine = [(lowering, wait) for index, lowering, wait in written if index == rank]
        assert report.count > 0 and mine == [(report.number, w) for w in range(report.count + 1)] * steps


@given(widths=widths, strategy=st.sampled_from(STRATEGIES), prefetch=st.integers(0, 2),
       microbatches=st.sampled_from([1, 2]))
def test_marked_fsdp_programs_train_exactly_like_unmarked_ones(widths, strategy, prefetch, microbatches):
    torch.manual_seed(0)
    model = MLPStack(widths)
    generator = torch.Generator().manual_seed(0)
    batches = [[regression_batch(generator, 2 * microbatches) for _ in range(2)] for _ in range(2)]
    traced = fxshard.trace(model, mse, batches[0][0], optimizer=ADAMW, config=fxshard.Config(microbatches=microbatches))
    program = fsdp(traced, FSDPConfig(2, strategy, prefetch))
    with recorded() as written:
        runs, reports = train_both(program, model, fxshard.Mesh(dp=2), batches)
    assert_identical(runs)
    assert_marked_in_order(written, reports, steps=len(batches))


def test_marked_pipeline_stages_train_exactly_like_unmarked_ones_every_transfer_marked():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, d_model=16, n_layer=4, n_head=2, d_ff=32))
    generator = torch.Generator().manual_seed(0)
    steps = [{"idx": torch.randint(0, 32, (4, 8), generator=generator),
              "tgt": torch.randint(0, 32, (4, 8), generator=generator)} for _ in range(2)]
    batches = [[batch, batch] for batch in steps]  # each stage is fed the step's whole batch
    mesh, config = fxshard.Mesh(pp=2), fxshard.Config(schedule="interleaved-1f1b", virtual_stages=2, microbatches=4)
    one_microbatch = {key: value[:1] for key, value in steps[0].items()}
    traced = fxshard.trace(model, lambda m, b: m.loss(b), one_microbatch, optimizer=ADAMW)
    stages = [run_pipeline(traced, mesh, config, stage=s)[-1] for s in range(2)]
    with recorded() as written:
        runs, reports = train_both(stages, model, mesh, batches)
    assert_identical(runs)
    assert_marked_in_order(written, reports, steps=len(batches))
    for stage, report in zip(stages, reports.values()):  # every transfer's wait is marked: sends, receives
        transfers = [n for n in stage.graph.nodes if n.op == "call_function" and "fxshard." in str(n.target)
                     and n.target._opname in ("send", "recv")]
        assert sum(("send to" in d or "receive from" in d) for d in report.described) == len(transfers) > 0


def hand_graph():
    """a = gather(x) and b = gather(y) issued, b waited first (a still in flight), then a; c =
    reduce_scatter(a + b) waited; a tensor through a non-NCCL op's wait is left alone."""
    graph = fx.Graph()
    x, y = graph.placeholder("x"), graph.placeholder("y")
    x.meta["val"], y.meta["val"] = torch.empty(8), torch.empty(8)
    a = graph.call_function(c10d.all_gather_into_tensor.default, (x, 2, "g0"))
    b = graph.call_function(c10d.all_gather_into_tensor.default, (y, 2, "g0"))
    wb = graph.call_function(c10d.wait_tensor.default, (b,))
    wa = graph.call_function(c10d.wait_tensor.default, (a,))
    total = graph.call_function(torch.ops.aten.add.Tensor, (wa, wb))
    total.meta["val"] = torch.empty(16)
    c = graph.call_function(c10d.reduce_scatter_tensor.default, (total, "sum", 2, "g0"))
    wc = graph.call_function(c10d.wait_tensor.default, (c,))
    other = graph.call_function(torch.ops.aten.clone.default, (x,))  # not NCCL's: its wait is not marked
    graph.call_function(c10d.wait_tensor.default, (other,))
    graph.output((wc,))
    return fx.GraphModule(torch.nn.Module(), graph)


def test_a_mark_before_each_nccl_wait_names_it_and_what_its_group_still_has_in_flight():
    gm, report = mark_waits(hand_graph(), 3, {"g0": "dp"})
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    marks = [(n.args, n.next.target) for n in calls if n.target is wait_marks.wait_mark]
    assert [args for args, _ in marks] == [(3, report.number, w) for w in range(4)]
    assert [after for _, after in marks[1:]] == [c10d.wait_tensor.default] * 3  # right before each wait
    assert marks[0][1] is c10d.all_gather_into_tensor.default  # the step's first mark before everything
    assert report.count == 3 and all("on group 'dp'" in d for d in report.described)
    assert [d.split(" of ")[0] for d in report.described] == ["all_gather_into_tensor"] * 2 + ["reduce_scatter_tensor"]
    assert report.in_flight[0] == (report.described[1],) and report.in_flight[1] == report.in_flight[2] == ()

    word = torch.zeros(2, dtype=torch.int32)
    assert report.waiting_in(word) is None  # the step's start: no wait reached yet
    word[:] = torch.tensor([report.number, 1])
    said = report.waiting_in(word)
    assert said.startswith(f"the wait for the {report.described[0]} (wait 1 of 3") and report.described[1] in said
    word[:] = torch.tensor([report.number + 1, 1])  # another step's mark
    assert report.waiting_in(word) is None
    assert mark_waits(fx.GraphModule(torch.nn.Module(), fx.Graph()), 0)[1] == WaitMarks()


def test_the_marks_are_stream_memory_writes_at_the_words_address(monkeypatch, stream_writes):
    word = torch.zeros(2, dtype=torch.int32)
    monkeypatch.setattr(wait_marks, "words", lambda index: word)
    wait_marks.wait_mark(0, 4, 17)
    assert stream_writes == [(7, word.data_ptr(), 4, 0), (7, word.data_ptr() + 4, 17, 0)]


def test_the_replay_watch_and_the_step_it_ends_say_what_the_stalled_stream_waits_for(capsys, monkeypatch):
    expired = []
    watch = ReplayWatch(5.0, rank=1, expire=lambda what, seconds, how: expired.append(what),
                        where=lambda: "the wait for the all_gather_into_tensor of x")
    watch._thread = object()  # driven by hand: no thread
    watch.launched("step 4", lambda: False, now=0.0)
    assert watch.poll(6.0) == "step 4" and expired == ["step 4"]
    assert "step 4 has run 6 s under its CUDA graph" in (err := capsys.readouterr().err)
    assert "this rank is at the wait for the all_gather_into_tensor of x. Aborting" in err

    # the step's own expire (runtime/step.py), here on a step without a mesh given the marks by hand
    from fxshard.runtime import step as step_module
    from strategies import MLPStack

    batch = regression_batch(torch.Generator().manual_seed(0), 4)
    step = fxshard.shard(MLPStack([4, 8, 4]), mse, batch, optimizer=ADAMW)
    _, step.wait_marks = mark_waits(hand_graph(), 0, {"g0": "dp"})
    word = torch.tensor([step.wait_marks.number, 3], dtype=torch.int32)
    monkeypatch.setattr(step_module, "wait_marks_words", lambda index: word)
    step_module._expire_replay(weakref.ref(step), 5.0)("step 2", 7.4, "under its CUDA graph")
    with pytest.raises(fxshard.FxShardError, match=re.escape(
            f"a rank stalled or stopped in a collective or transfer (this rank was at the wait for the "
            f"{step.wait_marks.described[2]} (wait 3 of 3 in the step)), so this rank aborted")):
        step(batch)
