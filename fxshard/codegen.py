"""Codegen: compile the compute of a per-rank program with Inductor, keeping fxshard's order.

The passes decide where communication goes (an all-gather issued one unit ahead, a wait just before
its first reader, an all-to-all with GEMMs in its window); the runtime lowerings decide how some ops
run (in-place AdamW, SM carveouts, copy-engine all-to-alls). Everything else is plain aten compute,
replayed op by op unless compiled. `compile_regions` cuts the graph at every node whose place fxshard
chose, the *fixed* nodes:

- collectives, their waits, point-to-point and every other op outside aten/prims (fxshard's custom
  ops with kernels of their own: grouped_mm, grouped_mlp, adamw_update, gather_rows; the lowerings'
  calls such as set_sm_carveout and the copy-engine all-to-alls);
- aten ops that mutate an argument, and ops whose output shape depends on data (nonzero & co.);
- placeholders, get_attr, the output.

Each run of consecutive non-fixed nodes is a *region*; a run also ends where the program reaches a
layer's forward or backward (of a microbatch) for the first time, so every layer is a region of its
own even where no communication cuts the graph (one device). A region is replaced by one call of
its compiled code, with its inputs and outputs threaded through; fixed nodes stay exactly where they
were. So the sequence of collectives, waits and sends is the one the dump shows, and no compiled
kernel can absorb a wait: a region lies wholly between two fixed nodes.

Invariant: the result computes the same values as `graph_module` (up to the floating-point
reassociation Inductor's fused kernels do; random ops keep aten's generator via `fallback_random`),
and its fixed nodes are the input's fixed nodes, with the same targets and arguments, in the same
order (plus a `get_attr` per folded constant).

Before cutting, compute that reads no input of the step (RoPE's cos/sin tables, built from `arange`
each step) is evaluated once by aten and kept as a constant of the module (`fold_constants`): left in a
region, Inductor would recompute it inside every kernel that reads it.

Regions that are the same code on the same shapes (the same layer's forward at another depth) are
compiled once: they are keyed by their structure. Inductor's own on-disk cache makes a second run of
the same program fast. A region Inductor cannot compile runs as aten replay, with a warning naming
the region and the reason; a region of only views and getitems is replayed (nothing to fuse).
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import operator
import sys
import time
import warnings
from collections import Counter
from typing import TYPE_CHECKING, Callable

import torch
import torch.fx as fx

from .ops.gloo import GLOO_ALL_GATHERS
from .ops.p2p import P2P_OPS
import torch.nn as nn

from . import meta
from .graph import Graph, ancestors, attribute, evaluate, is_pure, is_view, mutates, views_as_reshapes, lazy_module

if TYPE_CHECKING:
    from .share import CompileSplit

# ops whose output shape depends on values: Inductor needs unbacked symbols for them; left to aten
_DATA_DEPENDENT = {"nonzero", "masked_select", "unique", "_unique2", "unique_consecutive", "_local_scalar_dense",
                   "item", "repeat_interleave", "bincount", "histc"}
# Inductor options: random ops draw from aten's generator (the same numbers as aten replay, and
# capturable the way the eager step is); the step's CUDA graph is fxshard's, not Inductor's.
INDUCTOR_OPTIONS = {"fallback_random": True, "triton.cudagraphs": False}
# input-free ops too cheap to be worth a constant: Inductor generates them inside the kernels that read them
_CHEAP = {"full", "zeros", "ones", "empty", "empty_strided", "scalar_tensor", "arange", "iota", "lift_fresh_copy",
          "_to_copy", "clone", "alias"}
FOLD_LIMIT_BYTES = 64 << 20  # a larger input-free result stays in its region (memory held for good otherwise)


# fxshard's own ops that are plain compute, which Inductor calls as an extern kernel inside a region:
# passes/fuse_grad_accumulation.py puts one in every layer's backward, and region boundaries there would
# cut the fusions around it (where the runtime runs one in place, fxshard/runtime/reinplace.py moves it
# to its layer's run end, where the region ends anyway)
_REGION_OPS = ("fxshard::matmul_accumulate", "fxshard::matmul_wide", "fxshard::embedding_accumulate")


def is_fixed(node: fx.Node) -> bool:
    """A node whose position in the program fxshard decided, or that Inductor must not see."""
    if node.op != "call_function":
        return True
    if node.target is operator.getitem:
        return is_fixed(node.args[0])
    target = node.target
    if getattr(target, "_schema", None) is not None and target._schema.name in _REGION_OPS:
        return False
    if getattr(target, "namespace", None) not in ("aten", "prims") or not hasattr(target, "_schema"):
        return True
    return mutates(node) or _op_name(node) in _DATA_DEPENDENT


def is_communication(node: fx.Node) -> bool:
    """A collective, a wait, or a point-to-point op: the nodes whose order codegen must keep."""
    return node.op == "call_function" and (getattr(node.target, "namespace", None) in ("_c10d_functional", "c10d")
                                           or node.target in P2P_OPS or node.target in GLOO_ALL_GATHERS)


@dataclasses.dataclass
class Region:
    """One compiled region: consecutive compute nodes of the program, called as one function."""
    index: int
    nodes: list[fx.Node]
    inputs: list[fx.Node]
    outputs: list[fx.Node]
    key: str = ""
    status: str = "replayed"  # "compiled" | "cache hit" | "replayed" (views only) | "fallback: <why>"
    seconds: float = 0.0
    kernel_files: list[str] = dataclasses.field(default_factory=list)
    compiled_first_by: int | None = None  # the rank that compiled this code before this one (share_compile)

    @property
    def name(self) -> str:
        return f"region_{self.index}"

    @property
    def where(self) -> str:
        """The phase and layer most of its nodes belong to, e.g. 'fwd layers.3'; in a pipeline stage's
        program also the microbatch and the position of its action in the stage's actions
        (`StagePlan.actions`), e.g. 'bwd layers.3 mb 2 action 17'."""
        counts = Counter((meta.phase(n) or "-", meta.layer(n) or "-") for n in self.nodes)
        (phase, layer), _ = counts.most_common(1)[0]
        first = next((n for n in self.nodes if meta.action_index(n) is not None), self.nodes[0])
        action, microbatch = meta.action_index(first), meta.microbatch(first)
        return f"{phase} {layer}" + (f" mb {microbatch} action {action}" if action is not None else "")


def find_regions(graph: fx.Graph, by_layer: bool = True) -> list[Region]:
    """The runs of consecutive non-fixed nodes, each with what it reads and what is read of it.

    Fixed nodes end a run, and so does a change of pipeline action (`meta.ACTION_INDEX`: a region is
    never two actions' work; a node without one, such as a view a later pass copied in, joins the run
    it is in). With `by_layer`, so does the first node of each (phase, microbatch, layer)
    the program reaches: every layer's forward and backward is a region of its own (with the few
    nodes of a neighbouring layer that the backward orders in between), so the same code at
    another depth is one structure key and compiles once, however little communication there is to
    cut at (one device: otherwise the whole forward and backward is a single region)."""
    input_only = _input_only_nodes(graph)
    runs, run, seen = [], [], set()
    run_action = None  # the pipeline action of the run's nodes (None: not a pipeline, or none seen yet)
    for node in graph.nodes:
        if is_fixed(node):
            if run:
                runs.append(run)
            run, run_action = [], None
            continue
        action = meta.action_index(node)  # a node copied in by a later pass (fsdp's views) may have none
        if action is not None and run_action is not None and action != run_action:
            runs.append(run)
            run, run_action = [], None
        run_action = run_action if action is None else action
        part = (meta.phase(node), meta.microbatch(node), meta.layer(node))
        if by_layer and part not in seen and node not in input_only:
            seen.add(part)
            carried = len(run)  # the run's trailing views and casts of inputs join the layer after them
            while carried and run[carried - 1] in input_only:
                carried -= 1
            if carried:
                runs.append(run[:carried])
                run, run_action = run[carried:], action
        run.append(node)
    regions = []
    for nodes in runs:
        inside = set(nodes)
        inputs = list(dict.fromkeys(a for n in nodes for a in n.all_input_nodes if a not in inside))
        outputs = [n for n in nodes if any(user not in inside for user in n.users)]
        if outputs:  # a run nothing reads is dead code: left as it is
            regions.append(Region(len(regions), nodes, inputs, outputs))
    return regions


_CASTS = {"_to_copy", "convert_element_type"}


def _input_only_nodes(graph: fx.Graph) -> set[fx.Node]:
    """The nodes made from the step's inputs alone: those that read only placeholders and constants
    (whatever they compute, an embedding too when table and indices are both inputs), and the views
    and casts of such nodes (a parameter's view of its flat unit, its cast to the compute dtype, the
    cast's transpose). Such a node neither starts a layer's region nor counts as that layer reached,
    and joins the region after it. Otherwise the casts and views, which run once per step ahead of
    the forward (in a pipeline stage the flat units' views come first), would claim every layer
    before its forward does, and the whole forward would be one region."""
    input_only: set[fx.Node] = set()
    for node in graph.nodes:
        inputs = node.all_input_nodes
        if node.op in ("placeholder", "get_attr"):
            input_only.add(node)
        elif is_fixed(node):
            continue
        elif all(arg.op in ("placeholder", "get_attr") for arg in inputs) or (
                (is_view(node) or _op_name(node) in _CASTS) and all(arg in input_only for arg in inputs)):
            input_only.add(node)
    return input_only


def region_graph(region: Region) -> fx.GraphModule:
    """The region as a GraphModule of its own: inputs in order -> tuple of outputs."""
    graph = Graph()
    env = {node: graph.placeholder(f"in{i}") for i, node in enumerate(region.inputs)}
    for node, placeholder in env.items():
        placeholder.meta = dict(node.meta)
    for node in region.nodes:
        env[node] = graph.node_copy(node, env.__getitem__)
    graph.output(tuple(env[node] for node in region.outputs))
    return lazy_module(nn.Module(), graph)


def structure_key(region: Region) -> str:
    """Equal for regions that are the same code on the same shapes, strides and dtypes."""
    index = {node: ("in", i) for i, node in enumerate(region.inputs)}
    index.update({node: ("n", i) for i, node in enumerate(region.nodes)})
    lines = [repr(_tensor_spec(node.meta.get("val"))) for node in region.inputs]
    for node in region.nodes:
        args = fx.node.map_arg((node.args, node.kwargs), lambda a: index[a])
        lines.append(f"{node.target}{args!r}")
    lines.append(repr([index[node] for node in region.outputs]))
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]


def _tensor_spec(value):
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), tuple(value.stride()), value.dtype, value.device.type)
    return type(value).__name__


class CompiledRegion(nn.Module):
    """Calls a region's compiled code (or its aten replay); the outer graph calls this. Under
    torch.profiler the call is a range named `fxshard <region> [<where>]`, so a trace says which
    region (layer, phase, pipeline action) each of its kernels comes from (a fixed node's kernels,
    between regions, are in no range); otherwise it costs one check."""

    def __init__(self, region: Region, replay: fx.GraphModule, compiled: Callable | None):
        super().__init__()
        self.replay = replay
        self.compiled = compiled
        self.description = f"{region.name}: {len(region.nodes)} nodes, {region.where}, {region.status}"
        self.label = f"fxshard {region.name} [{region.where}]"
        # the layout each output's consumers were compiled for (its traced metadata)
        self.layouts = [(tuple(v.shape), tuple(v.stride())) if isinstance(v := node.meta.get("val"), torch.Tensor)
                        else None for node in region.outputs]
        self.restrided: list[int] | None = None  # outputs Inductor lays out otherwise: found at the first call

    def forward(self, *args):
        run = self.compiled or self.replay
        if torch._C._autograd._profiler_enabled():
            with torch.profiler.record_function(self.label):
                return self.conformed(run(*args))
        return self.conformed(run(*args))

    def conformed(self, outputs):
        """`outputs` in the layouts their consumers expect. Inductor may lay an output out otherwise than
        the traced program recorded (a `cat` with an empty legacy input, as transformers' DynamicCache
        makes, comes out in its other input's strides, where eager and the trace make it contiguous);
        a compiled consumer then fails its input check, an aten one may read it otherwise. Such
        outputs are copied into the recorded layout; which ones is decided at the first call."""
        if self.compiled is None:
            return outputs
        if self.restrided is None:
            self.restrided = [i for i, (out, layout) in enumerate(zip(outputs, self.layouts))
                              if layout is not None and isinstance(out, torch.Tensor) and
                              not _same_layout(out, *layout)]
        if not self.restrided:
            return outputs
        outputs = list(outputs)
        for i in self.restrided:
            outputs[i] = _laid_out(outputs[i], *self.layouts[i])
        return outputs

    def extra_repr(self) -> str:
        return self.description


def _laid_out(tensor: torch.Tensor, shape: tuple, stride: tuple) -> torch.Tensor:
    """A copy of `tensor` in `shape` and `stride`. Where the stride is 0 in a dim longer than 1 (an
    expanded value: its elements there are one memory location, which no copy can write), the values
    at index 0 of such dims are copied and expanded."""
    broadcast = [size > 1 and step == 0 for size, step in zip(shape, stride)]
    part = tensor[tuple(slice(0, 1) if b else slice(None) for b in broadcast)] if any(broadcast) else tensor
    copy = torch.empty_strided(part.shape, stride, dtype=tensor.dtype, device=tensor.device).copy_(part)
    return copy.expand(shape) if any(broadcast) else copy


def _same_layout(tensor: torch.Tensor, shape: tuple, stride: tuple) -> bool:
    """`tensor` has `shape` and, in every dim longer than 1, `stride` (as Inductor's input check)."""
    return tuple(tensor.shape) == shape and all(size <= 1 or actual == expected for size, actual, expected
                                                in zip(shape, tensor.stride(), stride))


@dataclasses.dataclass
class CodegenReport:
    """What codegen did: every region, the folded constants, and the totals a summary line needs."""
    regions: list[Region]
    seconds: float
    folded: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)

    def count(self, *statuses: str) -> int:
        return sum(any(r.status.startswith(s) for s in statuses) for r in self.regions)

    def line(self) -> str:
        shared = sum(r.compiled_first_by is not None for r in self.regions)
        return (f"codegen: {len(self.regions)} regions, {self.count('compiled')} compiled"
                f"{f' ({shared} first compiled by another rank of this host)' if shared else ''}, "
                f"{self.count('cache hit')} cache hits, {self.count('replayed')} replayed (views only), "
                f"{self.count('fallback')} fell back to aten, {len(self.folded)} constants folded "
                f"({sum(t.nbytes for t in self.folded.values()) / 2**20:.1f} MiB), {self.seconds:.1f}s")

    def table(self) -> str:
        """Every region: nodes, inputs, outputs, ops, status, time and Inductor's generated code."""
        lines = [f"# {self.line()}",
                 "# each region runs as one call between the fixed nodes (communication, custom ops) around it",
                 ""]
        for name, value in self.folded.items():
            lines.append(f"{name}: constant {tuple(value.shape)} {str(value.dtype).replace('torch.', '')}, "
                         f"computed once at compile time (reads no input of the step)")
        for r in self.regions:
            ops = Counter(str(n.target).replace("aten.", "").split(".")[0] for n in r.nodes if n.op == "call_function")
            lines.append(f"{r.name} [{r.where}] {len(r.nodes)} nodes {r.nodes[0].name} .. {r.nodes[-1].name}; "
                         f"{len(r.inputs)} inputs, {len(r.outputs)} outputs; key {r.key}; {r.status}"
                         f"{f' in {r.seconds:.1f}s' if r.status == 'compiled' else ''}"
                         f"{f' (rank {r.compiled_first_by} compiled it first)' if r.compiled_first_by is not None else ''}")
            lines.append("    ops: " + ", ".join(f"{op} x{n}" for op, n in ops.most_common(12)))
            for path in r.kernel_files:
                lines.append(f"    generated code: {path}")
        return "\n".join(lines) + "\n"


def compile_regions(graph_module: fx.GraphModule, compiler: Callable | None = None,
                    progress: Callable[[str], None] | None = None,
                    by_layer: bool = True, split: Callable[[list[str]], CompileSplit] | None = None,
                    ) -> tuple[fx.GraphModule, CodegenReport]:
    """A copy of `graph_module` whose regions each run as one compiled call; and what was done.

    `compiler(gm, region) -> callable` compiles one region (default: Inductor); an exception from it
    makes that region fall back to aten replay with a warning. `progress(line)` hears about regions
    as they compile. `by_layer`: regions also end where a layer begins (find_regions). `split(keys)`
    (`fxshard.share.split_compiles`, collective) says which structure keys this rank compiles before
    the others' share, which it then finds in Inductor's cache."""
    compiler = compiler or inductor_compile
    started = time.perf_counter()
    source = Graph()
    source.output(source.graph_copy(graph_module.graph, {}))
    folded = fold_constants(source, graph_module)
    _hoist_getitems(source)
    regions = find_regions(source, by_layer)
    replays = {}
    for region in regions:
        replays[region.name] = region_graph(region)
        region.key = structure_key(region)
    first = {}  # each key to compile, at its first region
    for region in regions:
        if not all(is_view(n) for n in region.nodes):
            first.setdefault(region.key, region)
    plan = split(list(first)) if split is not None else None
    order = list(first.values())
    if plan is not None:  # this rank's share first, then the others' (from the cache)
        order = [r for r in order if r.key in plan.mine] + [r for r in order if r.key not in plan.mine]
    compiled_by_key: dict[str, Callable | None] = {}
    done = 0
    for position, region in enumerate(order):
        if plan is not None and position == len(plan.mine):
            plan.wait()
        began = time.perf_counter()
        try:
            compiled_by_key[region.key] = compiler(replays[region.name], region)
            region.status = "compiled"
            if plan is not None and plan.owner.get(region.key, plan.rank) != plan.rank:
                region.compiled_first_by = plan.owner[region.key]
        except Exception as error:  # noqa: BLE001 -- any failure of the compiler means: replay this region
            compiled_by_key[region.key] = None
            reason = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
            region.status = f"fallback: {reason}"
            warnings.warn(f"fxshard codegen: {region.name} ({len(region.nodes)} nodes, {region.where}, "
                          f"{region.nodes[0].name} .. {region.nodes[-1].name}) runs as aten replay: Inductor "
                          f"could not compile it ({reason})", stacklevel=2)
        region.seconds = time.perf_counter() - began
        done += 1
        if progress is not None:
            progress(f"codegen: region {region.index + 1} of {len(regions)} ({len(region.nodes)} nodes, "
                     f"{region.where}) {region.status}; {done} of {len(order)} to compile; "
                     f"{time.perf_counter() - started:.1f}s elapsed")
    if plan is not None and len(plan.mine) == len(order):
        plan.wait()  # every rank waits once, also one that had nothing of the others' to compile
    modules: dict[str, nn.Module] = {}
    for region in regions:
        compiled = compiled_by_key.get(region.key)
        if all(is_view(n) for n in region.nodes):
            region.status = "replayed"
        elif first[region.key] is not region:
            region.status = "cache hit" if compiled is not None else "fallback: same code as a region that fell back"
        replay = replays[region.name]
        modules[region.name] = CompiledRegion(region, views_as_reshapes(replay) if compiled is None else replay, compiled)
    graph = _outer_graph(source, regions)
    attributes = {n.target: folded[n.target] if n.target in folded else attribute(graph_module, n.target)
                  for n in graph.nodes if n.op == "get_attr"}
    result = lazy_module({**attributes, **modules}, graph)
    return result, CodegenReport(regions, time.perf_counter() - started, folded)


def fold_constants(graph: fx.Graph, module: nn.Module) -> dict[str, torch.Tensor]:
    """Evaluate once, with aten, the compute in `graph` that reads no placeholder, and read its results
    through `get_attr` nodes named `folded_<i>`; returns those constants. Only results whose inputs
    include real compute are folded (an `arange` or `full` alone costs Inductor nothing), no random
    op, and none over FOLD_LIMIT_BYTES. Invariant: the graph computes the same values, bit for bit."""
    costly: dict[fx.Node, bool] = {}  # input-free node -> whether computing it takes more than a factory
    for node in graph.nodes:
        if node.op == "get_attr" and not any(mutates(user) for user in node.users):
            costly[node] = False
        elif is_pure(node) and all(a in costly for a in node.all_input_nodes):
            own = node.target is not operator.getitem and not is_view(node) and _op_name(node) not in _CHEAP
            costly[node] = own or any(costly[a] for a in node.all_input_nodes)
    boundary = [n for n, cost in costly.items() if cost and n.op == "call_function"
                and isinstance(n.meta.get("val"), torch.Tensor) and any(u not in costly for u in n.users)
                and n.meta["val"].numel() * n.meta["val"].element_size() <= FOLD_LIMIT_BYTES]
    values = evaluate(graph, module, ancestors(boundary))
    folded = {}
    first_op = next(n for n in graph.nodes if n.op != "placeholder")  # constants go first: they cut no region
    for node in boundary:
        name = f"folded_{len(folded)}"
        with graph.inserting_before(first_op):
            constant = graph.get_attr(name)
        constant.meta = dict(node.meta)
        node.replace_all_uses_with(constant)
        folded[name] = values[node].detach()
    for node in reversed(list(costly)):  # the input-free nodes nothing reads any more
        if not node.users:
            graph.erase_node(node)
    return folded


def _op_name(node: fx.Node) -> str:
    return node.target._schema.name.split("::")[-1]


def _hoist_getitems(graph: fx.Graph) -> None:
    """Move each getitem of a compute op's tuple to just after the op: a pass may have put a fixed
    node in between (a collective after nll_loss_forward), which would make the tuple itself cross a
    region boundary. Fixed nodes keep their order."""
    for node in list(graph.nodes):
        if node.op == "call_function" and not is_fixed(node):
            getitems = sorted((u for u in node.users if u.target is operator.getitem), key=lambda u: u.args[1])
            anchor = node
            for user in getitems:
                anchor.append(user)
                anchor = user


def _outer_graph(source: fx.Graph, regions: list[Region]) -> fx.Graph:
    """`source` with each region's nodes replaced by a call of the region and a getitem per output."""
    first = {region.nodes[0]: region for region in regions}
    covered = {node for region in regions for node in region.nodes}
    graph, env = Graph(), {}
    for node in source.nodes:
        if node in first:
            region = first[node]
            call = graph.call_module(region.name, tuple(env[a] for a in region.inputs))
            call.meta = {meta.PHASE: meta.phase(node), meta.LAYER: meta.layer(node)}
            for position, output in enumerate(region.outputs):
                env[output] = graph.call_function(operator.getitem, (call, position))
                env[output].meta = dict(output.meta)
        elif node not in covered:
            env[node] = graph.node_copy(node, env.__getitem__)
    graph.lint()
    return graph


def inductor_compile(replay: fx.GraphModule, region: Region) -> Callable:
    """Compile one region with Inductor for the shapes recorded in its inputs' metadata (no real data
    needed: the example inputs are fake tensors)."""
    from torch._inductor import codecache, standalone_compile
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    values = [node.meta.get("val") for node in region.inputs]
    missing = [node.name for node, value in zip(region.inputs, values) if not isinstance(value, torch.Tensor)]
    if missing:
        raise ValueError(f"inputs without a recorded tensor shape: {missing[:3]}")
    fake_mode = FakeTensorMode(shape_env=ShapeEnv())
    with fake_mode:
        examples = [torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device) for v in values]
    loaded = len(codecache.PyCodeCache.modules)
    kwargs = {"fake_mode": fake_mode} if "fake_mode" in inspect.signature(standalone_compile).parameters else {}
    compiled = standalone_compile(replay, examples, dynamic_shapes="from_example_inputs",
                                  options={"config_patches": dict(INDUCTOR_OPTIONS)}, **kwargs)
    region.kernel_files = [getattr(m, "__file__", "?") for m in codecache.PyCodeCache.modules[loaded:]]
    return compiled


def progress_printer(verbose: bool, quiet_seconds: float = 5.0) -> Callable[[str], None]:
    """Prints each region's progress line to stderr: every line with `verbose`, else only once the
    compile has taken `quiet_seconds` (short compiles stay silent); on rank 0 of a job only."""
    started = time.perf_counter()

    def report(line: str) -> None:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
            return
        if verbose or time.perf_counter() - started >= quiet_seconds:
            print(f"fxshard: {line}", file=sys.stderr, flush=True)
    return report
