"""Random streams: the process's generator states, and a pipeline stage's own stream.

On one device a program draws its random values (dropout masks) from the process's generators, in
program order, as eager PyTorch does. A pipeline stage runs only its own layers, on its own rank: had
it drawn from the process's generators, which every rank seeds alike (shard checks that they start
from the same weights, and data loaders usually want the same seed on every rank), stage s's first
layer would draw the same mask as stage 0's first layer, and so on: layers k and k + layers-per-stage
dropping the same units, a silent correlation eager PyTorch never has. So a pipeline step whose program
draws random values draws them from a stream of its stage's own (`StageStream`): derived at `shard`
from the process's generator states and the stage index, without drawing from them, swapped in around
each call and out after it. The process's generators then move only by what the user draws (batches
drawn on each rank stay the same on every stage); seeding them after `shard` does not reseed the
stages' streams. Data-parallel replicas of a stage share its stream, as they share their seed in
eager data parallelism.
"""

from __future__ import annotations

import contextlib
import hashlib

import torch
import torch.fx as fx

from ..graph import draws_random
from ..program import StagePlan


def rng_state(device: torch.device) -> dict:
    """The process's CPU generator state and, on CUDA, `device`'s."""
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def draws_random_values(graph: fx.Graph) -> bool:
    """The graph has an op that draws from a generator (dropout, rand, bernoulli; not attention
    without dropout)."""
    return any(draws_random(node) for node in graph.nodes)


class StageStream:
    """A pipeline stage's own generator states (see the module docstring). `key` names the mesh, the
    stage and the parameters it holds, so a checkpoint's stream is restored only into the stage that
    drew from it (the same mesh cut another way, or scheduled with other virtual stages, derives anew)."""

    def __init__(self, device: torch.device, plan: StagePlan, mesh: str):
        # a checkpoint's stream is this one's only under the same layout, stage and device type (a CPU
        # checkpoint has no CUDA state to restore)
        holds = hashlib.blake2b("\n".join(plan.params_by_stage[plan.stage]).encode(), digest_size=8).hexdigest()
        self.device, self.stage = device, plan.stage
        self.key = f"{mesh}, stage {plan.stage} holding {holds}, {device.type}"
        # the key of checkpoints from before session 50, which named no parameters: restored as then
        self.legacy_key = f"{mesh}, stage {plan.stage}, {device.type}"
        self.state = self.derived()

    def derived(self) -> dict:
        """Fresh states seeded from the process's current generator states and the stage index
        (the same on every rank that holds the stage, different between stages); nothing is drawn."""
        digest = hashlib.blake2b(digest_size=8)
        for value in rng_state(self.device).values():
            digest.update(value.numpy().tobytes())
        digest.update(self.stage.to_bytes(4, "little"))
        seed = int.from_bytes(digest.digest(), "little") >> 1
        state = {"cpu": torch.Generator().manual_seed(seed).get_state()}
        if self.device.type == "cuda":
            state["cuda"] = torch.Generator(device=self.device).manual_seed(seed).get_state()
        return state

    @contextlib.contextmanager
    def drawn_from(self):
        """Inside: the process's generators hold this stream; after: their own states again, and the
        stream where the draws inside left it."""
        outside = rng_state(self.device)
        set_rng_state(self.state, self.device)
        try:
            yield
        finally:
            self.state = rng_state(self.device)
            set_rng_state(outside, self.device)

    def saved(self) -> dict:
        return {"key": self.key, **self.state}

    def restore(self, saved: dict | None) -> None:
        """A checkpoint's stream where it is this stage's under this layout; otherwise (another layout
        saved it, or none was saved) one derived again from the process's states just loaded."""
        if saved is not None and saved.get("key") in (self.key, self.legacy_key):
            self.state = {name: value for name, value in saved.items() if name != "key"}
        else:
            self.state = self.derived()
