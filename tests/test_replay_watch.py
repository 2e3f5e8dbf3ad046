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
    watch = ReplayWatch(timeout_s, rank=1, expire=lambda what, seconds: expired.append((what, seconds)))
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
    _expire_replay(weakref.ref(step), 5.0)("step 2", 7.4)
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
    watch = ReplayWatch(0.2, rank=0, expire=lambda what, seconds: expired.append(what))
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
