"""lower_schedule: one pipeline rank's whole training step as one Program.

Input: the chunks of a traced microbatch program (`split_stages`), a schedule (per-rank action
lists, fxshard.schedule) and this rank's stage. Output: a Program like any traced one — this
stage's parameters, optimizer state, the full batch, lr and step in; loss, gradient norm, updated
parameters and state out — whose graph holds, in the schedule's order, every action of the stage:

    F c:m   a copy of chunk c's forward on microbatch m (rows m*R..(m+1)*R of every batch leaf)
    B c:m   its backward (or, with W actions in the schedule, its input-gradient part)
    W c:m   its weight-gradient part
    send    `fxshard::send` of the values chunk c hands to its neighbour; the token is waited on
            at the end of the step
    recv    `fxshard::recv`, issued late by default (Config(p2p_receives="late"): just before the
            compute that reads it or the next transfer with that peer) or early ("early":
            fxshard.schedule.issue_order orders a pair's messages by when the chunks' FLOP costs say
            they are produced, right after the previous transfer with the same peer), and waited on
            just before the action that reads it
    U/R/G   ZeRO's per-chunk collectives over dp: no nodes here. The program's StagePlan lists
            them among its actions and each node carries its action's position there
            (`meta.ACTION_INDEX`), so the fsdp pass issues a chunk's all-gathers at its U and its
            gradient reductions at its G

Buffers a chunk's forward updates (`Chunk.buffers`) carry over from microbatch to microbatch in the
order the forwards run (the schedule runs a chunk's forwards in microbatch order, as eager gradient
accumulation does); each backward reads the parameters and buffers its own forward read, and the
stage returns each buffer's final value (placement stage-local).

Gradients accumulate over microbatches as the B / W actions produce them; each parameter's total
(of the mean loss over microbatches: the last chunk's backward starts from the loss tangent 1/M,
`meta.LOSS_TANGENT`, so every gradient arrives divided) is final after its last action, where the
FSDP pass, which runs next in the pass list, issues its reduction. A parameter held by several
stages (tied embedding and head) has its partial gradients summed over them with an all-reduce.
The loss (the mean over microbatches, computed on the last chunk's stage) and reported metrics
(summed over microbatches) are all-reduced over `pp`, so every stage returns them; the gradient
norm sums over `pp`, a tied parameter counted on its first stage only (`Program.updates`).
A parameter's cast to the compute dtype and compute that reads no input (RoPE's tables) run once
per step, not per microbatch, placed at the chunk's first forward ahead of the waits for what that
forward receives (they read nothing received, so they run while the transfer is under way).

Invariant: run on every stage of the pipeline (the SPMD simulator, or real processes), the
programs return the loss and metrics of the input program on the whole batch (mean of the
microbatch losses, metrics summed), and each stage's updated parameters and optimizer state
are those the input program's optimizer would produce from the gradient of that mean loss.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.fx as fx

from fxshard import meta
from fxshard.balance import append_balancing, balancing_notes
from fxshard.errors import FxShardError
from fxshard.graph import Graph, fake_mode_of, inline, is_pure, lazy_module
from fxshard.loss_scale import NAME as LOSS_SCALE
from fxshard.ops.p2p import P2P_OPS  # noqa: F401  (registers fxshard::send / recv)
from fxshard.optimizer_graph import append_update
from fxshard.program import (OWN_INPUTS, REPLICATED, STAGE_LOCAL, Input, InputKind, Output, OutputKind, Program,
                             StagePlan)
from fxshard.schedule import COMPUTE, ZERO, Action, Schedule, check_point_to_point, issue_order

from .pipeline import Chunk, PipelineProgram, chunk_costs

_c10d = torch.ops._c10d_functional
_SEND, _RECV = torch.ops.fxshard.send.default, torch.ops.fxshard.recv.default
_CAST = torch.ops.aten._to_copy.default


def lower_schedule(pipeline: PipelineProgram, schedule: Schedule, stage: int, pairs=(),
                   receives: str = "late", costs: tuple | None = None) -> Program:
    """Stage `stage`'s per-rank Program for one training step. See the module docstring. `pairs`:
    each rank's actions that the interleave pass will run interleaved (fxshard.schedule.combine_pairs),
    checked here with the rest of the transfer order. `receives`: where receives are issued
    (Config(p2p_receives); fxshard.schedule.issue_order). `costs`: the items of
    `chunk_costs(pipeline, schedule)`, where the caller has them already."""
    if schedule.chunks != len(pipeline.chunks):
        raise FxShardError(f"the schedule has {schedule.chunks} chunks, the pipeline program {len(pipeline.chunks)}")
    if not 0 <= stage < schedule.stages:
        raise FxShardError(f"stage {stage} is not one of the schedule's {schedule.stages} stages")
    costs = tuple(chunk_costs(pipeline, schedule).items()) if costs is None else costs
    order = issue_order(schedule, costs, receives, pairs)
    check_point_to_point(schedule, order, pairs)
    return _Lowering(pipeline, schedule, stage, order[stage], costs).run()


def tied_group(stages: tuple[int, ...], count: int) -> str:
    """The axis name of the stages that hold one parameter: "pp" when it is every stage."""
    return "pp" if len(stages) == count else "pp" + "_".join(map(str, stages))


class _Lowering:
    def __init__(self, pipeline: PipelineProgram, schedule: Schedule, stage: int, actions: tuple[Action, ...],
                 costs: tuple[tuple[str, float], ...]):
        self.pipeline, self.schedule, self.stage, self.actions, self.costs = pipeline, schedule, stage, actions, costs
        self.source = pipeline.source
        self.fake = fake_mode_of(self.source.graph)
        self.graph = Graph()
        self.local = [c for c in pipeline.chunks if schedule.rank_of(c.index) == stage]
        self.microbatches = schedule.microbatches
        # the stages holding each trained parameter (more than one: tied), and each stage's parameters and buffers
        self.holders: dict[str, tuple[int, ...]] = {}
        for chunk in pipeline.chunks:
            for name in chunk.grads:
                stages = set(self.holders.get(name, ())) | {schedule.rank_of(chunk.index)}
                self.holders[name] = tuple(sorted(stages))
        self.params_by_stage = tuple(
            tuple(dict.fromkeys(n for c in pipeline.chunks if schedule.rank_of(c.index) == s for n in c.params))
            for s in range(schedule.stages))
        for s, names in enumerate(self.params_by_stage):
            for name in names:
                if name in self.holders and s not in self.holders[name]:
                    raise FxShardError(
                        f"parameter {name!r} is trained on pipeline stage(s) {list(self.holders[name])} and also read "
                        f"on stage {s} with no gradient flowing back there (e.g. through .detach()): that stage would "
                        f"keep reading its initial value. Cut the stages so that its readers share one "
                        f"(Config(stage_layers=...)), or let its gradient flow from every reader")
        self.split_backward = any(a.kind == "W" for a in actions)
        self.env: dict[str, fx.Node] = {}       # input name -> placeholder (parameters, buffers, state, batch)
        self.scalars: dict[InputKind, fx.Node] = {}  # the step's own inputs (LR, STEP, LOSS_SCALE) by kind
        self.inputs: list[Input] = []
        self.slices: dict[tuple[int, int], fx.Node] = {}      # (leaf, microbatch) -> rows of that microbatch
        self.once: dict[tuple, fx.Node] = {}    # what a node computes (once_key) -> its one copy per step
        self.outbox: dict[tuple[str, int, int], list[fx.Node]] = {}  # ("F"|"B", chunk, mb) -> values it hands on
        self.inbox: dict[tuple[str, int, int], list[fx.Node]] = {}   # received, not yet waited on
        self.buffers: dict[str, fx.Node] = {}   # buffer name -> its value after the forwards lowered so far
        self.read: dict[tuple[int, int], list[fx.Node]] = {}  # (chunk, mb) -> the parameters its forward read
        self.stash: dict[tuple[int, int], dict[str, fx.Node]] = {}   # (chunk, mb) -> forward values its backward reads
        self.weight_inputs: dict[tuple[int, int], list[fx.Node]] = {}
        self.grads: dict[str, fx.Node] = {}      # parameter -> its gradient summed so far
        self.remaining: dict[str, int] = {}      # parameter -> actions still to add to its gradient
        self.losses: list[fx.Node] = []
        self.metrics: dict[str, fx.Node] = {}
        self.tokens: list[fx.Node] = []
        self.balanced: list = []  # this stage's layers balanced torchtitan's way (fxshard/balance.py)

    # ---- inputs -------------------------------------------------------------------------------
    def make_inputs(self) -> None:
        local_params = set(self.params_by_stage[self.stage])
        trained = {n for c in self.local for n in c.grads}
        for spec, node in zip(self.source.inputs, self.source.placeholders()):
            value = node.meta["val"]
            if spec.kind in (InputKind.PARAM, InputKind.BUFFER):
                if spec.name not in local_params:
                    continue
                placement = STAGE_LOCAL if spec.placement == REPLICATED else spec.placement
                spec = dataclasses.replace(spec, placement=placement)
            elif spec.kind is InputKind.OPT_STATE:
                if spec.owner not in trained:
                    continue
                spec = dataclasses.replace(spec, placement=STAGE_LOCAL)
            elif spec.kind is InputKind.BATCH:  # the whole batch of the step: M microbatches
                shape = (value.shape[0] * self.microbatches, *value.shape[1:])
                spec = dataclasses.replace(spec, shape=shape)
                with self.fake:
                    value = torch.empty(shape, dtype=value.dtype, device=value.device)
            placeholder = self.graph.placeholder(node.name)
            placeholder.meta.update(node.meta)
            placeholder.meta["val"] = value
            if spec.kind in OWN_INPUTS:  # every stage takes them
                self.scalars[spec.kind] = placeholder
            else:
                self.env[spec.name] = placeholder
            self.inputs.append(spec)
        self.leaves = [self.env[s.name] for s in self.inputs if s.kind is InputKind.BATCH]
        self.device = next(iter(self.env.values())).meta["val"].device

    def batch_rows(self, leaf: int, mb: int) -> fx.Node:
        if (leaf, mb) not in self.slices:
            node = self.leaves[leaf]
            rows = node.meta["val"].shape[0] // self.microbatches
            (self.slices[leaf, mb],) = inline(self.graph, lambda t: [t[mb * rows:(mb + 1) * rows]], [node],
                                              fake_mode=self.fake, phase=meta.FWD, layer=meta.PRE,
                                              extra_meta={meta.MICROBATCH: mb})
        return self.slices[leaf, mb]

    # ---- copying a chunk's graph -------------------------------------------------------------
    def copy(self, gm: fx.GraphModule, inputs: list[fx.Node], mb: int, count: int,
             once_only: bool = False) -> list[fx.Node] | None:
        """Copy `gm`'s nodes (its first `count` inputs are parameters), return its outputs.
        `once_only`: copy only what runs once a step (`inputs` may then be the parameters alone)."""
        env: dict[fx.Node, fx.Node] = {}
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        if len(placeholders) != len(inputs) and not (once_only and len(inputs) == count):
            raise AssertionError(f"chunk graph takes {len(placeholders)} inputs, given {len(inputs)}")
        env.update(zip(placeholders, inputs))
        params, free = set(placeholders[:count]), set()  # parameters (and their casts); input-free nodes
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                continue
            if node.op == "output":
                return None if once_only else [env[v] for v in node.args[0]]
            input_free = node.op == "get_attr" or (is_pure(node) and all(i in free for i in node.all_input_nodes))
            if input_free or (node.target is _CAST and node.args[0] in params):
                # a constant or compute that reads no input (RoPE's tables), or a parameter's cast
                # (FSDP gathers it already cast): once per step
                (free if input_free else params).add(node)
                key = self.once_key(node, env)
                if key not in self.once:
                    self.once[key] = self.graph.node_copy(node, env.__getitem__)
                    self.once[key].meta[meta.MICROBATCH] = mb
                    if node.meta.get(meta.LOSS_TANGENT):  # the backward of the mean over microbatches
                        self.once[key].update_arg(1, node.args[1] / self.microbatches)
                env[node] = self.once[key]
                continue
            if once_only:
                continue
            env[node] = self.graph.node_copy(node, env.__getitem__)
            env[node].meta[meta.MICROBATCH] = mb
            if meta.PHASE not in env[node].meta:
                raise AssertionError(f"chunk node {node.name} has no phase")
        raise AssertionError("chunk graph has no output")

    @staticmethod
    def once_key(node: fx.Node, env) -> tuple:
        """Nodes that compute the same thing from the same parameters share one copy (the loss
        tangent, scaled when copied, none with another constant)."""
        if node.op == "get_attr":
            return ("get_attr", node.target)
        args = fx.node.map_arg(node.args, env.__getitem__)
        kwargs = fx.node.map_arg(node.kwargs, env.__getitem__)
        return (node.target, repr(args), repr(sorted(kwargs.items())), bool(node.meta.get(meta.LOSS_TANGENT)))

    def params_of(self, chunk: Chunk) -> list[fx.Node]:
        """The chunk's parameters and buffers, each buffer as the forwards lowered so far left it."""
        return [self.buffers.get(name, self.env[name]) for name in chunk.params]

    def scale_of(self, chunk: Chunk) -> list[fx.Node]:
        """What the chunk's graphs take after its parameters: the dynamic loss scale's state, if they read it."""
        return [self.scalars[InputKind.LOSS_SCALE]] if chunk.loss_scale else []

    # ---- point to point -----------------------------------------------------------------------
    def receive(self, action: Action) -> None:
        kind = action.kind[1]
        source = action.chunk - 1 if kind == "F" else action.chunk + 1
        values = self.message_values(kind, source)
        peer, nodes = action.peer, []
        for value in values:
            shape, dtype = list(value.shape), value.dtype
            (node,) = inline(self.graph, lambda: [_RECV(shape, dtype, self.device, peer, "pp")], [],
                             fake_mode=self.fake, phase=meta.FWD if kind == "F" else meta.BWD,
                             layer=self.boundary_layer(action.chunk, kind),
                             extra_meta={meta.MICROBATCH: action.mb})
            nodes.append(node)
        self.inbox[kind, source, action.mb] = nodes

    def message_values(self, kind: str, chunk: int) -> list:
        """Fake values of what chunk `chunk` sends in its forward ("F") or backward ("B")."""
        source = self.pipeline.chunks[chunk]
        gm, count = (source.forward, len(source.send)) if kind == "F" else (source.backward, len(source.grad_send))
        output = next(n for n in gm.graph.nodes if n.op == "output")
        return [n.meta["val"] for n in output.args[0][:count]]

    def boundary_layer(self, chunk: int, kind: str) -> str:
        layers = self.pipeline.chunks[chunk].layers
        return layers[0] if kind == "F" else layers[-1]

    def send(self, action: Action) -> None:
        kind = action.kind[1]
        peer = action.peer
        for value in self.outbox.pop((kind, action.chunk, action.mb)):
            (token,) = inline(self.graph, lambda t: [_SEND(t, peer, "pp")], [value], fake_mode=self.fake,
                              phase=meta.FWD if kind == "F" else meta.BWD,
                              layer=self.boundary_layer(action.chunk, "B" if kind == "F" else "F"),
                              extra_meta={meta.MICROBATCH: action.mb})
            self.tokens.append(token)

    def neighbour(self, kind: str, chunk: int, mb: int, phase: str) -> list[fx.Node]:
        """What chunk `chunk` handed on for microbatch `mb`: received (waited on here) or local."""
        key = (kind, chunk, mb)
        if key in self.outbox:
            return self.outbox.pop(key)
        if key not in self.inbox:
            raise FxShardError(f"stage {self.stage}: {kind} of chunk {chunk} microbatch {mb} is read before it "
                               f"is received; the schedule is not runnable")
        waited = []
        for node in self.inbox.pop(key):
            (done,) = inline(self.graph, lambda t: [_c10d.wait_tensor(t)], [node], fake_mode=self.fake,
                             phase=phase, layer=meta.layer(node), extra_meta={meta.MICROBATCH: mb})
            waited.append(done)
        return waited

    # ---- compute actions ----------------------------------------------------------------------
    def forward(self, c: int, mb: int) -> None:
        chunk = self.pipeline.chunks[c]
        params = self.read[c, mb] = self.params_of(chunk)  # its backward reads the buffers this forward saw
        # What runs once a step (the parameters' casts: ~0.3-0.5 ms a chunk, GPT 1b on an H200) reads
        # nothing received: copied ahead of the waits, it runs while the transfer is under way
        self.copy(chunk.forward, params, mb, len(chunk.params), once_only=True)
        received = self.neighbour("F", c - 1, mb, meta.FWD) if c > 0 else []
        leaves = [self.batch_rows(i, mb) for i in chunk.batch]
        outputs = self.copy(chunk.forward, [*params, *self.scale_of(chunk), *leaves, *received], mb, len(chunk.params))
        for name in reversed(chunk.buffers):  # microbatch m+1's forward reads what m's wrote, as in eager
            self.buffers[name] = outputs.pop()
        for name in reversed(chunk.metrics):
            value = outputs.pop()
            self.metrics[name] = value if name not in self.metrics else self.add(self.metrics[name], value, meta.FWD)
        if chunk.has_loss:
            self.losses.append(outputs.pop())
        values = dict(zip(chunk.recv, received))
        values.update(zip(chunk.forward_outputs, outputs))
        self.stash[c, mb] = {name: values[name] for name in chunk.saved}
        if c + 1 < len(self.pipeline.chunks):
            self.outbox["F", c, mb] = [values[name] for name in chunk.send]

    def backward(self, c: int, mb: int) -> None:
        chunk = self.pipeline.chunks[c]
        last = c + 1 == len(self.pipeline.chunks)
        received = [] if last else self.neighbour("B", c + 1, mb, meta.BWD)
        saved = self.stash.pop((c, mb))
        leaves = [self.batch_rows(i, mb) for i in chunk.batch]
        inputs = [*self.read.pop((c, mb)), *self.scale_of(chunk), *leaves, *[saved[n] for n in chunk.saved], *received]
        sent = len(chunk.grad_send)
        if self.split_backward:
            outputs = self.copy(chunk.backward_input, inputs, mb, len(chunk.params))
            self.weight_inputs[c, mb] = [*inputs, *outputs[sent:]]
        else:
            outputs = self.copy(chunk.backward, inputs, mb, len(chunk.params))
            self.accumulate(chunk, outputs[sent:])
        if c > 0:
            self.outbox["B", c, mb] = outputs[:sent]

    def weight_gradient(self, c: int, mb: int) -> None:
        chunk = self.pipeline.chunks[c]
        inputs = self.weight_inputs.pop((c, mb))
        self.accumulate(chunk, self.copy(chunk.backward_weight, inputs, mb, len(chunk.params)))

    def add(self, total: fx.Node, value: fx.Node, phase: str) -> fx.Node:
        (node,) = inline(self.graph, lambda a, b: [a + b], [total, value], fake_mode=self.fake, phase=phase,
                         layer=meta.layer(value), extra_meta={meta.MICROBATCH: meta.microbatch(value)})
        return node

    def accumulate(self, chunk: Chunk, grads: list[fx.Node]) -> None:
        for name, grad in zip(chunk.grads, grads):
            if name not in self.grads:
                self.grads[name] = grad
            else:
                # A gradient this action made (no action stamped on it yet) gets its add right after it,
                # in the region of the layer that made it, where codegen fuses the add with the cast to
                # reduce_dtype. Appended after the whole action, the cast was written out and read back
                # (GPT 1b, 2x H100: 4.6 ms of casts a step on a stage) and every layer's fp32 gradient
                # lived until the action's end. One an earlier action made (computed once a step, or
                # carried to a W) is added at the end, among this action's nodes.
                made_here = meta.ACTION not in grad.meta
                with self.graph.inserting_after(grad) if made_here else contextlib.nullcontext():
                    self.grads[name] = self.add(self.grads[name], grad, meta.BWD)
            self.remaining[name] -= 1
            if not self.remaining[name]:
                self.finish_gradient(name)

    def finish_gradient(self, name: str) -> None:
        """Mark the parameter's gradient of the mean loss as final (FSDP reduces it here). The sum is
        that gradient as it is: each backward started from the loss tangent 1/M (`copy`), so no pass
        over the gradients divides them at the end of the last one (GPT 1b, one H200: ~0.5 ms a chunk
        on the schedule's critical path)."""
        self.grads[name].meta[meta.PARAM] = name

    # ---- the walk -----------------------------------------------------------------------------
    def run(self) -> Program:
        self.make_inputs()
        trained = list(dict.fromkeys(n for c in self.local for n in c.grads))
        produces_grads = "W" if self.split_backward else "B"  # the action that yields a chunk's weight gradients
        for action in self.actions:
            if action.kind == produces_grads:
                for name in self.pipeline.chunks[action.chunk].grads:
                    self.remaining[name] = self.remaining.get(name, 0) + 1
        for chunk in self.local:  # the loss tangent divides every gradient by M (copy): the loss's chunk has it
            graphs = (chunk.backward_input, chunk.backward_weight) if self.split_backward else (chunk.backward,)
            tangents = sum(bool(n.meta.get(meta.LOSS_TANGENT)) for gm in graphs for n in gm.graph.nodes)
            if bool(tangents) != chunk.has_loss:
                raise AssertionError(f"chunk {chunk.index}'s backward holds {tangents} loss tangents (meta.LOSS_TANGENT)")
        for c in {c.index for c in self.local if c.buffers}:  # buffers carry over in microbatch order, as in eager
            order = [a.mb for a in self.actions if a.kind == "F" and a.chunk == c]
            if order != sorted(order):
                raise FxShardError(f"the schedule runs chunk {c}'s forwards in microbatch order {order}, but the chunk "
                                   f"updates buffers {list(self.pipeline.chunks[c].buffers)} in its forward, which "
                                   f"eager PyTorch updates microbatch by microbatch: run them in order")
        for index, action in enumerate(self.actions):
            before = set(self.graph.nodes)
            self.lower(action)
            for node in self.graph.nodes:  # what this action added (passes pair actions by it), not all at the end
                if node not in before:
                    node.meta.setdefault(meta.ACTION, str(action))
                    node.meta.setdefault(meta.ACTION_INDEX, index)
        if self.stash or self.weight_inputs or self.inbox:  # the simulator's checks make this unreachable
            raise FxShardError(f"stage {self.stage}'s schedule left values unread (a B with no W, or a receive no "
                               f"compute action reads): {list(self.stash)[:3]} {list(self.weight_inputs)[:3]} "
                               f"{list(self.inbox)[:3]}")
        return self.finish(trained)

    def lower(self, action: Action) -> None:
        kind = action.kind
        if kind in ("RF", "RB"):
            self.receive(action)
        elif kind in ("SF", "SB"):
            self.send(action)
        elif kind == "F":
            self.forward(action.chunk, action.mb)
        elif kind == "B":
            self.backward(action.chunk, action.mb)
        elif kind == "W":
            self.weight_gradient(action.chunk, action.mb)
        elif kind not in ("OPT", *ZERO):  # ZeRO's collectives are the fsdp pass's (StagePlan.actions)
            raise FxShardError(f"lower_schedule does not lower {kind} actions")

    def all_reduce(self, value: fx.Node, group: str, phase: str, layer: str) -> fx.Node:
        (node,) = inline(self.graph, lambda t: [_c10d.wait_tensor(_c10d.all_reduce(t, "sum", group))], [value],
                         fake_mode=self.fake, phase=phase, layer=layer)
        return node

    def balance(self) -> None:
        """torchtitan's load-balancing update (fxshard/balance.py) of the layers on this stage whose
        counts its forwards updated, once every microbatch's forward is done: their biases and counts
        in `self.buffers` become the updated ones (the traced program of one microbatch leaves the bias
        untouched, so it is no output of it)."""
        local = [b for b in self.source.balances if b.counts in self.buffers]
        if not local:
            return
        biases, counts = append_balancing(self.graph, self.fake, local, [self.buffers[b.counts] for b in local],
                                          [self.buffers.get(b.bias, self.env[b.bias]) for b in local])
        for b, bias, count in zip(local, biases, counts):
            self.buffers[b.bias], self.buffers[b.counts] = bias, count
        self.balanced = local

    def zeros_like_output(self, spec_name: str) -> fx.Node:
        """A zero standing for a loss or metric that another stage computes."""
        value = next(node.meta["val"] for spec, node in zip(self.source.outputs, self.source.output_nodes())
                     if spec.name == spec_name)
        shape, dtype, device = value.shape, value.dtype, value.device
        (node,) = inline(self.graph, lambda: [torch.zeros(shape, dtype=dtype, device=device)], [],
                         fake_mode=self.fake, phase=meta.FWD, layer=meta.POST)
        return node

    def finish(self, trained: list[str]) -> Program:
        count = self.schedule.stages
        for token in self.tokens:  # every send completes within the step
            inline(self.graph, lambda t: [_c10d.wait_tensor(t)], [token], fake_mode=self.fake, phase=meta.BWD,
                   layer=meta.layer(token))
        for name in sorted(n for n in trained if len(self.holders[n]) > 1):  # tied: the same order on every holder
            group = tied_group(self.holders[name], count)
            self.grads[name] = self.all_reduce(self.grads[name], group, meta.BWD, meta.layer(self.grads[name]))
            self.grads[name].meta[meta.PARAM] = name
        loss_name = self.source.outputs[0].name
        if self.losses:
            total = self.losses[0]
            for value in self.losses[1:]:
                total = self.add(total, value, meta.FWD)
            scale = 1.0 / self.microbatches
            (loss,) = inline(self.graph, lambda t: [t * scale], [total], fake_mode=self.fake, phase=meta.FWD,
                             layer=meta.POST)
        else:
            loss = self.zeros_like_output(loss_name)
        outputs = [Output(OutputKind.LOSS, loss_name), Output(OutputKind.GRAD_NORM, "grad_norm")]
        values = [self.all_reduce(loss, "pp", meta.FWD, meta.POST)]
        metric_outputs, metric_values = [], []
        for spec in self.source.outputs_of(OutputKind.METRIC):
            value = self.metrics.get(spec.name)
            value = value if value is not None else self.zeros_like_output(spec.name)
            metric_outputs.append(spec)
            metric_values.append(self.all_reduce(value, "pp", meta.FWD, meta.POST))
        # this stage's updates: summed over the stages, a tied parameter counted on its first holder
        updates = tuple(dataclasses.replace(update, norm_axes=("pp", *update.norm_axes),
                                            counted=update.counted and self.holders[update.name][0] == self.stage)
                        for update in self.source.updates if update.name in trained)
        states = {(spec.owner, spec.slot): self.env[spec.name]
                  for spec in self.inputs if spec.kind is InputKind.OPT_STATE}
        # a dynamic loss scale: every stage unscales with it and updates it alike (the skip follows the
        # norm, summed over the stages)
        scale = self.scalars.get(InputKind.LOSS_SCALE)
        grad_norm, new_params, new_states, nonfinite, next_scale = append_update(
            self.graph, self.source.train, self.fake, updates, [self.env[u.name] for u in updates],
            [self.grads[u.name] for u in updates], states, self.scalars[InputKind.LR], self.scalars[InputKind.STEP],
            loss_scale=scale)
        values.append(grad_norm)
        for update in updates:
            outputs.append(Output(OutputKind.PARAM, update.name, STAGE_LOCAL))
            values.append(new_params[update.name])
        for (name, slot), node in new_states.items():
            outputs.append(Output.optimizer_slot(slot, name, STAGE_LOCAL))
            values.append(node)
        outputs += metric_outputs
        values += metric_values
        self.balance()
        traced = [spec for spec in self.source.outputs_of(OutputKind.BUFFER) if spec.name in self.buffers]
        biases = [Output(OutputKind.BUFFER, name) for name in self.buffers if name not in {s.name for s in traced}]
        for spec in traced + biases:  # updated by this stage's forwards; the balanced layers' routing biases
            outputs.append(dataclasses.replace(spec, placement=STAGE_LOCAL))
            values.append(self.buffers[spec.name])
        if nonfinite is not None:
            outputs.append(Output(OutputKind.NONFINITE, "nonfinite"))
            values.append(nonfinite)
        if next_scale is not None:
            outputs.append(Output(OutputKind.LOSS_SCALE, LOSS_SCALE))
            values.append(next_scale)
        self.graph.output(tuple(values))
        self.graph.lint()
        gm = lazy_module(self.source.graph_module, self.graph)
        groups = {tied_group(stages, count): stages for stages in self.holders.values() if len(stages) > 1}
        plan = StagePlan(self.stage, count, self.params_by_stage, tuple(sorted(groups.items())), self.actions,
                         self.costs)
        layers = [layer for c in self.local for layer in c.layers]
        notes = dict(self.source.notes, pipeline=(
            f"stage {self.stage} of {count}: chunks {[c.index for c in self.local]} (layers {', '.join(layers)}), "
            f"schedule {self.schedule.name}, {self.microbatches} microbatches, "
            f"{sum(a.kind in COMPUTE for a in self.actions)} compute actions, "
            f"{sum(a.kind in ('SF', 'SB') for a in self.actions)} sends, {sum(a.kind in ('RF', 'RB') for a in self.actions)} receives"
            + "".join(f", {sum(a.kind == kind for a in self.actions)} {kind}" for kind in ZERO
                      if any(a.kind == kind for a in self.actions))))
        if self.balanced:
            notes["load_balancing"] = balancing_notes(self.balanced)
        return self.source.replace(graph_module=gm, inputs=tuple(self.inputs), outputs=tuple(outputs), notes=notes,
                                   updates=updates, stage=plan)
