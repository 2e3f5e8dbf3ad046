"""Checkpoint cost: save and load times of a whole training state, and how long an async save
stalls training, for fxshard.save / fxshard.load against torch.distributed.checkpoint on a plain
PyTorch model with torch.optim.AdamW (fused), what a one-GPU user would write instead.

    python bench/checkpoint.py --model 1b --dir /tmp/ckpt_bench [--json bench/checkpoint_h200.json]

Both sides hold fp32 parameters and two fp32 AdamW moments (GPT 1b: ~12.7 GB) and write with DCP's
FileSystemWriter (files fsynced). fxshard's step replays its graph without codegen or CUDA graphs:
step speed is not what is measured here, except the step time while an async save writes.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fxshard  # noqa: E402
from fxshard.models import GPT, GPTConfig  # noqa: E402

from common import write_json  # noqa: E402


def batch_for(cfg, rows, seq, device):
    generator = torch.Generator().manual_seed(0)
    return {"idx": torch.randint(0, cfg.vocab_size, (rows, seq), generator=generator).to(device),
            "tgt": torch.randint(0, cfg.vocab_size, (rows, seq), generator=generator).to(device)}


def seconds(fn):
    torch.cuda.synchronize()
    started = time.perf_counter()
    result = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - started, result


def step_ms(step, data, count=3):
    elapsed, _ = seconds(lambda: [step(data) for _ in range(count)])
    return 1000 * elapsed / count


def run_fxshard(cfg, args) -> dict:
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = GPT(cfg)
    data = batch_for(cfg, args.batch, args.seq, "cuda")
    step = fxshard.shard(model, lambda m, b: m.loss(b), data, fxshard.optim.AdamW(lr=1e-4),
                         config=fxshard.Config(param_dtype=torch.bfloat16, codegen=None))
    del model
    for _ in range(2):
        step(data)
    state_bytes = sum(t.numel() * t.element_size() for t in step.state.values())
    path = os.path.join(args.dir, "fxshard")
    idle = step_ms(step, data)
    save_s, _ = seconds(lambda: fxshard.save(step, path))
    stalls, totals, during = [], [], []
    for _ in range(2):  # the first async save allocates the pinned staging buffers, the second reuses them
        saved_checksum = {k: v.double().sum().item() for k, v in step.state.items()}
        started = time.perf_counter()
        pending = fxshard.save(step, path, async_save=True)
        stalls.append(time.perf_counter() - started)
        during.append(step_ms(step, data))
        pending.wait()
        totals.append(time.perf_counter() - started)
    # the steps taken while it wrote moved the state on; the load must bring back the one saved
    moved = any(saved_checksum[k] != step.state[k].double().sum().item() for k in saved_checksum)
    load_s, _ = seconds(lambda: fxshard.load(step, path))
    restored = all(saved_checksum[k] == step.state[k].double().sum().item() for k in saved_checksum)
    from fxshard.checkpoint.dcp import PIECE, _checkpoint_files, _crcs, _metadata  # the CRC-32s a save records

    started = time.perf_counter()  # the files as a save or load finds them: in the page cache
    _crcs(path, _checkpoint_files(_metadata(path)[0]), PIECE)
    checksum_s = time.perf_counter() - started
    shutil.rmtree(path, ignore_errors=True)
    assert moved
    return {"mode": "fxshard", "state_gb": state_bytes / 1e9, "save_s": save_s, "async_stall_s": stalls,
            "async_total_s": totals, "step_ms": idle, "step_ms_during_async_write": during, "load_s": load_s,
            "load_restores_saved_state": restored, "checksum_s": checksum_s}


def run_torch_dcp(cfg, args) -> dict:
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = GPT(cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    data = batch_for(cfg, args.batch, args.seq, "cuda")

    def train_step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model.loss(data)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(2):
        train_step()
    state = lambda: {"model": model.state_dict(), "optim": optimizer.state_dict()}  # noqa: E731
    state_bytes = sum(p.numel() * 4 * 3 for p in model.parameters())
    path = os.path.join(args.dir, "torch_dcp")
    idle_s, _ = seconds(lambda: [train_step() for _ in range(3)])
    save_s, _ = seconds(lambda: dcp.save(state(), checkpoint_id=path, no_dist=True))
    stalls, totals, during = [], [], []
    for _ in range(2):
        started = time.perf_counter()
        future = dcp.async_save(state(), checkpoint_id=path + "_async", no_dist=True)
        stalls.append(time.perf_counter() - started)
        elapsed, _ = seconds(lambda: [train_step() for _ in range(3)])
        during.append(1000 * elapsed / 3)
        future.result()
        totals.append(time.perf_counter() - started)

    def load():
        loaded = state()
        dcp.load(loaded, checkpoint_id=path, no_dist=True)
        model.load_state_dict(loaded["model"])
        optimizer.load_state_dict(loaded["optim"])

    load_s, _ = seconds(load)
    shutil.rmtree(path, ignore_errors=True)
    shutil.rmtree(path + "_async", ignore_errors=True)
    return {"mode": "torch-dcp", "state_gb": state_bytes / 1e9, "save_s": save_s, "async_stall_s": stalls,
            "async_total_s": totals, "step_ms": 1000 * idle_s / 3, "step_ms_during_async_write": during,
            "load_s": load_s}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="1b")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--dir", default="/tmp/fxshard_checkpoint_bench")
    parser.add_argument("--modes", nargs="+", default=["fxshard", "torch-dcp"])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    cfg = GPTConfig.preset(args.model)
    os.makedirs(args.dir, exist_ok=True)
    rows = []
    for mode in args.modes:
        rows.append({"fxshard": run_fxshard, "torch-dcp": run_torch_dcp}[mode](cfg, args))
        torch.cuda.empty_cache()
        row = rows[-1]
        print(f"{mode}: {row}", flush=True)
    print("\n| mode | state GB | save s | async stall s (1st, 2nd) | async write s | step ms idle / during write "
          "| load s |\n| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for row in rows:
        print(f"| {row['mode']} | {row['state_gb']:.1f} | {row['save_s']:.2f} | "
              f"{row['async_stall_s'][0]:.2f}, {row['async_stall_s'][1]:.2f} | {row['async_total_s'][1]:.2f} | "
              f"{row['step_ms']:.0f} / {row['step_ms_during_async_write'][1]:.0f} | {row['load_s']:.2f} |")
    if args.json:
        write_json(args.json, model=args.model, seq=args.seq, batch=args.batch, rows=rows,
                   command=" ".join(sys.argv))


if __name__ == "__main__":
    main()
