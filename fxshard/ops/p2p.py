"""Point-to-point as graph nodes: `fxshard::send` and `fxshard::recv`, each waited on by
`_c10d_functional.wait_tensor` like the functional collectives.

    token = torch.ops.fxshard.send(activation, peer, "pp")          # issued: isend
    buffer = torch.ops.fxshard.recv([4, 64], torch.float32, device, peer, "pp")  # issued: irecv
    ...
    activation = torch.ops._c10d_functional.wait_tensor(buffer)       # waited where first read
    torch.ops._c10d_functional.wait_tensor(token)                     # waited late (end of step)

`peer` is the other rank's index in `group` (a mesh axis in a Program; the runtime binds axes to
process-group names, as it does for collectives). Each op issues an asynchronous `isend` / `irecv`
and registers its work with c10d, so `wait_tensor` on the returned tensor waits for it: the graph
decides where a transfer is issued and where it is waited on, and the SPMD simulator, the dumps and
codegen see these nodes as communication. The send's token is an empty tensor; the sent tensor is
kept alive by the work until the wait.

Messages between two ranks match in issue order (gloo per tag, NCCL per communicator); the pipeline
lowering issues them in an order `fxshard.schedule.check_point_to_point` proves deadlock-free.
"""

from __future__ import annotations

import torch
from torch import Tensor

P2P_TAG = 0


def _group(name: str):
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


@torch.library.custom_op("fxshard::send", mutates_args=())
def send(tensor: Tensor, peer: int, group: str) -> Tensor:
    import torch.distributed as dist

    work = dist.isend(tensor.contiguous(), group=_group(group), group_dst=peer, tag=P2P_TAG)
    token = tensor.new_empty(0)
    torch._C._distributed_c10d._register_work(token, work)
    return token


@send.register_fake
def _send_fake(tensor, peer, group):
    return tensor.new_empty(0)


@torch.library.custom_op("fxshard::recv", mutates_args=())
def recv(shape: list[int], dtype: torch.dtype, device: torch.device, peer: int, group: str) -> Tensor:
    import torch.distributed as dist

    buffer = torch.empty(shape, dtype=dtype, device=device)
    work = dist.irecv(buffer, group=_group(group), group_src=peer, tag=P2P_TAG)
    torch._C._distributed_c10d._register_work(buffer, work)
    return buffer


@recv.register_fake
def _recv_fake(shape, dtype, device, peer, group):
    return torch.empty(shape, dtype=dtype, device=device)


P2P_OPS = frozenset({torch.ops.fxshard.send.default, torch.ops.fxshard.recv.default})
for _op in P2P_OPS:  # never dead code: a send has an effect, an unread receive still has to match its send
    torch.fx.node.has_side_effect(_op)
