"""All-gathers on gloo go through the entry point that stays sound with several in flight.

torch's functional `all_gather_into_tensor` reaches gloo through
`ProcessGroupGloo::allgather_into_tensor_coalesced`, and with several of them in flight at once (what
ZeRO-3's prefetch issues: gathers early, waits late) that path corrupts the host heap: the process
later aborts in `malloc(): unaligned tcache chunk detected` or segfaults, at a place unrelated to the
cause. `tools/repro_gloo_all_gather.py` shows it with nothing but torch (torch 2.13.0+cpu, 2 ranks, 1500
rounds of 1-8 gathers in flight): 2 to 8 runs of 12 died, in three batches of 12; the same gathers
issued through `dist.all_gather_into_tensor(async_op=True)` (`ProcessGroupGloo::_allgather_base`)
died in none of 36 runs, nor did functional ones each waited at once (18 runs). Functional
reduce-scatters, all-reduces and all-to-alls with several in flight died in none of 12 runs each.
In fxshard's suite it struck one 4-process gloo test in roughly every third CI run.

So on a gloo group every all-gather node becomes `fxshard::gloo_all_gather_into_tensor`, which issues
the same collective through `_allgather_base` and registers its work with c10d the way the functional
op does, so the graph's `wait_tensor` still waits where it did.

Invariant: the runtime graph issues the same collectives, in the same order, on the same groups,
with the same waits; only the c10d entry point of all-gathers on gloo groups changes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.fx as fx

from ..ops.gloo import GLOO_ALL_GATHER

_c10d = torch.ops._c10d_functional


def lower_gloo_all_gathers(graph_module: fx.GraphModule, gloo_groups: set[str]) -> tuple[fx.GraphModule, int]:
    """The graph with each all-gather on a group in `gloo_groups` (process-group names) issued through
    `fxshard::gloo_all_gather_into_tensor`, and how many were; the graph is changed in place."""
    lowered = 0
    for node in graph_module.graph.nodes:
        if node.op == "call_function" and node.target is _c10d.all_gather_into_tensor.default \
                and node.args[2] in gloo_groups:
            node.target = GLOO_ALL_GATHER
            lowered += 1
    if lowered:
        graph_module.recompile()
    return graph_module, lowered


def gloo_group_names(groups: dict) -> set[str]:
    """The names of the process groups in `groups` (axis -> group) whose backend is gloo."""
    return {group.group_name for group in groups.values() if dist.get_backend(group) == "gloo"}
