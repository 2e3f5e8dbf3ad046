"""A watchdog for steps replayed from CUDA graphs on a mesh: a stalled or dead peer ends the step
instead of hanging the job.

NCCL's own watchdog (ProcessGroupNCCL) times out the collectives that torch launched. A collective
replayed from a CUDA graph was launched by the graph, so nothing watches it: a rank whose peer stalled
or died waits in it forever, and so does its host at the next synchronization (the step's own
non-finite check, a `loss.item()`). Copy-engine collectives have their own timeout (their barriers
trap, copy_engine.Watch names them); NCCL point-to-point and collectives had none under graphs.

`ReplayWatch` is told about each replay, a training step's or an evaluation's (an event recorded
behind it). A daemon thread looks at the oldest replay that has not finished: once it has run longer
than Config(collective_timeout_s) since it could start (launched, and the replay before it done), it
says so on stderr (which replay, rank) and calls `expire`, which the step uses to abort its process
groups (NCCL's kernels poll their communicator's abort flag, so the replay stops and the host's wait
returns) and to make every later call raise an FxShardError that says why, instead of hanging.

The timeout is per replay, not per collective: under CUDA graphs Config(collective_timeout_s) is
also the longest one step may run on a mesh.
"""

from __future__ import annotations

import atexit
import collections
import os
import sys
import threading
import time
import weakref
from typing import Callable


class ReplayWatch:
    """Replays in flight, oldest first, and the report once one has run longer than `timeout_s`."""

    def __init__(self, timeout_s: float, rank: int, expire: Callable[[str, float], None]):
        self.timeout_s, self.rank, self.expire = timeout_s, rank, expire
        self.pending: collections.deque = collections.deque()  # (what, done() -> bool, launched at)
        self.last_done: float | None = None  # when the replay before the oldest pending one was seen done
        self.reported: str | None = None  # the replay it reported, once
        self._thread: threading.Thread | None = None  # started at the first replay; ends with the watch

    def launched(self, what: str, done: Callable[[], bool], now: float | None = None) -> None:
        """`what` ("step 7") was replayed; `done()` says whether the device has finished it (an event's query)."""
        self.pending.append((what, done, time.monotonic() if now is None else now))
        if self._thread is None:
            self.start()

    def poll(self, now: float) -> str | None:
        """One look: drop the finished replays; the replay reported if the oldest one has now run too long."""
        while self.pending and _finished(self.pending[0][1]):
            self.pending.popleft()
            self.last_done = now
        if not self.pending or self.reported is not None:
            return None
        what, _, launched = self.pending[0]
        started = launched if self.last_done is None else max(launched, self.last_done)
        if now - started < self.timeout_s:
            return None
        self.reported = what
        print(f"fxshard: rank {self.rank}: {what} has run {now - started:.0f} s under its CUDA graph, longer than "
              f"Config(collective_timeout_s)={self.timeout_s:g}: a rank of the job stalled or stopped inside a "
              f"collective or transfer (its own log says why). Aborting this rank's process groups, so the step "
              f"fails instead of hanging; restart from the last checkpoint", file=sys.stderr, flush=True)
        self.expire(what, now - started)
        return what

    def start(self) -> None:
        self._thread = poll_in_background(self, lambda watch, _: watch.poll(time.monotonic()),
                                          min(1.0, self.timeout_s / 4), "fxshard-replay-watch")


def poll_in_background(owner, look: Callable, interval: float, name: str,
                       stopped: threading.Event | None = None) -> threading.Thread:
    """A started daemon thread that calls look(owner, state) every `interval` seconds, `state` being
    what the previous call returned (None at first), for as long as `owner` lives (the thread holds it
    weakly, so a watch ends with what owns it) and `stopped` is not set."""
    ref = weakref.ref(owner)

    def run():
        state = None
        while True:
            alive = ref()
            if alive is None or (stopped is not None and stopped.is_set()):
                return
            state = look(alive, state)
            del alive
            time.sleep(interval)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread


def _finished(done: Callable[[], bool]) -> bool:
    """done(), where a query that fails (the device reported an error: a copy-engine barrier's trap,
    say) counts as finished: the main thread meets that error at its next synchronization, and a
    replay that ended in one is nothing to abort for."""
    try:
        return done()
    except Exception:  # noqa: BLE001 - whatever the device said, the main thread hears it too
        return True


_aborted_here: list[str] = []  # why this process's groups were aborted (expire_process_groups)


def expire_process_groups(why: str) -> None:
    """Note that a replay watch of this process is about to abort its process groups, and make the
    process exit at interpreter exit without tearing them down, with status 1: on 2x H200 (torch 2.11,
    NCCL 2.28) NCCL's abort of a communicator used by a graphed collective stopped the kernels (the
    host's wait returned) but never returned itself, and destroying the groups afterwards waited on
    it forever. The job failed either way (every later call says so); what is left of it must not
    hang. Also read by fxshard.launch's workers (`aborted_here`)."""
    if not _aborted_here:
        atexit.register(_exit_without_teardown)
    _aborted_here.append(why)


def aborted_here() -> bool:
    """Whether a replay watch aborted this process's groups (expire_process_groups)."""
    return bool(_aborted_here)


def _exit_without_teardown() -> None:
    print(f"fxshard: exiting without tearing down the process groups a replay watch aborted "
          f"({_aborted_here[0]})", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(1)


def abort_groups(groups: dict) -> list[str]:
    """Abort each process group in `groups` (axis -> group): NCCL's kernels stop waiting on their
    peers. What could not be aborted, as "axis: error" lines (reported, not raised: this runs on the
    watch's thread while the main thread is stuck in a wait)."""
    failed = []
    for axis, group in groups.items():
        try:
            group.abort()
        except Exception as error:  # noqa: BLE001 - any backend's failure is reported the same way
            failed.append(f"{axis}: {type(error).__name__}: {error}")
    return failed
