"""Ranks agree on their communication before the first step, or fail loudly naming where they differ.

A compiled step knows every collective and transfer it will issue. Ranks whose programs differ (a
rank with another batch shape, model, config or torch version) would hang in a collective or
exchange mismatched buffers; instead, `check_agreement` compares, right after compiling:

    per mesh axis      the sequence of collectives each rank issues on its group along it: kind,
                       reduction, shape and dtype, in program order (all members must be equal)
    per pair of stages the sequence of sends and receives between them (one rank's sends are the
                       other's receives, in the same order)

and then, over the whole job, what the collectives do not show (`check_same_start`): every rank traced
the same step (its nodes: another activation, epsilon or loss scale issues the same collectives), starts
from the same weights (a checksum of each parameter's and buffer's bits), the same optimizer, Config
and example batch structure, shapes and dtypes. Ranks whose models were seeded differently run the
same collectives and would train a mixture of their models (ZeRO) or drift apart (replicated).

Each rank hashes its sequences and the ranks all-gather the hashes: one small collective per group.
Only when hashes differ are the sequences themselves exchanged, so that every rank raises the same
`FxShardError` naming the first collective that differs, with its phase, layer and unit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
from dataclasses import dataclass

import torch
import torch.fx as fx

from .. import meta
from ..program import InputKind
from ..errors import FxShardError
from ..ops.gloo import GLOO_ALL_GATHERS
from ..ops.p2p import P2P_OPS

_c10d = torch.ops._c10d_functional
_SEND = torch.ops.fxshard.send.default


@dataclass(frozen=True)
class Entry:
    key: str    # what must match across ranks
    where: str  # phase, layer, unit: for the message

    def __str__(self) -> str:
        return f"{self.key} [{self.where}]"


def _where(node: fx.Node) -> str:
    parts = [meta.phase(node) or "?", meta.layer(node) or "?"]
    if meta.UNIT in node.meta:
        parts.append(f"unit {node.meta[meta.UNIT]}")
    if meta.MICROBATCH in node.meta:
        parts.append(f"microbatch {meta.microbatch(node)}")
    return ", ".join(parts)


def _value(node: fx.Node) -> str:
    value = node.meta.get("val")
    return f"{tuple(value.shape)}, {str(value.dtype).replace('torch.', '')}" if value is not None else "?"


def describe(node: fx.Node, group: str | None = None) -> str:
    """A collective or transfer issue node as an error message names it: what, how big, where."""
    if node.target in P2P_OPS:
        message = node.args[0] if node.target is _SEND else node
        what = f"{'send to' if node.target is _SEND else 'receive from'} stage {node.args[-2]} of {_value(message)}"
    else:  # an all-gather the gloo lowering reissued (runtime/gloo.py, reinplace.py) is named as the program names it
        name = "all_gather_into_tensor" if node.target in GLOO_ALL_GATHERS else node.target._opname
        what = f"{name} of {_value(node.args[0])}"
    return f"{what} [{_where(node)}] on group {group or node.args[-1]!r}"


def collective_sequences(graph: fx.Graph) -> dict[str, list[Entry]]:
    """Mesh axis -> the collectives the graph issues on it, in order."""
    sequences: dict[str, list[Entry]] = {}
    for node in graph.nodes:
        if node.op != "call_function" or node.target not in meta.COLLECTIVE_ISSUES:
            continue
        group = node.args[-1]
        reduce = next((a for a in node.args[1:-1] if isinstance(a, str)), None)
        source = node.args[0]
        name = node.target._opname + (f"({reduce})" if reduce else "")
        sequences.setdefault(str(group), []).append(Entry(f"{name} of {_value(source)}", _where(node)))
    return sequences


def transfer_sequences(graph: fx.Graph, me: int) -> dict[int, list[Entry]]:
    """Peer (index in the pipeline group) -> the transfers with it, each written the same way on both
    sides ("2 -> 3: (4, 16), float32"), in order."""
    sequences: dict[int, list[Entry]] = {}
    for node in graph.nodes:
        if node.op != "call_function" or node.target not in P2P_OPS:
            continue
        peer = node.args[-2]
        sender, receiver = (me, peer) if node.target is _SEND else (peer, me)
        message = node.args[0] if node.target is _SEND else node  # a send's own value is its token
        sequences.setdefault(peer, []).append(Entry(f"{sender} -> {receiver}: {_value(message)}", _where(node)))
    return sequences


def first_difference(sequences: list[list[Entry]]) -> tuple[int, list[Entry | None]] | None:
    """The first position at which the members' sequences differ, and each member's entry there
    (None: it has no more), or None when they all agree."""
    for index in range(max(len(s) for s in sequences)):
        entries = [s[index] if index < len(s) else None for s in sequences]
        if len({e.key if e else None for e in entries}) > 1:
            return index, entries
    return None


def _digest(entries: list[Entry]) -> list[int]:
    text = "\n".join(e.key for e in entries).encode()
    digest = hashlib.sha256(text).digest()
    return [int.from_bytes(digest[i:i + 8], "little", signed=True) for i in range(0, 16, 8)]


def _all_gather_lists(values: list[int], group, device) -> list[list[int]]:
    import torch.distributed as dist

    tensor = torch.tensor(values, dtype=torch.int64, device=device)
    out = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, tensor, group=group)
    return [t.tolist() for t in out]


def _all_gather_text(text: str, group, device) -> list[str]:
    data = list(text.encode())
    lengths = _all_gather_lists([len(data)], group, device)
    longest = max(length for (length,) in lengths)
    if longest == 0:
        return [""] * len(lengths)
    padded = _all_gather_lists(data + [0] * (longest - len(data)), group, device)
    return [bytes(row[:length]).decode() for row, (length,) in zip(padded, lengths)]


def _decode(text: str) -> list[Entry]:
    return [Entry(*line.split("\t")) for line in text.split("\n") if line]


def _encode(entries: list[Entry]) -> str:
    return "\n".join(f"{e.key}\t{e.where}" for e in entries)


_HINT = ("every rank must call shard with the same model, loss, optimizer, Config and batch shapes "
         "(and the same fxshard and torch versions)")


def check_agreement(graph: fx.Graph, groups: dict, device: torch.device, stage: int | None = None) -> None:
    """Raise FxShardError on every rank of the job when the members of some group would issue different
    collectives (or, in a pipeline, mismatched transfers). `groups`: mesh axis -> this rank's process
    group. Every rank takes part in every check, and then all of them learn the first problem found:
    a rank whose own groups agree must not go on into collectives its failed peers never issue."""
    raise_together(_disagreement(graph, groups, device, stage), device, "another rank's group disagrees")


def check_runtime_agreement(how: str, device: torch.device) -> None:
    """Raise FxShardError on every rank when the ranks would run their collectives differently (`how`:
    this rank's runtime settings, e.g. "ep_all_to_all='auto', ..., cuda_graphs=True"): the same program
    lowered to copy engines on one rank and left on NCCL on another (or with the other kind of
    barrier; or "auto" deciding, which under CUDA graphs takes a collective, on one rank only) waits
    forever in its first collective, which the program comparison (`check_agreement`) cannot see."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return
    every = _all_gather_text(how, dist.group.WORLD, device)
    if len(set(every)) > 1:
        said = "; ".join(f"rank {r}: {text}" for r, text in enumerate(every))
        raise FxShardError(f"the ranks would run their collectives differently ({said}): the job would hang in its "
                           "first collective. Give every rank the same Config(ep_all_to_all, fsdp_collectives, "
                           "copy_engine_barriers, cuda_graphs)")


def raise_together(problem: str | None, device: torch.device, elsewhere: str, group=None) -> None:
    """Every rank of the job raises FxShardError when any rank found a problem (its own, else the first
    rank's, after `elsewhere`), none when no rank did: a rank whose own part went well must not go on
    into collectives its failed peers never issue. One process alone raises its own problem. `group`: a
    gloo group of every rank (api._job_group), else the default group on `device`."""
    import torch.distributed as dist

    found = [problem] if problem else []
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        with waiting_for_peers(elsewhere.split(":")[0], group):
            found = [text for text in _all_gather_text(problem or "", group or dist.group.WORLD,
                                                       device if group is None else torch.device("cpu")) if text]
    if found:
        raise FxShardError(problem or f"{elsewhere}, so this job stops here too: {found[0]}")


@contextlib.contextmanager
def waiting_for_peers(what: str, group=None):
    """A context in which a collective over `group` (a job group, api._job_group) that times out or
    loses a peer raises FxShardError saying what every rank was to do together, instead of gloo's
    RuntimeError."""
    try:
        yield
    except RuntimeError as error:
        text = str(error)
        if not any(s in text for s in ("Timed out", "timed out", "Connection closed", "Connection reset")):
            raise
        seconds = None if group is None else _group_timeout_s(group)
        after = f"within Config(collective_timeout_s)={seconds:g} s" if seconds else "in time"
        raise FxShardError(f"another rank did not join {what} {after} (it stalled, or stopped): every rank must "
                           f"make this call; read the other ranks' logs ({text.strip()[:300]})") from error


def _group_timeout_s(group) -> float | None:
    """A gloo group's timeout in seconds (None where this torch does not say)."""
    try:
        return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    except Exception:  # noqa: BLE001  (a torch without these internals: the message says "in time")
        return None


def fail_together(failure: Exception | None, what: str, group=None) -> None:
    """Collective over `group` (default: the default process group): where some rank's `failure` is not None, raise on
    every rank (a rank's own failure is its caller's to raise; the others get an FxShardError naming
    the first failed rank and its error), instead of leaving the others waiting at their next
    collective for the rank that stopped. `what`: what the failed rank could not do. Unlike
    `raise_together`, the failed rank keeps its own exception (type and traceback), and the others'
    message names it; an object all-gather, so any backend and no device."""
    import torch.distributed as dist

    said = None if failure is None else f"{type(failure).__name__}: {str(failure).strip()[:600]}"
    everyone = [None] * dist.get_world_size()
    with waiting_for_peers(f"the check before they {what}", group):
        dist.all_gather_object(everyone, said, group=group)
    failed = next((rank for rank, message in enumerate(everyone) if message is not None), None)
    if failure is None and failed is not None:
        raise FxShardError(f"rank {failed} could not {what}, so no rank goes on ({everyone[failed]}); its own "
                           f"error says why")


def _disagreement(graph: fx.Graph, groups: dict, device: torch.device, stage: int | None) -> str | None:
    """The first disagreement in this rank's groups, described (or None)."""
    import torch.distributed as dist

    problem = None
    collectives = collective_sequences(graph)
    for axis in sorted(groups):  # the same order on every rank
        group = groups[axis]
        if dist.get_world_size(group) == 1:
            continue
        mine = collectives.get(axis, [])
        if len({tuple(d) for d in _all_gather_lists(_digest(mine), group, device)}) == 1:
            continue
        members = [_decode(t) for t in _all_gather_text(_encode(mine), group, device)]
        index, entries = first_difference(members)
        ranks = dist.get_process_group_ranks(group)
        issued = "; ".join(f"rank {r}: {e if e else 'nothing (its program ends)'}" for r, e in zip(ranks, entries))
        problem = problem or (f"the ranks of group {axis!r} {ranks} would issue different collectives: collective "
                              f"#{index + 1} on {axis!r} is {issued}. The job would hang or corrupt data there; {_HINT}")
    if stage is None or "pp" not in groups:
        return problem
    group = groups["pp"]
    stages = dist.get_world_size(group)
    transfers = transfer_sequences(graph, stage)
    digests = _all_gather_lists([v for peer in range(stages) for v in _digest(transfers.get(peer, []))], group, device)
    size = len(_digest([]))
    bad = [(a, b) for a in range(stages) for b in range(a + 1, stages)
           if digests[a][b * size:(b + 1) * size] != digests[b][a * size:(a + 1) * size]]
    if not bad:
        return problem
    texts = [_all_gather_text(_encode(transfers.get(peer, [])), group, device) for peer in range(stages)]
    a, b = bad[0]
    index, (mine, theirs) = first_difference([_decode(texts[b][a]), _decode(texts[a][b])])
    return problem or (f"pipeline stages {a} and {b} disagree on their transfers: #{index + 1} between them is "
                       f"{mine or 'nothing'} on stage {a} and {theirs or 'nothing'} on stage {b}; {_HINT}")


def check_pipeline_streams(group, mesh, config, costs: tuple = ()) -> None:
    """Refuse a pipeline schedule that would hang on the process group it runs on.

    A process group initialized with `device_id` (`init_process_group(..., device_id=...)`) is
    created eagerly, and NCCL then sends and receives over the group's one communicator: every
    transfer of a rank waits for the ones it issued before, to any peer, instead of only those to
    the same peer (fxshard's launcher leaves `device_id` out). `check_point_to_point` with
    `streams="group"` models that; interleaved 1F1B at P >= 3 deadlocks there. `costs`: the stage
    plan's (`StagePlan.costs`), which the lowering ordered the transfers by."""
    from .. import schedule as schedules
    from ..passes import lowered_schedule

    bound = getattr(group, "bound_device_id", None) or _default_bound_device()
    if bound is None or _backend(group) != "nccl":
        return
    plan, pairs = lowered_schedule(mesh, config, costs)
    try:
        schedules.check_point_to_point(plan, schedules.issue_order(plan, costs, config.p2p_receives, pairs), pairs,
                                       streams="group")
    except FxShardError as error:
        raise FxShardError(
            f"the process group was initialized with device_id={bound}, so NCCL runs every "
            f"point-to-point transfer of a stage on one communicator, in issue order, and the {plan.name} schedule "
            f"would hang there ({error}). Initialize the process group without device_id (as fxshard's launcher "
            f"does: each pair of stages then gets its own communicator), or use a schedule without this cycle "
            f"(e.g. schedule='1f1b', 'zb-h1' or 'dualpipev')") from None


def _default_bound_device():
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_group

    return _get_default_group().bound_device_id if dist.is_initialized() else None


def _backend(group) -> str:
    import torch.distributed as dist

    try:
        return str(dist.get_backend(group)).lower()
    except (RuntimeError, ValueError):
        return ""


def connect_pipeline_peers(graph: fx.Graph, group, device: torch.device) -> None:
    """Open this stage's point-to-point connections before the first step, every stage in one
    order. NCCL creates a pair's communicator at the pair's first send or receive and holds both
    ranks there until both arrive; a step's first transfers can go round a ring (interleaved 1F1B at
    P >= 3: stage r first receives from r-1 while r-1 first receives from r-2, ...), which would
    wait in a circle. Here each pair (lo, hi) exchanges one element, lo to hi, in ascending order of
    pairs: every rank's pairs are part of one total order, so the lowest pair not yet connected
    always has both its ranks at it."""
    import torch.distributed as dist

    me = dist.get_rank(group)
    peers = {node.args[-2] for node in graph.nodes if node.op == "call_function" and node.target in P2P_OPS}
    token = torch.zeros(1, device=device)
    for peer in sorted(peers, key=lambda p: (min(me, p), max(me, p))):
        if me < peer:
            dist.send(token, group=group, group_dst=peer)
        else:
            dist.recv(token, group=group, group_src=peer)


_START_FIXES = {
    "parameter": "every rank must build the same model with the same initial values (seed every rank alike "
                 "before building it, e.g. torch.manual_seed(0), or load the same weights on each): ranks that "
                 "start apart would train a mixture of their models (ZeRO) or drift apart (replicated). Ranks "
                 "that load a checkpoint into the step right after shard may pass "
                 "Config(check_initial_weights=False)",
    "example batch": "every rank's batches must have the same structure, shapes and dtypes (an equal share of "
                     "the global batch): the gradient average weighs every rank alike",
    "optimizer": "give every rank the same optimizer and hyperparameters",
    "Config": "give every rank the same Config",
    "traced step": "every rank must run the same model code and loss_fn (the same modules and settings, e.g. "
                   "activation, epsilon, RoPE base, loss scale; a forward or loss_fn that branches on the rank "
                   "computes another function on each): their gradients would be averaged as if they were one "
                   "model's",
}
_START_FIXES["buffer"] = _START_FIXES["parameter"]


def start_entries(model, batch_spec, optimizer, config, traced=None) -> list[Entry]:
    """What every rank of a job must start from, one Entry per item (`where`: what it is): the example
    batch's leaves, the optimizer, the Config (less `verbose` and `dump_dir`, which may differ), each
    node of the `traced` program (the step before any pass, the same on every rank: `traced_entries`),
    and each parameter and persistent buffer of `model` (what a checkpoint holds) by shape, dtype and a
    checksum of its bits (two int64 sums of its 32-bit words, all and odd ones; exact, so summation
    order cannot make equal tensors differ; "meta" for a meta-device model, which fxshard initializes
    the same way on every rank). A non-persistent buffer may be scratch, allocated uninitialized: it is
    compared only where the traced step reads it (a RoPE table). With Config(check_initial_weights=False),
    no tensor entries."""
    from ..share import _describe_callable

    leaves = "; ".join(f"{leaf.path} {tuple(leaf.shape)} {str(leaf.dtype).replace('torch.', '')}"
                       for leaf in batch_spec.leaves)
    fields = []
    for field in dataclasses.fields(optimizer):
        value = getattr(optimizer, field.name)
        if callable(value):  # an lr schedule: its name, and a digest of its code and closure
            code = hashlib.sha256(_describe_callable(value).encode()).hexdigest()[:8]
            value = f"<{getattr(value, '__qualname__', type(value).__qualname__)} {code}>"
        fields.append(f"{field.name}={value}")
    entries = [Entry(f"example batch: {leaves}", "example batch"),
               Entry(f"optimizer: {type(optimizer).__name__}({', '.join(fields)})", "optimizer")]
    entries += [Entry(f"Config({field.name}={getattr(config, field.name)!r})", "Config")  # one per field: named
                for field in dataclasses.fields(config) if field.name not in ("verbose", "dump_dir")]
    read = set()
    if traced is not None:
        entries += traced_entries(traced.graph)
        read = {i.name for i, node in zip(traced.inputs, traced.placeholders()) if i.kind is InputKind.BUFFER
                and any(_reads_values(user, node) for user in node.users)}
    tensors = [(f"parameter {name!r}", t) for name, t in model.named_parameters()]
    tensors += [(f"buffer {name!r}", t) for name, t in model.named_buffers() if _persistent(model, name) or name in read]
    if not config.check_initial_weights:
        tensors = []
    sums = _checksums([t for _, t in tensors])
    for (what, tensor), checksum in zip(tensors, sums):
        dtype = str(tensor.dtype).replace("torch.", "")
        bits = "meta" if checksum is None else f"checksum {checksum[0] & (2**64 - 1):016x}.{checksum[1] & (2**64 - 1):016x}"
        entries.append(Entry(f"{what}: {tuple(tensor.shape)} {dtype}, {bits}", what.split(" ")[0]))
    return entries


_aten = torch.ops.aten
# ops that read only their first argument's shape, dtype and device (a scratch buffer zeroed, filled or
# overwritten in the forward; a tensor made like it): its initial values do not matter to the step
_NOT_READING_FIRST = frozenset((
    _aten.copy.default, _aten.zero.default, _aten.fill.Scalar, _aten.fill.Tensor, _aten.zeros_like.default,
    _aten.ones_like.default, _aten.empty_like.default, _aten.full_like.default, _aten.new_zeros.default,
    _aten.new_ones.default, _aten.new_empty.default, _aten.new_full.default, _aten.sym_size.int,
    _aten.sym_stride.int, _aten.sym_numel.default, _aten.sym_storage_offset.default))


def _reads_values(user: fx.Node, tensor: fx.Node) -> bool:
    """Whether `user` reads `tensor`'s values, not only its shape (the first argument of
    _NOT_READING_FIRST's ops, e.g. the destination of a copy)."""
    if user.target in _NOT_READING_FIRST and user.args and user.args[0] is tensor:
        return any(a is tensor for a in user.args[1:]) or tensor in user.kwargs.values()
    return True


def traced_entries(graph: fx.Graph) -> list[Entry]:
    """One Entry per computing node of a traced step: its op and arguments (other nodes by name,
    constants by value, devices by type: each rank traces on its own GPU), where "traced step: ..."
    names it. Ranks whose steps issue the same collectives may still compute different functions."""
    def said(value):
        if isinstance(value, torch.device):
            return value.type
        return value.name if isinstance(value, fx.Node) else value

    entries = []
    for node in graph.nodes:
        if node.op not in ("call_function", "call_method", "get_attr"):
            continue
        args, kwargs = fx.node.map_aggregate((node.args, node.kwargs), said)
        call = ", ".join([*(repr(a) for a in args), *(f"{k}={v!r}" for k, v in kwargs.items())])
        entries.append(Entry(f"traced step: {node.name} = {getattr(node.target, '__name__', node.target)}({call}) "
                             f"[{_where(node)}]", "traced step"))
    return entries


def check_pipeline_batch(batch, mesh, device: torch.device) -> None:
    """Raise FxShardError on every rank when the stages of one pipeline were given different batches
    (the first step's: the example batch given to shard may be a placeholder). Each stage reads the
    one batch (the first stage its inputs, the last its targets), so ranks that draw batches by their
    global rank instead of their data-parallel coordinate would train on one batch's inputs and
    another's targets, silently. One all-gather over the default group of a digest of each rank's
    batch (the checksums of its tensors' bits); nothing for a batch on the meta device."""
    import torch.distributed as dist

    leaves = [t for t in torch.utils._pytree.tree_leaves(batch) if isinstance(t, torch.Tensor)]
    try:
        sums = _checksums(leaves)
    except Exception as error:  # noqa: BLE001  (a sparse tensor, say): compared as such, every rank gathers
        sums = [f"unreadable: {type(error).__name__}"]
    if any(checksum is None for checksum in sums):
        return
    every = _all_gather_lists(_digest([Entry(repr(sums), "batch")]), dist.group.WORLD, device)
    for rank, digest in enumerate(every):
        first = mesh.rank_of(0, mesh.coords(rank)["dp"])
        if digest != every[first]:
            raise FxShardError(
                f"rank {rank} (pipeline stage {mesh.coords(rank)['pp']}) was given another batch than rank {first} "
                f"(stage 0) of its pipeline at the first step: every stage of a pipeline must get the same batch, "
                f"the share of its data-parallel coordinate. Draw batches by mesh.coords(rank)['dp'] (torch's "
                f"DistributedSampler(num_replicas=mesh.dp, rank=mesh.coords(rank)['dp'])), not by the global rank")


def _persistent(model, name: str) -> bool:
    owner, _, leaf = name.rpartition(".")
    return leaf not in model.get_submodule(owner)._non_persistent_buffers_set


def _checksums(tensors: list[torch.Tensor], chunk_words: int = 1 << 24) -> list[tuple[int, int] | None]:
    """Per tensor, the int64 sums (wrapping) of its 32-bit words (bytes where its size is no multiple
    of 4), all of them and the odd ones; None for a meta tensor. Summed in chunks (an int64
    sum of int32 words may widen its input first: a chunk's worth of memory, not a tensor's), on
    the tensor's device, read to the host once for all."""
    sums, parts = [], []
    for tensor in tensors:
        if tensor.is_meta:
            sums.append(None)
            continue
        words = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        if words.numel() % 4 == 0:
            if words.storage_offset() % 4:  # a view 2 bytes into its storage: copied, so that where a
                words = words.clone()       # tensor lies never changes its checksum
            words = words.view(torch.int32)
        total = odd = torch.zeros((), dtype=torch.int64, device=words.device)
        for start in range(0, words.numel(), 2 * chunk_words):  # even starts: a chunk's odd words are the tensor's
            chunk = words[start:start + 2 * chunk_words]
            total = total + chunk.sum(dtype=torch.int64)
            odd = odd + chunk[1::2].sum(dtype=torch.int64)
        sums.append(len(parts))
        parts.append(torch.stack([total, odd]))
    values = torch.stack([p.to(parts[0].device) for p in parts]).cpu().tolist() if parts else []
    return [None if index is None else tuple(values[index]) for index in sums]


def check_same_start(model, batch_spec, optimizer, config, device: torch.device, traced=None, group=None) -> None:
    """Raise FxShardError on every rank of the job when some rank traced another step (`traced`: its
    program before any pass), starts from other weights, another optimizer, Config or example batch
    than rank 0 (`start_entries`), naming the first item that differs and each side of it. One small
    all-gather of digests over the default group. Only when they differ, rank 0's items are broadcast
    over `group` (a gloo group of every rank; default: the default group) and each rank gathers just
    where its own first differ: a traced step has thousands of items, which every rank gathering every
    rank's would multiply by the ranks. Nothing to compare in one process."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return
    mine = start_entries(model, batch_spec, optimizer, config, traced)
    if len({tuple(d) for d in _all_gather_lists(_digest(mine), dist.group.WORLD, device)}) == 1:
        return
    on_device = torch.cuda.device(device) if group is None and device.type == "cuda" else contextlib.nullcontext()
    with on_device, waiting_for_peers("the comparison of where they start", group):
        told = [_encode(mine) if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(told, src=0, group=group)  # NCCL's object transfer uses the current device
        found = first_difference([_decode(told[0]), mine])
        said = None if found is None else (found[0], *found[1])
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, said, group=group)
    index = min(entry[0] for entry in everyone if entry is not None)
    rank = next(r for r, entry in enumerate(everyone) if entry is not None and entry[0] == index)
    _, first, theirs = everyone[rank]
    what = (first or theirs).where
    fix = _START_FIXES.get(what, _HINT)
    raise FxShardError(f"rank {rank} starts from something else than rank 0: {theirs.key if theirs else 'nothing'} "
                       f"on rank {rank}, {first.key if first else 'nothing'} on rank 0. {fix[0].upper()}{fix[1:]}")
