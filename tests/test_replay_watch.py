"""The watchdog of CUDA-graph replays on a mesh (fxshard/runtime/replay_watch.py), on a clock of its
own: a replay counts from when it could start (launched, and the one before it done), is reported once
it has run longer than the timeout, and only once. The real thing, a stalled NCCL peer under CUDA
graphs, is a multigpu test in test_gpu.py."""

import re

import pytest

from fxshard.runtime.replay_watch import ReplayWatch, abort_groups


class Replay:
    def __init__(self):
        self.finished = False

    def done(self):
        return self.finished


def a_watch(timeout_s=10.0):
    expired = []
    watch = ReplayWatch(timeout_s, rank=1, expire=lambda what, seconds, how: expired.append((what, seconds)))
    watch._thread = object()  # driven by hand: no thread
    return watch, expired


def test_a_replay_counts_from_when_the_one_before_it_finished(capsys):
    watch, expired = a_watch()
    first, second = Replay(), Replay()
    watch.launched("step 1", first.done, now=0.0)
    watch.launched("step 2", second.done, now=0.5)  # the host runs a step ahead
    assert watch.poll(9.0) is None
    first.finished = True
    assert watch.poll(9.5) is None  # step 2 could start only now
    assert watch.poll(19.0) is None
    assert watch.poll(19.6) == "step 2" and expired == [("step 2", pytest.approx(10.1))]
    assert watch.poll(40.0) is None and len(expired) == 1  # said once
    assert "rank 1: step 2 has run 10 s under its CUDA graph, longer than Config(collective_timeout_s)=10" in \
        capsys.readouterr().err


def test_a_report_says_where_every_thread_of_the_host_was(capsys):
    """The report carries every thread's Python stack (session 30: two stalled benchmark runs said
    nothing about where they were): here the main thread's, in this test, polling."""
    watch, _ = a_watch(timeout_s=1.0)
    watch.launched("step 4", lambda: False, now=0.0)
    assert watch.poll(2.0) == "step 4"
    err = capsys.readouterr().err
    assert "This rank's threads were at:" in err and "thread MainThread:" in err
    assert "test_a_report_says_where_every_thread_of_the_host_was" in err.split("threads were at:")[1]


def test_host_phases_before_the_first_replay_are_said_once_never_aborted_for(capsys):
    """An eager warm-up step or a capture is pending until the host is through it (done() False). One that
    runs too long is said once, with the stacks, and not aborted for (a first step may take long;
    NCCL's watchdog ends its collectives); the replays after it count from when it ended, and a
    stalled replay is still reported and aborted for."""
    watch, expired = a_watch(timeout_s=5.0)
    through = []
    watch.launched("step 1", lambda: bool(through), now=0.0, how="eagerly, before its CUDA graph was captured",
                   abort=False)
    assert watch.poll(4.0) is None and capsys.readouterr().err == ""
    assert watch.poll(5.5) is None and watch.poll(9.0) is None and not expired
    err = capsys.readouterr().err
    assert err.count("rank 1: step 1 has run 6 s eagerly, before its CUDA graph was captured, longer than "
                     "Config(collective_timeout_s)=5; still waiting") == 1 and "threads are at:" in err
    through.append(True)
    replay = Replay()
    watch.launched("step 3", replay.done, now=9.5)
    assert watch.poll(10.0) is None  # step 1 seen done at 10.0: step 3 counts from then
    assert watch.poll(14.9) is None
    assert watch.poll(15.1) == "step 3" and expired == [("step 3", pytest.approx(5.1))]


def test_no_event_is_queried_while_the_main_thread_captures_and_a_long_capture_is_said(capsys):
    """In CUDA's global capture mode another thread's event query ends the capture: while `capturing`,
    no watch of the process queries anything (a query here fails the test), and the capturing step's
    says once, with the stacks, if the capture runs too long; afterwards they look again as before."""
    watch, expired = a_watch(timeout_s=5.0)
    queried = []

    def done():
        assert watch.capture is None and other.capture is None, "queried during a capture"
        queried.append(True)
        return True

    watch.launched("step 2", done, now=0.0, how="eagerly, before its CUDA graph was captured", abort=False)
    other, _ = a_watch(timeout_s=5.0)  # another step of the process (a benchmark's earlier mode)
    other.launched("step 9", done, now=0.0)
    with watch.capturing("the capture of the CUDA graph after step 2", now=lambda: 1.0):
        assert watch.poll(3.0) is None and watch.poll(7.0) is None and watch.poll(9.0) is None
        assert other.poll(9.0) is None
        assert not queried and not expired
    err = capsys.readouterr().err
    assert err.count("the capture of the CUDA graph after step 2 has run 6 s on the host, longer than") == 1
    assert watch.poll(9.5) is None and other.poll(9.5) is None and len(queried) == 2
    assert not watch.pending and not other.pending and not expired


def test_a_capture_that_raises_lets_the_watches_look_again():
    from fxshard.runtime import replay_watch

    watch, _ = a_watch()
    with pytest.raises(RuntimeError, match="capture failed"):
        with watch.capturing("the capture of the CUDA graph after step 2"):
            raise RuntimeError("capture failed")
    assert watch.capture is None and replay_watch._CAPTURES == []


def test_replays_that_finish_in_time_are_never_reported():
    watch, expired = a_watch(timeout_s=1.0)
    for number in range(1, 50):
        replay = Replay()
        watch.launched(f"step {number}", replay.done, now=float(number))
        replay.finished = True
        assert watch.poll(number + 0.9) is None
    assert not watch.pending and not expired


def test_a_replay_whose_query_fails_counts_as_finished():
    """A device error (a copy-engine barrier's trap) makes the event query raise: the main thread meets
    that error itself, and the watch neither dies nor aborts for it."""
    watch, expired = a_watch(timeout_s=1.0)

    def failed():
        raise RuntimeError("CUDA error: unspecified launch failure")

    watch.launched("step 1", failed, now=0.0)
    assert watch.poll(5.0) is None and not watch.pending and not expired


def test_groups_that_cannot_be_aborted_are_listed_not_raised():
    class Group:
        def __init__(self, fails):
            self.fails, self.aborted = fails, False

        def abort(self):
            if self.fails:
                raise RuntimeError("no backend")
            self.aborted = True

    groups = {"dp": Group(False), "ep": Group(True)}
    assert abort_groups(groups) == ["ep: RuntimeError: no backend"]
    assert groups["dp"].aborted


def test_a_step_whose_replay_the_watch_ended_refuses_every_later_call():
    """What the watch's `expire` does to a step (here one without a mesh or a GPU, called by hand):
    training, evaluating and reading the parameters all raise why, loading a checkpoint does not
    clear it (the process groups are gone)."""
    import weakref

    import torch

    import fxshard
    from fxshard.checkpoint.state import set_progress
    from fxshard.runtime.step import _expire_replay
    from strategies import MLPStack, mse, regression_batch

    batch = regression_batch(torch.Generator().manual_seed(0), 4)
    step = fxshard.shard(MLPStack([4, 8, 4]), mse, batch, optimizer=fxshard.optim.AdamW(lr=1e-2))
    step(batch)
    _expire_replay(weakref.ref(step), 5.0)("step 2", 7.4, "under its CUDA graph")
    message = re.escape("step 2 ran 7 s under its CUDA graph, longer than Config(collective_timeout_s)=5: a rank stalled")
    for call in (lambda: step(batch), lambda: step.evaluate(batch), step.parameters):
        with pytest.raises(fxshard.FxShardError, match=message):
            call()
    set_progress(step, None, None)
    with pytest.raises(fxshard.FxShardError, match="Restart the job from the last checkpoint"):
        step(batch)


def test_the_watch_thread_reports_a_replay_that_never_finishes_by_itself():
    import time

    expired = []
    watch = ReplayWatch(0.2, rank=0, expire=lambda what, seconds, how: expired.append(what))
    watch.launched("step 3", lambda: False)  # starts the thread
    deadline = time.monotonic() + 5
    while not expired and time.monotonic() < deadline:
        time.sleep(0.05)
    assert expired == ["step 3"]


def test_a_process_whose_groups_were_aborted_exits_with_status_1_without_tearing_them_down():
    """NCCL's abort of a graphed communicator can stop its kernels and never return, and destroying the
    groups then waits forever (2x H200): a process the watch expired exits at interpreter exit, status 1,
    saying why, before the exit handlers registered before it (teardown among them) run."""
    import subprocess
    import sys

    script = ("import atexit\n"
              "from fxshard.runtime.replay_watch import aborted_here, expire_process_groups\n"
              "atexit.register(lambda: print('teardown ran'))\n"  # registered first: must not run
              "assert not aborted_here()\n"
              "expire_process_groups('step 4 on rank 1')\n"
              "assert aborted_here()\n"
              "print('finished', flush=True)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done
    assert done.stdout.strip() == "finished", done.stdout
    assert "exiting without tearing down the process groups a replay watch aborted (step 4 on rank 1)" in done.stderr
