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
from ..program import FlatUnit, InputKind, OutputKind
from ..schedule import Action, Schedule


class RankExecutor:
    """One rank's chunks and state for one step: stashes, received values, gradient sums, losses."""

    def __init__(self, rank: int, pipeline, schedule: Schedule, params_of: Callable,
                 microbatches: list[list[torch.Tensor]]):
        """`params_of(chunk)` -> the tensors of `chunk.params`, in order (gathered where sharded)."""
        self.rank, self.pipeline, self.schedule = rank, pipeline, schedule
        self.params_of = params_of
        self.microbatches = microbatches
        self.inbox: dict[tuple[str, int, int], list[torch.Tensor]] = {}   # ("F"|"B", chunk, mb) -> values
        self.outbox: dict[tuple[str, int, int], list[torch.Tensor]] = {}
        self.stash: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        self.grads: dict[str, torch.Tensor] = {}
        self.losses: dict[int, torch.Tensor] = {}
        self.metrics: dict[str, torch.Tensor] = {}   # reported metrics, summed over microbatches
        self.position = 0
        # with W actions (zero bubble) B runs the input-gradient part and W the weight-gradient part
        self.split_backward = any(a.kind == "W" for a in schedule.ranks[rank])
        self.weight_inputs: dict[tuple[int, int], list[torch.Tensor]] = {}

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
        elif kind == "W":
            self.weight_gradient(c, mb)
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
        outputs = list(chunk.forward(*self.params_of(chunk), *leaves, *received))
        for name in reversed(chunk.metrics):
            value = outputs.pop()
            self.metrics[name] = self.metrics[name] + value if name in self.metrics else value
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
        inputs = [*self.params_of(chunk), *leaves, *[saved[n] for n in chunk.saved], *received]
        if self.split_backward:
            outputs = list(chunk.backward_input(*inputs))
            sent = outputs[:len(chunk.grad_send)]
            # W reads the same inputs (activations stay alive until it runs) and the carried values
            self.weight_inputs[c, mb] = [*inputs[len(chunk.params):], *outputs[len(chunk.grad_send):]]
        else:
            outputs = list(chunk.backward(*inputs))
            sent = outputs[:len(chunk.grad_send)]
            self._add_grads(chunk, outputs[len(chunk.grad_send):])
        if c > 0:
            self.outbox["B", c, mb] = sent

    def weight_gradient(self, c: int, mb: int) -> None:
        chunk = self.pipeline.chunks[c]
        self._add_grads(chunk, chunk.backward_weight(*self.params_of(chunk), *self.weight_inputs.pop((c, mb))))

    def _add_grads(self, chunk, grads) -> None:
        for name, grad in zip(chunk.grads, grads):
            self.grads[name] = grad if name not in self.grads else self.grads[name] + grad


def run_local(pipeline, schedule: Schedule, params: dict[str, torch.Tensor],
              microbatches: list[list[torch.Tensor]]) -> list[RankExecutor]:
    """Every rank's actions in this process, in an order the messages allow; returns the executors
    (losses per microbatch on the last chunk's rank, gradient sums per rank)."""
    if schedule.chunks != len(pipeline.chunks):
        raise FxShardError(f"the schedule has {schedule.chunks} chunks, the pipeline program {len(pipeline.chunks)}")
    ranks = [RankExecutor(r, pipeline, schedule, lambda chunk: [params[n] for n in chunk.params], microbatches)
             for r in range(schedule.stages)]
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


class PipelineStep:
    """`step(batch)` on one rank of a Mesh(pp=P, dp=N): this rank's chunks run the schedule over the
    M microbatches of its data-parallel batch with point-to-point sends and receives, then

      1. gradients of parameters held by several stages (tied embedding and head) are summed
         across those stages;
      2. over the N data-parallel ranks, gradients are all-reduced (`no_shard`) or reduce-scattered
         into flat units, one per (chunk, dtype) plus one per shared parameter (`optim`,
         `optim_grads`, `optim_grads_params`: the optimizer state lives in shards);
      3. the loss (mean over microbatches, on the last stage) is shared with every stage and
         averaged over data-parallel ranks;
      4. the optimizer updates this rank's parameters (or its shards, which `optim` and
         `optim_grads` then all-gather); the gradient norm is one all-reduce of a scalar per mesh
         axis (a tied parameter counted once).

    Under `optim_grads_params` parameters stay sharded between actions: each forward and backward of
    a chunk all-gathers the chunk's units first and drops them after (no prefetch yet).

    Every rank of one pipeline calls `step` with the same batch (the first stage reads the inputs,
    the last the targets). `parameters()` returns the parameters of this rank's chunks; under
    `optim_grads_params` it all-gathers, so every data-parallel rank must call it.
    """

    def __init__(self, pipeline, schedule: Schedule, mesh, coords: dict[str, int], groups: dict,
                 params: dict[str, torch.Tensor], optimizer, batch_spec, microbatches: int, device,
                 sharding: str = "no_shard"):
        import torch.distributed as dist

        from ..graph import fake_mode_of

        self.pipeline, self.schedule, self.mesh = pipeline, schedule, mesh
        self.pp_rank, self.dp_rank = coords["pp"], coords["dp"]
        self.groups, self.optimizer, self.batch_spec = groups, optimizer, batch_spec
        self.microbatches, self.device = microbatches, device
        self.sharded = sharding != "no_shard" and mesh.dp > 1
        self.shards_params = self.sharded and sharding == "optim_grads_params"
        self.step_count = 0
        self.local_chunks = [c for c in pipeline.chunks if schedule.rank_of(c.index) == self.pp_rank]
        names = list(dict.fromkeys(n for c in self.local_chunks for n in c.params))
        self.params = {n: params[n].detach().clone() for n in names}
        self.trainable = list(dict.fromkeys(n for c in self.local_chunks for n in c.grads))
        # stages that hold each trained parameter; one process group per set shared by several stages
        holders: dict[str, list[int]] = {}
        for chunk in pipeline.chunks:
            for name in chunk.grads:
                stage = schedule.rank_of(chunk.index)
                if stage not in holders.setdefault(name, []):
                    holders[name].append(stage)
        self.shared_groups = {}
        for stages in sorted({tuple(sorted(s)) for s in holders.values() if len(s) > 1}):
            for dp in range(mesh.dp):  # every rank creates every group, in the same order
                group = dist.new_group([mesh.rank_of(p, dp) for p in stages])
                if dp == self.dp_rank and self.pp_rank in stages:
                    for name, held in holders.items():
                        if tuple(sorted(held)) == stages:
                            self.shared_groups[name] = group
        counted_elsewhere = {n for n in self.trainable if min(holders[n]) != self.pp_rank}
        if self.sharded:
            self.units = _units(self.local_chunks, self.trainable, self.params, set(self.shared_groups), mesh.dp)
            tensors = {u.name: u.shard(u.flatten(self.params), self.dp_rank) for u in self.units}
            if self.shards_params:
                for unit in self.units:
                    for member in unit.members:
                        del self.params[member.name]
            self.shards = tensors
            update_names = [u.name for u in self.units]
            not_in_norm = frozenset(u.name for u in self.units if u.members[0].name in counted_elsewhere
                                    and u.name.startswith("shared/"))
        else:
            tensors = {n: self.params[n] for n in self.trainable}
            update_names = list(self.trainable)
            not_in_norm = frozenset(counted_elsewhere)
        self.states = {(n, slot): value for n in update_names
                       for slot, value in optimizer.init_state(tensors[n]).items()}
        axes = tuple(axis for axis, size in (("pp", mesh.pp), ("dp", mesh.dp if self.sharded else 1)) if size > 1)
        update = _optimizer_graph(pipeline.source.train, {n: tensors[n] for n in update_names}, self.states,
                                  not_in_norm, axes, fake_mode_of(pipeline.source.graph))
        from .step import bind_group_names

        self._update_names = update_names
        self._update = bind_group_names(update, {axis: groups[axis].group_name for axis in axes})
        self._shapes = _message_shapes(pipeline)

    def _params_of(self, chunk) -> list[torch.Tensor]:
        if not self.shards_params:
            return [self.params[n] for n in chunk.params]
        values = dict(self.params)
        wanted = set(chunk.params)
        for unit in self.units:
            if any(m.name in wanted for m in unit.members):
                values.update(unit.unflatten(self._gather(self.shards[unit.name])))
        return [values[n] for n in chunk.params]

    def _gather(self, shard: torch.Tensor) -> torch.Tensor:
        from .state import gather_shard

        return gather_shard(shard, self.groups["dp"])

    def __call__(self, batch) -> dict[str, torch.Tensor]:
        import torch.distributed as dist

        from ..optim import lr_at

        leaves = self.batch_spec.flatten(batch)
        rows = leaves[0].shape[0] // self.microbatches
        microbatches = [[leaf[m * rows:(m + 1) * rows] for leaf in leaves] for m in range(self.microbatches)]
        executor = RankExecutor(self.pp_rank, self.pipeline, self.schedule, self._params_of, microbatches)
        pending = []

        def send(action, values):
            peer = self.mesh.rank_of(action.peer, self.dp_rank)
            ops = [dist.P2POp(dist.isend, v.contiguous(), peer) for v in values]
            pending.extend(dist.batch_isend_irecv(ops) if ops else [])

        def receive(action):
            peer = self.mesh.rank_of(action.peer, self.dp_rank)
            source = action.chunk - 1 if action.kind == "RF" else action.chunk + 1
            buffers = [torch.empty(shape, dtype=dtype, device=self.device)
                       for shape, dtype in self._shapes[action.kind[1], source]]
            for work in dist.batch_isend_irecv([dist.P2POp(dist.irecv, b, peer) for b in buffers]) if buffers else []:
                work.wait()
            return buffers

        while not executor.done:
            executor.step(receive, send)
        for work in pending:
            work.wait()
        grads = {}
        for name in self.trainable:
            grad = executor.grads[name] / self.microbatches
            if name in self.shared_groups:
                dist.all_reduce(grad, group=self.shared_groups[name])
            grads[name] = grad
        if self.sharded:
            update_grads = []
            for unit in self.units:
                flat = unit.flatten(grads).to(next(iter(grads.values())).dtype)
                shard = flat.new_empty(unit.shard_numel)
                dist.reduce_scatter_tensor(shard, flat, op=dist.ReduceOp.AVG, group=self.groups["dp"])
                update_grads.append(shard.to(self.shards[unit.name].dtype))
            update_params = [self.shards[u.name] for u in self.units]
        else:
            update_grads = []
            for name in self.trainable:
                if self.mesh.dp > 1:
                    dist.all_reduce(grads[name], op=dist.ReduceOp.AVG, group=self.groups["dp"])
                update_grads.append(grads[name].to(self.params[name].dtype))  # reduced in reduce_dtype
            update_params = [self.params[n] for n in self.trainable]
        is_last = self.pp_rank == self.schedule.rank_of(len(self.pipeline.chunks) - 1)
        loss = (torch.stack([executor.losses[m] for m in range(self.microbatches)]).mean().float() if is_last
                else torch.zeros((), device=self.device))
        if self.mesh.pp > 1:
            dist.all_reduce(loss, group=self.groups["pp"])
        if self.mesh.dp > 1:
            dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=self.groups["dp"])
        reported = {}
        for spec in self.pipeline.source.outputs:
            if spec.kind is not OutputKind.METRIC:
                continue
            value = executor.metrics.get(spec.name)
            value = value.clone() if value is not None else torch.zeros((), dtype=_metric_dtype(self.pipeline, spec.name),
                                                                         device=self.device)
            for axis in ("pp", "dp"):
                if getattr(self.mesh, axis) > 1:
                    dist.all_reduce(value, group=self.groups[axis])
            reported[spec.name] = value
        self.step_count += 1
        lr = torch.tensor(lr_at(self.optimizer, self.step_count), device=self.device)
        step = torch.tensor(float(self.step_count), device=self.device)
        outputs = self._update(*update_params, *update_grads, *self.states.values(), lr, step)
        grad_norm, new = outputs[0], list(outputs[1:])
        for name in self._update_names:
            if self.sharded:
                self.shards[name] = new.pop(0)
            else:
                self.params[name] = new.pop(0)
        for key in self.states:
            self.states[key] = new.pop(0)
        if self.sharded and not self.shards_params:
            for unit in self.units:
                self.params.update(unit.unflatten(self._gather(self.shards[unit.name])))
        return {"loss": loss.detach(), "grad_norm": grad_norm.detach(), **reported}

    def parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter of the model, in the model's order, on every rank, as tensors the step will
        not change: this rank's chunks' (all-gathered over dp where sharded) and the other stages'
        (gathered over pp). Every rank of the mesh must call it."""
        import torch.distributed as dist

        values = dict(self.params)
        if self.shards_params:
            for unit in self.units:
                values.update(unit.unflatten(self._gather(self.shards[unit.name])))
        source = self.pipeline.source
        specs = {spec.name: node.meta["val"] for spec, node in zip(source.inputs, source.placeholders())
                 if spec.kind is InputKind.PARAM}
        owner = {}  # the first stage holding each parameter sends it (a tied one is equal on each holder)
        for chunk in self.pipeline.chunks:
            for name in chunk.params:
                if name in specs:
                    owner[name] = min(owner.get(name, self.mesh.pp), self.schedule.rank_of(chunk.index))
        result = {}
        for stage in range(self.mesh.pp):
            for dtype in dict.fromkeys(specs[n].dtype for n in specs if owner[n] == stage):
                members = [n for n in specs if owner[n] == stage and specs[n].dtype == dtype]
                if stage == self.pp_rank:
                    flat = torch.cat([values[n].detach().reshape(-1) for n in members])
                else:
                    flat = torch.empty(sum(specs[n].numel() for n in members), dtype=dtype, device=self.device)
                dist.broadcast(flat, src=self.mesh.rank_of(stage, self.dp_rank), group=self.groups["pp"])
                for name, piece in zip(members, flat.split([specs[n].numel() for n in members])):
                    result[name] = piece.view(specs[name].shape)
        return {name: result[name] for name in specs}


def _metric_dtype(pipeline, metric: str) -> torch.dtype:
    """The dtype of a reported metric, from the traced program."""
    for spec, node in zip(pipeline.source.outputs, pipeline.source.output_nodes()):
        if spec.name == metric:
            return node.meta["val"].dtype
    raise KeyError(metric)


def _units(local_chunks, trainable, params, shared: set[str], world: int):
    """Flat units over the data-parallel ranks: one per (first local chunk, dtype) of a trained
    parameter, and one per parameter shared with another stage (its norm is counted once)."""
    groups: dict[str, list[str]] = {}
    for chunk in local_chunks:
        for name in chunk.grads:
            if any(name in members for members in groups.values()):
                continue
            key = f"shared/{name}" if name in shared else f"chunk{chunk.index}:{params[name].dtype}".replace("torch.", "")
            groups.setdefault(key, []).append(name)
    return [FlatUnit.laid_out(key, [(n, params[n].shape) for n in names], params[names[0]].dtype, world)
            for key, names in groups.items()]


def _optimizer_graph(train, tensors: dict[str, torch.Tensor], states, not_in_norm, norm_axes, fake):
    """(params..., grads..., states..., lr, step) -> (grad_norm, new params..., new states...)."""
    import torch.fx as fx

    from ..optimizer_graph import append_update

    graph = fx.Graph()
    names = list(tensors)

    def placeholder(value):
        node = graph.placeholder(f"in_{len(graph.nodes)}")
        node.meta["val"] = value
        return node

    with fake:
        fakes = {n: torch.empty(t.shape, dtype=t.dtype, device=t.device) for n, t in tensors.items()}
        params = [placeholder(fakes[n]) for n in names]
        grads = [placeholder(torch.empty_like(fakes[n])) for n in names]
        state_nodes = {key: placeholder(torch.empty_like(fakes[key[0]])) for key in states}
        device = fakes[names[0]].device
        lr = placeholder(torch.empty((), device=device))
        step = placeholder(torch.empty((), device=device))
    grad_norm, new_params, new_states = append_update(graph, train, fake, names, params, grads, state_nodes, lr, step,
                                                      norm_group=norm_axes, not_in_norm=not_in_norm)
    graph.output((grad_norm, *[new_params[n] for n in names], *[new_states[k] for k in states]))
    return fx.GraphModule(torch.nn.Module(), graph)


def _message_shapes(pipeline) -> dict[tuple[str, int], list[tuple[tuple[int, ...], torch.dtype]]]:
    """("F", c) -> shapes of chunk c's sent activations; ("B", c) -> of its sent gradients."""
    shapes = {}
    for chunk in pipeline.chunks:
        for kind, gm, count in (("F", chunk.forward, len(chunk.send)), ("B", chunk.backward, len(chunk.grad_send))):
            output = next(n for n in gm.graph.nodes if n.op == "output")
            values = [node.meta["val"] for node in output.args[0][:count]]
            shapes[kind, chunk.index] = [(tuple(v.shape), v.dtype) for v in values]
    return shapes
