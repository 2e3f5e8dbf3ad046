"""Probe: what torch's allocator stats show for the copy-engine all-to-all's symmetric workspace.

    python3 bench/probes/ce_memory.py   # 2 GPUs
"""

import torch
import torch.distributed as dist

from fxshard.launch import run_local


def main():
    from fxshard.runtime import copy_engine

    group = dist.group.WORLD.group_name
    gib = 2 ** 30
    before = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    copy_engine._workspace(group, 2 * gib)
    after = torch.cuda.memory_allocated(), torch.cuda.memory_reserved(), torch.cuda.max_memory_allocated()
    free, total = torch.cuda.mem_get_info()
    x = torch.randn(4096, 1024, device="cuda")
    out = copy_engine.copy_engine_all_to_all(x, [2048, 2048], [2048, 2048], group, 0, 2 * gib)
    torch.ops._c10d_functional.wait_tensor(out)
    torch.cuda.synchronize()
    line = (f"rank {dist.get_rank()}: 2 GiB workspace: allocated {before[0] / gib:.2f} -> {after[0] / gib:.2f} GiB, "
            f"reserved {before[1] / gib:.2f} -> {after[1] / gib:.2f}, peak {after[2] / gib:.2f}, "
            f"device free {free / gib:.1f} of {total / gib:.1f}; after one all-to-all: allocated "
            f"{torch.cuda.memory_allocated() / gib:.2f}, peak {torch.cuda.max_memory_allocated() / gib:.2f}")
    print(line, flush=True)
    return line


if __name__ == "__main__":
    run_local(main, 2, backend="nccl")
