"""Recognize MoE layers written elsewhere (transformers, torchtitan) by what they compute.

`fxshard.moe.dispatch` writes its static facts (experts, top-k, tokens, capacity) into the metadata
of the offsets it computes, and the expert-parallel pass reads them there. A MoE layer written with
plain torch ops has expert GEMMs (`fxshard::grouped_mm`: tracing routes `torch._grouped_mm`,
`F.grouped_mm` and transformers' fallback op to it, fxshard/ops/grouped_mm.py) whose offsets carry
no facts. This pass finds them by matching the dataflow that makes such a layer correct:

    ids      = each token's k expert ids [..., k] (an integer tensor), flattened      [T*k]: the
               indices of a `topk` over [T, E] router scores (k distinct per token), or ids chosen
               another way (PhiMoE samples them), where a token may name an expert twice
    perm     = sort(ids).indices  (or argsort(ids), stable or not)             [T*k]
    offsets  = cumsum(count of each expert in ids or in sort(ids).values)      [E]  (histc,
               scatter_add of ones, or the sum over tokens of a one-hot routing map
               zeros[..., E].scatter(-1, ids, True), torchtitan's; an int cast anywhere on the way)
    rows     = tokens[perm // k] (index, index_select or gather), or tokens[perm], then any row-wise
               ops with other rows in the same order, e.g. a multiplication by scores[perm]
               (torchtitan's score_before_experts), a mask computed from sort(ids).values, or a
               per-expert table read at each row's expert, table[sort(ids).values] (GPT-OSS's biases)
    experts  = fxshard::grouped_mm(rows, offsets, weight[E, ...]) ... row-wise ops ... grouped_mm

so every row the expert ops read belongs to the expert that `offsets` assigns it to: row i is
assignment perm[i], whose expert is the i-th smallest id, and the counts of ids are the group sizes.
That is the layout `fxshard.moe.dispatch` produces with no capacity, so the pass writes the same
facts (`capacity` None: dropless; `style` "sorted") into the offsets' metadata. The weighted combine
(un-permute and sum over k, transformers; scatter_add into the tokens, torchtitan) is left as the
model wrote it: the expert-parallel pass returns the expert outputs in the original row order, so
any combine still reads the rows it expects.

`distinct` is written True only for a top-k's indices over exactly the experts; for other ids the
expert-parallel pass sizes its all-to-all buffers for a token that reaches one expert up to k times.
`unowned_rows` is written True unless every id is known to lie below the expert count (indices of a
topk, max or argmax over the experts, or a cat of such): a sentinel id that histc does not count sorts
its rows past the last expert's, where no expert owns them, and the expert-parallel pass then refuses
values computed there and read outside the experts, as it does under a capacity.

Rejected (the facts are not written, and the expert-parallel pass's error says which check failed):
offsets whose counts come from another key than the one the rows are sorted by, counts that are not
accumulated into cumulative ends, counts from a one-hot routing map over ids that may repeat an
expert (the map counts a repeated expert once), ids that are not an integer tensor with each
token's k ids in its last dim, a cast that may change ids or counts (to bool, int8/16, half) on the
way, rows the sort did not order, or a row count other than T*k.

Invariant: the program is unchanged but for metadata (the same nodes compute the same values);
`notes["moe_recognized"]` lists each recognized layer and `notes["moe_unrecognized"]` the reasons.
"""

from __future__ import annotations

import operator
import warnings

import torch
import torch.fx as fx

from fxshard import meta, moe
from fxshard.graph import Graph, call_argument, lazy_module
from fxshard.program import Program

from .ep import first_tensor, keeps_dim0

_aten = torch.ops.aten
# forward expert ops (rows, offsets, weight [E, ...], ...), found before or after fuse_grouped_mlp
EXPERT_OPS = {torch.ops.fxshard.grouped_mm.default, torch.ops.fxshard.grouped_mlp_fwd.default}

_INT_PASSTHROUGH = {_aten._to_copy.default, _aten.clone.default, _aten.alias.default, _aten.detach.default,
                    _aten.lift_fresh_copy.default}
# casts that keep every expert id's and count's value (a cast to bool, int8/16 or half may not)
_EXACT_DTYPES = (torch.int32, torch.int64, torch.float32, torch.float64)
_RESHAPES = {_aten.view.default, _aten._unsafe_view.default, _aten.reshape.default}


class _NoMatch(Exception):
    pass


def recognize_moe(program: Program, capacity_factor: float | None = None) -> Program:
    """`program` with the facts of every recognized MoE layer written on its offsets (module docstring).
    A recognized layer stays dropless: `capacity_factor` (Config(moe_capacity_factor)), which bounds
    fxshard.moe.dispatch calls, does not apply to it, and a warning says so."""
    pending = _unannotated_offsets(program.graph)
    if not pending:  # every layer routed by fxshard.moe: the graph as it is
        return program.replace(notes={**program.notes, "moe_recognized": []})
    graph = Graph()
    env: dict[fx.Node, fx.Node] = {}
    graph.output(graph.graph_copy(program.graph, env))
    recognized, rejected = [], []
    for offsets in (env[node] for node in pending):
        try:
            facts = _match(offsets)
        except _NoMatch as reason:
            offsets.meta[meta.MOE_REJECTED] = str(reason)
            rejected.append(f"{meta.layer(offsets) or offsets.name}: {reason}")
            continue
        offsets.meta.pop(meta.MOE_REJECTED, None)
        offsets.meta["custom"] = {**(offsets.meta.get("custom") or {}), moe.ANNOTATION: facts}
        recognized.append(f"{meta.layer(offsets) or offsets.name} (microbatch {meta.microbatch(offsets)}): "
                          f"{facts['experts']} experts, top-{facts['top_k']}, {facts['tokens']} tokens, dropless"
                          f"{'' if facts['distinct'] else ', ids not a top-k (a token may name an expert twice)'}")
    notes = {**program.notes, "moe_recognized": recognized}
    if recognized and capacity_factor is not None:
        warnings.warn(f"Config(moe_capacity_factor={capacity_factor}) bounds fxshard.moe.dispatch calls only; the "
                      f"{len(recognized)} MoE layer calls recognized in the model's own code stay dropless (all-to-all "
                      f"buffers sized for the worst case)", stacklevel=2)
    if rejected:
        notes["moe_unrecognized"] = rejected
    return program.replace(graph_module=lazy_module(program.graph_module, graph), notes=notes)


def _unannotated_offsets(graph: fx.Graph) -> list[fx.Node]:
    found = []
    for node in graph.nodes:
        if node.op == "call_function" and node.target in EXPERT_OPS and meta.phase(node) == meta.FWD:
            offsets = node.args[1]
            if moe.ANNOTATION not in (offsets.meta.get("custom") or {}) and offsets not in found:
                found.append(offsets)
    return found


def _match(offsets: fx.Node) -> dict:
    experts_ops = [u for u in offsets.users if u.target in EXPERT_OPS and meta.phase(u) == meta.FWD]
    experts = {_val(op.args[2]).shape[0] for op in experts_ops}
    rows = {_val(op.args[0]).shape[0] for op in experts_ops}
    if len(experts) != 1 or len(rows) != 1:
        raise _NoMatch("its expert ops disagree on the number of experts or rows")
    (n_experts,), (n_rows,) = experts, rows
    key, bins, one_hot = _counted_key(offsets)
    if bins != n_experts:
        raise _NoMatch(f"the offsets count {bins} bins but the expert weights hold {n_experts} experts")
    ids = _ids_of(key)
    if ids is None:
        raise _NoMatch("the offsets count a key that is neither each token's expert ids (an integer tensor "
                       "[..., k], e.g. a top-k's indices) flattened nor their sorted values")
    distinct = _is_topk_indices(ids, n_experts)
    if one_hot and not distinct:
        raise _NoMatch("the offsets sum a one-hot routing map of expert ids that are not a top-k's indices: a "
                       "token naming an expert twice would be counted once")
    top_k = _val(ids).shape[-1]
    tokens = _val(ids).numel() // top_k
    if tokens * top_k != n_rows:
        raise _NoMatch(f"the expert ops read {n_rows} rows, not tokens x top-k = {tokens} x {top_k}")
    perms = _sort_permutations(ids)
    if not perms:
        raise _NoMatch("no sort of the flattened expert ids the offsets count orders the rows")
    in_order = _RowOrder(ids, perms, offsets, n_rows)
    for op in experts_ops:
        if not in_order(op.args[0]):
            raise _NoMatch(f"the rows {op.name} reads are not the tokens in the order of the sort of the "
                           f"expert ids (or row-wise ops of them)")
    return {"experts": n_experts, "top_k": top_k, "tokens": tokens, "capacity": None, "slots": False,
            "distinct": distinct, "style": "sorted", "unowned_rows": not _below(ids, n_experts)}


def _val(node):
    return node.meta.get("val") if isinstance(node, fx.Node) else node


def _through(node, targets):
    """Back from `node` through ops in `targets`; a cast only where it keeps the values (_EXACT_DTYPES)."""
    while isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets:
        if node.target is _aten._to_copy.default and _val(node).dtype not in _EXACT_DTYPES:
            break
        node = node.args[0]
    return node


def _counted_key(offsets: fx.Node) -> tuple[fx.Node, int, bool]:
    """offsets = cumsum(counts of key over `bins` experts): (key, bins, counted by a one-hot map)."""
    cumsum = _through(offsets, _INT_PASSTHROUGH)
    if not (isinstance(cumsum, fx.Node) and cumsum.target is _aten.cumsum.default and _val(cumsum).dim() == 1):
        raise _NoMatch("the offsets are not a cumulative sum (expected cumsum of per-expert counts)")
    counts = _through(cumsum.args[0], _INT_PASSTHROUGH)
    bins = _val(counts).shape[0]
    if counts.target is _aten.histc.default:
        low, high = call_argument(counts, "min"), call_argument(counts, "max")
        if low != 0 or high not in (bins - 1, bins):  # one bin per expert id
            raise _NoMatch(f"histc(bins={bins}, min={low}, max={high}) does not count one expert id per bin")
        return _through(counts.args[0], _INT_PASSTHROUGH), bins, False
    if counts.target is _aten.scatter_add.default and counts.args[1] == 0 and _is_ones(counts.args[3]):
        return counts.args[2], bins, False
    if counts.target is _aten.sum.dim_IntList:
        return _one_hot_key(counts), bins, True
    raise _NoMatch(f"the offsets accumulate {counts.target}, not a per-expert count (histc, "
                   f"scatter_add of ones, or the sum of a one-hot routing map)")


def _one_hot_key(counts: fx.Node) -> fx.Node:
    """counts = sum over every dim but the last of zeros[..., E].scatter(-1, key, True): a routing map
    with a one where a token chose an expert (torchtitan's MoE). Only with the key a top-k's indices
    (distinct per token, checked by the caller) is each one an assignment, so that the sum counts each
    expert's rows."""
    routing_map = _through(counts.args[0], _INT_PASSTHROUGH)
    if not (isinstance(routing_map, fx.Node) and routing_map.target is _aten.scatter.value):
        raise _NoMatch("the offsets sum something other than a routing map scattered from the expert ids")
    base, dim, key, value = routing_map.args[:4]
    shape = _val(routing_map).shape
    summed = sorted(d % len(shape) for d in counts.args[1])
    if summed != list(range(len(shape) - 1)) or call_argument(counts, "keepdim"):
        raise _NoMatch(f"the offsets sum a routing map of shape {tuple(shape)} over dims {counts.args[1]}, not over "
                       f"every dim but the experts'")
    if dim % len(shape) != len(shape) - 1 or value not in (1, True) or not _is_zeros(base) or \
            _val(key).shape[:-1] != shape[:-1]:
        raise _NoMatch("the routing map the offsets sum is not ones scattered into zeros at the expert ids")
    return key


def _is_zeros(node) -> bool:
    node = _through(node, _INT_PASSTHROUGH)
    return isinstance(node, fx.Node) and (node.target in (_aten.zeros_like.default, _aten.zeros.default,
                                                          _aten.new_zeros.default)
                                          or node.target is _aten.full.default and node.args[1] in (0, False))


def _is_ones(node) -> bool:
    node = _through(node, _INT_PASSTHROUGH)
    return node.target in (_aten.ones_like.default, _aten.ones.default) or \
        node.target is _aten.full.default and node.args[1] == 1


def _ids_source(node: fx.Node) -> fx.Node | None:
    """What `node` views (views and int casts only) when that is expert ids [..., k]: an integer
    tensor of two or more dims, each token's k ids in the last; else None."""
    ids = _through(node, _INT_PASSTHROUGH | _RESHAPES | {_aten.flatten.using_ints})
    value = _val(ids)
    if not isinstance(value, torch.Tensor) or value.dim() < 2 or value.dtype.is_floating_point or \
            value.dtype.is_complex or value.dtype == torch.bool:
        return None
    return ids


def _flat_ids_of(node: fx.Node) -> fx.Node | None:
    """The expert ids [..., k] that `node` flattens to 1-D, or None."""
    value = _val(node)
    return _ids_source(node) if isinstance(value, torch.Tensor) and value.dim() == 1 else None


def _is_topk_indices(ids: fx.Node, experts: int) -> bool:
    """`ids` are the indices of a topk over the last dim, of the experts' size: k distinct expert ids
    per token, each below `experts`."""
    return (ids.target is operator.getitem and ids.args[1] == 1 and ids.args[0].target is _aten.topk.default
            and _over_the_experts(ids.args[0], experts))


def _over_the_experts(reduction: fx.Node, experts: int) -> bool:
    """`reduction` (a topk, max or argmax) runs over the last dim of its input, which has `experts` entries."""
    scores, dim = _val(reduction.args[0]), call_argument(reduction, "dim")
    return dim is not None and dim % scores.dim() == scores.dim() - 1 and scores.shape[-1] == experts


def _below(ids: fx.Node, experts: int) -> bool:
    """Every id in `ids` is known to lie in [0, experts): the indices of a topk, max or argmax over a
    last dim of `experts` entries, or a cat of such. Otherwise some rows may sort past the last
    expert's (a sentinel id for a dropped token, which histc does not count) and belong to no expert."""
    ids = _through(ids, _INT_PASSTHROUGH | _RESHAPES | {_aten.flatten.using_ints, _aten.unsqueeze.default})
    if not isinstance(ids, fx.Node) or ids.op != "call_function":
        return False
    if ids.target is _aten.cat.default:
        return all(_below(part, experts) for part in ids.args[0])
    reduced = ids.args[0] if ids.target is operator.getitem and ids.args[1] == 1 else ids
    if not isinstance(reduced, fx.Node) or reduced.target not in (_aten.topk.default, _aten.max.dim,
                                                                   _aten.argmax.default):
        return False
    if reduced is ids and reduced.target is not _aten.argmax.default:
        return False  # a topk's or max's values
    return _over_the_experts(reduced, experts)


def _ids_of(key: fx.Node) -> fx.Node | None:
    """The expert ids whose flattening `key` is, directly or as the values of their ascending sort; or,
    for a one-hot routing map's key (not flattened: each token's ids in its last dim), those ids."""
    value = _val(key)
    if isinstance(value, torch.Tensor) and value.dim() >= 2:
        ids = _ids_source(key)
        return ids if ids is not None and _val(ids).shape[-1] == value.shape[-1] else None
    direct = _flat_ids_of(key)
    if direct is not None:
        return direct
    if key.target is operator.getitem and key.args[1] == 0 and _is_ascending_sort(key.args[0]):
        return _flat_ids_of(key.args[0].args[0])
    return None


def _is_ascending_sort(node) -> bool:
    if not (isinstance(node, fx.Node) and node.target in (_aten.sort.default, _aten.sort.stable)):
        return False
    return not call_argument(node, "descending") and _val(node.args[0]).dim() == 1


def _sort_permutations(ids: fx.Node) -> set[fx.Node]:
    """The `indices` outputs of every ascending sort of the flattened expert ids."""
    found = set()
    for node in ids.graph.nodes:
        if _is_ascending_sort(node) and _flat_ids_of(node.args[0]) is ids:
            found |= {u for u in node.users if u.target is operator.getitem and u.args[1] == 1}
    return found


class _RowOrder:
    """Is a row-space tensor (dim 0 = the R assignments) in the order of one of the sorts?"""

    def __init__(self, ids: fx.Node, perms: set[fx.Node], offsets: fx.Node, rows: int):
        self.ids, self.perms, self.offsets, self.rows = ids, perms, offsets, rows
        self.top_k = _val(ids).shape[-1]
        self.memo: dict[fx.Node, bool] = {}

    def __call__(self, node) -> bool:
        if not isinstance(node, fx.Node):
            return False
        if node not in self.memo:
            self.memo[node] = self.decide(node)
        return self.memo[node]

    def is_perm_index(self, index) -> bool:
        """perm, perm // k, or either reshaped to a column and expanded (torch.gather's index)."""
        index = _through(index, {_aten.expand.default, *_RESHAPES, *_INT_PASSTHROUGH})
        if index in self.perms:
            return True
        if isinstance(index, fx.Node) and index.args and index.args[0] in self.perms:
            if index.target is _aten.floor_divide.default and index.args[1] == self.top_k:
                return True
            if index.target is _aten.div.Tensor_mode and index.args[1] == self.top_k and \
                    index.kwargs.get("rounding_mode") == "floor":
                return True
        return False

    def is_sorted_ids(self, node) -> bool:
        """sort(ids).values: row i's expert."""
        return isinstance(node, fx.Node) and node.target is operator.getitem and node.args[1] == 0 and \
            _is_ascending_sort(node.args[0]) and _flat_ids_of(node.args[0].args[0]) is self.ids

    def decide(self, node: fx.Node) -> bool:
        if node.op != "call_function":
            return False
        target = node.target
        if target in EXPERT_OPS and node.args[1] is self.offsets:
            return True
        if self.is_sorted_ids(node):
            return True  # the sorted ids (the same for every ascending sort): sort(ids).values[i] = ids[perm[i]]
        if target is _aten.index.Tensor:
            indices = node.args[1]
            if len(indices) == 1 and self.is_sorted_ids(indices[0]) and \
                    _val(node.args[0]).shape[0] == _val(self.offsets).shape[0]:
                return True  # a per-expert table (GPT-OSS's expert biases) read at each row's expert
            return len(indices) == 1 and self.is_perm_index(indices[0])
        if target is _aten.index_select.default:
            return node.args[1] % _val(node.args[0]).dim() == 0 and self.is_perm_index(node.args[2])
        if target is _aten.gather.default:
            return node.args[1] % _val(node.args[0]).dim() == 0 and self.is_perm_index(node.args[2])
        if not self.is_rows(node) or not keeps_dim0(node):  # the row-wise rule the EP pass moves ops by
            return False
        row_inputs = [i for i in node.all_input_nodes if self.is_rows(i)]
        return bool(row_inputs) and all(self(i) for i in row_inputs)

    def is_rows(self, node: fx.Node) -> bool:
        """Has dim 0 of R rows (a tuple-valued node such as a split: its first tensor does)."""
        value = first_tensor(_val(node))
        return value is not None and value.dim() >= 1 and value.shape[0] == self.rows
