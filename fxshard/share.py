"""Ranks that would trace the same step trace it once (Config(share_trace)); ranks on one host split
the compiling of their regions (Config(share_compile), `split_compiles` below).

Every rank of a launch runs `shard` on the same model, loss and batch shapes, and the trace (aot_autograd
on fake tensors, ~half of `shard`'s time) comes out the same on each. Where the ranks share a host's
cores (gloo: CPU training, tests, a laptop), N ranks tracing at once take N times the CPU of one. With
sharing, the ranks exchange a fingerprint of what the trace reads; among the ranks whose fingerprints
agree, the lowest traces and broadcasts the program's bytes (fxshard/program_io.py), and the others
load them (~15% of a trace's time).

Invariant: a rank gets the program it would have traced itself, provided its trace is a function of
what the fingerprint covers: the module tree (each module's path, class and plain attributes), the
parameters' and buffers' names, shapes, dtypes and devices, the loss function's code and simple closure
values, the batch's structure, the optimizer and the Config (less `verbose` and `dump_dir`, which only
report: each pipeline stage dumps into its own folder, and the trace does not read it). That is
SPMD's premise (every rank runs the same code); a forward that branches on the rank itself is
outside it: with share_trace=False each rank traces its own step, and `shard()` refuses ranks whose
traced steps differ (runtime/agreement.py check_same_start).
Nothing is lost when sharing fails: a trace that raises is broadcast as "none", and every rank then
traces itself (and raises its own error); a program that does not serialize is traced again by each.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import sys
import time
from typing import Callable

import torch
import torch.nn as nn

from . import program_io
from .program import Program

_PLAIN = (bool, int, float, str, type(None))


def fingerprint(model: nn.Module, loss_fn, batch_spec, optimizer, config) -> str:
    """A digest of what `fxshard.trace` reads of its arguments (the module docstring lists it)."""
    parts = [repr(batch_spec), repr(optimizer), repr(dataclasses.replace(config, verbose=False, dump_dir=None)),
             _describe_callable(loss_fn)]
    for path, module in model.named_modules():
        attributes = sorted((k, _describe(v)) for k, v in vars(module).items()
                            if not k.startswith("_") and not callable(v))
        parts.append(f"{path}:{type(module).__module__}.{type(module).__qualname__}:{attributes}")
    for kind, tensors in (("p", model.named_parameters()), ("b", model.named_buffers())):
        parts.extend(f"{kind}:{name}:{tuple(t.shape)}:{t.dtype}:{t.device.type}:{t.requires_grad}"
                     for name, t in tensors)
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def _describe(value) -> str:
    """Plain values and tuples or lists of them, dataclasses and configs (a transformers config's
    `to_dict()`), by repr; a tensor attribute by its metadata; anything else by its class."""
    if isinstance(value, _PLAIN) or (isinstance(value, (tuple, list)) and all(isinstance(v, _PLAIN) for v in value)):
        return repr(value)
    if isinstance(value, torch.Tensor):
        return f"tensor{tuple(value.shape)}:{value.dtype}:{value.device.type}"
    if isinstance(value, type):
        return f"{value.__module__}.{value.__qualname__}"
    if dataclasses.is_dataclass(value):
        return repr(value)
    if callable(getattr(value, "to_dict", None)):
        try:
            return f"{type(value).__qualname__}:{sorted(value.to_dict().items(), key=lambda item: str(item[0]))!r}"
        except Exception:  # noqa: BLE001  a to_dict that needs arguments, or fails: the class alone
            pass
    return type(value).__qualname__


def _describe_callable(fn) -> str:
    """A function by its name, code and closure, the same in every process that holds the same one."""
    code = getattr(fn, "__code__", None)
    if code is None:  # a callable object, a partial, a builtin: its class and repr
        return f"{type(fn).__qualname__}:{_describe(fn)}"
    closure = [_describe(cell.cell_contents) for cell in (fn.__closure__ or ())]
    return f"{fn.__module__}.{fn.__qualname__}:{_describe_code(code)}:{closure}"


def _describe_code(code) -> str:
    """Bytecode, constants and names; a nested code object (a comprehension, a generator expression, an
    inner function) described the same way, since its repr holds a memory address."""
    consts = [_describe_code(c) if hasattr(c, "co_code") else repr(c) for c in code.co_consts]
    return f"{code.co_code.hex()}:{consts}:{code.co_names}"


def shared_trace(trace: Callable[[], Program], digest: str, verbose: bool = False) -> Program:
    """`trace()`'s program, traced by the lowest rank of those whose `digest` equals this rank's and
    loaded by the others. Collective over the default process group: every rank calls it, in the same
    order (as it calls `shard`)."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    digests = [None] * world
    dist.all_gather_object(digests, digest)
    program, failure = None, None
    for group_digest in dict.fromkeys(digests):  # each set of agreeing ranks, by its lowest rank
        source = digests.index(group_digest)
        if digests.count(group_digest) == 1:
            continue  # nobody to share with: that rank traces below
        payload = [None]
        if rank == source:
            try:
                program = trace()
            except Exception as error:  # noqa: BLE001  the others trace (and fail) themselves
                failure = error
            else:
                try:
                    payload = [program_io.dumps(program)]
                except TypeError as error:  # meta that does not serialize: the others trace themselves
                    if verbose:
                        print(f"fxshard: rank {rank}: the trace is not shared ({error})", file=sys.stderr)
        dist.broadcast_object_list(payload, src=source)
        if digest == group_digest and rank != source and payload[0] is not None:
            started = time.perf_counter()
            program = program_io.loads(payload[0])
            program.notes["trace_shared_by"] = source
            program.notes["trace_load_seconds"] = round(time.perf_counter() - started, 3)
            if verbose:
                print(f"fxshard: rank {rank}: loaded rank {source}'s trace ({len(payload[0]) / 1e6:.1f} MB, "
                      f"{program.notes['trace_load_seconds']} s)", file=sys.stderr)
    if failure is not None:
        raise failure
    return program if program is not None else trace()


def compile_owners(everyone: list[tuple[tuple, list[str]]], rank: int) -> dict[str, int]:
    """For each key rank `rank` needs, the rank that compiles it first: among the ranks whose place
    (host, cache directory) is `rank`'s, the one that needs it with the fewest keys given so far (the
    lowest on a tie), keys needed by fewer ranks given first (they have fewer places to go), else in
    the order the ranks list them. `everyone[r]` is rank r's (place, keys)."""
    place = everyone[rank][0]
    members = [r for r, (p, _) in enumerate(everyone) if p == place]
    load = dict.fromkeys(members, 0)
    needed = {r: set(everyone[r][1]) for r in members}
    owner: dict[str, int] = {}
    keys = list(dict.fromkeys(k for r in members for k in everyone[r][1]))
    for key in sorted(keys, key=lambda k: sum(k in needed[r] for r in members)):  # stable
        chosen = min((r for r in members if key in needed[r]), key=lambda r: (load[r], r))
        load[chosen] += 1
        owner[key] = chosen
    return {k: owner[k] for k in everyone[rank][1]}


@dataclasses.dataclass
class CompileSplit:
    """Which of this rank's regions (by structure key) it compiles first, and which rank compiles each
    key first (`owner`); `wait()` returns once every rank has compiled its share (collective)."""
    mine: set[str]
    owner: dict[str, int]
    wait: Callable[[], None]
    rank: int


def split_compiles(keys: list[str]) -> CompileSplit:
    """Split the compiling of `keys` (this rank's regions, `fxshard.codegen.structure_key`) among the
    ranks that can read each other's compiled code: those on this host with the same Inductor cache
    directory. Each key goes to the least-loaded of those ranks that need it; a rank compiles its own
    keys, waits (`wait()`), then compiles the rest, which Inductor finds in its on-disk cache, written
    there by the rank that compiled it (a key a rank's peers could not compile, or that the cache does
    not match, it simply compiles). N ranks with the same program compile 1/N of it each instead of all
    of it at once. Collective over the default process group: every rank calls it, as it calls `shard`.

    Invariant: which code a region runs does not depend on the split; only the order in which the
    ranks compile, and so what Inductor's cache holds when each compiles, does."""
    import socket

    import torch.distributed as dist
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    world = dist.get_world_size()
    place = (socket.gethostname(), os.path.realpath(cache_dir()))
    everyone = [None] * world
    dist.all_gather_object(everyone, (place, list(keys)))
    owner = compile_owners(everyone, dist.get_rank())
    rank = dist.get_rank()

    def wait() -> None:
        done = [None] * world
        dist.all_gather_object(done, rank)
    return CompileSplit({k for k in keys if owner.get(k) == rank}, owner, wait, rank)
