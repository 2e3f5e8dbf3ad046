"""Expert parallelism: each MoE layer's experts computed where they live, tokens moved by all-to-all.

On `Mesh(dp=N, ep=K)` the K ranks of an expert-parallel group each own E/K consecutive experts.
The pass finds every MoE layer by its expert ops (`fxshard::grouped_mm` / `grouped_mm_wgrad`, or the
fused `grouped_mlp_*`), whose offsets come from `fxshard.moe.dispatch`, and moves the *expert
region* — the expert ops and the row-wise ops between them (activation, its backward) — from the
rank that routed the tokens to the rank that owns the experts:

    route    from the layer's offsets: each row's destination rank and (ep_overlap) chunk, its slot
             in a fixed-size per-destination buffer, and (one small all-to-all) how many rows of
             each local expert every source sends
    dispatch every row-space tensor entering the region (the sorted tokens; in the backward the
             gradient of the expert output) is packed into [K, B, ...] and sent: all_to_all_single
    experts  the region's ops run on the received rows, sorted by local expert, with the local
             experts' weights [E/K, ...] and local offsets
    combine  every row-space tensor leaving the region goes back by all_to_all_single and is
             unpacked into the original row order (rows that were dropped or routed nowhere: zero)

in the forward and the backward alike (the backward's region is its own expert ops: the gradient
enters by dispatch, the data gradient leaves by combine, weight gradients stay local). Buffers are
static: B = the most rows one source can send one destination (dropless: min(T*min(k, E/K), ...);
with a capacity C: at most E/K * C), so the step has static shapes and replays in a CUDA graph.

Overlap (`chunks` > 1, Config(ep_overlap=True)): every rank's local experts are split into
`chunks` contiguous groups, and chunk c carries the rows routed to group c on every destination
(so one token's k assignments usually travel in different chunks). Every chunk has its own
dispatch / experts / combine; all dispatches are issued first, and chunk c's experts run while
chunk c+1's dispatch and chunk c-1's combine are in flight (`wait_tensor` placed at the last
moment). Splitting by experts rather than by rows of each expert keeps every expert's GEMM whole and
gives each chunk the weight gradients of its own experts (no partial gradients to add up, in bf16
or otherwise). Nodes carry `meta.MOE_PIECE` and `meta.MOE_CHUNK`.

Invariant: run on the K ranks of an expert-parallel group, each rank's program computes the same
loss and metrics as the input program on that rank's batch, the same gradients for the non-expert
parameters, and, for each of its local experts, the sum over the group's ranks of the gradients
the input program computes on their batches. Its optimizer phase applies those local gradients;
the FSDP pass that follows on every mesh turns them into the data-parallel update (expert
gradients averaged over `edp` and divided by K), so that the composition trains exactly like the
input program on the concatenated batch (mean loss, per-rank routing, capacity and balance loss).
Expert parameters become inputs of shape [E/K, ...] placed `sharded(ep)`. Routing statistics are
added as metrics: `moe/<layer>/tokens_per_expert` ([E], kept rows) and `moe/<layer>/dropped`.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field, replace

import torch
import torch.fx as fx

from fxshard import meta, moe
from fxshard.errors import FxShardError
from fxshard.graph import Graph, ancestors, call_argument, fake_mode_of, inline, lazy_module
from fxshard.ops.grouped_mlp_backends import expert_of_rows
from fxshard.optimizer_graph import append_update
from fxshard.program import EXPERT_SHARDED, Input, InputKind, Output, OutputKind, Program

_c10d = torch.ops._c10d_functional
_aten = torch.ops.aten


@dataclass(frozen=True)
class EPConfig:
    ep: int
    chunks: int = 1   # > 1: the ep_overlap split
    axis: str = "ep"

    def __post_init__(self):
        if self.ep < 1 or self.chunks < 1:
            raise FxShardError(f"expert parallelism needs ep >= 1 and chunks >= 1, got {self}")


def _expert_ops():
    """op -> (argument roles, output roles): "row" (one row per routed token, sorted by expert),
    "offsets", "weight" ([E, ...] expert tensors), "experts" (the int E), "capacity" (the grouped
    MLP's slot layout, which find_layers refuses), None (anything else)."""
    ops = torch.ops.fxshard
    return {
        ops.grouped_mm.default: (("row", "offsets", "weight", "capacity"), ("row",)),
        ops.grouped_mm_wgrad.default: (("row", "row", "offsets", "experts", "capacity"), ("weight",)),
        ops.grouped_mlp_fwd.default: (("row", "offsets", "weight", "weight", "weight", "weight", None, None,
                                       "capacity"), ("row", "row")),
        ops.grouped_mlp_dgrad.default: (("row", "row", "offsets", "weight", "weight", None, None, "capacity"),
                                        ("row", "row", "row")),
        ops.grouped_mlp_wgrad.default: (("row", "row", "row", "row", "offsets", None, "capacity"),
                                        ("weight", "weight", "weight", "weight")),
    }


# Ops that act on each row (or each expert) on its own, given the dimension they act along.
_VIEWS = {_aten.view.default, _aten._unsafe_view.default, _aten.reshape.default, _aten.expand.default}
_ALONG_DIM = {_aten.split.Tensor: 2, _aten.split_with_sizes.default: 2, _aten.chunk.default: 2,
              _aten.slice.Tensor: 1, _aten.narrow.default: 1, _aten.select.int: 1, _aten.unsqueeze.default: 1,
              _aten.squeeze.dim: 1, _aten.index_select.default: 1, _aten.cat.default: 1,
              _aten.slice_backward.default: 2, _aten.select_backward.default: 2, _aten.slice_scatter.default: 2,
              _aten.select_scatter.default: 2, _aten.stack.default: 1}
_BACKWARD_VIEWS = {_aten.slice_backward.default, _aten.select_backward.default}  # args[1]: the input's sizes
_PLAIN = {_aten._to_copy.default, _aten.clone.default, _aten.alias.default, _aten.detach.default,
          operator.getitem}


# Row-wise ops that give zero rows where the rows they read are zero: the output is zero where ...
_ZERO_IF_FIRST = {  # ... the first argument is (a function f with f(0) = 0, a gradient times something)
    _aten.relu.default, _aten.gelu.default, _aten.silu.default, _aten.tanh.default, _aten.neg.default,
    _aten.abs.default, _aten.sin.default, _aten.sign.default, _aten.mul.Scalar, _aten.div.Scalar,
    _aten.div.Tensor, _aten.threshold_backward.default, _aten.gelu_backward.default, _aten.silu_backward.default,
    _aten.tanh_backward.default, _aten.sigmoid_backward.default, _aten.transpose.int, _aten.permute.default,
    *_PLAIN, *_VIEWS, *(op for op in _ALONG_DIM if op not in (_aten.cat.default, _aten.slice_scatter.default,
                                                              _aten.select_scatter.default))}
_ZERO_IF_ANY = {_aten.mul.Tensor}  # ... any argument is
_ZERO_IF_ALL = {_aten.add.Tensor, _aten.sub.Tensor}  # ... every argument is (a number must be 0)
_SCATTERS = {_aten.slice_scatter.default, _aten.select_scatter.default}  # ... the base and what lands in it are


def _zero_rows_stay_zero(node: fx.Node, is_zero) -> bool:
    """Whether `node` is zero in the rows where the region's values it reads are (`is_zero(input)`),
    known from its op; False where not known."""
    target = node.target
    if target is _aten.cat.default:
        return all(is_zero(a) for a in node.args[0])
    if target is _aten.pow.Tensor_Scalar:
        return isinstance(node.args[1], (int, float)) and node.args[1] > 0 and is_zero(node.args[0])
    if target in _ZERO_IF_FIRST:
        return isinstance(node.args[0], fx.Node) and is_zero(node.args[0])
    if target in _ZERO_IF_ANY:
        return any(isinstance(a, fx.Node) and is_zero(a) for a in node.args)
    if target in _ZERO_IF_ALL:
        return all(is_zero(a) if isinstance(a, fx.Node) else a == 0 for a in node.args)
    if target in _SCATTERS:
        return all(isinstance(a, fx.Node) and is_zero(a) for a in node.args[:2])
    return False


def _val(node):
    return node.meta.get("val") if isinstance(node, fx.Node) else node


def first_tensor(value):
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (list, tuple)):
        return next((v for v in value if isinstance(v, torch.Tensor)), None)
    return None


def keeps_dim0(node: fx.Node) -> bool:
    """True when output element [i, ...] reads only input elements [i, ...] (dim 0 is carried along)."""
    target = node.target
    out = first_tensor(_val(node))
    if out is None or out.dim() == 0:
        return False
    if target in _PLAIN:
        return True
    if isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags:
        return True
    source = first_tensor(_val(node.args[0][0] if target in (_aten.cat.default, _aten.stack.default) else node.args[0]))
    if source is None:
        return False
    if target in _ALONG_DIM:
        position = _ALONG_DIM[target]
        dim = node.args[position] if len(node.args) > position else node.kwargs.get("dim", 0)
        if target in (_aten.unsqueeze.default, _aten.select_backward.default, _aten.stack.default):  # the output's dims
            return dim % (source.dim() + 1) != 0
        return dim % source.dim() != 0
    if target in _VIEWS:
        return source.dim() >= 1 and out.shape[0] == source.shape[0]
    if target in (_aten.transpose.int, _aten.permute.default):
        dims = node.args[1:3] if target is _aten.transpose.int else node.args[1]
        return all(d % source.dim() != 0 for d in dims)
    return False


def _mixed_experts_error(node: fx.Node, placeholders: dict, experts: int) -> FxShardError:
    """Why the weight an expert op reads cannot be split by expert: the parameters it comes from, and
    what lies between (per-expert parameters stacked: an indexed layout; a parameter whose dim 0 is
    not the experts reshaped into [E, ...], as Dbrx stores its experts [E * F, H])."""
    params = {placeholders[n].name: tuple(placeholders[n].shape) for n in ancestors([node]) | {node}
              if n.op == "placeholder" and placeholders[n].kind is InputKind.PARAM}
    names = sorted(params)
    named = ", ".join(f"{name} {params[name]}" for name in names[:3]) + (", ..." if len(names) > 3 else "")
    out = first_tensor(_val(node))
    fix = (f"store each expert weight as one [{experts}, ...] parameter (reshaped once in the model, before "
           f"shard()), or train this model without ep")
    if node.target in (_aten.stack.default, _aten.cat.default) and call_argument(node, "dim") in (0, None):
        how = (f"{node.name} ({node.target}) joins parameters along dim 0 ({named}): per-expert parameters, where "
               f"expert parallelism splits one [{experts}, ...] parameter per weight by its dim 0; {fix} (fxshard's "
               f"MoEGPT: expert_weights='grouped')")
    elif node.target in _VIEWS and out is not None:
        how = (f"{node.name} ({node.target}) reshapes what it reads from {named} into {tuple(out.shape)}: dim 0 is not "
               f"the {experts} experts before it, and expert parallelism splits a parameter by its dim 0; {fix}")
    else:
        how = (f"{node.name} ({node.target}) moves dim 0 between {named or 'a parameter'} and the expert op, where "
               f"expert parallelism splits each expert weight by its dim 0, expert by expert; {fix}")
    return FxShardError(f"expert parallelism cannot split these expert weights: {how}")


def receive_order(counts: torch.Tensor, buffer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The order that sorts an all-to-all's received rows by local expert, and its inverse.

    Source rank r's `buffer` rows arrive at r * buffer: its rows for each local expert e in expert
    order (`counts[r, e]` of them), then padding. The order lists the rows by (expert, source, place),
    the padding last (by source, place): `order[i]` is the received row that goes i-th, and
    `inverse[row]` where a row goes. Every row's place is computed, not sorted for: row p of source r,
    of expert e, goes to the rows of the experts before e (all sources), plus expert e's rows from
    sources before r, plus p's distance from the first row of e in r's block. (An argsort of the
    packed key (e, r, p) computed the same: 10 small radix-sort kernels a layer and microbatch, ~90 us
    a call on an H200 at 2 x 16384 rows, in the window the other microbatch's all-to-all hides behind.)"""
    k, experts = counts.shape
    place = torch.arange(buffer, device=counts.device).expand(k, buffer)
    filled = counts.cumsum(1)
    owner = torch.searchsorted(filled, place.contiguous(), right=True)  # [k, buffer]; `experts`: padding
    sizes = torch.cat([counts, buffer - filled[:, -1:]], 1)            # [source, expert or padding]
    first_in_block = sizes.cumsum(1) - sizes                           # where (r, e) starts in r's block
    by_expert = sizes.t().reshape(-1)                                  # expert-major, then source
    first_in_order = (by_expert.cumsum(0) - by_expert).view(experts + 1, k)  # where (e, r) starts in the order
    source = torch.arange(k, device=counts.device).unsqueeze(1)
    inverse = (first_in_order[owner, source] + place - first_in_block.gather(1, owner)).reshape(-1)
    order = torch.empty_like(inverse).scatter(0, inverse, torch.arange(k * buffer, device=counts.device))
    return order, inverse


@dataclass(eq=False)
class _Layer:
    """One MoE call (one layer, one microbatch): its offsets node and static facts."""

    offsets: fx.Node
    name: str
    experts: int
    top_k: int
    tokens: int
    capacity: int | None
    rows: int
    distinct: bool = False    # each token's k experts are distinct (fxshard.moe.dispatch(distinct=True))
    unowned_rows: bool = False  # rows may sort past the last expert's without a capacity (recognize_moe)
    local: int = 0            # experts per rank
    chunks: int = 1           # expert groups per rank (ep_overlap), at most `local`
    bounds: tuple[int, ...] = (0,)  # local expert index where each chunk's group starts, then `local`
    buffer: int = 0           # rows per destination per chunk
    region: list[fx.Node] = field(default_factory=list)   # expert-region nodes, graph order


def expert_parallel(program: Program, cfg: EPConfig) -> Program:
    """Rewrite every MoE layer of `program` for `cfg.ep` expert-parallel ranks (module docstring)."""
    if cfg.ep == 1:
        return program
    return _Rewrite(program, cfg).run()


class _Rewrite:
    def __init__(self, program: Program, cfg: EPConfig):
        self.program, self.cfg = program, cfg
        self.old = program.graph
        self.kinds = {node: (spec.kind, spec.name) for node, spec in zip(program.placeholders(), program.inputs)}
        self.updated_buffers = {spec.name for spec in program.outputs_of(OutputKind.BUFFER)}  # they differ per rank
        self.same: dict[fx.Node, bool] = {}  # same_on_every_rank, per node
        self.fake = fake_mode_of(self.old)
        self.position = {n: i for i, n in enumerate(self.old.nodes)}
        self.roles = _expert_ops()
        self.find_layers()
        self.find_expert_tensors()

    # ---- analysis ------------------------------------------------------------------------------
    def find_layers(self):
        seeds = [n for n in self.old.nodes if n.op == "call_function" and n.target in self.roles]
        if not seeds and not any(n.target is torch.ops.aten.topk.default for n in self.old.nodes):
            raise FxShardError(
                f"Mesh(ep={self.cfg.ep}) but the model has no MoE layer: its traced forward routes no token to "
                f"experts (no top-k anywhere), and expert parallelism splits a MoE layer's experts over ranks. Use "
                f"ep=1 (dp={self.cfg.ep} splits the batch over as many ranks)")
        if not seeds:
            raise FxShardError(
                f"Mesh(ep={self.cfg.ep}) but the program has no MoE layer fxshard can split over ranks: expert "
                f"parallelism rewrites MoE layers whose experts run as grouped GEMMs (fxshard.ops.grouped_mm, "
                f"torch._grouped_mm, or the fused grouped MLP) on the tokens routed to them: fxshard.moe.dispatch's "
                f"layers (fxshard.models.MoEGPT), and transformers' and torchtitan's MoE layers, which are recognized. "
                f"This model's experts compute otherwise (e.g. one batched matmul of every expert over every token; "
                f"transformers' Llama 4 MoE, which does, is traced as its sparse layer). Register a forward for its MoE module that routes with fxshard.moe.dispatch "
                f"(fxshard.register_moe), or use ep=1 (its experts then train replicated or sharded over dp)")
        self.layers: dict[fx.Node, _Layer] = {}
        self.layer_of: dict[fx.Node, _Layer] = {}
        for seed in seeds:
            arg_roles, _ = self.roles[seed.target]
            offsets = seed.args[arg_roles.index("offsets")]
            facts = (offsets.meta.get("custom") or {}).get(moe.ANNOTATION)
            if facts is not None and facts.get("slots"):
                raise FxShardError(
                    f"MoE layer {meta.layer(offsets)} routes tokens into capacity slots (moe.dispatch(slots=True), "
                    f"MoEGPTConfig(expert_slots=True)), which expert parallelism does not rewrite yet; use "
                    f"slots=False (expert_slots=False) under Mesh(ep>1)")
            if "capacity" in arg_roles and call_argument(seed, "capacity") is not None:
                raise FxShardError(
                    f"{seed.name} ({seed.target}) uses the capacity-slot row layout (capacity="
                    f"{call_argument(seed, 'capacity')}), which expert parallelism does not rewrite yet; "
                    f"call the expert ops with capacity=None (ragged rows) under Mesh(ep>1)")
            layer = self.layers.get(offsets)
            if layer is None:
                if facts is None:
                    raise FxShardError(
                        f"{seed.name} ({seed.target}) in {meta.layer(offsets) or 'the model'} takes offsets that "
                        f"fxshard.moe.dispatch did not compute and that fxshard did not recognize as an MoE "
                        f"layer's: {offsets.meta.get(meta.MOE_REJECTED, 'not examined')}. Expert parallelism needs "
                        f"the experts' rows sorted by the expert ids whose counts give the offsets "
                        f"(passes/recognize_moe.py); register the module's forward written with fxshard.moe "
                        f"(fxshard.register_moe, README \"MoE layers from other libraries\"), or use ep=1")
                experts = facts["experts"]
                if experts % self.cfg.ep:
                    raise FxShardError(f"Mesh(ep={self.cfg.ep}) must divide the number of experts; MoE layer "
                                       f"{meta.layer(offsets)} has {experts}")
                rows = next(_val(a).shape[0] for a, r in zip(seed.args, arg_roles) if r == "row")
                name = meta.layer(offsets) or "moe"
                if meta.microbatch(offsets):
                    name += f"/mb{meta.microbatch(offsets)}"
                layer = self.layers[offsets] = _Layer(offsets, name, experts, facts["top_k"], facts["tokens"],
                                                      facts["capacity"], rows, facts.get("distinct", False),
                                                      facts.get("unowned_rows", False))
                self.size_buffers(layer)
            self.layer_of[seed] = layer
            for argument, role in zip(seed.args, arg_roles):
                if role == "weight" and isinstance(argument, fx.Node) and _val(argument).shape[0] != layer.experts:
                    raise FxShardError(
                        f"{seed.name} ({seed.target}) in MoE layer {layer.name} takes {argument.name}, expert "
                        f"weights for {_val(argument).shape[0]} experts, but the layer routes its tokens among "
                        f"{layer.experts} (fxshard.moe.dispatch's n_experts); expert parallelism splits both, so "
                        f"they must agree")
        # The expert region: expert ops, their tuple items, and the row-wise ops between two expert ops.
        downstream = set(self.layer_of)
        for node in self.old.nodes:
            if node in downstream or node.op != "call_function" or meta.phase(node) == meta.OPTIM:
                continue
            if any(i in downstream for i in node.all_input_nodes) and (
                    node.target is operator.getitem and node.args[0] in self.layer_of or keeps_dim0(node)):
                downstream.add(node)
        upstream = set(self.layer_of)
        for node in reversed(self.old.nodes):
            if node in upstream:
                for source in node.all_input_nodes:
                    if source.op == "call_function" and source in downstream and keeps_dim0(source):
                        upstream.add(source)
        region = set(self.layer_of) | {n for n in downstream if n.target is operator.getitem and
                                       n.args[0] in self.layer_of} | (downstream & upstream)
        for node in self.old.nodes:
            if node in region and node not in self.layer_of:
                owners = {self.layer_of[i] for i in node.all_input_nodes if i in self.layer_of}
                if len(owners) != 1:
                    raise FxShardError(f"{node.name} mixes the expert computations of several MoE layers; "
                                       f"expert parallelism cannot split it")
                self.layer_of[node] = owners.pop()
        for node in self.old.nodes:
            if node in self.layer_of:
                self.layer_of[node].region.append(node)
        self.region = region

    def size_buffers(self, layer: _Layer):
        """Rows one source sends one destination, per chunk: an upper bound, so nothing is ever lost."""
        layer.local = local = layer.experts // self.cfg.ep
        layer.chunks = chunks = min(self.cfg.chunks, local)
        layer.bounds = tuple(math.ceil(c * local / chunks) for c in range(chunks)) + (local,)
        widest = max(b - a for a, b in zip(layer.bounds, layer.bounds[1:]))
        # with distinct experts per token a token reaches an expert at most once; a capacity bounds each expert
        reach = min(layer.top_k, widest) if layer.distinct else layer.top_k
        per_expert = layer.tokens * (1 if layer.distinct else layer.top_k)
        per_expert = per_expert if layer.capacity is None else min(per_expert, layer.capacity)
        layer.buffer = max(1, min(layer.rows, layer.tokens * reach, widest * per_expert))

    def find_expert_tensors(self):
        """Expert-space nodes (dim 0 = experts): the expert parameters, what is computed from them
        for the expert ops, the weight gradients and what is computed from those."""
        self.expert_params: dict[str, int] = {}   # name -> experts
        placeholders = dict(zip(self.program.placeholders(), self.program.inputs))
        weights: dict[fx.Node, int] = {}
        stack = []
        for seed in (n for n in self.region if n.op == "call_function" and n.target in self.roles):
            arg_roles, _ = self.roles[seed.target]
            stack += [(a, self.layer_of[seed].experts) for a, r in zip(seed.args, arg_roles)
                      if r == "weight" and isinstance(a, fx.Node)]
        while stack:
            node, experts = stack.pop()
            if node in weights:
                continue
            weights[node] = experts
            if node.op == "placeholder":
                spec = placeholders[node]
                if spec.kind is not InputKind.PARAM:
                    raise FxShardError(f"expert weights must be parameters; {spec.name} is {spec.kind.value}")
                self.expert_params[spec.name] = experts
                continue
            if not keeps_dim0(node) or meta.phase(node) == meta.OPTIM:
                raise _mixed_experts_error(node, placeholders, experts)
            stack += [(i, experts) for i in node.all_input_nodes if first_tensor(_val(i)) is not None
                      and first_tensor(_val(i)).dim() >= 1 and first_tensor(_val(i)).shape[0] == experts]
        # Everything downstream of an expert parameter or a weight gradient, outside the region.
        self.expert_nodes: dict[fx.Node, int] = dict(weights)
        for node in self.old.nodes:
            if node.op != "call_function" or meta.phase(node) == meta.OPTIM:
                continue
            if node in self.region:
                if node.target in self.roles and "weight" in self.roles[node.target][1]:
                    self.expert_nodes[node] = self.layer_of[node].experts
                elif node.target is operator.getitem and node.args[0] in self.expert_nodes:
                    self.expert_nodes[node] = self.expert_nodes[node.args[0]]
                continue
            sources = [i for i in node.all_input_nodes if i in self.expert_nodes]
            if sources and node not in self.expert_nodes:
                if not keeps_dim0(node):
                    raise FxShardError(
                        f"{node.name} ({node.target}) reads expert weights (or their gradients) across experts; "
                        f"expert parallelism keeps only E/K experts per rank and cannot compute it")
                self.expert_nodes[node] = self.expert_nodes[sources[0]]

    # ---- building ------------------------------------------------------------------------------
    def run(self) -> Program:
        self.graph = Graph()
        self.env: dict[fx.Node, fx.Node] = {}
        self.chunk_env: dict[tuple[fx.Node, int], fx.Node] = {}
        self.plans: dict[int, dict] = {}
        self.sent: dict[tuple[fx.Node, int], fx.Node] = {}      # (entry, chunk) -> issued all-to-all
        self.received: dict[tuple[fx.Node, int], fx.Node] = {}  # (entry, chunk) -> rows, expert order
        self.returned: dict[tuple[fx.Node, int], fx.Node] = {}  # (exit, chunk) -> issued all-to-all
        self.exits: dict[fx.Node, fx.Node] = {}
        self.zero_rows: dict[fx.Node, bool] = {}  # zero_where_unowned, per node
        self.emitted_parts: set[tuple[int, str]] = set()
        self.inputs: list[Input] = []
        for spec, node in zip(self.program.inputs, self.program.placeholders()):
            self.env[node] = self.placeholder(spec, node)
        for node in self.old.nodes:
            if node.op not in ("placeholder", "output") and meta.phase(node) != meta.OPTIM:
                self.emit(node)
        return self.finish()

    def placeholder(self, spec: Input, old: fx.Node) -> fx.Node:
        owner = spec.owner if spec.kind is InputKind.OPT_STATE else spec.name
        new = self.graph.node_copy(old)
        if owner in self.expert_params and spec.kind in (InputKind.PARAM, InputKind.OPT_STATE):
            local = spec.shape[0] // self.cfg.ep
            spec = replace(spec, shape=(local, *spec.shape[1:]), placement=EXPERT_SHARDED)
            with self.fake:
                new.meta["val"] = old.meta["val"].new_empty((local, *spec.shape[1:]))
        self.inputs.append(spec)
        return new

    def emit(self, node: fx.Node) -> fx.Node | None:
        """Copy `node` (and first, anything it needs that is not copied yet). A region node is copied
        with the rest of its layer's region, once per chunk (`chunk_env`): None then."""
        if node in self.env:
            return self.env[node]
        if node in self.region:
            self.emit_region(self.layer_of[node], meta.phase(node))
            return None
        for source in node.all_input_nodes:
            if source not in self.env and source not in self.region:
                self.emit(source)
        copy = self.copy(node, self.lookup, self.sizes_for(node))
        self.env[node] = copy
        return copy

    def lookup(self, node: fx.Node) -> fx.Node:
        """A node outside the region reads a region value: rows combined back, or a weight gradient
        concatenated over the chunks."""
        if node in self.region:
            if node not in self.exits:
                self.emit_region(self.layer_of[node], meta.phase(node))
                self.exits[node] = self.finish_exit(node)
            return self.exits[node]
        return self.env[node] if node in self.env else self.emit(node)

    def sizes_for(self, node: fx.Node) -> dict[int, int]:
        if node in self.expert_nodes:
            experts = self.expert_nodes[node]
            return {experts: experts // self.cfg.ep}
        return {}

    def copy(self, node: fx.Node, lookup, sizes: dict[int, int], extra_meta: dict | None = None) -> fx.Node:
        """node_copy, with leading sizes in view-like arguments (and the expert count) remapped, and a
        fresh fake value."""
        new = self.graph.node_copy(node, lookup)
        if sizes:
            if node.target in _VIEWS or node.target in (_aten.new_zeros.default, _aten.new_empty.default,
                                                        _aten.new_full.default):
                shape = list(new.args[1])
                if shape and shape[0] in sizes:
                    shape[0] = sizes[shape[0]]
                new.args = (new.args[0], shape, *new.args[2:])
            if node.target in _BACKWARD_VIEWS and new.args[1] and new.args[1][0] in sizes:
                new.args = (new.args[0], [sizes[new.args[1][0]], *new.args[1][1:]], *new.args[2:])
            if node.target is torch.ops.fxshard.grouped_mm_wgrad.default:
                new.args = (*new.args[:3], sizes.get(new.args[3], new.args[3]))
        if sizes and new.op == "call_function":  # elsewhere shapes are unchanged
            args, kwargs = fx.node.map_arg((new.args, new.kwargs), lambda n: n.meta["val"])
            with self.fake:
                new.meta["val"] = new.target(*args, **kwargs)
        new.meta.update(extra_meta or {})
        return new

    # ---- one MoE layer's region (one phase) ----------------------------------------------------
    def emit_region(self, layer: _Layer, phase: str):
        key = (id(layer), phase)
        if key in self.emitted_parts:
            return
        self.emitted_parts.add(key)
        nodes = [n for n in layer.region if meta.phase(n) == phase]
        outside = [i for n in nodes for i in n.all_input_nodes if i not in self.region]
        for source in sorted(set(outside), key=self.position.get):
            self.emit(source)
        for source in {i for n in nodes for i in n.all_input_nodes if i in self.region and meta.phase(i) != phase}:
            self.emit_region(self.layer_of[source], meta.phase(source))
        self.plan(layer)  # the sending side; the receiving side follows the dispatches
        entries = self.entries(layer, nodes)
        self.check_same_on_every_rank(layer, nodes, entries)
        for chunk in range(layer.chunks):
            for entry in entries:
                self.send(layer, entry, chunk, phase)
        for chunk in range(layer.chunks):
            for node in nodes:
                def lookup(source, chunk=chunk):
                    if source in self.region:
                        return self.chunk_env[source, chunk]
                    if source is layer.offsets:
                        return self.receiving(layer, "local_offsets")[chunk]
                    if source in entries:
                        return self.receive(layer, source, chunk, phase)
                    if source in self.expert_nodes and layer.chunks > 1:
                        return self.expert_slice(layer, source, chunk, phase)
                    return self.env[source]

                sizes = {layer.rows: self.cfg.ep * layer.buffer}
                if node in self.expert_nodes:
                    sizes[layer.experts] = layer.bounds[chunk + 1] - layer.bounds[chunk]
                copy = self.copy(node, lookup, sizes, self.piece(layer, "experts", chunk))
                if layer.chunks > 1:
                    copy.meta.pop(meta.PARAM, None)  # one chunk's experts; their concatenation is the gradient
                self.chunk_env[node, chunk] = copy
                if self.is_exit(node) and node not in self.expert_nodes:
                    self.send_back(layer, node, chunk, phase)

    def expert_slice(self, layer: _Layer, source: fx.Node, chunk: int, phase: str) -> fx.Node:
        """This chunk's experts of an expert-space value (a view of its rows along dim 0)."""
        key = (source, chunk, "slice")
        if key not in self.chunk_env:
            low, high = layer.bounds[chunk], layer.bounds[chunk + 1]
            (self.chunk_env[key],) = self.inline(layer, lambda w: [w[low:high]], [self.env[source]], phase,
                                                 "experts", chunk)
        return self.chunk_env[key]

    def zero_where_unowned(self, node: fx.Node) -> bool:
        """`node`'s rows past the last expert's (under a capacity, those of dropped assignments: the
        rows `finish_exit` fills with zeros) are zero on one device: expert ops write zeros there, and
        `_zero_rows_stay_zero` follows them through the region. Anything else (a row that came from
        outside, a bias added) is not known to be zero there."""
        if node not in self.zero_rows:
            source = node.args[0] if node.target is operator.getitem else node
            if isinstance(source, fx.Node) and source.target in self.roles:  # an expert op's row result
                self.zero_rows[node] = True
            elif node not in self.region:
                self.zero_rows[node] = False
            else:
                self.zero_rows[node] = _zero_rows_stay_zero(node, self.zero_where_unowned)
        return self.zero_rows[node]

    def is_exit(self, node: fx.Node) -> bool:
        return any(user not in self.region for user in node.users)

    def check_same_on_every_rank(self, layer: _Layer, nodes: list[fx.Node], entries: list[fx.Node]) -> None:
        """A value the region reads that is not a row travels to no one: the expert rank uses its own. So
        it must be the same on every rank: computed from parameters, the step and constants only, never
        from the batch (a statistic of this rank's tokens, such as a scale from their mean)."""
        for node in nodes:
            for source in node.all_input_nodes:
                if (source in self.region or source is layer.offsets or source in entries or source in self.expert_nodes
                        or self.same_on_every_rank(source)):
                    continue
                raise FxShardError(
                    f"{node.name} ({node.target}) in the experts of MoE layer {layer.name} reads {source.name}, a value "
                    f"computed from this rank's batch that is not one per row: under expert parallelism the experts "
                    f"compute on rows from every rank, and would use their own rank's value for all of them. Compute "
                    f"it per token (one row each) or from parameters only, or train without Mesh(ep)")

    def same_on_every_rank(self, node: fx.Node) -> bool:
        """`node` depends only on parameters, optimizer state, lr, step, buffers the step does not update
        and constants (no batch, updated buffer or mesh coordinate): every rank computes the same value."""
        known = self.same
        stack = [node]
        while stack:
            current = stack[-1]
            if current in known:
                stack.pop()
                continue
            if current.op == "placeholder":
                kind, name = self.kinds[current]
                known[current] = kind in (InputKind.PARAM, InputKind.OPT_STATE, InputKind.LR, InputKind.STEP,
                                        InputKind.LOSS_SCALE) or (
                    kind is InputKind.BUFFER and name not in self.updated_buffers)
                stack.pop()
                continue
            pending = [i for i in current.all_input_nodes if i not in known]
            if pending:
                stack.extend(pending)
                continue
            known[current] = all(known[i] for i in current.all_input_nodes)
            stack.pop()
        return known[node]

    def entries(self, layer: _Layer, nodes: list[fx.Node]) -> list[fx.Node]:
        """Row-space values computed outside the region that the region's nodes read as rows."""
        entries = []
        for node in nodes:
            roles = self.roles[node.target][0] if node.target in self.roles else None
            out = first_tensor(_val(node))
            for position, arg in enumerate(node.args):
                for source in (arg if isinstance(arg, (list, tuple)) else [arg]):
                    if not isinstance(source, fx.Node) or source in self.region or source in entries:
                        continue
                    value = first_tensor(_val(source))
                    is_row = (roles[position] == "row" if roles is not None else
                              value is not None and out is not None and value.dim() == out.dim() and
                              value.dim() >= 1 and value.shape[0] == layer.rows)
                    if is_row:
                        entries.append(source)
        return entries

    def piece(self, layer: _Layer, piece: str, chunk: int | None = None) -> dict:
        extra = {meta.MOE_PIECE: piece, meta.UNIT: f"{layer.name}:{piece}"}
        if chunk is not None:
            extra[meta.MOE_CHUNK] = chunk
            if layer.chunks > 1:
                extra[meta.UNIT] += f"[{chunk}]"
        return extra

    def inline(self, layer: _Layer, fn, inputs, phase: str, piece: str, chunk: int | None = None):
        return inline(self.graph, fn, inputs, fake_mode=self.fake, phase=phase, layer=meta.layer(layer.offsets),
                      extra_meta={**self.piece(layer, piece, chunk), meta.MICROBATCH: meta.microbatch(layer.offsets)})

    def plan(self, layer: _Layer) -> dict:
        """The layer's routing plan, built once from its offsets (see the module docstring)."""
        if id(layer) in self.plans:
            return self.plans[id(layer)]
        k, chunks, local, buffer, rows, experts = (self.cfg.ep, layer.chunks, layer.local, layer.buffer,
                                                   layer.rows, layer.experts)
        axis = self.cfg.axis

        def route(offsets):
            ends = offsets.long()
            row = torch.arange(rows, device=offsets.device)
            expert = expert_of_rows(offsets, rows)                           # experts: routed nowhere
            valid = expert < experts
            chunk = torch.where(valid, expert % local * chunks // local, 0)  # the group of the row's expert
            dest = expert // local                                           # k for rows routed nowhere
            group = torch.where(valid, dest * chunks + chunk, k * chunks)    # one group per (dest, chunk)
            position = moe.rank_within(group, k * chunks + 1)
            slot = torch.where(valid, (chunk * k + dest) * buffer + position, chunks * k * buffer)
            # counts[dest, local expert]: what each destination receives, exchanged up front
            per_expert = torch.zeros(k * local + 1, dtype=torch.long, device=offsets.device).scatter_add(
                0, torch.where(valid, expert, k * local), torch.ones_like(row))[:-1]
            counts = _c10d.all_to_all_single(per_expert, [local] * k, [local] * k, axis)  # waited on later
            sources = []
            for c in range(chunks):
                # rows this chunk sends: slot -> source row (rows never filled point at row 0: unread)
                source = torch.zeros(k * buffer + 1, dtype=torch.long, device=offsets.device).scatter(
                    0, torch.where(chunk == c, slot - c * k * buffer, k * buffer).clamp(max=k * buffer), row)
                sources.append(source[:-1])
            tokens_per_expert = ends - torch.cat([ends.new_zeros(1), ends[:-1]])
            dropped = rows - ends[-1]
            return [slot, *sources, counts, tokens_per_expert, dropped]

        phase = meta.phase(layer.offsets)
        out = self.inline(layer, route, [self.env[layer.offsets]], phase, meta.MOE_ROUTE)
        n = chunks
        out[1 + n].meta[meta.COMM_BYTES] = k * local * 8
        plan = {"slot": out[0], "sources": out[1:1 + n], "counts": out[1 + n], "tokens_per_expert": out[2 + n],
                "dropped": out[3 + n]}
        self.plans[id(layer)] = plan
        return plan

    def receiving(self, layer: _Layer, part: str) -> list[fx.Node]:
        """The receiving side of the layer's plan (local_order, inverse or local_offsets), built where
        first needed: after the layer's dispatches are issued, so waiting for the counts delays nothing."""
        plan = self.plans[id(layer)]
        if part not in plan:
            n = layer.chunks
            arranged = self.inline(layer, self.arrange(layer), [plan["counts"], self.env[layer.offsets]],
                                   meta.phase(layer.offsets), meta.MOE_ROUTE)
            plan.update(local_order=arranged[:n], inverse=arranged[n:2 * n], local_offsets=arranged[2 * n:])
        return plan[part]

    def arrange(self, layer: _Layer):
        """The function (counts, offsets) -> receiving side that `receiving` inlines."""
        k, chunks, local, buffer, bounds = self.cfg.ep, layer.chunks, layer.local, layer.buffer, layer.bounds

        def arrange(counts, offsets):
            """The receiving side, from the counts every source sent: per chunk, the order that sorts
            the received rows by local expert, its inverse, and the local offsets."""
            received = _c10d.wait_tensor(counts).view(k, local)
            local_order, inverse, local_offsets = [], [], []
            for c in range(chunks):
                counts_c = received[:, bounds[c]:bounds[c + 1]]              # [source rank, chunk's expert]
                order_c, inverse_c = receive_order(counts_c, buffer)
                local_order.append(order_c)
                inverse.append(inverse_c)
                local_offsets.append(counts_c.sum(0).cumsum(0).to(offsets.dtype))
            return [*local_order, *inverse, *local_offsets]

        return arrange

    def send(self, layer: _Layer, entry: fx.Node, chunk: int, phase: str):
        if (entry, chunk) in self.sent:
            return
        k, buffer, axis = self.cfg.ep, layer.buffer, self.cfg.axis

        def dispatch(values, sources):
            packed = values.index_select(0, sources)
            return [_c10d.all_to_all_single(packed, [buffer] * k, [buffer] * k, axis)]

        (issued,) = self.inline(layer, dispatch, [self.env[entry], self.plans[id(layer)]["sources"][chunk]], phase,
                                "dispatch", chunk)
        value = issued.meta["val"]
        issued.meta[meta.COMM_BYTES] = value.numel() * value.element_size()
        self.sent[entry, chunk] = issued

    def receive(self, layer: _Layer, entry: fx.Node, chunk: int, phase: str) -> fx.Node:
        if (entry, chunk) not in self.received:
            order = self.receiving(layer, "local_order")[chunk]
            (rows,) = self.inline(layer, lambda sent, order: [_c10d.wait_tensor(sent).index_select(0, order)],
                                  [self.sent[entry, chunk], order], phase,
                                  "dispatch", chunk)
            self.received[entry, chunk] = rows
        return self.received[entry, chunk]

    def send_back(self, layer: _Layer, node: fx.Node, chunk: int, phase: str):
        k, buffer, axis = self.cfg.ep, layer.buffer, self.cfg.axis

        def combine(values, inverse):
            return [_c10d.all_to_all_single(values.index_select(0, inverse), [buffer] * k, [buffer] * k, axis)]

        (issued,) = self.inline(layer, combine, [self.chunk_env[node, chunk], self.receiving(layer, "inverse")[chunk]],
                                phase, "combine", chunk)
        value = issued.meta["val"]
        issued.meta[meta.COMM_BYTES] = value.numel() * value.element_size()
        self.returned[node, chunk] = issued

    def finish_exit(self, node: fx.Node) -> fx.Node:
        """The full-size value of a region node, for a reader outside the region."""
        layer = self.layer_of[node]
        chunks = layer.chunks
        phase = meta.phase(node)
        if node in self.expert_nodes:  # weight gradients: each chunk's experts, in order
            parts = [self.chunk_env[node, c] for c in range(chunks)]
            if chunks == 1:
                return parts[0]
            (total,) = self.inline(layer, lambda *p: [torch.cat(p)], parts, phase, "experts")
            if meta.param(node):
                total.meta[meta.PARAM] = meta.param(node)
            return total

        def unpack(slot, *returned):
            values = [_c10d.wait_tensor(r) for r in returned]
            padded = torch.cat([*values, values[0].new_zeros(1, *values[0].shape[1:])])
            return [padded.index_select(0, slot)]

        if (layer.capacity is not None or layer.unowned_rows) and not self.zero_where_unowned(node):
            which = ("With a capacity, the rows no expert owns (dropped assignments)" if layer.capacity is not None
                     else "Its expert ids are not known to lie below the expert count (a sentinel id for a dropped "
                          "token sorts past the last expert's rows), so rows no expert owns")
            raise FxShardError(
                f"{node.name} ({node.target}) is computed inside the experts of MoE layer {layer.name} and read "
                f"outside them. {which} hold there what that "
                f"computation makes of a zero row; expert parallelism returns zeros for them, and only the expert "
                f"ops' own results are zero there. Read only the experts' outputs outside them, route without a "
                f"capacity (dropless), or train without Mesh(ep)")
        if (node, 0) not in self.returned:
            raise FxShardError(
                f"{node.name} ({node.target}), a result of the experts of MoE layer {layer.name}, is read back inside "
                f"those experts through an op that expert parallelism does not know to act on each row alone; it "
                f"cannot split that layer. Write the step between the expert GEMMs with row-wise ops (elementwise, "
                f"views, slices along other dims), or train without Mesh(ep)")
        (full,) = self.inline(layer, unpack, [self.plans[id(layer)]["slot"],
                                              *[self.returned[node, c] for c in range(chunks)]], phase, "combine")
        return full

    # ---- the optimizer phase and the signature -------------------------------------------------
    def finish(self) -> Program:
        old_output = next(n for n in self.old.nodes if n.op == "output")
        old_values = list(old_output.args[0])
        grads = {meta.param(n): n for n in self.old.nodes if meta.phase(n) == meta.BWD and meta.param(n)}
        placeholders = {spec.name: node for spec, node in zip(self.program.inputs, self.program.placeholders())
                        if spec.kind in (InputKind.PARAM, InputKind.OPT_STATE)}
        updates = self.program.updates  # the same tensors: experts become this rank's shard of them
        params = [self.env[placeholders[u.name]] for u in updates]
        grad_nodes = [self.lookup(grads[u.name]) for u in updates]
        states = {(s.owner, s.slot): self.env[placeholders[s.name]]
                  for s in self.program.inputs if s.kind is InputKind.OPT_STATE}
        lr, step = (self.env[self.program.placeholder_of(kind)] for kind in (InputKind.LR, InputKind.STEP))
        scale = self.program.placeholder_of(InputKind.LOSS_SCALE)
        scale = self.env[scale] if scale is not None else None
        grad_norm, new_params, new_states, nonfinite, next_scale = append_update(
            self.graph, self.program.train, self.fake, updates, params, grad_nodes, states, lr, step, loss_scale=scale)
        outputs, values = [], []
        for spec, value in zip(self.program.outputs, old_values):
            if spec.kind is OutputKind.LOSS or spec.kind is OutputKind.METRIC or spec.kind is OutputKind.BUFFER:
                outputs.append(spec)
                values.append(self.lookup(value))
            elif spec.kind is OutputKind.GRAD_NORM:
                outputs.append(spec)
                values.append(grad_norm)
            elif spec.kind is OutputKind.NONFINITE:
                outputs.append(spec)
                values.append(nonfinite)
            elif spec.kind is OutputKind.LOSS_SCALE:
                outputs.append(spec)
                values.append(next_scale)
            elif spec.kind is OutputKind.PARAM:
                if spec.name in self.expert_params:
                    spec = replace(spec, placement=EXPERT_SHARDED)
                outputs.append(spec)
                values.append(new_params[spec.name])
            elif spec.kind is OutputKind.OPT_STATE:
                if spec.owner in self.expert_params:
                    spec = replace(spec, placement=EXPERT_SHARDED)
                outputs.append(spec)
                values.append(new_states[spec.owner, spec.slot])
        outputs_by_layer: dict[str, list] = {}
        for layer in self.layers.values():
            if not layer.region or id(layer) not in self.plans:
                continue
            name = meta.layer(layer.offsets) or "moe"
            plan = self.plans[id(layer)]
            outputs_by_layer.setdefault(name, []).append((plan["tokens_per_expert"], plan["dropped"]))
        for name, parts in outputs_by_layer.items():
            for index, metric in ((0, "tokens_per_expert"), (1, "dropped")):
                total = parts[0][index]
                for part in parts[1:]:
                    total = self.graph.call_function(_aten.add.Tensor, (total, part[index]))
                    total.meta.update({"val": parts[0][index].meta["val"], meta.PHASE: meta.FWD,
                                       meta.LAYER: name})  # forward values: passes after this copy them
                outputs.append(Output.moe_routing(name, metric))
                values.append(total)
        self.graph.output(tuple(values))
        self.graph.lint()
        gm = lazy_module(self.program.graph_module, self.graph)
        notes = dict(self.program.notes, ep=self.describe())
        return self.program.replace(graph_module=gm, inputs=tuple(self.inputs), outputs=tuple(outputs), notes=notes)

    def describe(self) -> str:
        """Per MoE layer, for the dump: experts, capacity, buffer rows and the bytes each all-to-all moves."""
        k, chunks = self.cfg.ep, self.cfg.chunks
        lines = [f"ep={k}, up to {chunks} chunk(s) per layer{' (ep_overlap)' if chunks > 1 else ''}"]
        for layer in self.layers.values():
            sizes = {}
            for node in self.graph.nodes:
                if node.meta.get(meta.UNIT, "").startswith(layer.name + ":") and meta.COMM_BYTES in node.meta:
                    piece = f"{meta.phase(node)} {node.meta[meta.MOE_PIECE]}"
                    sizes[piece] = sizes.get(piece, 0) + node.meta[meta.COMM_BYTES]
            traffic = ", ".join(f"{piece} {size / 2**20:.2f} MiB" for piece, size in sizes.items())
            capacity = "dropless" if layer.capacity is None else f"capacity {layer.capacity}/expert"
            padding = layer.buffer * layer.chunks * k / layer.rows  # buffer rows per balanced load
            if layer.capacity is None and padding > 2:
                capacity += (f" (buffers hold {padding:.0f}x the balanced load, all of it sent: "
                             f"Config(moe_capacity_factor=...) bounds those of fxshard.moe.dispatch calls)")
            lines.append(f"  {layer.name}: {layer.experts} experts ({layer.local}/rank), top-{layer.top_k}, "
                         f"{layer.tokens} tokens -> {layer.rows} rows, {capacity}, buffer {layer.buffer} rows x {k} "
                         f"ranks x {layer.chunks} chunk(s); all-to-all per rank: {traffic}")
        return "\n".join(lines)
