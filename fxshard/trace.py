"""model + loss + optimizer -> Program: one joint forward+backward+optimizer graph in aten IR.

Route (docs/architecture.md, "Tracing"): aot_autograd's `aot_export_joint_with_descriptors` under
`torch.fx.traceback.preserve_node_meta()`, on fake tensors, with each layer's forward annotated; the
backward nodes inherit their forward's annotation. The optimizer update is traced with make_fx on
the same fake tensors and appended, so the program is one graph:

    (params, opt_state, buffers, batch, lr, step) -> (loss, grad_norm, new params, new opt_state, new buffers)
"""

from __future__ import annotations

import contextlib
import itertools
import operator
import os
import sys
import time
import warnings
from fnmatch import fnmatchcase

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
import torch.nn as nn
from torch._functorch.aot_autograd import aot_export_joint_with_descriptors
from torch._subclasses.fake_tensor import FakeTensorMode

from . import meta, moe
from .config import Config
from .errors import FxShardError, user_stacklevel
from .errors_trace import explain_trace_failure
from .graph import Graph, inline, lazy_module
from .layers import LayerTrace, annotate_layers, find_layers
from .loss_scale import NAME as LOSS_SCALE
from .moe_modules import swapped_forwards
from .sink_attention import swapped_attention
from .balance import Balance, append_balancing, balanced_layers, balancing_notes
from .ops.grouped_mm import RouteGroupedMM
from .optim import AdamW, Optimizer
from .optimizer_graph import TrainSpec, append_update
from .program import Input, InputKind, Output, OutputKind, Program, Update
from .batch import BatchSpec


RESERVED_METRICS = frozenset({"loss", "grad_norm", "nonfinite", "skipped"})  # what every step reports itself


class _LossStep(nn.Module):
    """The module aot_autograd traces: loss_fn(model, batch) with the model's tensors passed in.

    The model is held in a tuple so it is not a submodule: its tensors enter only as arguments.
    functional_call swaps them in around a wrapper, because loss_fn may call any method of the model
    (`model.loss(batch)`), not only its forward.
    """

    def __init__(self, model, loss_fn, batch_spec, param_names, buffer_names):
        super().__init__()
        self.target = (_Apply(model, loss_fn),)
        self.batch_spec = batch_spec
        self.names = [f"model.{n}" for n in [*param_names, *buffer_names]]

    metric_names: tuple[str, ...] = ()

    def forward(self, params, buffers, leaves):
        tensors = dict(zip(self.names, [*params, *buffers]))
        result = torch.func.functional_call(self.target[0], tensors, (self.batch_spec.unflatten(leaves),))
        if isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], dict):
            loss, metrics = result
            self.metric_names = tuple(sorted(metrics))
            taken = sorted(set(self.metric_names) & RESERVED_METRICS)
            if taken:
                raise FxShardError(f"loss_fn's metrics {taken} have names the step's own outputs use "
                                   f"({sorted(RESERVED_METRICS)}); rename them")
            for name in self.metric_names:
                value = metrics[name]
                if not isinstance(value, torch.Tensor) or value.numel() != 1:
                    raise FxShardError(f"loss_fn's metric {name!r} must be a one-element tensor, got "
                                       f"{type(value).__name__} {getattr(value, 'shape', '')}")
            return (loss, *[metrics[name].detach().reshape(()) for name in self.metric_names])
        return result


class _Apply(nn.Module):
    def __init__(self, model, loss_fn):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self._swapped_in: dict = {}  # during a call: the step's buffer inputs (functional_call's)
        self._written: dict = {}  # buffer name -> the rebound value already written into its input

    def forward(self, batch):
        self._swapped_in, self._written = dict(self.model.named_buffers()), {}
        result = self.loss_fn(self.model, batch)
        self.write_back_rebound()
        self._swapped_in, self._written = {}, {}
        return result

    def write_back_rebound(self) -> None:
        """Buffers rebound since the last call (`self.count = self.count + 1`), written into the step's
        input: functional_call would drop the new value; written into the input it is an update of the
        buffer, like an in-place one. Called at every layer boundary too (annotate_layers), so the
        write-back belongs to the layer (or the part before the first) that rebound it."""
        for name, value in self.model.named_buffers():
            original = self._swapped_in.get(name)
            if original is None or value is original or self._written.get(name) is value:
                continue
            if value.shape != original.shape:
                raise FxShardError(f"the model rebinds buffer {name!r} to a tensor of shape {tuple(value.shape)}; "
                                   f"it was {tuple(original.shape)}: shapes are static, so a buffer "
                                   f"keeps its shape (update it in place, or keep the new value elsewhere)")
            with torch.no_grad():
                original.copy_(value)
            self._written[name] = value


def _refuse_untraceable_parameters(model: nn.Module, params: dict[str, nn.Parameter]) -> None:
    """Refuse complex trainable parameters (the optimizers are real), sparse embeddings (a sparse
    gradient), and hooks on trainable parameter tensors (`p.register_hook`,
    `register_post_accumulate_grad_hook`): a hook belongs to its tensor, and the traced step computes
    gradients of its own, so it would skip the hook silently."""
    for path, module in model.named_modules():
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.sparse and module.weight.requires_grad:
            raise FxShardError(f"{path or type(model).__name__} is an {type(module).__name__} with sparse=True: its "
                               f"gradient would be a sparse tensor, which fxshard's dense step does not make; build "
                               f"it with sparse=False (the default)")
    for name, param in params.items():
        if param.is_complex() and param.requires_grad:
            raise FxShardError(f"parameter {name!r} is complex ({param.dtype}); fxshard trains real parameters "
                               f"(its optimizers and gradient norm are real): store it as torch.view_as_real and "
                               f"view it as complex in forward")
        kinds = [kind for kind, attribute in (("register_hook", "_backward_hooks"),
                                              ("register_post_accumulate_grad_hook", "_post_accumulate_grad_hooks"))
                 if param.requires_grad and getattr(param, attribute, None)]  # a frozen one's never run
        if kinds:
            raise FxShardError(
                f"parameter {name!r} has a gradient hook ({kinds[0]}), which the traced step would not run: "
                f"fxshard computes the gradients in its own graph. Change the gradient in loss_fn or in the "
                f"module instead (a module's register_full_backward_hook is traced), or remove the hook (its "
                f"handle's remove(), or param._backward_hooks.clear() / _post_accumulate_grad_hooks.clear() for "
                f"one a library registered)")


def trace(model: nn.Module, loss_fn, example_batch, optimizer: Optimizer | None = None,
          config: Config | None = None, balance: bool = True) -> Program:
    """Trace one training step into a Program, on fake tensors (no real compute, no weight memory).
    The step differentiates whatever the caller's grad mode: a shard() or a first evaluate() under
    torch.no_grad() or torch.inference_mode() traces the same step. With `balance`, torchtitan's MoE
    load balancing is part of the step (fxshard/balance.py; not for a pipeline's one microbatch)."""
    with torch.inference_mode(False), torch.enable_grad():
        return _trace_step(model, loss_fn, example_batch, optimizer, config, balance)


def _trace_step(model: nn.Module, loss_fn, example_batch, optimizer: Optimizer | None,
                config: Config | None, balance: bool = True) -> Program:
    config = config or Config()
    optimizer = optimizer or AdamW()
    started = time.perf_counter()
    batch_spec = BatchSpec.from_example(example_batch)
    if config.microbatches > 1:  # microbatches are rows of every leaf (a 0-dim leaf is fine without them)
        batch_spec.split_rows(config.microbatches)
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    if not any(p.requires_grad for p in params.values()):
        raise FxShardError(
            f"{type(model).__name__} has no trainable parameters ({len(params)} parameters, none with "
            f"requires_grad=True); there is nothing to train")
    _refuse_untraceable_parameters(model, params)
    device = batch_spec.device
    layer_paths = find_layers(model, config.layers)

    fake_mode = FakeTensorMode(allow_non_fake_inputs=False)
    with fake_mode:
        full = _full_precision_params(model) if config.param_dtype is not None else set()
        fake_params = [torch.empty(p.shape, dtype=p.dtype if id(p) in full else _compute_dtype(p, config),
                                   device=device, requires_grad=p.requires_grad) for p in params.values()]
        fake_buffers = [torch.empty(b.shape, dtype=b.dtype, device=device) for b in buffers.values()]
        fake_leaves = [torch.empty(_microbatch_shape(s, config.microbatches), dtype=s.dtype, device=device)
                       for s in batch_spec.leaves]

    step_module = _LossStep(model, loss_fn, batch_spec, list(params), list(buffers))
    try:
        with contextlib.ExitStack() as stack, fx_traceback.preserve_node_meta(), \
                annotate_layers(step_module.target[0], model, layer_paths,
                                step_module.target[0].write_back_rebound) as layer_trace, \
                moe.capacity_factor_override(config.moe_capacity_factor), RouteGroupedMM(), _tracing_flags(), \
                _compiled_callables_as_python(), \
                _cast_forward_inputs(model, config.param_dtype), _attributes_kept(model), \
                _checkpoints_marked() as policies, swapped_forwards(model) as swapped, \
                swapped_attention(model) as attention_swapped:
            joint = aot_export_joint_with_descriptors(
                stack, step_module, (fake_params, fake_buffers, fake_leaves))
            joint_gm = joint.graph_module
        _apply_checkpoint_policies(joint_gm, policies)
        _check_matmul_dtypes(joint_gm, config.param_dtype, layer_trace)
    except FxShardError:
        raise
    except Exception as error:  # translate the tracer's failure into the user's terms
        raise explain_trace_failure(error) from error

    builder = _ProgramBuilder(params, buffers, batch_spec, optimizer, config, device, fake_mode, layer_trace)
    builder.metric_names = step_module.metric_names
    balances = balanced_layers(model)
    builder.balances = balances if balance else []  # a pipeline's stages balance in lower_schedule
    program = builder.build(joint_gm).replace(balances=tuple(balances))
    program.notes["trace_seconds"] = round(time.perf_counter() - started, 3)
    program.notes["layers"] = layer_paths
    if attention_swapped:
        program.notes["attention_forwards"] = attention_swapped
    if builder.balanced:
        program.notes["load_balancing"] = balancing_notes(builder.balanced)
    if swapped:
        program.notes["moe_forwards"] = swapped
    return program


def _no_gradient_error(names: list[str], graded: list[str]) -> FxShardError:
    """All the trainable parameters the loss does not depend on, at once: as names, and as the patterns
    of a loop that freezes them (DeepSeek-V3.2's indexers: every layer's). A name's layer indices
    become * only where that matches no parameter that does get a gradient."""
    import fnmatch
    import re

    def pattern(name):
        general = re.sub(r"(^|\.)\d+(?=\.)", r"\1*", re.sub(r"[[*?]", lambda m: f"[{m.group()}]", name))
        exact = re.sub(r"[[*?]", lambda m: f"[{m.group()}]", name)
        return general if not any(fnmatch.fnmatchcase(other, general) for other in graded) else exact
    patterns = list(dict.fromkeys(pattern(name) for name in names))
    listed = ", ".join(names[:6]) + (f", ... ({len(names)} in all)" if len(names) > 6 else "")
    one = len(names) == 1
    return FxShardError(
        f"{'parameter ' + repr(names[0]) + ' requires' if one else f'{len(names)} parameters require'} grad but the "
        f"loss does not depend on {'it' if one else 'them'} (not read in the forward, or read only through .detach() "
        f"or under torch.no_grad(), so no gradient reaches {'it' if one else 'them'}; eager torch.optim skips such "
        f"parameters){'' if one else ': ' + listed}. Freeze {'it' if one else 'them'}, which trains the same: "
        f"`for name, p in model.named_parameters(): p.requires_grad_(p.requires_grad and not any("
        f"fnmatch.fnmatchcase(name, pattern) for pattern in {patterns!r}))` (import fnmatch), or let "
        f"{'its' if one else 'their'} gradient reach the loss")


class _ProgramBuilder:
    """Assembles the joint graph and the traced optimizer into one graph with a typed signature."""

    def __init__(self, params, buffers, batch_spec, optimizer, config, device, fake_mode, layer_trace: LayerTrace):
        self.params = params
        self.buffers = buffers
        self.batch_spec = batch_spec
        self.train = TrainSpec(optimizer, config.clip_grad_norm, config.nonfinite_mode() != "ignore",
                               config.loss_scaling())
        self.loss_scale: fx.Node | None = None  # a dynamic loss scale's state (InputKind.LOSS_SCALE)
        self.reduce_dtype = config.reduce_dtype or config.param_dtype
        self.microbatches = config.microbatches
        self.optimizer = optimizer
        self.device = device
        self.fake_mode = fake_mode
        self.layer_trace = layer_trace  # which layer an annotation names
        self.graph = Graph()
        self.root = nn.Module()
        self.inputs: list[Input] = []
        self.metric_names: tuple[str, ...] = ()
        self.balances: list[Balance] = []  # torchtitan's load-balancing layers (fxshard/balance.py)
        self.balanced: list[Balance] = []  # those whose counts the step updates: balanced by it

    def placeholder(self, kind: InputKind, name: str, value: torch.Tensor, requires_grad=False,
                    **node_meta) -> fx.Node:
        return self.add_input(Input(kind, name, tuple(value.shape), value.dtype, requires_grad), value, **node_meta)

    def add_input(self, spec: Input, value: torch.Tensor, **node_meta) -> fx.Node:
        node = self.graph.placeholder(_identifier(f"{spec.kind.value}_{spec.name}"))
        node.meta["val"] = value
        node.meta.update(node_meta)
        self.inputs.append(spec)
        return node

    def build(self, joint_gm: fx.GraphModule) -> Program:
        flat_inputs, tangents = _joint_placeholders(joint_gm)
        with self.fake_mode:
            param_nodes = {name: self.placeholder(InputKind.PARAM, name, torch.empty(
                                p.shape, dtype=p.dtype, device=self.device), p.requires_grad, **{meta.PARAM: name})
                           for name, p in self.params.items()}
            trainable = [name for name, p in self.params.items() if p.requires_grad]
            state_nodes = {}
            for name in trainable:
                for slot, value in self.optimizer.init_state(param_nodes[name].meta["val"]).items():
                    state_nodes[name, slot] = self.add_input(
                        Input.optimizer_slot(slot, name, value.shape, value.dtype), value, **{meta.PARAM: name})
            offset = len(self.params)
            buffer_nodes = [self.placeholder(InputKind.BUFFER, name, flat_inputs[offset + i].meta["val"])
                            for i, name in enumerate(self.buffers)]
            offset += len(self.buffers)
            batch_nodes = [self.placeholder(InputKind.BATCH, leaf.path, torch.empty(
                               leaf.shape, dtype=leaf.dtype, device=self.device)) for leaf in self.batch_spec.leaves]
            lr = self.placeholder(InputKind.LR, "lr", torch.empty((), device=self.device))
            step = self.placeholder(InputKind.STEP, "step", torch.empty((), device=self.device))
            if self.train.scales_dynamically:
                self.loss_scale = self.placeholder(InputKind.LOSS_SCALE, LOSS_SCALE, torch.empty(2, device=self.device))

        # Mixed precision: the forward and backward see each parameter cast to its compute dtype;
        # gradients are cast to the reduce dtype where they appear; masters and state keep theirs.
        compute = [self.cast(node, flat.meta["val"].dtype, meta.FWD)
                   for node, flat in zip(param_nodes.values(), flat_inputs)]
        losses, metrics, grad_nodes, buffers = [], [], {}, list(buffer_nodes)
        for microbatch in range(self.microbatches):
            env = dict(zip(flat_inputs, [*compute, *buffers, *self.slice_batch(batch_nodes, microbatch)]))
            loss, metric_values, grads, mutations = self.copy_joint(joint_gm, env, tangents, microbatch)
            losses.append(loss)
            metrics.append(metric_values)
            for index, node in mutations.items():  # the next microbatch sees the updated buffers
                buffers[index - len(self.params)] = node
            ungraded = [name for i, name in enumerate(self.params) if name in trainable and grads[i] is None]
            if ungraded:
                raise _no_gradient_error(ungraded, [name for name in trainable if name not in ungraded])
            for i, name in enumerate(self.params):
                if name in trainable:
                    grad_nodes[name] = self.accumulate(name, grad_nodes.get(name), grads[i])
        claimed = set()
        for name, node in list(grad_nodes.items()):
            if node in claimed:  # one node is the gradient of two parameters (y = W x + (a + b)): each its own
                with self.graph.inserting_after(node):
                    (node,) = inline(self.graph, lambda g: [torch.ops.aten.alias(g)], [node], fake_mode=self.fake_mode,
                                     phase=meta.BWD, layer=meta.layer(node))
                grad_nodes[name] = node
            claimed.add(node)
            node.meta[meta.PARAM] = name
        self.append_balancing(buffer_nodes, buffers)
        mutations = {len(self.params) + i: node for i, node in enumerate(buffers) if node is not buffer_nodes[i]}
        if len(losses) > 1:
            (loss,) = inline(self.graph, lambda *ls: [sum(ls) / len(ls)], losses, fake_mode=self.fake_mode,
                             phase=meta.FWD, layer=meta.POST)
        metric_totals = []  # each metric summed over microbatches
        for per_microbatch in zip(*metrics):
            total = per_microbatch[0]
            if len(per_microbatch) > 1:
                (total,) = inline(self.graph, lambda *values: [sum(values)], list(per_microbatch),
                                  fake_mode=self.fake_mode, phase=meta.FWD, layer=meta.POST)
            metric_totals.append(total)
        grad_norm, new_params, new_states, nonfinite, next_scale = self.append_optimizer(
            param_nodes, grad_nodes, state_nodes, lr, step)

        outputs = [Output(OutputKind.LOSS, "loss"), Output(OutputKind.GRAD_NORM, "grad_norm")]
        values = [loss, grad_norm]
        for name, node in zip(self.metric_names, metric_totals):
            outputs.append(Output(OutputKind.METRIC, name))
            values.append(node)
        for name, node in new_params.items():
            outputs.append(Output(OutputKind.PARAM, name))
            values.append(node)
        for (name, slot), node in new_states.items():
            outputs.append(Output.optimizer_slot(slot, name))
            values.append(node)
        buffer_names = list(self.buffers)
        for index, node in mutations.items():
            outputs.append(Output(OutputKind.BUFFER, buffer_names[index - len(self.params)]))
            values.append(node)
        if nonfinite is not None:
            outputs.append(Output(OutputKind.NONFINITE, "nonfinite"))
            values.append(nonfinite)
        if next_scale is not None:
            outputs.append(Output(OutputKind.LOSS_SCALE, LOSS_SCALE))
            values.append(next_scale)
        self.graph.output(tuple(values))
        _assign_layers(self.graph, param_nodes)
        self.graph.lint()
        return Program(lazy_module(self.root, self.graph), tuple(self.inputs), tuple(outputs), train=self.train,
                       updates=self.updates)

    def append_balancing(self, inputs: list[fx.Node], buffers: list[fx.Node]) -> None:
        """torchtitan's load-balancing update of the layers whose counts the forward updated, once the
        last microbatch is done (fxshard/balance.py): their bias and count entries of `buffers` become
        the updated ones."""
        index = {name: i for i, name in enumerate(self.buffers)}
        self.balanced = [b for b in self.balances if buffers[index[b.counts]] is not inputs[index[b.counts]]]
        if not self.balanced:  # eval mode (evaluate's program): torchtitan counts only in training
            return
        biases, counts = append_balancing(self.graph, self.fake_mode, self.balanced,
                                          [buffers[index[b.counts]] for b in self.balanced],
                                          [buffers[index[b.bias]] for b in self.balanced])
        for b, bias, count in zip(self.balanced, biases, counts):
            buffers[index[b.bias]], buffers[index[b.counts]] = bias, count

    def slice_batch(self, batch_nodes: list[fx.Node], microbatch: int) -> list[fx.Node]:
        if self.microbatches == 1:
            return batch_nodes
        rows = [node.meta["val"].shape[0] // self.microbatches for node in batch_nodes]
        return inline(self.graph, lambda *leaves: [leaf[microbatch * r:(microbatch + 1) * r]
                                                   for leaf, r in zip(leaves, rows)],
                      batch_nodes, fake_mode=self.fake_mode, phase=meta.FWD, layer=meta.PRE,
                      extra_meta={meta.MICROBATCH: microbatch})

    def accumulate(self, name: str, total: fx.Node | None, grad: fx.Node | None) -> fx.Node:
        """Cast a microbatch's gradient to the reduce dtype and add it to the running sum, right
        where it appears (the loss tangent of 1/microbatches already averages)."""
        dtype = self.reduce_dtype or grad.meta["val"].dtype
        with self.graph.inserting_before(grad.next):
            if total is None:
                return self.cast(grad, dtype, meta.BWD)
            # total is already in dtype: where adding the gradient promotes to dtype anyway (bf16 into
            # an fp32 sum), the add does the cast, bit for bit, without writing a cast copy first
            promotes = torch.promote_types(dtype, grad.meta["val"].dtype) == dtype
            (total,) = inline(self.graph, lambda t, g: [t + g if promotes else t + g.to(dtype)], [total, grad],
                              fake_mode=self.fake_mode, phase=meta.BWD,
                              extra_meta={meta.MICROBATCH: meta.microbatch(grad)})
            return total

    def cast(self, node: fx.Node, dtype: torch.dtype, phase: str) -> fx.Node:
        if node.meta["val"].dtype == dtype:
            return node
        cast = self.graph.call_function(torch.ops.aten._to_copy.default, (node,), {"dtype": dtype})
        with self.fake_mode:
            cast.meta.update({"val": node.meta["val"].to(dtype), meta.PHASE: phase})
        return cast

    def copy_joint(self, joint_gm, env, tangents, microbatch: int = 0):
        """Copy the joint graph's nodes; the loss tangent becomes a constant 1/microbatches, created
        just before its first use so that the backward starts where the forward ends. Under a loss
        scale it is multiplied by the scale: a static one folded into the constant, a dynamic one read
        from its state (fxshard/loss_scale.py)."""
        # a tangent that is not one element belongs to a non-scalar loss or to a parameter the forward
        # mutates in place: read_joint_outputs tells the two apart and says which

        def lookup(node):
            if node not in env and node in tangents:
                value = node.meta["val"]
                static = self.train.loss_scale if isinstance(self.train.loss_scale, float) else 1.0
                ones = self.graph.call_function(torch.ops.aten.full.default, ([], static / self.microbatches),
                                                {"dtype": value.dtype, "device": value.device})
                ones.meta.update({"val": value, meta.PHASE: meta.BWD, meta.LAYER: meta.POST,
                                  meta.MICROBATCH: microbatch, meta.LOSS_TANGENT: True})
                env[node] = ones
                if self.loss_scale is not None:  # GradScaler's loss * scale, in the loss's dtype
                    (env[node],) = inline(self.graph, lambda t, state: [t * state[0].to(t.dtype)],
                                          [ones, self.loss_scale], fake_mode=self.fake_mode, phase=meta.BWD,
                                          layer=meta.POST, extra_meta={meta.MICROBATCH: microbatch})
            return env[node]

        for node in joint_gm.graph.nodes:
            if node.op == "placeholder":
                continue
            if node.op == "output":
                return self.read_joint_outputs(node, env)
            if node.op == "get_attr":
                setattr(self.root, node.target, getattr(joint_gm, node.target))
            copy = self.graph.node_copy(node, lookup)
            custom = node.meta.get("custom") or {}
            copy.meta[meta.PHASE] = meta.BWD if node.meta.get("partitioner_tag") == "is_backward" else meta.FWD
            if meta.ANNOTATION_LAYER in custom:
                copy.meta[meta.LAYER] = self.layer_trace.layer_of(custom[meta.ANNOTATION_LAYER])
            if meta.ANNOTATION_RECOMPUTE in custom and copy.meta[meta.PHASE] == meta.FWD:
                copy.meta[meta.RECOMPUTE] = custom[meta.ANNOTATION_RECOMPUTE]
                if node.meta.get(meta.SAVED):
                    copy.meta[meta.SAVED] = True
            copy.meta[meta.MICROBATCH] = microbatch
            env[node] = copy
        raise AssertionError("joint graph has no output node")

    def read_joint_outputs(self, output_node, env):
        loss, grads, mutations, metrics = None, {}, {}, []
        for value, desc in zip(output_node.args[0], output_node.meta["desc"]):
            if desc is None and value is None:  # the gradient slot of an input that needs none
                continue
            kind = type(desc).__name__
            mapped = env[value] if isinstance(value, fx.Node) else None
            if kind == "PlainAOTOutput" and loss is not None:
                if len(metrics) >= len(self.metric_names):
                    raise FxShardError("loss_fn must return one scalar tensor, or (loss, {name: scalar}); "
                                       "it returned several outputs")
                metrics.append(mapped)
            elif kind == "PlainAOTOutput":
                loss = mapped
                if mapped is not None:
                    loss_val = mapped.meta["val"]
                    if not loss_val.is_floating_point():
                        raise FxShardError(
                            f"loss_fn returned a {loss_val.dtype} tensor; a loss must be floating point and "
                            f"computed from the model's outputs (e.g. F.cross_entropy(logits, targets)), so "
                            f"that it has a gradient")
                    if loss_val.dim() != 0 and loss_val.numel() != 1:
                        raise FxShardError(
                            f"loss_fn must return a scalar tensor, got shape {tuple(loss_val.shape)}; "
                            f"reduce it (e.g. .mean()) inside loss_fn")
            elif kind == "GradAOTOutput":
                grads[desc.grad_of.idx] = mapped
            elif kind == "InputMutationAOTOutput":
                index = desc.mutated_input.idx
                if index < len(self.params):
                    name, param = list(self.params.items())[index]
                    fix = ("a constraint on a trained weight (clamp_) belongs outside the step, or in a "
                           "parametrization (torch.nn.utils.parametrize)" if param.requires_grad else
                           f"a value updated outside the gradient (a router's score-correction bias) belongs in "
                           f"a buffer: register_buffer({name.rsplit('.', 1)[-1]!r}, ...) instead of "
                           f"nn.Parameter(..., requires_grad=False)")
                    raise FxShardError(f"the forward mutates parameter {name!r} in place; only buffers may be "
                                       f"mutated (as BatchNorm's running statistics are): {fix}")
                if index >= len(self.params) + len(self.buffers):
                    raise FxShardError("the forward mutates the batch in place; copy it first (x = x.clone())")
                mutations[index] = mapped
            else:
                raise FxShardError(f"unsupported traced output {desc}; loss_fn must return one scalar")
        if loss is None:
            raise FxShardError("loss_fn returned no tensor; it must return a scalar loss tensor")
        return loss, metrics, [grads.get(i) for i in range(len(self.params))], mutations

    def append_optimizer(self, param_nodes, grad_nodes, state_nodes, lr, step):
        optimizer = self.train.optimizer
        for pattern in optimizer.no_decay:  # a typo, or a recipe's pattern for parts this model lacks (biases)
            if not any(fnmatchcase(name, pattern) for name in grad_nodes):
                warnings.warn(f"fxshard: {type(optimizer).__name__}(no_decay=...) pattern {pattern!r} matches no "
                              f"trainable parameter (they are named like {', '.join(list(grad_nodes)[:3])}): it exempts "
                              f"nothing from weight decay (fnmatch, against model.named_parameters() names)",
                              stacklevel=user_stacklevel())
        self.updates = tuple(Update(name, decay=optimizer.decays(name)) for name in grad_nodes)
        return append_update(self.graph, self.train, self.fake_mode, self.updates,
                             [param_nodes[n] for n in grad_nodes], list(grad_nodes.values()), state_nodes, lr, step,
                             loss_scale=self.loss_scale)


@contextlib.contextmanager
def _cast_forward_inputs(model: nn.Module, dtype: torch.dtype | None):
    """Config(param_dtype): floating-point tensors passed to the model's forward are cast to it, as
    FSDP2's MixedPrecisionPolicy(cast_forward_inputs=True) does (targets that loss_fn reads from the
    batch itself keep their dtype)."""
    if dtype is None:
        yield
        return

    def cast(_module, args, kwargs):
        def to(value):
            return value.to(dtype) if isinstance(value, torch.Tensor) and value.is_floating_point() else value
        return torch.utils._pytree.tree_map(to, (args, kwargs))

    handle = model.register_forward_pre_hook(cast, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


_MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
            torch.ops.aten.baddbmm.default, torch.ops.aten.convolution.default}


def _check_matmul_dtypes(joint_gm: fx.GraphModule, param_dtype: torch.dtype | None, layer_trace) -> None:
    """Refuse at shard() what would fail in the first step: a matmul or convolution of two dtypes,
    floating or integer (the fake kernels accept it, the real ones do not)."""
    for node in joint_gm.graph.nodes:
        if node.target not in _MATMULS:
            continue
        dtypes = sorted({str(a.meta["val"].dtype) for a in node.args if isinstance(a, fx.Node)
                         and isinstance(a.meta.get("val"), torch.Tensor)})
        if len(dtypes) > 1:
            annotation = (node.meta.get("custom") or {}).get(meta.ANNOTATION_LAYER)
            layer = layer_trace.layer_of(annotation) if annotation else "outside the layers"
            hint = (f"a tensor reaches the model in another dtype than Config(param_dtype={param_dtype}): fxshard casts "
                    f"the floating-point tensors passed to the model's forward, not those that enter another way "
                    f"(loss_fn calling another method than forward, tensors made inside the model); cast them "
                    f"there with .to({param_dtype})") if param_dtype is not None else \
                "cast one operand so that both have the same dtype (an integer batch leaf fed to a Linear: .float())"
            raise FxShardError(f"the step multiplies {' by '.join(dtypes)} ({node.target.__name__} in {layer}), "
                               f"which torch's kernels refuse at run time: {hint}")


@contextlib.contextmanager
def _compiled_callables_as_python():
    """A `torch.compile`d function or module inside the model's forward (torchtitan compiles
    flex_attention and its block-mask builder at module level) runs as its own Python while fxshard
    traces: the trace records its ops, which fxshard then compiles with the rest of the step. Run
    compiled, Inductor's generated code would read the trace's fake tensors' memory."""
    with torch.compiler.set_stance("force_eager"):
        yield


@contextlib.contextmanager
def _tracing_flags():
    """Tell libraries that they are being traced, as torch.export's non-strict mode does: with
    `torch.compiler.is_compiling()` / `is_exporting()` true, transformers and torch itself take their
    traceable paths (no host reads of masks, no fast paths that branch on tensor values)."""
    compiling, exporting = torch.compiler._is_compiling_flag, torch.compiler._is_exporting_flag
    is_exporting = torch.compiler.is_exporting

    def is_exporting_unless_asked_by_dynamo_disable():
        # torch._dynamo.disable's wrapper (on torch.utils.checkpoint.checkpoint, among others) asks, and
        # when exporting wraps its call in fx_traceback.annotate, which on the way out restores the whole
        # annotation: the layer marks annotate_layers sets inside the call (after layer k) would be lost
        caller = sys._getframe(1).f_code
        if caller.co_name == "_fn" and caller.co_filename.endswith(os.path.join("_dynamo", "eval_frame.py")):
            return False
        return is_exporting()

    torch.compiler._is_compiling_flag = torch.compiler._is_exporting_flag = True
    torch.compiler.is_exporting = is_exporting_unless_asked_by_dynamo_disable
    try:
        yield
    finally:
        torch.compiler._is_compiling_flag, torch.compiler._is_exporting_flag = compiling, exporting
        torch.compiler.is_exporting = is_exporting


@contextlib.contextmanager
def _checkpoints_marked():
    """Activation checkpointing, traced: each `torch.utils.checkpoint.checkpoint` call (use_reentrant
    True or False; transformers' gradient_checkpointing_enable() and checkpoint_sequential call it;
    torch.distributed._composable.checkpoint, which binds torch's generator at import, too)
    runs its function as a plain call whose nodes carry the call's number (meta.ANNOTATION_RECOMPUTE),
    instead of autograd's saved-tensor machinery, which a joint trace would flatten into one forward
    whose values the backward reads (the checkpoint silently lost). passes/recompute.py then gives
    the backward its own copy of what it reads from inside each call.

    Yields {call number: policy}: the selective checkpointing policies (`context_fn` made by
    `torch.utils.checkpoint.create_selective_checkpoint_contexts`), which `_apply_checkpoint_policies`
    asks about the call's ops once the trace exists. Another `context_fn` is not applied (warned)."""
    import warnings

    import torch.utils.checkpoint as checkpoint

    numbers = itertools.count()
    policies = {}

    @contextlib.contextmanager
    def mark():
        # not fx_traceback.annotate, which restores the whole annotation on exit: the layer hooks set
        # theirs inside the call (annotate_layers' "after layer k"), and it must outlive the call
        custom = fx_traceback.current_meta.setdefault("custom", {})
        outer = custom.get(meta.ANNOTATION_RECOMPUTE)  # a checkpoint inside a checkpointed call
        enclosing = custom.get(meta.ANNOTATION_RECOMPUTE_CALLS, ())
        number = custom[meta.ANNOTATION_RECOMPUTE] = next(numbers)
        custom[meta.ANNOTATION_RECOMPUTE_CALLS] = (*enclosing, number)  # whose policies are asked
        try:
            yield number
        finally:
            custom = fx_traceback.current_meta.get("custom", {})
            if outer is None:
                custom.pop(meta.ANNOTATION_RECOMPUTE, None)
                custom.pop(meta.ANNOTATION_RECOMPUTE_CALLS, None)
            else:
                custom[meta.ANNOTATION_RECOMPUTE] = outer
                custom[meta.ANNOTATION_RECOMPUTE_CALLS] = enclosing

    def marked(function, *args, **kwargs):
        with mark():
            return function(*args, **kwargs)

    class Reentrant:  # stands for CheckpointFunction: checkpoint(use_reentrant=True) calls its apply
        @staticmethod
        def apply(function, preserve_rng_state, *args):
            return marked(function, *args)

    def without_reentrant(function, preserve_rng_state=True, context_fn=checkpoint.noop_context_fn, *rest, **kwargs):
        # checkpoint(use_reentrant=False) runs its function between this generator's two steps
        forward_context = context_fn()[0]
        policy = None
        if isinstance(forward_context, checkpoint._CachingTorchDispatchMode):
            policy = forward_context.policy_fn
        elif not isinstance(forward_context, contextlib.nullcontext):
            warnings.warn(f"fxshard: a torch.utils.checkpoint call's context_fn gave {type(forward_context).__name__}, "
                          f"which is not applied (only selective checkpointing policies from "
                          f"create_selective_checkpoint_contexts are): every deterministic op in the call "
                          f"is computed again in the backward", stacklevel=3)
        with mark() as number:
            if policy is not None:
                policies[number] = policy
            yield

    bindings = [(checkpoint, "CheckpointFunction", Reentrant),
                (checkpoint, "_checkpoint_without_reentrant_generator", without_reentrant)]
    composable = sys.modules.get("torch.distributed._composable.checkpoint_activation")
    if composable is not None:  # imported it from torch.utils.checkpoint when the user imported it
        bindings.append((composable, "_checkpoint_without_reentrant_generator", without_reentrant))
    saved = [(module, name, getattr(module, name)) for module, name, _ in bindings]
    for module, name, replacement in bindings:
        setattr(module, name, replacement)
    try:
        yield policies
    finally:
        for module, name, original in saved:
            setattr(module, name, original)


def _apply_checkpoint_policies(joint_gm: fx.GraphModule, policies: dict) -> None:
    """Mark meta.SAVED on the forward nodes of selectively checkpointed calls whose op a policy keeps
    (CheckpointPolicy's MUST_SAVE / PREFER_SAVE, or True; the CPU-offload decisions are computed
    again, as eager PyTorch's checkpoint does): passes/recompute.py lets the backward read those where
    the forward made them. Each policy is asked as autograd asks it in eager: once per op of its call
    and of the calls inside it (nested checkpoints: every enclosing call's policy is asked, and one
    that keeps a value keeps it), in the forward's order, with the op's output (fake tensors here),
    not about the ops it never asks about (SAC_IGNORED_OPS), so policies that count ops
    (torchtitan's "every other matmul") decide the same on the same ops. The ops are the joint
    trace's: functional (an in-place `mul_` is asked about as `mul`), decomposed as aot_autograd
    decomposes them (CPU dropout is one `native_dropout`), and without ops whose value nothing
    reads (the trace drops them; eager runs and counts them)."""
    if not policies:
        return
    import torch.utils.checkpoint as checkpoint

    def value(n):
        return n.meta.get("val") if isinstance(n, fx.Node) else n

    ignored = getattr(checkpoint, "SAC_IGNORED_OPS", frozenset())
    keeping = (checkpoint.CheckpointPolicy.MUST_SAVE, checkpoint.CheckpointPolicy.PREFER_SAVE)
    for node in joint_gm.graph.nodes:
        custom = node.meta.get("custom") or {}
        calls = [number for number in custom.get(meta.ANNOTATION_RECOMPUTE_CALLS, ()) if number in policies]
        if not calls or node.op != "call_function" or node.meta.get("partitioner_tag") == "is_backward":
            continue
        if node.target is operator.getitem:  # an output of a multi-output op is saved with it
            if node.args[0].meta.get(meta.SAVED):
                node.meta[meta.SAVED] = True
            continue
        if not isinstance(node.target, torch._ops.OpOverload) or node.target in ignored:
            continue
        args, kwargs = fx.map_arg((node.args, node.kwargs), value)
        for number in calls:  # outermost first; each policy counts what it is asked about
            context = checkpoint.SelectiveCheckpointContext(is_recompute=False)
            context.op_output = node.meta.get("val")  # torch >= 2.12 passes it to the constructor
            decision = policies[number](context, node.target, *args, **kwargs)
            if decision is True or decision in keeping:
                node.meta[meta.SAVED] = True


@contextlib.contextmanager
def _attributes_kept(model: nn.Module):
    """The model's attributes as they were before tracing: a forward that stores a value on its
    module (`self.last = out`) would leave a fake tensor of the trace there; and its parameters and
    buffers, which functional_call swaps back itself except in a module registered under two paths
    (`nn.ModuleList([block] * 4)`, `self.b = self.a`: it restores the swapped-in tensor there, leaving
    the model holding the trace's tensors)."""
    own = ("_parameters", "_buffers", "_modules")
    before = {module: {k: v for k, v in vars(module).items() if k not in own} for module in model.modules()}
    tensors = {module: (dict(module._parameters), dict(module._buffers)) for module in model.modules()}
    try:
        yield
    finally:
        for module, attributes in before.items():
            for key in [k for k in vars(module) if k not in own and k not in attributes]:
                delattr(module, key)
            for key, value in attributes.items():
                if vars(module).get(key, _MISSING) is not value:
                    object.__setattr__(module, key, value)
        for module, (parameters, buffers) in tensors.items():
            module._parameters.clear()
            module._parameters.update(parameters)
            module._buffers.clear()
            module._buffers.update(buffers)


_MISSING = object()


def _microbatch_shape(leaf, microbatches: int) -> tuple[int, ...]:
    return tuple(leaf.shape) if microbatches == 1 else (leaf.shape[0] // microbatches, *leaf.shape[1:])


def _full_precision_params(model: nn.Module) -> set[int]:
    """The parameters (by id) Config(param_dtype) does not cast: BatchNorm's weight and bias, which
    its kernels need in the dtype of its running statistics (fp32) next to a low-precision input, as
    torch's FSDP MixedPrecision keeps them (`_module_classes_to_ignore`). One that another module
    uses too (tied) is refused: it cannot be in both dtypes."""
    norms = {id(p) for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
             for p in m.parameters(recurse=False)}
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            continue
        for own, p in module.named_parameters(recurse=False):
            if id(p) in norms:
                raise FxShardError(f"parameter {name}.{own} is also a BatchNorm's weight or bias; with "
                                   f"Config(param_dtype) BatchNorm keeps its parameters in their dtype (its kernels "
                                   f"need them next to its fp32 statistics) while {type(module).__name__} computes "
                                   f"in param_dtype: untie them, or train without param_dtype")
    return norms


def _compute_dtype(param: torch.Tensor, config: Config) -> torch.dtype:
    if config.param_dtype is not None and param.is_floating_point():
        return config.param_dtype
    return param.dtype


def _joint_placeholders(joint_gm):
    flat, tangents = {}, []
    for node in joint_gm.graph.nodes:
        if node.op != "placeholder":
            continue
        desc = node.meta["desc"]
        if type(desc).__name__ == "PlainAOTInput":
            flat[desc.idx] = node
        elif type(desc).__name__ == "TangentAOTInput":
            tangents.append(node)
        elif "Token" in type(desc).__name__:  # AOT autograd threads effectful ops through tokens
            raise FxShardError(
                "cannot trace the training step: the model or loss_fn calls an op with side effects, such as "
                "an in-place torch.distributed collective (dist.all_reduce(t)), which one traced graph cannot "
                "order. Use a functional collective, whose result is a new tensor "
                "(torch.distributed._functional_collectives.all_reduce(t, 'sum', group)), or call it outside the step")
        else:
            raise FxShardError(f"unsupported traced input {desc}")
    return [flat[i] for i in range(len(flat))], tangents


def _assign_layers(graph: fx.Graph, param_nodes: dict[str, fx.Node]) -> None:
    """Give every node a layer. Optimizer nodes take their parameter's layer; a parameter takes the
    layer of its first forward use; an unannotated node (autograd's gradient sums) takes the layer
    of its first annotated user, else of its inputs, else "post"."""
    def first_layer(node, depth=0):  # looks through unannotated casts to the first annotated use
        for user in node.users:
            if meta.phase(user) != meta.FWD:
                continue
            if meta.LAYER in user.meta:
                return meta.layer(user)
            if depth < 4 and (found := first_layer(user, depth + 1)) is not None:
                return found
        return None

    param_layer = {}
    for name, node in param_nodes.items():
        param_layer[name] = first_layer(node) or meta.PRE
        node.meta[meta.LAYER] = param_layer[name]
    for node in reversed(graph.nodes):
        if meta.LAYER in node.meta or node.op == "output":
            continue
        if meta.PARAM in node.meta and node.meta[meta.PARAM] in param_layer:
            node.meta[meta.LAYER] = param_layer[node.meta[meta.PARAM]]
            continue
        annotated = [meta.layer(u) for u in node.users if meta.LAYER in u.meta]
        if annotated:
            node.meta[meta.LAYER] = annotated[0]
    for node in graph.nodes:
        if meta.LAYER not in node.meta and node.op != "output":
            inputs = [meta.layer(i) for i in node.all_input_nodes if meta.LAYER in i.meta]
            node.meta[meta.LAYER] = inputs[-1] if inputs else meta.POST
        if node.op == "placeholder":
            node.meta.setdefault(meta.PHASE, meta.FWD)


def _identifier(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name)
