"""Helpers for tests: eager reference training, parity measurement, and the SPMD simulator
(`fxshard.spmd.simulate`, re-exported here)."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn as nn

from .runtime.nonfinite import was_skipped

from . import optim as fx_optim
from .spmd import simulate  # noqa: F401  (part of the testing API)


def torch_optimizer(optimizer, params):
    """The torch.optim optimizer with the same semantics as an fxshard.optim description. `params`:
    tensors, or (name, tensor) pairs (`model.named_parameters()`), which an optimizer with `no_decay`
    needs: the parameters it names form a second group, with weight_decay 0."""
    params = list(params)
    named = bool(params) and isinstance(params[0], tuple)
    if optimizer.no_decay and not named:
        raise TypeError("an optimizer with no_decay needs named parameters: pass model.named_parameters()")
    pairs = [(name, p) for name, p in (params if named else [(None, p) for p in params]) if p.requires_grad]
    groups = [{"params": [p for name, p in pairs if name is None or optimizer.decays(name)]},
              {"params": [p for name, p in pairs if name is not None and not optimizer.decays(name)], "weight_decay": 0.0}]
    groups = [group for group in groups if group["params"]]
    lr = optimizer.lr if not callable(optimizer.lr) else optimizer.lr(1)
    if isinstance(optimizer, fx_optim.AdamW):
        return torch.optim.AdamW(groups, lr=lr, betas=optimizer.betas, eps=optimizer.eps,
                                 weight_decay=optimizer.weight_decay, foreach=False)
    return torch.optim.SGD(groups, lr=lr, momentum=optimizer.momentum, weight_decay=optimizer.weight_decay,
                           dampening=optimizer.dampening, nesterov=optimizer.nesterov, foreach=False)


@dataclass
class Parity:
    """Worst relative differences between an fxshard run and eager PyTorch."""

    losses: list[tuple[float, float]]
    max_loss_rel: float
    max_param_rel: float


_TRACED: dict = {}


def traced_once(key, trace):
    """`trace()`'s program, made once per test process for each `key`. For property tests whose
    examples vary what the passes do (schedule, strategy, mesh) and not what is traced: tracing is
    ~40% of such an example's time. Passes are pure, so the examples can share the program; one that
    rewrote its input in place would make the next example fail. `key` names the test and everything
    its trace depends on (model, batch shapes, optimizer, config)."""
    if key not in _TRACED:
        _TRACED[key] = trace()
    return _TRACED[key]


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = b.detach().abs().max().item()
    return (a.detach() - b.detach()).abs().max().item() / (scale if scale > 0 else 1.0)


def eager_parity(model: nn.Module, loss_fn, batches, optimizer, config=None) -> Parity:
    """Train a copy of `model` eagerly and through `fxshard.shard` on the same batches; compare."""
    from .api import shard

    reference = copy.deepcopy(model)
    step = shard(model, loss_fn, batches[0], optimizer=optimizer, config=config)
    torch_opt = torch_optimizer(optimizer, reference.named_parameters())
    losses, worst = [], 0.0
    for index, batch in enumerate(batches):
        if callable(optimizer.lr):
            for group in torch_opt.param_groups:
                group["lr"] = optimizer.lr(index + 1)
        metrics = step(batch)
        torch_opt.zero_grad()
        eager_loss = loss_fn(reference, batch)
        eager_loss.backward()
        clip = config.clip_grad_norm if config is not None else None
        if clip is not None:
            nn.utils.clip_grad_norm_([p for p in reference.parameters() if p.requires_grad], clip)
        torch_opt.step()
        losses.append((metrics["loss"].item(), eager_loss.item()))
        worst = max(worst, abs(losses[-1][0] - losses[-1][1]) / max(abs(losses[-1][1]), 1e-12))
    params = step.parameters()
    param_rel = max(relative(params[name], p) for name, p in reference.named_parameters())
    return Parity(losses, worst, param_rel)


class SimulatedRanks:
    """Train a per-rank Program on N simulated ranks in this process (the SPMD simulator runs the
    collectives). The counterpart of CompiledStep for property tests: fast, deterministic, no spawning."""

    def __init__(self, program, model, optimizer, mesh, lowering=None, rank_lowering=None):
        """`model`: a model with real weights, or an fxshard.init.MetaInit for a meta-device one.
        `program`: every rank's Program, or a list of one per pipeline stage (Mesh(pp>1)).
        `lowering`: a runtime lowering (GraphModule -> GraphModule) to run each rank's graph through,
        as CompiledStep does (e.g. runtime/copy_engine.py's, whose regions the simulator emulates);
        or `rank_lowering` ((GraphModule, rank, {group name: place of rank in it}) -> GraphModule)
        for one whose graph differs per rank."""
        from .runtime.state import initial_state

        self.optimizer, self.mesh = optimizer, mesh
        self.world = mesh.size
        stages = program if isinstance(program, (list, tuple)) else [program] * mesh.pp
        self.programs = [stages[mesh.coords(rank)["pp"]] for rank in range(self.world)]
        self.program = self.programs[0]
        if rank_lowering is not None:
            places = [{name: next(m for m in lists if rank in m).index(rank) for name, lists in self.groups().items()
                       if any(rank in m for m in lists)} for rank in range(self.world)]
            self.graphs = [rank_lowering(p.graph_module, rank, places[rank]) for rank, p in enumerate(self.programs)]
        else:
            lowered = {id(p): (lowering or (lambda gm: gm))(p.graph_module) for p in self.programs}
            self.graphs = [lowered[id(p)] for p in self.programs]
        self.workspaces: dict = {}  # each rank's copy-engine workspaces, kept across steps as on GPUs
        self.states = [initial_state(self.programs[rank], model, optimizer, mesh.coords(rank))
                       for rank in range(self.world)]
        self.step_count = 0
        self.skipped = 0  # steps the non-finite guard skipped: the optimizer's step counts the others

    def step(self, local_batches, lr: float | None = None) -> list[dict[str, torch.Tensor]]:
        from .optim import lr_at
        from .program import InputKind, OutputKind
        from .runtime.reinplace import WRITE_BACK

        self.step_count += 1
        lr = lr_at(self.optimizer, self.step_count) if lr is None else lr
        inputs = []
        for rank, batch in enumerate(local_batches):
            leaves = iter(leaf.contiguous() for leaf in torch.utils._pytree.tree_leaves(batch))  # as BatchSpec.flatten
            args = []
            for spec in self.programs[rank].inputs:
                if spec.kind is InputKind.BATCH:
                    args.append(next(leaves))
                elif spec.kind is InputKind.LR:
                    args.append(torch.tensor(lr))
                elif spec.kind is InputKind.STEP:
                    args.append(torch.tensor(float(self.step_count - self.skipped)))
                else:
                    args.append(self.states[rank][spec.kind, spec.name])
            inputs.append(args)
        outputs = simulate(self.graphs, inputs, self.groups(), self.workspaces)
        metrics = []
        for rank, results in enumerate(outputs):
            metrics.append({})
            for spec, value in zip(self.programs[rank].outputs, results):
                if spec.kind in WRITE_BACK:
                    self.states[rank][WRITE_BACK[spec.kind], spec.name] = value
                else:
                    metrics[rank][spec.name] = value
        if any(spec.kind is OutputKind.NONFINITE for spec in self.program.outputs):
            self.skipped += int(was_skipped(metrics[0]["nonfinite"]))  # as CompiledStep counts
        return metrics

    def groups(self) -> dict[str, list[list[int]]]:
        """The mesh's groups, and those of stage subsets that pipeline programs name (tied weights)."""
        groups = self.mesh.all_groups()
        for program in self.programs:
            for axis, stages in program.stage.groups if program.stage else ():
                groups[axis] = self.mesh.stage_groups(stages)
        return groups

    def parameters(self, rank: int = 0) -> dict[str, torch.Tensor]:
        """Full parameters as `rank` sees them (sharded inputs concatenated over all ranks; under
        a pipeline, every stage's parameters)."""
        from .runtime.state import expert_parameters, local_parameters

        groups = self.mesh.all_groups()

        def members(r, axis):
            return next(g for g in groups[axis] if r in g)

        def local(r):
            def gather(spec, shard):
                return torch.cat([self.states[m][spec.kind, spec.name] for m in members(r, spec.placement.axis)])
            return local_parameters(self.programs[r], self.states[r], gather)

        result = {}
        for stage_rank in reversed(members(rank, "pp")):  # a tied parameter: its first stage's copy
            stage = local(stage_rank)
            experts = expert_parameters(self.programs[stage_rank])
            if experts:  # each rank holds its own experts: concatenated over its ep group
                locals_ = {m: local(m) for m in members(stage_rank, "ep")}
                for name in experts:
                    stage[name] = torch.cat([locals_[m][name] for m in members(stage_rank, "ep")])
            result.update(stage)
        return result


def assert_bit_identical(programs, model, optimizer, mesh, local_batches, steps: int = 2) -> None:
    """Train each program (e.g. one before and one after a reordering pass) `steps` steps on the
    simulated ranks of `mesh`, from the same state on the same batches; assert that every rank's
    metrics of the last step and the parameters are equal bit for bit across the programs."""
    results = []
    for program in programs:
        ranks = SimulatedRanks(program, model, optimizer, mesh)
        metrics = [ranks.step(local_batches) for _ in range(steps)][-1]
        results.append((metrics, ranks.parameters()))
    (metrics, params), rest = results[0], results[1:]
    for other_metrics, other_params in rest:
        for rank, rank_metrics in enumerate(metrics):
            for name, value in rank_metrics.items():
                assert torch.equal(value, other_metrics[rank][name]), (rank, name)
        for name, value in params.items():
            assert torch.equal(value, other_params[name]), name


def assert_step_like_eager(programs, model, optimizer, mesh, local_batches, pieces, loss_fn,
                           tolerance: float = 1e-5) -> None:
    """One step of `programs` (every rank's, or one per pipeline stage) on the simulated ranks of
    `mesh`, rank r on `local_batches[r]`, against one eager step of a copy of `model` on the mean of
    `loss_fn` over `pieces` (the same rows as the ranks' microbatches): every rank's loss and every
    parameter within `tolerance`, relative."""
    import copy

    ranks = SimulatedRanks(programs, model, optimizer, mesh)
    metrics = ranks.step(local_batches)
    reference = copy.deepcopy(model)
    eager_optimizer = torch_optimizer(optimizer, reference.named_parameters())
    loss = sum(loss_fn(reference, piece) for piece in pieces) / len(pieces)
    loss.backward()
    eager_optimizer.step()
    for rank_metrics in metrics:
        assert abs(rank_metrics["loss"].item() - loss.item()) <= tolerance * abs(loss.item())
    params = ranks.parameters(rank=0)
    for name, p in reference.named_parameters():
        assert relative(params[name], p) < tolerance, name
