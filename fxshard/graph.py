"""Small graph-building helpers shared by the tracer and the passes.

`inline` is the workhorse: write a piece of program as a plain PyTorch function (functional
collectives included, with symbolic group names such as "dp"), and the aten ops it calls on the fake
values of its input nodes are inserted into the graph at the current insertion point.
"""

from __future__ import annotations

import operator
from typing import Callable, Sequence

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
from torch._C import DispatchKey
from torch.fx._lazy_graph_module import _LazyGraphModule
from torch.fx.experimental.proxy_tensor import snapshot_fake
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakTensorKeyDictionary

from . import meta


class Graph(fx.Graph):
    """The `fx.Graph` that fxshard's passes and lowerings build: nodes made without torch's scan of
    their arguments for raw SymInts.

    torch 2.13's `Graph.create_node` walks every new node's arguments with pytree to warn about a raw
    `torch.SymInt` among them. fxshard's programs have static shapes, so none can be one, and the walk
    was 14% of the CPU of the world-4 pipeline test (py-spy, session 38): every pass and runtime
    lowering copies its graph node by node. A node is made as `fx.Graph.create_node` makes it, its
    arguments set right after through `Node.args` / `Node.kwargs` (which keep the users as
    `Node.__init__` does); create-node hooks (fxshard registers none) see it without them."""

    def create_node(self, op, target, args=None, kwargs=None, name=None, type_expr=None) -> fx.Node:
        if args is not None and not isinstance(args, tuple):
            raise AssertionError(f"args must be a tuple, got {type(args)}")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise AssertionError(f"kwargs must be a dict, got {type(kwargs)}")
        node = super().create_node(op, target, None, None, name, type_expr)
        if args:
            node.args = args
        if kwargs:
            node.kwargs = kwargs
        return node


def fake_tensor(fake_mode, shape, stride, dtype, device, offset: int = 0) -> torch.Tensor:
    """A fake tensor of `fake_mode` with this metadata (a view into a storage as long as it reaches,
    where `offset` > 0), made from a meta tensor: ~4x cheaper than `torch.empty_strided` dispatched
    to the mode, which a program's load (fxshard/program_io.py) and each `inline` call pay per value."""
    if offset:
        extent = offset + sum((size - 1) * step for size, step in zip(shape, stride) if size > 0) + 1
        meta_value = torch.empty(extent, dtype=dtype, device="meta").as_strided(shape, stride, offset)
    else:
        meta_value = torch.empty_strided(shape, stride, dtype=dtype, device="meta")
    return fake_mode.fake_tensor_converter.from_meta_and_device(fake_mode, meta_value, torch.device(device))


def lazy_module(root, graph: fx.Graph) -> fx.GraphModule:
    """`fx.GraphModule(root, graph)` whose Python code is generated when it is first run or read, not
    when it is built: most of the modules the passes build are only ever read as graphs, and
    generating their code was ~15% of a pipeline's shard() on the 2-core CI machine."""
    return _LazyGraphModule(root, graph)


def fake_mode_of(graph: fx.Graph):
    for node in graph.nodes:
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor) and hasattr(value, "fake_mode"):
            return value.fake_mode
    raise AssertionError("graph carries no fake values; was it traced by fxshard.trace?")


def ancestors(nodes) -> set[fx.Node]:
    """`nodes` (non-nodes among them ignored) and every node they read, transitively."""
    seen, stack = set(), [n for n in nodes if isinstance(n, fx.Node)]
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            stack.extend(node.all_input_nodes)
    return seen


def attribute(module, target: str):
    """What a `get_attr` node of `target` ("a.b.c") reads from `module`."""
    for part in target.split("."):
        module = getattr(module, part)
    return module


def evaluate(graph: fx.Graph, module, needed: set[fx.Node]) -> dict[fx.Node, object]:
    """The values of the `needed` nodes of `graph`, which read no placeholder: their ops run with
    aten in graph order, `get_attr` reads from `module`."""
    values: dict[fx.Node, object] = {}
    for node in graph.nodes:
        if node in needed:
            if node.op == "get_attr":
                values[node] = attribute(module, node.target)
            else:
                args, kwargs = fx.node.map_arg((node.args, node.kwargs), values.__getitem__)
                values[node] = node.target(*args, **kwargs)
    return values


def mutates(node: fx.Node) -> bool:
    """`node` calls an op that writes one of its arguments."""
    schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
    return schema is not None and schema.is_mutable


def is_pure(node: fx.Node) -> bool:
    """A deterministic op without side effects: aten/prims, no mutation, no random draw. Computing it
    again, or ahead of time, gives the same value."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return True
    if getattr(node.target, "namespace", None) not in ("aten", "prims") or not hasattr(node.target, "_schema"):
        return False
    return not mutates(node) and torch.Tag.nondeterministic_seeded not in getattr(node.target, "tags", ())


def draws_random(node: fx.Node) -> bool:
    """The op draws from a random generator (dropout, rand): tagged nondeterministic_seeded, except an
    op with a dropout_p of 0 (SDPA's kernels carry the tag for their dropout)."""
    if node.op != "call_function" or torch.Tag.nondeterministic_seeded not in getattr(node.target, "tags", ()):
        return False
    schema = getattr(node.target, "_schema", None)
    if schema is not None and any(argument.name == "dropout_p" for argument in schema.arguments):
        return call_argument(node, "dropout_p") != 0
    return True


def call_argument(node: fx.Node, name: str):
    """Argument `name` of an op call, passed by position or by name, or its schema default."""
    arguments = node.target._schema.arguments
    position = next(i for i, argument in enumerate(arguments) if argument.name == name)
    if position < len(node.args):
        return node.args[position]
    return node.kwargs.get(name, arguments[position].default_value)


def set_call_argument(node: fx.Node, name: str, value) -> None:
    """Set argument `name` of an op call, where it is passed by position, else by name."""
    position = next(i for i, argument in enumerate(node.target._schema.arguments) if argument.name == name)
    if position < len(node.args):
        node.args = (*node.args[:position], value, *node.args[position + 1:])
    else:
        node.kwargs = {**node.kwargs, name: value}


# ops that may return (a view of) an input although their schema has no alias annotation
_ALIASING_WITHOUT_SCHEMA_SAYING_SO = {"_unsafe_view", "type_as", "atleast_1d", "atleast_2d", "atleast_3d",
                                      "sum_to_size", "lift", "lift_fresh", "data"}


def may_alias_input(node: fx.Node) -> bool:
    """Whether `node`'s result may share memory with one of its inputs: `is_view`'s question answered
    cautiously, for lowerings whose safety depends on it (a Python function or an op whose schema cannot
    be seen into may; so does a wait, which returns its input). runtime/workspace_plan.py and
    runtime/reinplace.py's gathers into parameters ask it."""
    target = node.target
    if node.op != "call_function":
        return True
    if target is operator.getitem or target is torch.ops._c10d_functional.wait_tensor.default:
        return True
    schema = getattr(target, "_schema", None)
    if schema is None:
        return True
    if schema.name.split("::")[-1] in _ALIASING_WITHOUT_SCHEMA_SAYING_SO:
        return True
    return any(ret.alias_info is not None for ret in schema.returns)


def is_view(node: fx.Node) -> bool:
    """`node` returns an alias of an input (a view, or getitem of a tuple): it writes no memory.
    `aten._unsafe_view` is one too, though its schema does not say so."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return node.target is operator.getitem
    return node.target is torch.ops.aten._unsafe_view.default or any(r.alias_info is not None for r in schema.returns)


def views_as_reshapes(graph_module: fx.GraphModule) -> fx.GraphModule:
    """`graph_module`, or a copy of it in which every `aten.view` is an `aten.reshape`.

    For aten replay. A traced view was chosen from its input's fake strides (reshape decomposes to a
    view where those allow one), but a few kernels' real outputs are laid out otherwise than their fake
    tensors say (CPU's softplus_backward keeps a transposed gradient's layout where its fake output is
    contiguous: Qwen3-Next's gated delta-net backward), and the view then fails on the real tensor.
    A reshape is that same view wherever the view is valid, and a copy only where it would have
    failed. Inductor's regions need none of this: they are compiled for the strides they are given."""
    view = torch.ops.aten.view.default
    if not any(n.op == "call_function" and n.target is view for n in graph_module.graph.nodes):
        return graph_module
    graph = Graph()
    graph.output(graph.graph_copy(graph_module.graph, {}))
    for node in graph.nodes:
        if node.op == "call_function" and node.target is view:
            node.target = torch.ops.aten.reshape.default
    return lazy_module(graph_module, graph)


def reordered(graph_module: fx.GraphModule, order: Sequence[fx.Node]) -> fx.GraphModule:
    """A copy of `graph_module` with its nodes in `order` (every node once, each after its inputs)."""
    graph = Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in order:
        env[node] = graph.node_copy(node, env.__getitem__)
    graph.lint()
    return lazy_module(graph_module, graph)


def inline(graph: fx.Graph, fn: Callable, inputs: Sequence[fx.Node], *, fake_mode, phase: str,
           layer: str | None = None, extra_meta: dict | None = None) -> list[fx.Node]:
    """Run `fn(*input values) -> sequence of tensors` on fake values and insert the aten ops it calls
    at the graph's insertion point; return the output nodes.

    Nodes get `phase`, `layer` (if given) and `extra_meta`; a node traced under
    `torch.fx.traceback.annotate({key: value})` with fxshard's meta keys (fxshard.meta: the
    parameter an update is for, the unit and bytes of a collective) also gets those entries.

    The ops are recorded by a dispatch mode (`_Recorder`), at the level where make_fx records them, so
    the nodes are those `make_fx(fn)` would trace (tests/test_graph.py compares the two); make_fx
    itself costs ~15 ms a call on the 2-core CI machine, most of a pipeline's shard() time, which
    inlines every slice, send, receive, wait and accumulation of every action.
    """
    # fresh values: copied nodes share their `val`, and the recorder keys tensors by identity
    values = [_fresh(node.meta["val"], fake_mode) for node in inputs]
    recorder = _Recorder(graph, dict(zip(values, inputs)), phase, layer, extra_meta)
    with fake_mode, recorder:
        outputs = list(fn(*values))
    return [recorder.node_of(value) for value in outputs]


class _Recorder(TorchDispatchMode):
    """Inserts a node for each aten op dispatched to it (inner of a FakeTensorMode, so each value is
    fake), its arguments mapped to the nodes that made them. A tensor argument that no input or
    recorded op made is a constant from outside the function: refused, a graph has nowhere to keep it.
    Values are keyed weakly and described by detached aliases, as make_fx's tracker does: a strong
    reference to a factory's output makes torch hand fn a detached alias of it (an `aten.detach` node
    more)."""

    def __init__(self, graph: fx.Graph, env: dict[torch.Tensor, fx.Node], phase: str, layer: str | None,
                 extra_meta: dict | None):
        super().__init__()
        self.graph, self.env = graph, WeakTensorKeyDictionary()
        self.env.update(env)
        self.phase, self.layer, self.extra_meta = phase, layer, extra_meta or {}

    def node_of(self, value) -> fx.Node:
        node = self.env.get(value) if isinstance(value, torch.Tensor) else None
        if node is None:
            raise AssertionError(f"inlined code created a constant tensor ({type(value).__name__}); build it "
                                 f"from the inputs instead")
        return node

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.prim.device.default:  # a query, no op of the program (make_fx skips it too)
            return func(*args, **kwargs)
        if func.has_kernel_for_dispatch_key(DispatchKey.CompositeImplicitAutograd):  # as make_fx: its parts
            with self:
                decomposed = func.decompose(*args, **kwargs)
            if decomposed is not NotImplemented:
                return decomposed
        node_args, node_kwargs = pytree.tree_map_only(torch.Tensor, self.node_of, (args, kwargs))
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__ if isinstance(func, torch._ops.OpOverload) else None
        node = self.graph.create_node("call_function", func, node_args, node_kwargs,
                                      name=self.graph._target_to_str(name) if name else None)
        # annotations with fxshard's meta keys (the parameter an update is for, a collective's unit)
        custom = fx_traceback.get_current_meta().get("custom") or {}
        annotations = {key: value for key, value in custom.items() if key.startswith("fxshard_")}
        self._describe(node, out, annotations)
        if isinstance(out, (tuple, list)):  # one getitem per tensor, as make_fx's proxies make them
            for index, value in enumerate(out):
                if isinstance(value, torch.Tensor):
                    item = self.graph.create_node("call_function", operator.getitem, (node, index), name="getitem")
                    self._describe(item, value, annotations)
                    self.env[value] = item
        elif isinstance(out, torch.Tensor):
            self.env[out] = node
        return out

    def _describe(self, node: fx.Node, value, annotations: dict) -> None:
        # a detached alias, as make_fx keeps: the graph must not hold the value fn goes on with
        node.meta["val"] = pytree.tree_map_only(torch.Tensor, snapshot_fake, value)
        node.meta[meta.PHASE] = self.phase
        if self.layer is not None:
            node.meta[meta.LAYER] = self.layer
        node.meta.update(annotations)
        node.meta.update(self.extra_meta)


def _fresh(value, fake_mode):
    if isinstance(value, torch.Tensor):
        return fake_tensor(fake_mode, value.shape, value.stride(), value.dtype, value.device)
    return value


def flops(node: fx.Node) -> int:
    """The floating-point operations of one GEMM-class node (torch's flop counter formulas for aten's
    matmuls and attention, which count causal attention whole; fxshard's grouped ops by their rows
    and weights), 0 for any other node or one whose shapes are unknown. The dump shows each
    collective's window in FLOPs: a count of GEMMs alone does not tell three router matmuls from an
    attention layer. Grouped GEMMs count every row of their buffer: exact with a capacity (the slots
    are computed, padding included), an upper bound for dropless layers, whose buffer after an
    expert-parallel dispatch is sized for the worst case while only the rows received are computed."""
    if node.op != "call_function":
        return 0
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
    try:
        return _grouped_flops(getattr(node.target, "__name__", "").replace(".default", ""), args) or _aten_flops(node, args, kwargs)
    except Exception:  # noqa: BLE001 - an estimate for the dump; a shape it cannot read counts 0
        return 0


def _grouped_flops(name: str, args) -> int:
    if name == "matmul_wide":  # a [m, k], b [k, n]: the matmul it replaced
        return 2 * args[0].shape[0] * args[0].shape[1] * args[1].shape[1]
    if name == "grouped_mm":  # x [rows, in], weight [E, out, in]
        return 2 * args[0].shape[0] * args[2].shape[1] * args[2].shape[2]
    if name == "grouped_mm_wgrad":  # a [rows, m], b [rows, n] (grad_out and x, or swapped: stored layout)
        return 2 * args[0].shape[0] * args[0].shape[1] * args[1].shape[1]
    if name in ("grouped_mlp_fwd", "grouped_mlp_dgrad"):  # both GEMMs of every row: x / grad_out, w1, w2
        w1, w2 = (args[2], args[3]) if name == "grouped_mlp_fwd" else (args[3], args[4])
        return 2 * args[0].shape[0] * (w1.shape[1] * w1.shape[2] + w2.shape[1] * w2.shape[2])
    if name == "grouped_mlp_wgrad":  # grad_out, grad_h, x, act: both weight gradients
        grad_out, grad_h, x, act = args[:4]
        return 2 * x.shape[0] * (grad_h.shape[1] * x.shape[1] + grad_out.shape[1] * act.shape[1])
    return 0


def _aten_flops(node: fx.Node, args, kwargs) -> int:
    from torch.utils.flop_counter import flop_registry

    packet = getattr(node.target, "overloadpacket", None)
    formula = flop_registry.get(_FLOP_ALIASES.get(packet, packet))
    return 0 if formula is None else int(formula(*args, out_val=node.meta.get("val"), **kwargs))


_aten = torch.ops.aten
_FLOP_ALIASES = {  # the CPU kernels of attention take the arguments of the CUDA flash kernels
    _aten._scaled_dot_product_flash_attention_for_cpu: _aten._scaled_dot_product_flash_attention,
    _aten._scaled_dot_product_flash_attention_for_cpu_backward: _aten._scaled_dot_product_flash_attention_backward,
}
