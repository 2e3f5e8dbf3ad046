"""Executes a pipeline schedule over the chunks of a PipelineProgram (passes/pipeline.py).

`RankExecutor` runs one rank's actions: F runs a chunk's forward graph on one microbatch and keeps
what its backward needs (per microbatch, dropped once the backward ran), B runs the backward and
adds the chunk's parameter gradients into per-parameter sums, SF/SB hand the sent values to the
transport, RF/RB take them from it. The transport is either in-process (`run_local`: all ranks in
one process, for tests and the dump's timings) or point-to-point between processes (next).
"""

from __future__ import annotations

from typing import Callable

import torch

from ..errors import FxShardError
from ..schedule import Action, Schedule


class RankExecutor:
    """One rank's chunks and state for one step: stashes, received values, gradient sums, losses."""

    def __init__(self, rank: int, pipeline, schedule: Schedule, params: dict[str, torch.Tensor],
                 microbatches: list[list[torch.Tensor]]):
        self.rank, self.pipeline, self.schedule = rank, pipeline, schedule
        self.params = params
        self.microbatches = microbatches
        self.inbox: dict[tuple[str, int, int], list[torch.Tensor]] = {}   # ("F"|"B", chunk, mb) -> values
        self.outbox: dict[tuple[str, int, int], list[torch.Tensor]] = {}
        self.stash: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        self.grads: dict[str, torch.Tensor] = {}
        self.losses: dict[int, torch.Tensor] = {}
        self.position = 0

    @property
    def actions(self) -> tuple[Action, ...]:
        return self.schedule.ranks[self.rank]

    @property
    def done(self) -> bool:
        return self.position >= len(self.actions)

    def step(self, receive: Callable[[Action], list[torch.Tensor] | None],
             send: Callable[[Action, list[torch.Tensor]], None]) -> bool:
        """Run the next action if it can run now; False if it waits on a message."""
        action = self.actions[self.position]
        kind, c, mb = action.kind, action.chunk, action.mb
        if kind in ("RF", "RB"):
            values = receive(action)
            if values is None:
                return False
            self.inbox[kind[1], c - 1 if kind == "RF" else c + 1, mb] = values
        elif kind in ("SF", "SB"):
            send(action, self.outbox.pop((kind[1], c, mb)))
        elif kind == "F":
            self.forward(c, mb)
        elif kind == "B":
            self.backward(c, mb)
        elif kind != "OPT":
            raise FxShardError(f"the pipeline runtime does not run {kind} actions yet")
        self.position += 1
        return True

    def _neighbour_values(self, kind: str, chunk: int, mb: int, local_chunk: int) -> list[torch.Tensor]:
        """Values from a neighbour chunk: received (other rank) or left by it on this rank."""
        key = (kind, chunk, mb)
        if key in self.inbox:
            return self.inbox.pop(key)
        if (kind, chunk, mb) in self.outbox:
            return self.outbox.pop(key)
        raise FxShardError(f"rank {self.rank}: chunk {local_chunk} microbatch {mb} has no input from chunk {chunk}")

    def forward(self, c: int, mb: int) -> None:
        chunk = self.pipeline.chunks[c]
        received = self._neighbour_values("F", c - 1, mb, c) if c > 0 else []
        leaves = [self.microbatches[mb][i] for i in chunk.batch]
        outputs = list(chunk.forward(*[self.params[n] for n in chunk.params], *leaves, *received))
        if chunk.has_loss:
            self.losses[mb] = outputs.pop()
        values = dict(zip(chunk.recv, received))
        values.update(zip(chunk.forward_outputs, outputs))
        self.stash[c, mb] = {name: values[name] for name in chunk.saved}
        if c + 1 < len(self.pipeline.chunks):
            self.outbox["F", c, mb] = [values[name] for name in chunk.send]

    def backward(self, c: int, mb: int) -> None:
        chunk = self.pipeline.chunks[c]
        received = self._neighbour_values("B", c + 1, mb, c) if c + 1 < len(self.pipeline.chunks) else []
        saved = self.stash.pop((c, mb))
        leaves = [self.microbatches[mb][i] for i in chunk.batch]
        outputs = list(chunk.backward(*[self.params[n] for n in chunk.params], *leaves,
                                      *[saved[n] for n in chunk.saved], *received))
        sent, grads = outputs[:len(chunk.grad_send)], outputs[len(chunk.grad_send):]
        for name, grad in zip(chunk.grads, grads):
            self.grads[name] = grad if name not in self.grads else self.grads[name] + grad
        if c > 0:
            self.outbox["B", c, mb] = sent


def run_local(pipeline, schedule: Schedule, params: dict[str, torch.Tensor],
              microbatches: list[list[torch.Tensor]]) -> list[RankExecutor]:
    """Every rank's actions in this process, in an order the messages allow; returns the executors
    (losses per microbatch on the last chunk's rank, gradient sums per rank)."""
    if schedule.chunks != len(pipeline.chunks):
        raise FxShardError(f"the schedule has {schedule.chunks} chunks, the pipeline program {len(pipeline.chunks)}")
    ranks = [RankExecutor(r, pipeline, schedule, params, microbatches) for r in range(schedule.stages)]
    mail: dict[tuple[str, int, int, int], list[torch.Tensor]] = {}  # (kind, chunk, mb, to) -> values

    def sender(rank):
        def send(action, values):
            mail[action.kind[1], action.chunk, action.mb, action.peer] = values
        return send

    def receiver(rank):
        def receive(action):
            source = action.chunk - 1 if action.kind == "RF" else action.chunk + 1
            return mail.pop((action.kind[1], source, action.mb, rank), None)
        return receive

    while not all(r.done for r in ranks):
        progressed = False
        for executor in ranks:
            while not executor.done and executor.step(receiver(executor.rank), sender(executor.rank)):
                progressed = True
        if not progressed:
            waiting = {r.rank: str(r.actions[r.position]) for r in ranks if not r.done}
            raise FxShardError(f"pipeline schedule {schedule.name} deadlocked; waiting: {waiting}")
    return ranks
