"""Program: a GraphModule plus a typed signature (what each input and output means, and where it lives).

Passes take a Program and return a new one; they never mutate their input.
"""

from __future__ import annotations

import dataclasses
import enum
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from . import meta


class InputKind(enum.Enum):
    PARAM = "param"          # a trainable or frozen parameter
    OPT_STATE = "opt_state"  # one optimizer slot of one parameter ("exp_avg/<param>")
    BUFFER = "buffer"        # a module buffer
    BATCH = "batch"          # one leaf of the batch pytree
    LR = "lr"                # learning rate, a 0-d float32 tensor
    STEP = "step"            # optimizer step count (1-based), a 0-d float32 tensor


class OutputKind(enum.Enum):
    LOSS = "loss"
    GRAD_NORM = "grad_norm"
    PARAM = "param"          # the updated parameter
    OPT_STATE = "opt_state"  # the updated optimizer slot
    BUFFER = "buffer"        # the new value of a buffer the forward mutated


@dataclass(frozen=True)
class Placement:
    """Where a value lives on the mesh. `Replicated()` is the single-device default."""

    kind: str = "replicated"     # "replicated" | "sharded" | "stage_local"
    axis: str | None = None      # mesh axis for "sharded" ("dp", "ep") or "pp" for "stage_local"

    def __str__(self) -> str:
        return self.kind if self.axis is None else f"{self.kind}({self.axis})"


REPLICATED = Placement()


@dataclass(frozen=True)
class Input:
    kind: InputKind
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool = False
    placement: Placement = REPLICATED


@dataclass(frozen=True)
class Output:
    kind: OutputKind
    name: str
    placement: Placement = REPLICATED


@dataclass(frozen=True)
class Program:
    """One traced training step: `graph_module(*inputs) -> outputs`, both described by the signature.

    `name` is what the dump calls it ("traced", or the pass that produced it).
    """

    graph_module: fx.GraphModule
    inputs: tuple[Input, ...]
    outputs: tuple[Output, ...]
    name: str = "traced"
    notes: dict = field(default_factory=dict)  # free-form facts a pass wants in the dump

    def replace(self, **changes) -> "Program":
        return dataclasses.replace(self, **changes)

    @property
    def graph(self) -> fx.Graph:
        return self.graph_module.graph

    @property
    def code(self) -> str:
        return self.graph_module.code

    def inputs_of(self, kind: InputKind) -> list[Input]:
        return [i for i in self.inputs if i.kind is kind]

    def outputs_of(self, kind: OutputKind) -> list[Output]:
        return [o for o in self.outputs if o.kind is kind]

    def placeholders(self) -> list[fx.Node]:
        return [n for n in self.graph.nodes if n.op == "placeholder"]

    def output_nodes(self) -> list[fx.Node]:
        (out,) = [n for n in self.graph.nodes if n.op == "output"]
        return list(out.args[0])

    def __call__(self, *args):
        return self.graph_module(*args)

    def dump(self, directory, index: int = 0) -> list[str]:
        from .dump import dump_program

        return dump_program(self, directory, index)

    def summary(self) -> str:
        from .dump import summarize

        return summarize(self)

    def __str__(self) -> str:
        return self.summary()

    def __repr__(self) -> str:
        counts = Counter(meta.phase(n) for n in self.graph.nodes if n.op == "call_function")
        return (f"Program({self.name!r}, {len(self.inputs)} inputs, {len(self.outputs)} outputs, "
                f"nodes={dict(counts)})")
