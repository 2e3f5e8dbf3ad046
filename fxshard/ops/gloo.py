"""`fxshard::gloo_all_gather_into_tensor`: an all-gather issued through `ProcessGroupGloo::_allgather_base`,
waited on by `_c10d_functional.wait_tensor` like the functional collective it stands for. The runtime
puts it in place of every all-gather on a gloo group (fxshard/runtime/gloo.py says why)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

# dist.all_gather_into_tensor under the name torch 2.13 gives it (the old name warns there; torch 2.11
# has only the old one)
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@torch.library.custom_op("fxshard::gloo_all_gather_into_tensor", mutates_args=())
def gloo_all_gather_into_tensor(shard: Tensor, group_size: int, group_name: str) -> Tensor:
    """`_c10d_functional.all_gather_into_tensor`, issued through `ProcessGroupGloo::_allgather_base`."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    gathered = shard.new_empty((shard.shape[0] * group_size, *shard.shape[1:]))
    work = all_gather_single(gathered, shard.contiguous(), group=_resolve_process_group(group_name), async_op=True)
    torch._C._distributed_c10d._register_work(gathered, work)  # `wait_tensor(gathered)` waits for it
    return gathered


@gloo_all_gather_into_tensor.register_fake
def _gloo_all_gather_fake(shard, group_size, group_name):
    return shard.new_empty((shard.shape[0] * group_size, *shard.shape[1:]))


GLOO_ALL_GATHER = torch.ops.fxshard.gloo_all_gather_into_tensor.default


def gloo_all_gather_into_tensor_out(shard: Tensor, group_size: int, group_name: str, *, out: Tensor) -> Tensor:
    """`_c10d_functional.all_gather_into_tensor_out` on a gloo group: gathers into `out` and returns it,
    waited on by `wait_tensor(out)`. A runtime function, never traced: runtime/reinplace.py puts it where
    an updated parameter's gather would otherwise be copied back into the parameter's buffer."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    work = all_gather_single(out, shard.contiguous(), group=_resolve_process_group(group_name), async_op=True)
    torch._C._distributed_c10d._register_work(out, work)
    return out


GLOO_ALL_GATHERS = frozenset({GLOO_ALL_GATHER, gloo_all_gather_into_tensor_out})  # what gloo groups gather with
