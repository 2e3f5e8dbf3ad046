"""Expert-parallel MoE benchmark: how much all-to-all time the ep_overlap split hides.

    python bench/moe.py --gpus 4 --ep 4 --chunks 2 4 --out bench/moe.json
    python bench/moe.py --gpus 4 --ep 4 --microbatches 2 --chunks 1 2   # + microbatch interleaving

One process group, every mode side by side on the same MoEGPT (bf16 compute, fp32 masters, AdamW,
ZeRO-1 over dp; experts split over ep) and the same per-rank batch:

    nocomm            the EP program with every all-to-all replaced by a local copy of its buffer:
                      the same kernels on the same shapes, no token exchange (per-rank compute time)
    nocomm-nocopy     (with --all-to-all ... copy-engine) each all-to-all replaced by its input, no
                      copy at all: the floor for copy engines, which take the copy off the SMs too
    ep                expert parallelism, no overlap
    nocomm-overlapN   as nocomm, with the layers split into N chunks
    ep-ce, ep-overlapN-ce   the same with Config(ep_all_to_all="copy-engine") (--all-to-all ... copy-engine):
                      the all-to-alls moved by peer memcpys instead of an NCCL kernel
    ep-ces, ep-overlapN-ces  (--all-to-all ... copy-engine-stream) the same with
                      Config(copy_engine_barriers="stream"): barriers that wait holding no SM
    ep-overlapN       Config(ep_overlap=True, ep_chunks=N): work that does not need an all-to-all
                      is moved between its issue and its wait (passes/overlap.py: delayed weight
                      gradients, the shared expert), and with N > 1 each layer's experts are split
                      into N chunks; with --microbatches M > 1 the step accumulates M microbatches
                      and microbatch m's backward is interleaved with m+1's forward
                      (passes/interleave.py); N=1: no split

and, first, the expert MLPs alone on one GPU (grouped GEMMs + SwiGLU, forward and backward, the
rows one rank's experts receive on average). Exposed all-to-all = ep - nocomm; hidden by overlap =
1 - (ep-overlapN - nocomm) / (ep - nocomm). Also given against nocomm-overlapN, which charges the
split's own compute cost (smaller GEMMs, more gathers) to the overlap rather than to communication.
Steps replay from CUDA graphs unless --eager-replay.

MFU counts the FLOPs of the tokens actually routed (assignments dropped over capacity do no expert
work) against the dense bf16 peak of every GPU. Routing is balanced by default (MoEGPTConfig(routing=
"balanced"): every expert gets exactly its share, nothing is dropped at capacity 1.0), so step times
compare across runs; --routing learned uses the untrained router (~35% dropped at capacity 1.0).
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import gc
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.fx as fx

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import fxshard  # noqa: E402
from fxshard.launch import run_local  # noqa: E402
from fxshard.models import MoEGPT, MoEGPTConfig  # noqa: E402
from fxshard.runtime import CompiledStep  # noqa: E402
from common import (H200_BF16_DENSE_PEAK, IDLE_SHORT_US, exposed_copies, gemm_line, holds_sms, idle_gaps,  # noqa: E402
                    idle_under_local_copies, kernel_timeline, write_json)

_c10d = torch.ops._c10d_functional


def model_config(args) -> MoEGPTConfig:
    return MoEGPTConfig(vocab_size=32000, d_model=args.hidden, n_layer=args.layers, n_head=args.hidden // 128,
                        n_expert=args.experts, top_k=args.top_k, d_ff_expert=args.d_ff, d_ff_shared=args.d_ff_shared,
                        capacity_factor=args.capacity_factor, routing=args.routing)


def step_flops(cfg: MoEGPTConfig, tokens: int, seq: int, dropped: int) -> float:
    """Training FLOPs of one step over `tokens` tokens (all ranks) in sequences of `seq`: 6 per weight
    a token meets (attention projections, router, head, shared expert; each kept expert assignment's
    three GEMMs), plus causal attention (as bench/fsdp.py)."""
    d, layers = cfg.d_model, cfg.n_layer
    dense = layers * (4 * d * d + d * cfg.n_expert + 3 * d * (cfg.d_ff_shared or 0)) + d * cfg.vocab_size
    kept = layers * tokens * cfg.top_k - dropped
    return 6 * dense * tokens + 6 * layers * seq * d * tokens + 6 * 3 * d * cfg.d_ff_expert * kept


def without_all_to_all(program, copy=True):
    """The program with each all_to_all_single replaced by a copy of its input (same shapes, no exchange;
    copy=False: by the input itself, not even the local copy)."""
    graph = fx.Graph()
    graph.output(graph.graph_copy(program.graph, {}))
    for node in list(graph.nodes):
        if node.target is _c10d.all_to_all_single.default:
            if copy:
                with graph.inserting_before(node):
                    clone = graph.call_function(torch.ops.aten.clone.default, (node.args[0],))
                clone.meta = dict(node.meta)
                node.replace_all_uses_with(clone)
            else:
                node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
    return program.replace(graph_module=fx.GraphModule(program.graph_module, graph), name="nocomm")


def timed(step_fn, warmup, iters) -> float:
    for _ in range(warmup):
        step_fn()
    torch.cuda.synchronize()
    dist.barrier()
    started = time.perf_counter()
    for _ in range(iters):
        step_fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - started) / iters * 1e3


def profile(step_fn, path, steps=2, labels=(), keep_trace=False) -> dict:
    """On rank 0: kernel time per op over `steps` steps into `path` (top 40), and from the kernel timeline: ms/step
    of all-to-all kernels, and how much of that time other kernels ran alongside (overlap); for copy-engine
    collectives, which of them ran with no compute beside (`exposed_copies`, named by `labels`). With
    `keep_trace`, the chrome trace stays beside `path`, gzipped (chrome://tracing and Perfetto read it)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    if dist.get_rank() != 0:  # the other ranks step along (collectives), unprofiled
        for _ in range(steps):
            step_fn()
        torch.cuda.synchronize()
        return {}
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step_fn()
        torch.cuda.synchronize()
    with open(path, "w") as handle:
        handle.write(prof.key_averages().table(sort_by="cuda_time_total", row_limit=40))
    trace = path[:-4] + ".trace.json"
    prof.export_chrome_trace(trace)
    timeline = kernel_timeline(trace, steps, lambda name: "AllToAll" in name or "SendRecv" in name)
    with open(trace) as handle:
        events = json.load(handle)["traceEvents"]
    if keep_trace:
        import gzip
        import shutil

        with open(trace, "rb") as source, gzip.open(trace + ".gz", "wb") as target:
            shutil.copyfileobj(source, target)
    os.remove(trace)
    # where no compute kernel runs (communication, barriers, markers and copies aside): the exposed
    # waits of either all-to-all kind, the largest named by the compute kernels around them
    waits = idle_gaps(events, steps, counts=lambda e: e.get("cat") == "kernel" and not _is_communication(e["name"]))
    alone = exposed_copies(events, steps, labels, is_compute=lambda name: not _is_communication(name))
    alone.update(idle_under_local_copies(events, steps, is_compute=lambda name: not _is_communication(name)))
    return {"gpu_busy_ms": timeline["gpu_busy_ms"], "all_to_all_kernels_ms": timeline["comm_kernels_ms"],
            "all_to_all_overlapped_ms": timeline["comm_overlapped_ms"], "copies_ms": timeline["copies_ms"],
            "copies_overlapped_ms": timeline["copies_overlapped_ms"], "by_class_ms": timeline["by_class_ms"],
            "compute_idle_ms": waits["idle_ms"], "compute_idle_long_ms": waits["idle_long_ms"],
            "compute_idle_long_gaps": waits["idle_long_gaps"], "compute_idle_largest": waits["idle_largest"],
            **{key: timeline[key] for key in ("gemm_ms", "gemm_beside_ms", "gemm_beside_extra_ms")}, **alone}


def _is_communication(kernel: str) -> bool:
    """NCCL's kernels, torch's symmetric-memory barriers and fxshard's progress markers: no compute."""
    return holds_sms(kernel) or kernel == "mark"


def expert_compute_alone(args) -> float:
    """ms for every layer's (and microbatch's) expert MLP forward+backward on one GPU, at the rows one
    rank receives."""
    from fxshard.ops import grouped_mm

    local = args.experts // args.ep
    rows = args.seq * args.top_k  # balanced routing: each rank's experts receive as many rows as it sends
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(rows, args.hidden, device="cuda", dtype=torch.bfloat16, generator=gen, requires_grad=True)
    w1 = (torch.randn(local, 2 * args.d_ff, args.hidden, device="cuda", generator=gen) * 0.02).bfloat16().requires_grad_()
    w2 = (torch.randn(local, args.hidden, args.d_ff, device="cuda", generator=gen) * 0.02).bfloat16().requires_grad_()
    offsets = torch.linspace(rows / local, rows, local, device="cuda").round().to(torch.int32)

    def step():
        for _ in range(args.layers * args.microbatches):
            gate, up = grouped_mm(x, offsets, w1).chunk(2, dim=-1)
            out = grouped_mm(torch.nn.functional.silu(gate) * up, offsets, w2)
            out.backward(torch.ones_like(out))

    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(args.iters):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - started) / args.iters * 1e3


STREAM_BARRIERS = "copy-engine-stream"  # --all-to-all choice: copy engines, Config(copy_engine_barriers="stream")
CE_SUFFIX = {"copy-engine": "-ce", STREAM_BARRIERS: "-ces"}  # a mode label's suffix per --all-to-all choice


def without_ce(label: str) -> str:
    """A copy-engine mode's label as its NCCL twin's: "-overlap1-ces" -> "-overlap1"."""
    for suffix in sorted(CE_SUFFIX.values(), key=len, reverse=True):
        if label.endswith(suffix):
            return label.removesuffix(suffix)
    return label


def run_modes(args):
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    device = f"cuda:{rank}"
    cfg = model_config(args)
    generator = torch.Generator().manual_seed(rank)
    data = {k: torch.randint(0, cfg.vocab_size, (args.microbatches, args.seq), generator=generator).to(device)
            for k in ("idx", "tgt")}
    results = {}
    if rank == 0:
        results["experts-alone"] = expert_compute_alone(args)
        print(f"  experts alone (1 GPU): {results['experts-alone']:.2f} ms", flush=True)
    dist.barrier()
    modes = [(False, 1, "nccl")] + [(False, 1, a2a) for a2a in args.all_to_all if a2a != "nccl"]
    modes += [(True, c, a2a) for a2a in args.all_to_all for c in args.chunks]
    for overlap, chunks, choice in modes:
        if args.dump_stacks_after:  # restarts the timer: one dump per mode that outlasts it
            faulthandler.dump_traceback_later(args.dump_stacks_after)
        a2a, barriers = ("copy-engine", "stream") if choice == STREAM_BARRIERS else (choice, "kernel")
        carveout = args.sm_carveout if overlap and a2a == "nccl" else None  # copy engines hold no SMs
        torch.manual_seed(0)
        with torch.device(device):
            model = MoEGPT(cfg)
        config = fxshard.Config(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, sharding="optim",
                                cuda_graphs=not args.eager_replay, ep_overlap=overlap, ep_chunks=chunks,
                                microbatches=args.microbatches, ep_sm_carveout=carveout,
                                ep_interleave=args.interleave, ep_all_to_all=a2a,
                                fsdp_collectives=args.fsdp_collectives, collective_timeout_s=args.collective_timeout,
                                copy_engine_barriers=barriers, nccl_high_priority=args.nccl_high_priority,
                                copy_engine_own_part=args.own_part)
        started = time.perf_counter()
        step = fxshard.shard(model, lambda m, b: m.loss_and_metrics(b), data, optimizer=fxshard.optim.AdamW(lr=1e-5),
                             mesh=fxshard.Mesh(dp=world, ep=args.ep), config=config)
        del model
        if rank == 0:
            print(f"  ep_overlap={overlap}, chunks={chunks}, all-to-all by {a2a}: compiled in {time.perf_counter() - started:.1f}s: {step.program!r}", flush=True)
            if not overlap and "ep" in step.program.notes:  # ep=1: no expert parallelism, no notes
                print("  " + step.program.notes["ep"].replace("\n", "\n  "), flush=True)
        suffix = (f"-overlap{chunks}" if overlap else "") + CE_SUFFIX.get(choice, "")
        # nocomm runs the step's program without its all-to-alls, lowered and compiled as the step is
        nocomm_config = dataclasses.replace(config, ep_all_to_all="nccl", nonfinite="ignore")
        nocomm = CompiledStep([without_all_to_all(step.program)], step.state, step.batch_spec, step.optimizer,
                              step.device, step.groups, nocomm_config)
        runs = [(f"ep{suffix}", step)]
        own_nocomm = "nocomm" + without_ce(suffix)  # the same program for every all-to-all
        if own_nocomm not in results:
            runs.insert(0, (own_nocomm, nocomm))
        if not overlap and a2a == "nccl" and set(CE_SUFFIX) & set(args.all_to_all):
            # copy engines move the bytes off the compute stream, where nocomm copies them: the floor
            # they are compared with has no copy either
            runs.insert(1, ("nocomm-nocopy", CompiledStep([without_all_to_all(step.program, copy=False)], step.state,
                                                          step.batch_spec, step.optimizer, step.device, step.groups,
                                                          dataclasses.replace(nocomm_config, ep_sm_carveout=None))))
        for label, runner in runs:
            torch.cuda.reset_peak_memory_stats()
            ms = timed(lambda: runner(data), args.warmup, args.iters)
            times = [None] * world
            dist.all_gather_object(times, ms)
            results[label] = max(times)
            lowered = runner.copy_engine
            if lowered.all_to_alls:  # how many read their own part from the input (Config(copy_engine_own_part))
                results[f"{label}-own-parts-from-input"] = [lowered.own_parts_from_input, lowered.all_to_alls]
            if rank == 0:
                print(f"  {label}: {results[label]:.2f} ms/step (slowest rank; ranks {', '.join(f'{t:.2f}' for t in times)})"
                      f", peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB"
                      + (f"; {lowered.own_parts_from_input} of {lowered.all_to_alls} copy-engine all-to-alls read "
                         "their own part from the input" if lowered.all_to_alls else ""), flush=True)
            if args.profile:  # every rank steps (collectives); rank 0 reports
                os.makedirs(args.profile, exist_ok=True)
                kernels = profile(lambda: runner(data), os.path.join(args.profile, f"{label}.txt"),
                                  labels=runner.copy_engine.described, keep_trace=args.keep_traces)
                if rank == 0:
                    results[f"{label}-kernels"] = kernels
                    classes = ", ".join(f"{k} {v:.2f}" for k, v in kernels["by_class_ms"].items())
                    print(f"  {label}: GPU busy {kernels['gpu_busy_ms']:.2f} ms/step; all-to-all kernels "
                          f"{kernels['all_to_all_kernels_ms']:.2f} ms, of which {kernels['all_to_all_overlapped_ms']:.2f} "
                          f"ms ran alongside compute; copies (copy engines) {kernels['copies_ms']:.2f} ms, of which "
                          f"{kernels['copies_overlapped_ms']:.2f} ms beside kernels; kernel ms by class {classes}; "
                          f"no compute kernel for {kernels['compute_idle_ms']:.2f} ms/step, "
                          f"{kernels['compute_idle_long_ms']:.2f} of it in "
                          f"{kernels['compute_idle_long_gaps']:.0f} gaps over {IDLE_SHORT_US:.0f} us, "
                          f"largest (us, before, after) "
                          f"{kernels['compute_idle_largest'][:3]}; " + gemm_line(kernels), flush=True)
                    if kernels["exposed_copies_largest"]:
                        print(f"  {label}: peer copies with no compute beside them {kernels['exposed_copies_us'] / 1e3:.2f}"
                              f" ms/step; largest (collective, exposed us, copy us): "
                              f"{kernels['exposed_copies_largest']}", flush=True)
                    if kernels.get("local_copies"):
                        print(f"  {label}: compute idle under the own-part copies ({kernels['local_copies']} a step) "
                              f"{kernels['idle_under_local_copies_us'] / 1e3:.2f} ms/step", flush=True)
        metrics = step(data)
        dropped = metrics["moe_dropped_tokens"].item()
        results["dropped"] = dropped  # the same routing in every mode
        if rank == 0:
            print(f"  dropped assignments over capacity (all ranks, all layers): {dropped}", flush=True)
        if "copy-engine" in (a2a, args.fsdp_collectives) and rank == 0:
            from fxshard.runtime.copy_engine import workspace_bytes

            held = workspace_bytes()
            results["copy_engine_workspace_bytes"] = held
            print(f"  copy-engine workspace (symmetric memory, outside torch's allocator stats): "
                  f"{held / 2**30:.2f} GiB", flush=True)
        runner = None  # with step, nocomm and runs: every CUDA graph and its memory pool, before the next mode
        del step, nocomm, runs, metrics
        gc.collect()
        torch.cuda.empty_cache()
    faulthandler.cancel_dump_traceback_later()  # --dump-stacks-after: not during the collection of results
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", type=int, default=4)
    parser.add_argument("--ep", type=int, default=4)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--d-ff", type=int, default=1024, help="each expert's hidden width")
    parser.add_argument("--d-ff-shared", type=int, default=None,
                        help="a shared expert (dense SwiGLU every token passes) of this width; default none")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=4096, help="tokens per sequence; one sequence per microbatch")
    parser.add_argument("--microbatches", type=int, default=1, help="gradient-accumulation microbatches per step")
    parser.add_argument("--capacity-factor", type=float, default=1.0,
                        help="buffers hold capacity_factor x the balanced load (dropless would pad each to the "
                             "worst case, top_k x more rows than balanced); <= 0 means dropless")
    parser.add_argument("--routing", default="balanced", choices=["balanced", "learned"],
                        help="MoEGPTConfig(routing): balanced gives every expert its exact share (comparable step "
                             "times); learned is the untrained router")
    parser.add_argument("--chunks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--interleave", default="combined-1f1b", choices=fxshard.config.EP_INTERLEAVINGS,
                        help="with --microbatches > 1: which two microbatches alternate (Config(ep_interleave))")
    parser.add_argument("--sm-carveout", type=int, default=None,
                        help="overlap modes: Config(ep_sm_carveout=N), SMs kept free of matmuls in all-to-all windows")
    parser.add_argument("--all-to-all", nargs="+", default=["nccl"],
                        choices=["nccl", "copy-engine", STREAM_BARRIERS],  # named ones: "auto" would hide which
                        help="Config(ep_all_to_all) of the ep modes: each listed one gets an ep mode and the overlap "
                             "modes (copy-engine ones are labelled -ce and compared with the same nocomm; "
                             f"{STREAM_BARRIERS}: copy engines with Config(copy_engine_barriers='stream'), -ces)")
    parser.add_argument("--fsdp-collectives", default="nccl", choices=fxshard.config.FSDP_COLLECTIVES,
                        help="Config(fsdp_collectives) of every mode: ZeRO-1's reduce-scatters and gathers of "
                             "updated shards on NCCL or on the copy engines")
    parser.add_argument("--nccl-high-priority", action="store_true",
                        help="Config(nccl_high_priority=True) in every mode: NCCL's collectives (ZeRO-1's, NCCL "
                             "all-to-alls) on high-priority streams (compare a run without it)")
    parser.add_argument("--own-part", choices=fxshard.config.COPY_ENGINE_OWN_PARTS, default="auto",
                        help="Config(copy_engine_own_part) of every mode: copy-engine all-to-alls copy this rank's "
                             "own rows into the region (copy), or skip them and let the readers take them from the "
                             "input (input); auto: input under codegen")
    parser.add_argument("--dump-stacks-after", type=float, default=None, metavar="S",
                        help="print every thread's Python stack on each rank when a mode has run S seconds "
                             "(a hang's whereabouts; the run goes on)")
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--eager-replay", action="store_true")
    parser.add_argument("--collective-timeout", type=float, default=120.0,
                        help="Config(collective_timeout_s): a copy-engine collective that waits this long ends the "
                             "run naming it (a device command has 10 minutes)")
    parser.add_argument("--profile", metavar="DIR", help="after timing each mode, profile two steps: kernel table "
                        "into DIR, all-to-all time and its overlap with compute printed")
    parser.add_argument("--keep-traces", action="store_true",
                        help="with --profile: keep each mode's chrome trace in DIR, gzipped (rank 0, two steps)")
    parser.add_argument("--out", default="bench/moe.json")
    args = parser.parse_args()
    if args.capacity_factor <= 0:
        args.capacity_factor = None
    print(f"MoEGPT: {args.layers} layers, hidden {args.hidden}, {args.experts} experts x d_ff {args.d_ff}, "
          f"top-{args.top_k}, {args.routing} routing, shared expert {args.d_ff_shared}, S={args.seq} x {args.microbatches} microbatch(es) per rank ({args.interleave} with overlap), {args.gpus} GPUs, ep={args.ep}, capacity factor "
          f"{args.capacity_factor}, SM carveout {args.sm_carveout}, ZeRO collectives by {args.fsdp_collectives}{', NCCL on high-priority streams' if args.nccl_high_priority else ''}, own part of an all-to-all by {args.own_part}, {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"{'eager replay' if args.eager_replay else 'CUDA graphs'}", flush=True)
    results = run_local(run_modes, args.gpus, args, backend="nccl")[0]
    base, exposed = results["nocomm"], results["ep"] - results["nocomm"]
    tokens = args.gpus * args.microbatches * args.seq
    flops = step_flops(model_config(args), tokens, args.seq, results["dropped"])
    print(f"\nrouted: {results['dropped']} of {args.layers * tokens * args.top_k} assignments dropped; "
          f"{flops / 1e12:.1f} TFLOP per step; MFU of {args.gpus} x {H200_BF16_DENSE_PEAK / 1e12:.0f} TFLOP/s")
    print(f"{'mode':<18} {'ms/step':>9} {'MFU':>6} {'exposed a2a ms':>15} {'hidden vs ep':>13}")
    rows = []
    ce = [CE_SUFFIX[choice] for choice in CE_SUFFIX if choice in args.all_to_all]
    labels = ["nocomm", *["nocomm-nocopy" for _ in ce[:1]], "ep", *[f"ep{s}" for s in ce]]
    labels += [f"{kind}-overlap{c}" for c in args.chunks for kind in ("nocomm", "ep")]
    labels += [f"ep-overlap{c}{s}" for s in ce for c in args.chunks]
    for label in labels:
        if label not in results:  # --all-to-all copy-engine alone: no NCCL overlap modes
            continue
        ms = results[label]
        mfu = flops / (ms / 1e3) / (args.gpus * H200_BF16_DENSE_PEAK)
        row = {"mode": label, "ms_per_step": ms, "mfu": mfu}
        if f"{label}-own-parts-from-input" in results:  # [rewritten, copy-engine all-to-alls]
            row["own_parts_from_input"] = results[f"{label}-own-parts-from-input"]
        text = f"{label:<18} {ms:>9.2f} {mfu:>6.1%}"
        if label.startswith("ep"):
            own_base = results["nocomm" + without_ce(label[2:])]
            row.update(exposed_ms=ms - base, exposed_vs_own_nocomm_ms=ms - own_base,
                       hidden_fraction=1 - (ms - base) / exposed if exposed > 0 else None,
                       hidden_fraction_vs_own_nocomm=1 - (ms - own_base) / exposed if exposed > 0 else None)
            hidden = "-" if label == "ep" or exposed <= 0 else \
                f"{row['hidden_fraction']:.0%} ({row['hidden_fraction_vs_own_nocomm']:.0%})"
            text += f" {ms - base:>15.2f} {hidden:>13}"
        rows.append(row)
        print(text)
    if "nocomm-nocopy" in results:
        floor = results["nocomm-nocopy"]
        for row in rows:
            if row["mode"].startswith("ep"):
                row["hidden_fraction_vs_nocopy"] = 1 - (row["ms_per_step"] - floor) / (results["ep"] - floor)
        print("hidden against nocomm-nocopy (the all-to-alls' local copies left out too): " + ", ".join(
            f"{row['mode']} {row['hidden_fraction_vs_nocopy']:.0%}" for row in rows if row["mode"].startswith("ep-")))
    print(f"expert MLPs alone, one GPU: {results['experts-alone']:.2f} ms/step"
          f"\nhidden = 1 - (overlap - nocomm) / (ep - nocomm); in parentheses against nocomm with the same chunks")
    write_json(args.out, args=vars(args), experts_alone_ms=results["experts-alone"],
               kernels={k: v for k, v in results.items() if k.endswith("-kernels")},
               copy_engine_workspace_bytes=results.get("copy_engine_workspace_bytes"),
               dropped_assignments=results["dropped"], flops_per_step=flops,
               rows=rows)


if __name__ == "__main__":
    main()
