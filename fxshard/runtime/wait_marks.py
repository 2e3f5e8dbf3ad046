"""Which NCCL collective or transfer a step replayed from a CUDA graph was waiting for when a peer
stalled: before each wait, the step's stream writes the wait's number into a pinned host word.

Under CUDA graphs NCCL's watchdog does not see the replayed collectives, and the replay watch
(replay_watch.py) can only say which step ran too long. With this lowering each `wait_tensor` on an
NCCL collective or point-to-point transfer is preceded by `wait_mark(device, lowering, i)`: two
stream memory operations (cuStreamWriteValue32, no kernel, no SM; a CUDA graph captures them as
nodes like the rest) that write [lowering, i] into the device's pinned word (`words`). The step's
stream runs in program order and can only stop at a wait, so once a replay has run past the timeout
the word names the wait it stopped at; `WaitMarks.waiting_in` turns it into words: the collective or
transfer (agreement.describe: what, how big, which layer or action, which group), and the ones issued
before it on the same group and not yet waited on (NCCL runs a communicator's work in issue order, so
the one that hangs may be any of them). A step writes 0 first, so a word left by an earlier step does
not name one of this step's waits.

Invariant: the lowered graph computes exactly what its input computes. A mark writes host memory
that no node of the program reads, and takes no tensor: it changes no value and orders nothing but
itself (it is a fixed node next to a wait, which is fixed already, so codegen's regions are cut where
they were). Applied by CompiledStep under Config(cuda_graphs=True) on a mesh (eager replay has NCCL's
watchdog); copy-engine collectives have their own markers (copy_engine.py) and are left alone.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.fx as fx

from .. import meta
from ..graph import Graph, lazy_module
from ..ops.p2p import P2P_OPS
from .agreement import describe

_WAIT = torch.ops._c10d_functional.wait_tensor.default
_WORDS: dict[int, torch.Tensor] = {}  # device index -> pinned int32 [lowering, wait]: the last wait reached
_NUMBERS = itertools.count(1)  # each lowering's number, written with its waits: another step's marks are not ours


def words(index: int) -> torch.Tensor:
    """The pinned host words device `index`'s steps write their waits into: [lowering, wait]."""
    if index not in _WORDS:
        _WORDS[index] = torch.zeros(2, dtype=torch.int32, pin_memory=True)
    return _WORDS[index]


def wait_mark(index: int, lowering: int, wait: int) -> None:
    """On the current stream: write [lowering, wait] into device `index`'s words (the runtime's call
    before each marked wait; `wait` 0 at the step's start)."""
    from .copy_engine import write_words

    write_words(words(index), (lowering, wait), "wait marks")


@dataclass(frozen=True)
class WaitMarks:
    """What mark_waits did: the lowering's number and, per marked wait (1, 2, ...), the collective or
    transfer it waits for and those issued before it on its group and not waited on yet."""

    number: int = 0
    described: tuple[str, ...] = ()  # wait i (1-based) waits for described[i - 1]
    in_flight: tuple[tuple[str, ...], ...] = ()  # issued earlier on its group, not yet waited

    @property
    def count(self) -> int:
        return len(self.described)

    def line(self) -> str:
        return f"{self.count} waits for NCCL marked"

    def waiting_in(self, word: torch.Tensor) -> str | None:
        """What the words say the stream was waiting for, or None (not this step's mark, or none yet)."""
        lowering, wait = (int(v) for v in word.tolist())
        if lowering != self.number or not 1 <= wait <= self.count:
            return None
        text = f"the wait for the {self.described[wait - 1]} (wait {wait} of {self.count} in the step)"
        if self.in_flight[wait - 1]:
            text += ("; issued before it on that group and not yet waited on, any of which may be the one that "
                     "hangs (NCCL runs a group's work in issue order): " + "; ".join(self.in_flight[wait - 1]))
        return text


def issue_of(wait: fx.Node) -> fx.Node | None:
    """The NCCL collective or transfer issue a wait waits for, or None (a copy-engine collective's
    lowered call, a gloo all-gather: they are not NCCL's)."""
    issue = wait.args[0]
    if isinstance(issue, fx.Node) and issue.op == "call_function" and (
            issue.target in meta.COLLECTIVE_ISSUES or issue.target in P2P_OPS):
        return issue
    return None


def mark_waits(gm: fx.GraphModule, device_index: int, axes: dict[str, str] | None = None
               ) -> tuple[fx.GraphModule, WaitMarks]:
    """`gm` with a `wait_mark` before each wait for an NCCL collective or transfer, and one writing 0
    before everything else (module docstring). `axes`: process-group name -> mesh axis, for the
    descriptions. Returns `gm` unchanged where it waits for none."""
    axes = axes or {}
    waits = [(node, issue) for node in gm.graph.nodes if node.op == "call_function" and node.target is _WAIT
             for issue in [issue_of(node)] if issue is not None]
    if not waits:
        return gm, WaitMarks()
    number = next(_NUMBERS)
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    waited_at: dict[fx.Node, int] = {}  # issue -> where its first wait is
    for wait, issue in waits:
        waited_at.setdefault(issue, order[wait])
    described, in_flight = [], []
    for i, (wait, issue) in enumerate(waits, start=1):
        group = issue.args[-1]
        earlier = [other for other, at in waited_at.items() if other.args[-1] == group
                   and order[other] < order[issue] and at > order[wait]]
        described.append(describe(issue, axes.get(group, group)))
        in_flight.append(tuple(describe(other, axes.get(group, group)) for other in sorted(earlier, key=order.get)))
    graph, env = Graph(), {}  # a new graph: the input's (the program's own, on one device) stays as it is
    graph.output(graph.graph_copy(gm.graph, env))
    for i, (wait, _) in enumerate(waits, start=1):
        with graph.inserting_before(env[wait]):
            graph.call_function(wait_mark, (device_index, number, i))
    first = next(node for node in graph.nodes if node.op != "placeholder")
    with graph.inserting_before(first):
        graph.call_function(wait_mark, (device_index, number, 0))
    graph.lint()
    return lazy_module(gm, graph), WaitMarks(number, tuple(described), tuple(in_flight))
