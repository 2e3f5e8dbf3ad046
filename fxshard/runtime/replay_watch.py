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
also the longest one step may run on a mesh. With each report go every thread's Python stacks, so the
log says where the host was.

The step's host phases before its first replay (the eager warm-up steps, `launched(..., abort=False)`;
the captures, `capturing`) are watched too, but only said, never aborted for: a first step may
legitimately take long (NCCL's communicators, autotuning), and its collectives have NCCL's own
watchdog. What that misses is a host that never comes back; now its stacks are in the log.

No watch queries an event while any step of the process is being captured: in CUDA's global capture
mode, which fxshard's captures use, another thread's event query ends the capture with an error
(torch's NCCL watchdog had the same problem). Two steps in one process, as a benchmark's runners are,
made that likely: the earlier step's watch still looked at its last replays, about once a second,
while the next step was captured (2x H200, session 30: three MoE benchmark runs stalled, the failed
rank silent in its teardown).
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import os
import sys
import threading
import time
import traceback
import weakref
from typing import Callable


_CAPTURE_LOCK = threading.Lock()  # held by every watch's look at the device, and to start or end a capture
_CAPTURES: list = []  # the watches whose steps are being captured now (ReplayWatch.capturing)


class ReplayWatch:
    """Replays in flight, oldest first, and the report once one has run longer than `timeout_s`."""

    def __init__(self, timeout_s: float, rank: int, expire: Callable[[str, float, str], None],
                 where: Callable[[], str | None] | None = None):
        # where(): what the replay's stream waits for, said with the report (the step's wait marks)
        self.timeout_s, self.rank, self.expire, self.where = timeout_s, rank, expire, where
        self.pending: collections.deque = collections.deque()  # (what, done() -> bool, launched at, how, abort)
        self.last_done: float | None = None  # when the replay before the oldest pending one was seen done
        self.reported: str | None = None  # the replay it reported, once
        self.noticed: tuple | None = None  # the host phase it last said had run too long (no abort)
        self.capture: tuple[str, float] | None = None  # (what, since when) while this step's graph is captured
        self._thread: threading.Thread | None = None  # started at the first replay; ends with the watch

    def launched(self, what: str, done: Callable[[], bool], now: float | None = None,
                 how: str = "under its CUDA graph", abort: bool = True) -> None:
        """`what` ("step 7") was replayed; `done()` says whether the device has finished it (an event's query).
        `how` says what kind of work it is in the report: a replay by default, or a host phase watched
        the same way ("eagerly, before its CUDA graph was captured", `abort=False`: said, not aborted
        for), whose `done()` stays False until the host is through it."""
        self.pending.append((what, done, time.monotonic() if now is None else now, how, abort))
        if self._thread is None:
            self.start()

    def poll(self, now: float) -> str | None:
        """One look: drop the finished replays; the replay reported if the oldest one has now run too long.
        No device query while any step of this process is being captured (`capturing`): another thread's
        event query ends a capture in CUDA's global capture mode, which fxshard's captures use, and a
        benchmark's earlier step may still have replays to look at when the next one is captured."""
        with _CAPTURE_LOCK:
            if not _CAPTURES:
                notice, stalled = self._look(now)
            elif self.capture is not None and now - self.capture[1] >= self.timeout_s:
                what, since = self.capture
                notice, stalled = self._notice(self.capture, what, now - since, "on the host"), None
            else:
                notice, stalled = None, None
        if notice is not None:  # said after the lock is let go: a full stderr pipe must not hold a capture up
            print(notice, file=sys.stderr, flush=True)
        if stalled is None:
            return None
        what, seconds, how = stalled
        waiting = self.where() if self.where is not None else None  # host memory: no device query
        # outside the lock: aborting NCCL's communicators may not return (expire_process_groups)
        print(f"fxshard: rank {self.rank}: {what} has run {seconds:.0f} s {how}, longer than "
              f"Config(collective_timeout_s)={self.timeout_s:g}: a rank of the job stalled or stopped inside a "
              f"collective or transfer (its own log says why)"
              + (f"; this rank is at {waiting}" if waiting else "") + f". Aborting this rank's process groups, so the step "
              f"fails instead of hanging; restart from the last checkpoint. This rank's threads were at:\n"
              f"{thread_stacks()}", file=sys.stderr, flush=True)
        self.expire(what, seconds, how)
        return what

    def _look(self, now: float) -> tuple[str | None, tuple[str, float, str] | None]:
        """Under the lock: drop the finished entries; then (the notice to print, if the oldest is a host
        phase that has run too long; (what, seconds, how), if it is a replay to abort for)."""
        while self.pending and _finished(self.pending[0][1]):
            self.pending.popleft()
            self.last_done = now
        if not self.pending or self.reported is not None:
            return None, None
        oldest = self.pending[0]
        what, _, launched, how, abort = oldest
        started = launched if self.last_done is None else max(launched, self.last_done)
        if now - started < self.timeout_s:
            return None, None
        if not abort:
            return self._notice(oldest, what, now - started, how), None
        self.reported = what
        return None, (what, now - started, how)

    def _notice(self, key, what: str, seconds: float, how: str) -> str | None:
        """Once per `key`: the words that say a host phase has run too long, with the stacks (it aborts
        nothing); None when already said."""
        if self.noticed is key:
            return None
        self.noticed = key
        return (f"fxshard: rank {self.rank}: {what} has run {seconds:.0f} s {how}, longer than "
                f"Config(collective_timeout_s)={self.timeout_s:g}; still waiting (NCCL's watchdog ends a "
                f"collective that timed out). This rank's threads are at:\n{thread_stacks()}")

    @contextlib.contextmanager
    def capturing(self, what: str, now: Callable[[], float] = time.monotonic):
        """Around a CUDA graph capture on the main thread: no watch of this process queries an event
        meanwhile (a look in progress ends first), and this one says, with the stacks, if the capture
        runs too long."""
        if self._thread is None:
            self.start()
        try:
            with _CAPTURE_LOCK:
                self.capture = (what, now())
                _CAPTURES.append(self)
            yield
        finally:
            with _CAPTURE_LOCK:
                self.capture = None
                if self in _CAPTURES:
                    _CAPTURES.remove(self)

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


def thread_stacks() -> str:
    """Every thread's Python stack, innermost call last, as one text (faulthandler needs a real file
    descriptor; this works wherever stderr goes)."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        stack = "".join(traceback.format_stack(frame))
        parts.append(f"  thread {names.get(ident, ident)}:\n{stack}")
    return "".join(parts)


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
