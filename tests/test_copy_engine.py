"""The copy-engine lowering (fxshard/runtime/copy_engine.py) and its workspace plan
(fxshard/runtime/workspace_plan.py): which nodes it rewrites, and, in the SPMD simulator with every
region really shared, that the lowered program computes exactly what the unlowered one does. What the
GPU copies compute is checked on GPUs (tests/test_gpu.py: bit-identical to NCCL, eager and graphed)."""

import dataclasses
import operator

import pytest
import torch
import torch.fx as fx
from hypothesis import given, strategies as st

import fxshard
from fxshard import meta
from fxshard.models import GPT, GPTConfig, MoEGPT, MoEGPTConfig
from fxshard.passes import run_pipeline
from fxshard.passes.fsdp import STRATEGIES, FSDPConfig, fsdp
from fxshard.runtime import workspace_plan
from fxshard.runtime.copy_engine import (COPY_ENGINE_COLLECTIVES, copy_engine_all_gather, copy_engine_all_to_all,
                                         copy_engine_reduce_scatter, lower_to_copy_engines, read_own_part_from_input)
from fxshard.runtime.reinplace import gather_updates_in_place, reinplace, write_back_positions
from fxshard.testing import SimulatedRanks
from strategies import MLPStack, mse, rank_batches, regression_batch, widths

c10d = torch.ops._c10d_functional
ADAMW = fxshard.optim.AdamW(lr=1e-2)


def moe_program(config, world=2):
    torch.manual_seed(0)
    model = MoEGPT(MoEGPTConfig.preset("tiny", capacity_factor=1.0))
    local = rank_batches(world, 2)
    program = run_pipeline(fxshard.trace(model, lambda m, b: m.loss_and_metrics(b), local[0], optimizer=ADAMW,
                                         config=config), fxshard.Mesh(dp=world, ep=world), config)[-1]
    return model, program


def test_every_ep_all_to_all_and_nothing_else_is_lowered():
    config = fxshard.Config(ep_overlap=True, microbatches=2, ep_interleave="dual-batch")
    _, program = moe_program(config)
    before = [n for n in program.graph.nodes if meta.is_moe_all_to_all(n)]
    others = [n.name for n in program.graph.nodes if n.op == "call_function" and n.target in
              (c10d.all_gather_into_tensor.default, c10d.reduce_scatter_tensor.default, c10d.all_reduce.default)]
    lowered, report = lower_to_copy_engines(program.graph_module)
    assert report.all_to_alls == len(before) > 0 and report.all_gathers == report.reduce_scatters == 0
    nodes = {n.name: n for n in lowered.graph.nodes}
    for node in before:
        new = nodes[node.name]
        assert new.target is copy_engine_all_to_all
        assert new.args[0] is nodes[node.args[0].name] and new.args[1:4] == node.args[1:4]
        value = node.args[0].meta["val"]
        region, total = new.args[4:6]
        assert region % 256 == 0 and region + value.numel() * value.element_size() <= total
        assert [u.target for u in new.users] == [c10d.wait_tensor.default]  # still waited where it was
    for name in others:
        assert nodes[name].target in (c10d.all_gather_into_tensor.default, c10d.reduce_scatter_tensor.default,
                                      c10d.all_reduce.default)
    assert all(not meta.is_moe_all_to_all(n) for n in lowered.graph.nodes)


def test_all_to_alls_with_unequal_splits_keep_nccl():
    graph = fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.empty(6, 4)
    for splits in ([2, 4], [3, 3]):
        node = graph.call_function(c10d.all_to_all_single.default, (x, splits, splits, "0"))
        node.meta[meta.MOE_PIECE] = "dispatch"
        graph.call_function(c10d.wait_tensor.default, (node,))
    graph.output(None)
    lowered, report = lower_to_copy_engines(fx.GraphModule(torch.nn.Module(), graph))
    assert report.all_to_alls == 1
    assert [n.args[1] for n in lowered.graph.nodes if n.target is copy_engine_all_to_all] == [[3, 3]]


def gather_graph():
    """Shards x, y: a = gather(x); b = gather(y), issued while a is still read (a prefetch); mm(a, b);
    c = reduce_scatter(mm); d = gather(x); mm(b, b), b's last read; e = gather(y), returned."""
    graph = fx.Graph()
    x, y = graph.placeholder("x"), graph.placeholder("y")
    x.meta["val"], y.meta["val"] = torch.empty(8), torch.empty(8)

    def gather(shard):
        node = graph.call_function(c10d.all_gather_into_tensor.default, (shard, 2, "dp"))
        view = graph.call_function(torch.ops.aten.view.default,
                                   (graph.call_function(c10d.wait_tensor.default, (node,)), [4, 4]))
        return node, view
    a, a_view = gather(x)
    b, b_view = gather(y)
    product = graph.call_function(torch.ops.aten.mm.default, (a_view, b_view))
    product.meta["val"] = torch.empty(4, 4)
    c = graph.call_function(c10d.reduce_scatter_tensor.default, (product, "avg", 2, "dp"))
    graph.call_function(c10d.wait_tensor.default, (c,))
    d, _ = gather(x)
    square = graph.call_function(torch.ops.aten.mm.default, (b_view, b_view))
    e, e_view = gather(y)
    graph.output((square, e_view))
    return graph, (a, b, c, d, e)


def test_a_region_is_reused_once_its_last_reader_has_run_and_returned_results_are_copied_out():
    graph, (a, b, c, d, e) = gather_graph()
    plan = workspace_plan.plan_regions(graph, [a, b, c, d, e])
    assert all(plan.sizes[n] == 256 for n in (a, b, c, d, e))  # 2 x 8 or 16 floats, aligned up
    assert plan.regions[a] == 0 and plan.regions[b] == 256  # b is issued while a is still read
    assert plan.lifetimes[c][0] == plan.lifetimes[c][1]  # read only by its own sum
    assert plan.regions[c] == 0 and plan.regions[d] == 0  # a's last reader ran before c, c's sum before d
    assert plan.regions[e] == 0 and plan.lifetimes[b][1] < plan.lifetimes[e][0]
    assert plan.copied_out == {a: False, b: False, c: False, d: False, e: True}
    assert plan.workspace == {"dp": 512} and plan.unshared == {"dp": 5 * 256}
    lowered, report = lower_to_copy_engines(fx.GraphModule(torch.nn.Module(), graph), gathers_and_scatters=True,
                                            timeout_s=2.5)
    assert (report.all_gathers, report.reduce_scatters, report.all_to_alls) == (4, 1, 0)
    calls = [n for n in lowered.graph.nodes if n.op == "call_function"]
    targets = [n.target for n in calls]
    assert targets.count(copy_engine_all_gather) == 4 and targets.count(copy_engine_reduce_scatter) == 1
    # their barriers give up after Config(collective_timeout_s) instead of hanging on a missing peer, and
    # each writes its place in the program into the device's marker around them (Watch reads it)
    lowered_calls = [n for n in calls if n.target in COPY_ENGINE_COLLECTIVES]
    assert [n.kwargs for n in lowered_calls] == [{"timeout_ms": 2500, "mark": (report.number, i), "barrier": "kernel"}
                                                 for i in range(5)]
    assert report.number > 0 and len(report.described) == 5
    assert report.described[4].startswith("all_gather_into_tensor of (8,), float32 [") and "on group 'dp'" in \
        report.described[4]
    assert "reduce_scatter_tensor of " in report.described[2]


def test_the_watch_names_the_collective_a_device_stopped_in_and_reports_a_stall_once(capsys):
    """The marker is host memory the device writes (runtime/copy_engine.py): here the host writes it, as
    a device would have before a barrier that never returns."""
    from fxshard.runtime.copy_engine import CopyEngineLowering, Watch

    graph, nodes = gather_graph()
    _, report = lower_to_copy_engines(fx.GraphModule(torch.nn.Module(), graph), gathers_and_scatters=True,
                                      timeout_s=5, axes={"dp": "data"})
    word = torch.zeros(3, dtype=torch.int32)  # [lowering, code, marks so far]
    watch = Watch(report, word, timeout_s=5, rank=1)
    assert watch.waiting_in() is None  # nothing ran yet
    word[:] = torch.tensor([report.number, 2 * 3 + 1, 7])  # waiting in collective 3
    assert watch.waiting_in() == report.described[3] and "on group 'data'" in report.described[3]
    word[1] = 2 * 3 + 2  # through it: the device stopped elsewhere, if it stopped
    assert watch.waiting_in() is None
    word[:] = torch.tensor([report.number + 1, 7, 8])  # another program's collective
    assert watch.waiting_in() is None
    assert Watch(CopyEngineLowering(), torch.zeros(3, dtype=torch.int32), 5).waiting_in() is None

    word[:] = torch.tensor([report.number, 2 * 1 + 1, 9])
    seen = watch.poll(None, now=100.0)
    assert watch.poll(seen, now=104.0) == seen and capsys.readouterr().err == ""  # within the timeout
    word[1:] = torch.tensor([2 * 2 + 1, 11])  # the next collective: the clock starts again
    seen = watch.poll(seen, now=104.5)
    assert seen == ((5, 11), 104.5) and watch.poll(seen, now=108.0) == seen and watch.reported is None
    word[2] = 11 + 2 * 5  # the same collective, steps later (the thread looked at the same moment of each)
    seen = watch.poll(seen, now=109.6)
    assert seen == ((5, 21), 109.6) and watch.reported is None  # not a stall: the clock starts again
    assert watch.poll(seen, now=114.0) == seen and watch.reported is None
    watch.poll(seen, now=115.0)
    watch.poll(seen, now=116.0)
    err = capsys.readouterr().err
    assert err.count("fxshard: rank 1: waited 5 s in the copy-engine " + report.described[2]) == 1
    assert "Config(collective_timeout_s)=5" in err and watch.reported == report.described[2]


def test_the_watch_thread_reports_a_stall_by_itself():
    import time

    from fxshard.runtime.copy_engine import Watch

    graph, _ = gather_graph()
    _, report = lower_to_copy_engines(fx.GraphModule(torch.nn.Module(), graph), gathers_and_scatters=True)
    word = torch.tensor([report.number, 1, 1], dtype=torch.int32)
    watch = Watch(report, word, timeout_s=0.2)
    watch.start()
    deadline = time.monotonic() + 10
    while watch.reported is None and time.monotonic() < deadline:
        time.sleep(0.05)
    watch.stop()
    assert watch.reported == report.described[0]


def test_stream_barriers_are_each_collectives_argument_and_the_watch_stops_the_device_for_them(capsys):
    """Config(copy_engine_barriers="stream"): every lowered collective says so in its arguments (the
    runtime dump shows it), and since such a barrier cannot give up by itself, the watch stops the
    device once, after the timeout (kernel barriers trap by themselves: the watch only reports)."""
    from fxshard.runtime.copy_engine import Watch

    graph, _ = gather_graph()
    with pytest.raises(fxshard.FxShardError, match="copy_engine_barriers='spin'; choose one of"):
        lower_to_copy_engines(fx.GraphModule(torch.nn.Module(), graph), gathers_and_scatters=True, barriers="spin")
    lowered, report = lower_to_copy_engines(fx.GraphModule(torch.nn.Module(), graph), gathers_and_scatters=True,
                                            timeout_s=5, barriers="stream")
    calls = [n for n in lowered.graph.nodes if n.op == "call_function" and n.target in COPY_ENGINE_COLLECTIVES]
    assert len(calls) == 5 and {n.kwargs["barrier"] for n in calls} == {"stream"}
    assert "barrier = 'stream'" in lowered.code and report.line().endswith("stream barriers)")
    for barriers, stops in (("stream", [3]), ("kernel", [])):
        stopped = []  # what the watch stopped: the stand-in records the call
        word = torch.tensor([report.number, 2 * 1 + 1, 3], dtype=torch.int32)  # waiting in collective 1
        watch = Watch(dataclasses.replace(report, barriers=barriers), word, timeout_s=5, device_index=3,
                      stopper=lambda: stopped.append(3))
        seen = watch.poll(None, now=0.0)
        watch.poll(seen, now=4.0)
        assert stopped == []  # within the timeout
        watch.poll(seen, now=6.0)
        watch.poll(seen, now=9.0)
        assert stopped == stops and watch.reported == report.described[1]
        err = capsys.readouterr().err
        assert ("stops the device" in err) == (barriers == "stream") and ("traps" in err) == (barriers == "kernel")
    with pytest.raises(fxshard.FxShardError, match="copy_engine_barriers='spin'"):
        fxshard.Config(copy_engine_barriers="spin")


_STOP_WHILE_HOLDING_THE_GIL = """
import ctypes, sys, time
from fxshard.runtime.copy_engine import DeviceStop

class Blocked(DeviceStop):
    def __init__(self):  # no CUDA: the assert's launch is what blocks, holding the GIL
        self.index, self.grace_s, self.armed = 0, 1.0, False
    def _assert(self):
        if sys.argv[1] == "reported":
            self.stopped_seen("the device stopped in a test")
            print("reported", flush=True)
            return
        ctypes.PyDLL(None).sleep(30)  # PyDLL keeps the GIL through the call: no Python thread can run

Blocked()()
time.sleep(1.5)  # past the grace period: an exit still armed would have fired
print("no exit", flush=True)
"""


@pytest.mark.parametrize("reported", [False, True])
def test_a_device_stop_ends_the_process_even_when_its_launch_blocks_holding_the_gil(reported):
    """DeviceStop arms a GIL-free exit (faulthandler's C thread) before it launches the assert: a
    launch behind a blocked hardware queue, with the GIL held, still ends the process after the grace
    period, with status 1 and every thread's stack; once the runtime has reported the stop, the exit
    is disarmed (and comes at interpreter exit instead, without group teardown)."""
    import subprocess
    import sys
    import time

    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", _STOP_WHILE_HOLDING_THE_GIL, "reported" if reported else "blocked"],
                          capture_output=True, text=True, timeout=60)
    if reported:
        assert done.returncode == 1 and "reported" in done.stdout and "no exit" in done.stdout
        assert "exiting without tearing down" in done.stderr and "Timeout" not in done.stderr
    else:
        assert done.returncode == 1 and "no exit" not in done.stdout and time.monotonic() - start < 25
        assert "exits with status 1 in 1 s" in done.stderr and "Timeout (0:00:01)" in done.stderr


def test_with_stream_barriers_the_marker_is_written_by_stream_memory_operations_not_a_kernel(monkeypatch,
                                                                                            stream_writes):
    """No kernel on the way into a collective whose barriers hold no SM: the marker's two words are
    written by cuStreamWriteValue32 (recorded here), at the marker's own address."""
    from fxshard.runtime import copy_engine

    word = torch.zeros(3, dtype=torch.int32)
    monkeypatch.setattr(copy_engine, "marker", lambda index: word)
    monkeypatch.setattr(copy_engine, "_mark_kernel", lambda: pytest.fail("a kernel was launched"))
    copy_engine._mark(0, 12, 2 * 3 + 1, "stream")
    assert stream_writes == [(7, word.data_ptr(), 12, 0), (7, word.data_ptr() + 4, 7, 0)]


def test_stream_barriers_are_refused_where_every_stream_shares_one_hardware_queue(monkeypatch):
    graph, _ = gather_graph()
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    with pytest.raises(fxshard.FxShardError, match="CUDA_DEVICE_MAX_CONNECTIONS=1.*copy_engine_barriers='kernel'"):
        lower_to_copy_engines(fx.GraphModule(torch.nn.Module(), graph), gathers_and_scatters=True, barriers="stream")
    lower_to_copy_engines(fx.GraphModule(torch.nn.Module(), graph), gathers_and_scatters=True)  # kernels: fine
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "2")
    lower_to_copy_engines(fx.GraphModule(torch.nn.Module(), graph), gathers_and_scatters=True, barriers="stream")


def test_a_stream_barrier_signals_every_peer_then_waits_for_each_then_resets_in_its_slot(monkeypatch):
    """The barrier of stream memory operations (its GPU run: bench/probes/stream_barrier.py), with the
    driver's functions recorded: rank 1 of 3 writes 1 into its word of the slot on each peer's signal
    pad, waits for each peer's word on its own pad to be 1, and sets those back to 0; a collective's two
    barriers (slots 0 and 1) use different words, all in the pads' second half."""
    from fxshard.runtime import copy_engine

    calls = []

    def driver(name):
        def call(stream, word, value, flags):
            calls.append((name, word, value, flags))
            return 0
        call.__name__ = name
        return call
    monkeypatch.setattr(copy_engine, "_stream_memory_operations", lambda: (driver("write"), driver("wait")))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: type("Stream", (), {"cuda_stream": 7})())

    class Handle:
        signal_pad_ptrs, rank, world_size, signal_pad_size = [1 << 20, 2 << 20, 3 << 20], 1, 3, 2048
    words = {}
    for slot in (0, 1):
        calls.clear()
        copy_engine._stream_barrier(Handle, slot)
        base = 1 << 20
        assert [c[0] for c in calls] == ["write", "write", "wait", "wait", "write", "write"]
        signals, waits, resets = calls[:2], calls[2:4], calls[4:]
        assert [w // base for _, w, _, _ in signals] == [1, 3] and all(c[2:] == (1, 0) for c in signals)
        assert {w // base for _, w, _, _ in waits} == {2} and all(c[2:] == (1, copy_engine._WAIT_EQ) for c in waits)
        assert [c[1] for c in resets] == [c[1] for c in waits] and all(c[2] == 0 for c in resets)
        offsets = {w % base for _, w, _, _ in calls}
        assert all(1024 <= o < 2048 and o % 4 == 0 for o in offsets)  # the second half: torch's channels are below
        words[slot] = offsets
    assert not words[0] & words[1]
    Handle.signal_pad_size = 16  # no room for 3 ranks in two slots
    with pytest.raises(fxshard.FxShardError, match="no room for 3 ranks"):
        copy_engine._stream_barrier(Handle, 0)


def aliased_read_graph(alias: str) -> fx.GraphModule:
    """a = gather(x), waited at once, then read through `alias` only after b = gather(y) is issued: the
    plan must follow the alias, or b's region is a's and the late read sees y's values."""
    aten = torch.ops.aten
    graph = fx.Graph()
    x, y = graph.placeholder("x"), graph.placeholder("y")
    x.meta["val"], y.meta["val"] = torch.empty(8), torch.empty(8)
    a = graph.call_function(c10d.all_gather_into_tensor.default, (x, 2, "dp"))
    waited = graph.call_function(c10d.wait_tensor.default, (a,))
    if alias == "split":
        kept = graph.call_function(operator.getitem, (graph.call_function(aten.split.Tensor, (waited, 8)), 1))
    else:
        kept = graph.call_function(*{"view": (aten.view.default, (waited, [4, 4])),
                                     "slice": (aten.slice.Tensor, (waited, 0, 4, 12)),
                                     "alias": (aten.alias.default, (waited,))}[alias])
    b = graph.call_function(c10d.all_gather_into_tensor.default, (y, 2, "dp"))
    late = graph.call_function(aten.mul.Tensor, (kept, 2.0))
    graph.output((late, graph.call_function(c10d.wait_tensor.default, (b,))))
    return fx.GraphModule(torch.nn.Module(), graph)


@pytest.mark.parametrize("alias", ["view", "split", "slice", "alias"])
def test_a_result_read_through_an_alias_after_the_next_issue_keeps_its_region(alias):
    from fxshard.spmd import simulate

    graph_module = aliased_read_graph(alias)
    lowered, report = lower_to_copy_engines(graph_module, gathers_and_scatters=True)
    assert report.workspace["dp"] == report.unshared["dp"]  # nothing could be reused
    inputs = [[torch.arange(8.0) + 10 * rank, -torch.arange(8.0) - 10 * rank] for rank in range(2)]
    expected = simulate([graph_module] * 2, inputs, {"dp": [0, 1]})
    for got, want in zip(simulate([lowered] * 2, inputs, {"dp": [0, 1]}), expected):
        assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_a_send_an_nccl_collective_or_a_lowered_one_reads_its_input_until_it_is_done():
    graph = fx.Graph()
    x, y = graph.placeholder("x"), graph.placeholder("y")
    x.meta["val"], y.meta["val"] = torch.empty(8), torch.empty(8)
    gathers = []
    for reader in (torch.ops.fxshard.send.default, c10d.all_reduce.default):
        a = graph.call_function(c10d.all_gather_into_tensor.default, (x, 2, "dp"))
        waited = graph.call_function(c10d.wait_tensor.default, (a,))
        args = (waited, 1, "dp") if reader is torch.ops.fxshard.send.default else (waited, "sum", "dp")
        token = graph.call_function(reader, args)
        b = graph.call_function(c10d.all_gather_into_tensor.default, (y, 2, "dp"))
        graph.call_function(c10d.wait_tensor.default, (b,))
        graph.call_function(c10d.wait_tensor.default, (token,))  # the send / all-reduce may read a until here
        gathers += [a, b]
    plan = workspace_plan.plan_regions(graph, gathers)
    for a, b in zip(gathers[::2], gathers[1::2]):
        assert plan.regions[a] != plan.regions[b]
        assert plan.lifetimes[a][1] > plan.lifetimes[b][0]
    # a lowered collective whose input is an earlier one's result reads it while peers write its own region
    graph = fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.empty(8)
    a = graph.call_function(c10d.all_gather_into_tensor.default, (x, 2, "dp"))
    gathered = graph.call_function(c10d.wait_tensor.default, (a,))
    gathered.meta["val"] = torch.empty(16)
    c = graph.call_function(c10d.all_gather_into_tensor.default, (gathered, 2, "dp"))
    plan = workspace_plan.plan_regions(graph, [a, c])
    assert plan.regions == {a: 0, c: 256}


def simulate_both(program, model, mesh, batches, all_to_alls, gathers_and_scatters, own_part="copy"):
    """Train `program` on the simulator as CompiledStep lowers it for CUDA, unlowered and lowered to copy
    engines (regions shared for real); return both runs' losses and states, and the lowering's report."""
    reports = []

    def lowered(gm, rank, places):
        gm = gather_updates_in_place(reinplace(gm)[0], write_back_positions(program))[0]
        gm, report = lower_to_copy_engines(gm, all_to_alls, gathers_and_scatters, own_part=own_part,
                                           group_rank=places.__getitem__)
        reports.append(report)
        return gm

    runs = []
    for lowering in (lambda gm, rank, places: reinplace(gm)[0], lowered):
        ranks = SimulatedRanks(program, model, ADAMW, mesh, rank_lowering=lowering)
        losses = [[m["loss"] for m in ranks.step(batch)] for batch in batches]
        runs.append((losses, ranks.states))
    return runs, reports[0]


def assert_identical(runs):
    (losses, states), (lowered_losses, lowered_states) = runs
    assert all(torch.equal(a, b) for step, other in zip(losses, lowered_losses) for a, b in zip(step, other))
    for state, other in zip(states, lowered_states):
        assert state.keys() == other.keys()
        for key in state:
            assert torch.equal(state[key], other[key]), key


def fsdp_case(model_widths, strategy, prefetch, microbatches, steps=2):
    torch.manual_seed(0)
    model = MLPStack(model_widths)
    generator = torch.Generator().manual_seed(0)
    batches = [[regression_batch(generator, 2 * microbatches) for _ in range(2)] for _ in range(steps)]
    local = fxshard.trace(model, mse, batches[0][0], optimizer=ADAMW, config=fxshard.Config(microbatches=microbatches))
    return model, fsdp(local, FSDPConfig(2, strategy, prefetch)), batches


@given(widths=widths, strategy=st.sampled_from(STRATEGIES[1:]), prefetch=st.integers(0, 2),
       microbatches=st.sampled_from([1, 2]))
def test_fsdp_collectives_on_copy_engines_compute_exactly_what_nccl_does(widths, strategy, prefetch, microbatches):
    model, program, batches = fsdp_case(widths, strategy, prefetch, microbatches)
    runs, report = simulate_both(program, model, fxshard.Mesh(dp=2), batches, False, True)
    assert report.all_gathers + report.reduce_scatters > 0
    assert_identical(runs)


def test_moe_with_every_collective_on_copy_engines_computes_exactly_what_nccl_does():
    config = fxshard.Config(sharding="optim", ep_overlap=True, microbatches=2, ep_interleave="dual-batch")
    model, program = moe_program(config)
    batches = [rank_batches(2, 2, seed=seed) for seed in range(2)]
    runs, report = simulate_both(program, model, fxshard.Mesh(dp=2, ep=2), batches, True, True)
    assert report.all_to_alls > 0 and report.all_gathers > 0 and report.reduce_scatters > 0
    assert sum(report.workspace.values()) < sum(report.unshared.values())  # regions were reused
    assert_identical(runs)


@pytest.mark.parametrize("ep", [2, 4])
def test_all_to_alls_whose_readers_take_the_own_part_from_the_input_compute_exactly_what_nccl_does(ep):
    """own_part="input": each EP all-to-all skips its own rows (the simulated region keeps whatever it
    held there) and every reader gets them from the input through a cat of its rank's own slice (at
    ep=4 the middle ranks' own rows lie between two parts of the region)."""
    config = fxshard.Config(sharding="optim", ep_overlap=True, microbatches=2, ep_interleave="dual-batch")
    model, program = moe_program(config, world=ep)
    mesh = fxshard.Mesh(dp=ep, ep=ep)
    batches = [rank_batches(ep, 2, seed=seed) for seed in range(2)]
    runs, report = simulate_both(program, model, mesh, batches, True, False, own_part="input")
    assert report.all_to_alls > 0 and report.own_parts_from_input == report.all_to_alls
    assert f"all-to-alls ({report.all_to_alls} read their own part from the input)" in report.line()
    assert_identical(runs)
    places = {}

    def lowering(gm, rank, place):
        places[rank] = place
        return lower_to_copy_engines(reinplace(gm)[0], True, False, own_part="input", group_rank=place.__getitem__)[0]

    graphs = SimulatedRanks(program, model, ADAMW, mesh, rank_lowering=lowering).graphs
    for rank, graph in enumerate(graphs):
        lowered = [n for n in graph.graph.nodes if n.target is copy_engine_all_to_all]
        assert lowered and all(n.kwargs.get("skip_own") for n in lowered)
        for exchange in lowered:  # its own rows, sliced from its input, go into a cat for each reader
            x, rows, place = exchange.args[0], exchange.args[1][0], places[rank][exchange.args[3]]
            own = [n for n in x.users if n.target is torch.ops.aten.slice.Tensor
                   and n.args[1:] == (0, place * rows, (place + 1) * rows)]
            assert own and all(user.target is torch.ops.aten.cat.default for n in own for user in n.users)


@pytest.mark.parametrize("source, reader, rewritten", [
    ("compute", "gather", True), ("view of compute", "gather", True),
    ("graph input", "gather", False), ("view of a collective's result", "gather", False),
    ("compute", "op with a kernel of its own", False), ("compute written into later", "gather", False)])
def test_the_own_part_is_read_from_the_input_only_where_that_input_is_fresh_compute_nobody_writes(
        source, reader, rewritten):
    """read_own_part_from_input on small graphs: an all-to-all of 2 ranks x 4 rows whose result a gather
    (index_select) reads. Refused where its input is a graph input or aliases another collective's
    result (whose region may be reused while the cat still reads it), where something writes into the
    input, or where the reader is a fixed op (the cat would be written out before it)."""
    graph = fx.Graph()
    a, order = graph.placeholder("a"), graph.placeholder("order")
    x = {"graph input": a}.get(source) or graph.call_function(torch.ops.aten.mul.Tensor, (a, 2))
    if source == "view of compute":
        x = graph.call_function(torch.ops.aten.view.default, (x, [8, 3]))
    if source == "view of a collective's result":
        gathered = graph.call_function(c10d.wait_tensor.default, (
            graph.call_function(c10d.all_gather_into_tensor.default, (a, 1, "g")),))
        x = graph.call_function(torch.ops.aten.view.default, (gathered, [8, 3]))
    exchange = graph.call_function(c10d.all_to_all_single.default, (x, [4, 4], [4, 4], "g"))
    result = graph.call_function(c10d.wait_tensor.default, (exchange,))
    if reader == "gather":
        out = graph.call_function(torch.ops.aten.index_select.default, (result, 0, order))
    else:
        out = graph.call_function(torch.ops.fxshard.adamw_update.default, (result, result, result, result))
    if source == "compute written into later":
        graph.call_function(torch.ops.aten.add_.Tensor, (x, 1))
    graph.output(out)
    assert read_own_part_from_input(graph, exchange, rank=1) is rewritten
    cats = [n for n in graph.nodes if n.target is torch.ops.aten.cat.default]
    if rewritten:  # rank 1's own rows are the input's last 4; the first 4 come from the region
        (cat,) = cats
        assert cat.users.keys() == {out} and result not in out.args
        (before, own), = cat.args
        assert (before.args, own.args) == ((result, 0, 0, 4), (x, 0, 4, 8))
    else:
        assert not cats and result in out.args
    graph.lint()
    with pytest.raises(fxshard.FxShardError, match="copy_engine_own_part='region'; choose one of"):
        fxshard.Config(copy_engine_own_part="region")


def test_zero3_gathers_reuse_regions_and_a_plan_that_reuses_too_early_is_caught(monkeypatch):
    """The simulator's check can fail: with every region at offset 0, a prefetched gather overwrites the
    parameters the layer before it is still computing with."""
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny"))
    local = rank_batches(2, 2)
    config = fxshard.Config()
    program = run_pipeline(fxshard.trace(model, lambda m, b: m.loss(b), local[0], optimizer=ADAMW,
                                         config=config), fxshard.Mesh(dp=2), config)[-1]
    batches = [rank_batches(2, 2, seed=seed) for seed in range(2)]
    runs, report = simulate_both(program, model, fxshard.Mesh(dp=2), batches, False, True)
    assert report.workspace["dp"] < report.unshared["dp"] / 2
    assert_identical(runs)
    monkeypatch.setattr(workspace_plan, "_first_fit", lambda held, size: 0)
    runs, _ = simulate_both(program, model, fxshard.Mesh(dp=2), batches[:1], False, True)
    with pytest.raises(AssertionError):
        assert_identical(runs)


def test_collective_backends_are_checked():
    with pytest.raises(fxshard.FxShardError, match="ep_all_to_all"):
        fxshard.Config(ep_all_to_all="nvshmem")
    with pytest.raises(fxshard.FxShardError, match="fsdp_collectives"):
        fxshard.Config(fsdp_collectives="nvshmem")
    assert fxshard.Config(fsdp_collectives="copy-engine").fsdp_collectives == "copy-engine"


def test_a_workspace_that_cannot_be_set_up_says_why_and_what_to_do(monkeypatch):
    from torch.distributed import _symmetric_memory as symm

    from fxshard.runtime import copy_engine

    def no_peer_access(*args, **kwargs):
        raise RuntimeError("CUDA driver error: peer access is not supported between these two devices")

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(symm, "enable_symm_mem_for_group", lambda name: None)
    monkeypatch.setattr(symm, "empty", no_peer_access)
    with pytest.raises(fxshard.FxShardError, match="peer access is not supported.*fsdp_collectives='nccl'"):
        copy_engine._workspace("ep_group", 2 ** 30)
    assert "ep_group" not in copy_engine._WORKSPACES


def test_a_new_workspace_is_zeroed_on_the_device_before_any_peer_can_signal_into_it(monkeypatch):
    """torch 2.11 zeroes a symmetric allocation's signal pad with a memset that returns before it runs;
    a peer's first barrier signal that lands before it is erased (the likeliest cause of a stalled MoE
    benchmark on 2x H200, bench/RESULTS.md 2026-11-28).
    The device is synchronized between the allocation and the exchange that lets peers signal, and
    after the exchange (the peers' pointers are uploaded the same way); also when a larger workspace
    replaces the group's."""
    from torch.distributed import _symmetric_memory as symm

    from fxshard.runtime import copy_engine

    calls = []
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append("synchronize"))
    monkeypatch.setattr(symm, "enable_symm_mem_for_group", lambda name: None)
    monkeypatch.setattr(symm, "empty", lambda n, dtype, device: calls.append("empty") or torch.empty(n, dtype=dtype))
    monkeypatch.setattr(symm, "rendezvous", lambda tensor, name: calls.append("rendezvous") or f"handle {tensor.numel()}")
    monkeypatch.setattr(copy_engine, "_WORKSPACES", {})
    monkeypatch.setattr(copy_engine, "_RETIRED", [])
    assert copy_engine._workspace("dp", 256) == "handle 256"
    assert copy_engine._workspace("dp", 128) == "handle 256"  # large enough: no new allocation
    assert copy_engine._workspace("dp", 512) == "handle 512"
    assert calls == ["empty", "synchronize", "rendezvous", "synchronize"] * 2
    assert [t.numel() for t, _ in copy_engine._RETIRED] == [256]  # kept: a copy may still write it


def test_a_step_whose_device_stopped_in_a_copy_engine_collective_says_which():
    """The runtime's error path (the device's trap itself needs two GPUs: tests/test_gpu.py): a CUDA
    error from a step while the marker says "waiting in collective i" becomes an FxShardError naming it;
    any other error passes through unchanged."""
    from fxshard.runtime.copy_engine import Watch

    batch = regression_batch(torch.Generator().manual_seed(0), 4)
    step = fxshard.shard(MLPStack([4, 4]), mse, batch, optimizer=ADAMW)
    graph, _ = gather_graph()
    _, report = lower_to_copy_engines(fx.GraphModule(torch.nn.Module(), graph), gathers_and_scatters=True)
    word = torch.tensor([report.number, 2 * 4 + 2, 10], dtype=torch.int32)
    step._watch = Watch(report, word, timeout_s=5)

    def trapped(_batch):
        raise RuntimeError("CUDA error: unspecified launch failure\nmore")
    step._call = trapped
    with pytest.raises(RuntimeError, match="unspecified launch failure"):  # through collective 4: not its doing
        step(batch)
    word[1] = 2 * 4 + 1
    with pytest.raises(fxshard.FxShardError) as error:
        step(batch)
    text = str(error.value)
    assert text.startswith("this rank's device stopped in the copy-engine " + report.described[4])
    assert "Config(collective_timeout_s)" in text and text.endswith("CUDA said: CUDA error: unspecified launch failure")


@pytest.fixture
def triton_chunks(monkeypatch):
    """fxshard.runtime._triton_chunks: the real kernels on CUDA; without a GPU, Triton's interpreter
    (numpy) where triton is installed (not in CI's CPU environment: skipped there)."""
    import importlib
    import sys

    if not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")  # read when the kernel is decorated: import afresh
        monkeypatch.delitem(sys.modules, "fxshard.runtime._triton_chunks", raising=False)
    pytest.importorskip("triton")
    return importlib.import_module("fxshard.runtime._triton_chunks")


@pytest.fixture
def sum_chunks(triton_chunks):
    return triton_chunks.sum_chunks


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_reduce_scatter_sums_its_own_chunk_where_it_is_and_the_others_in_rank_order(sum_chunks, world, dtype):
    """The copy-engine reduce-scatter's sum: this rank's chunk read from its input (its block of the
    region is never written: NaN here, never read), every chunk summed in rank order in fp32, times
    float32(1 / world) for avg (torch's CUDA division by a number; at three ranks the GPU caught an
    IEEE division here), rounded once; for fp32 at two ranks, what the three-pass sum it replaced gave."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and dtype is torch.bfloat16:
        pytest.skip("Triton's interpreter rounds float32 to bfloat16 by truncation, a GPU to nearest")
    generator = torch.Generator().manual_seed(world)
    n = 3000  # not a multiple of the kernel's block
    for rank in range(world):
        for average in (True, False):
            chunks = [torch.randn(n, generator=generator).to(dtype).to(device) for _ in range(world)]
            landed = torch.cat(chunks)
            landed[rank * n:(rank + 1) * n] = float("nan")
            out = sum_chunks(chunks[rank], landed, torch.empty(n, dtype=dtype, device=device), world, rank, average)
            total = torch.zeros(n, dtype=torch.float32, device=device)
            for chunk in chunks:
                total = total + chunk.float()
            expected = (total * (1.0 / world) if average else total).to(dtype)  # torch's CUDA div_ by a number
            assert torch.equal(out, expected), (rank, average)
            if dtype is torch.float32 and world == 2:
                stacked = torch.stack(chunks)
                before = torch.sum(stacked, dim=0)
                assert torch.equal(out, before.div_(world) if average else before)


def test_auto_collectives_pick_copy_engines_only_where_they_were_measured_faster(monkeypatch):
    """Config "auto" (the default of ep_all_to_all and fsdp_collectives): copy engines for a step under
    CUDA graphs of 2 CUDA processes on one host whose GPUs have peer access, NCCL for anything else;
    on CPU nothing is gathered and the lowering line says what was chosen and why."""
    from fxshard.runtime.copy_engine import choose_auto, resolve_auto

    cuda = torch.device("cuda", 0)
    both = [("node0", "GPU-a", {"GPU-b": True}), ("node0", "GPU-b", {"GPU-a": True})]
    assert choose_auto(cuda, 2, both) == (True, "2 GPUs of one host with peer access")
    for device, world, places, why in (
            (torch.device("cpu"), 2, both, "not CUDA"),
            (cuda, 4, both * 2, "measured on 2 GPUs only"),
            (cuda, 2, [("node0", "GPU-a", {}), ("node1", "GPU-b", {})], "more than one host"),
            (cuda, 2, [("node0", "GPU-a", {"GPU-b": True})] * 2, "share a GPU"),
            (cuda, 2, [both[0], ("node0", "GPU-b", {"GPU-a": False})], "lack peer access"),
            (cuda, 2, [("node0", "GPU-a", {}), ("node0", "GPU-b", {})], "sees only its own GPU")):
        chosen, said = choose_auto(device, world, places)
        assert not chosen and why in said, said
    for device, graphed, why in ((cuda, False, "no CUDA graphs"), (torch.device("cpu"), True, "not CUDA")):
        chosen, said = choose_auto(device, 2, both, graphed)
        assert not chosen and why in said, said
    monkeypatch.setenv("NCCL_P2P_DISABLE", "1")
    assert choose_auto(cuda, 2, both) == (False, "NCCL_P2P_DISABLE is set")
    assert resolve_auto("auto", "copy-engine", torch.device("cpu")) == (
        "nccl", "copy-engine", "collectives 'auto': nccl, i.e. the process group's own collectives (not CUDA)")
    assert resolve_auto("nccl", "nccl", torch.device("cpu")) == ("nccl", "nccl", None)
    assert resolve_auto("auto", "auto", cuda, meshed=False) == (  # nothing gathered: no other rank may be here
        "nccl", "nccl", "collectives 'auto': nccl (no process groups)")
    assert fxshard.Config().fsdp_collectives == fxshard.Config().ep_all_to_all == "auto"
    step = fxshard.shard(MLPStack([3, 4, 1]), mse, regression_batch(torch.Generator().manual_seed(0), 4))
    assert "collectives 'auto': nccl, i.e. the process group's own collectives (no process groups)" in step.lowerings()
