"""Each pipeline stage's compute, action by action, on one GPU: what bench/pipeline.py's simulator
would be given as measured costs, before two GPUs are at hand.

    python bench/probes/pipeline_fake_stages.py --out DIR [--schedules 1f1b interleaved-v2 zb-h1 dualpipev]
        [--unfused-grad-accumulation] [--half-blocks] [--stage-layers 10,10,9,7]

bench/pipeline.py's fxshard setup (GPT 1b, Mesh(pp=2), M=8 microbatches of 1x2048, bf16 compute / fp32
masters, AdamW, no_shard, codegen, eager replay). Each stage runs in its own process as that rank of a
2-rank world of torch's FakeProcessGroup: transfers and collectives do nothing (received values are
whatever the buffers held, so losses are meaningless and the non-finite guard may skip the update;
compute takes the same time on any values), and the cross-rank agreement checks are switched off. One
step is profiled; its kernels are attributed to actions through codegen's region ranges
(bench/pipeline.py `action_times`). --cat-flat-gradients runs without the runtime's flat-gradient
lowering (A/B; "_cat" in the file names). Prints per chunk the measured F / B (/ W) ms next to the FLOP
model's (`chunk_costs`), and the simulated bubble under each, and each rank's GPU busy time of the step (the union of its
kernels and copies); writes DIR/pipeline_fake_stages.json (with --unfused-grad-accumulation, which
runs Config(fuse_grad_accumulation=False): DIR/pipeline_fake_stages_unfused.json). --half-blocks and
--stage-layers cut as bench/pipeline.py's options of those names do (a cut inside a block) and add
"_halves" and the counts to the file names; a second run with the same options overwrites the summary.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

SCHEDULES = {"1f1b": ("1f1b", 1), "interleaved-v2": ("interleaved-1f1b", 2), "zb-h1": ("zb-h1", 1),
             "dualpipev": ("dualpipev", 2)}
HALF_BLOCKS = ("layers.*.attn", "layers.*.mlp")  # bench/pipeline.py --half-blocks: a cut may fall inside a block


def run_stage(schedule: str, rank: int, microbatches: int, out: str, fuse: bool = True, half_blocks: bool = False,
              stage_layers: tuple | None = None, cat_flat_gradients: bool = False) -> None:
    """In this process: rank `rank` of a fake 2-rank world; one profiled step of its stage.
    `cat_flat_gradients`: without the runtime's flat-gradient lowering (runtime/flat_gradients.py)."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import fxshard
    import fxshard.runtime.agreement as agreement
    import fxshard.runtime.step

    if cat_flat_gradients:  # the units' flat gradients as the fsdp pass writes them: a cat at the end
        fxshard.runtime.step.flat_gradients_in_place = lambda graph_module: (graph_module, 0)
    from fxshard.models import GPT, GPTConfig
    from pipeline import action_times, gpu_bubble  # bench/pipeline.py

    for name in ("check_agreement", "check_pipeline_streams", "connect_pipeline_peers"):  # they talk to the peer
        setattr(agreement, name, lambda *args, **kwargs: None)
    dist.init_process_group("fake", rank=rank, world_size=2, store=FakeStore())
    torch.cuda.set_device(0)
    name, virtual = SCHEDULES[schedule]
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = GPT(GPTConfig.preset("1b"))
    generator = torch.Generator().manual_seed(0)
    data = {k: torch.randint(0, 32000, (microbatches, 2048), generator=generator).cuda() for k in ("idx", "tgt")}
    config = fxshard.Config(schedule=name, virtual_stages=virtual, microbatches=microbatches,
                            param_dtype=torch.bfloat16, reduce_dtype=torch.float32, sharding="no_shard",
                            nonfinite="skip", fuse_grad_accumulation=fuse,  # received values are garbage
                            layers=HALF_BLOCKS if half_blocks else None, stage_layers=stage_layers)
    step = fxshard.shard(model, lambda m, b: m.loss(b), data, optimizer=fxshard.optim.AdamW(lr=1e-4),
                         mesh=fxshard.Mesh(pp=2), config=config)
    del model
    for _ in range(3):
        step(data)
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profiler:
        step(data)
        torch.cuda.synchronize()
    actions = [str(a) for a in step.program.stage.actions]
    with tempfile.TemporaryDirectory() as scratch:
        path = os.path.join(scratch, "trace.json")
        profiler.export_chrome_trace(path)
        with open(path) as handle:
            events = json.load(handle)["traceEvents"]
    times = action_times(events, actions)
    busy_ms = gpu_bubble(events)["busy_ms"]  # kernels, memsets and device copies; no communication
    census = kernel_census(events, actions)
    with open(out, "w") as handle:
        json.dump({"actions": actions, "action_ms": times, "pipeline": step.program.notes.get("pipeline"),
                   "busy_ms": busy_ms, "lowerings": step.lowerings(), "kernels": census}, handle)
    print(f"rank {rank}: GPU busy {busy_ms:.2f} ms a step; {step.lowerings()}", flush=True)
    print(f"rank {rank} kernels: " + json.dumps(census), flush=True)


def kernel_census(events: list[dict], actions: list[str]) -> dict:
    """Per kind of action (F / B / W / other: optimizer and once-per-step work): how many kernels a
    step launches, their GPU ms, and the ms of idle gaps before them shorter than bench/pipeline.py's
    WAIT_US (what session 23's traces found between kernels even under CUDA graphs, ~1.7 us each);
    the 12 kernel names launched most often in a step, with their count and ms; and one forward and
    one backward action of the steady state, kernel by kernel."""
    from pipeline import REGION_RANGE, WAIT_US, is_communication, kernels_by_range, owner_of

    kernels = sorted(kernels_by_range(events, REGION_RANGE, is_communication))
    kinds: dict[str, dict[str, float]] = {}
    names: dict[str, list[float]] = {}
    previous_end = None
    for start, end, name, label in kernels:
        kind = owner_of(label, actions)[0] if owner_of(label, actions) != "other" else "other"
        row = kinds.setdefault(kind, {"kernels": 0, "ms": 0.0, "gap_ms": 0.0})
        row["kernels"] += 1
        row["ms"] += (end - start) / 1e3
        if previous_end is not None and 0 < start - previous_end < WAIT_US:
            row["gap_ms"] += (start - previous_end) / 1e3
        previous_end = end if previous_end is None else max(previous_end, end)
        entry = names.setdefault(name[:90], [0, 0.0])
        entry[0] += 1
        entry[1] += (end - start) / 1e3
    top = sorted(names.items(), key=lambda item: -item[1][0])[:12]
    # one backward and one forward of the steady state, kernel by kernel (what a layer launches)
    middle = {kind: [i for i, a in enumerate(actions) if a.startswith(kind)] for kind in "FB"}
    sequences = {}
    for kind, indices in middle.items():
        if indices:
            label = str(indices[len(indices) // 2])
            sequences[actions[int(label)]] = [name[:70] for _, _, name, own in kernels if own == label]
    return {"by_kind": kinds, "most_launched": [[name, count, round(ms, 3)] for name, (count, ms) in top],
            "one_action": sequences}



def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--schedules", nargs="+", default=["1f1b", "interleaved-v2"], choices=sorted(SCHEDULES))
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--unfused-grad-accumulation", action="store_true",
                        help="Config(fuse_grad_accumulation=False): gradients added into their totals by a "
                             "cast-and-add of their own (the default adds them in the GEMM since session 34)")
    parser.add_argument("--half-blocks", action="store_true",
                        help="each block's attention and MLP layers of their own (a cut may fall inside a block)")
    parser.add_argument("--stage-layers", help="comma-separated layer counts per chunk (Config(stage_layers))")
    parser.add_argument("--cat-flat-gradients", action="store_true",
                        help="without the runtime's flat-gradient lowering (a cat per unit; before session 40)")
    parser.add_argument("--stage", nargs=3, metavar=("SCHEDULE", "RANK", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    stage_layers = tuple(int(n) for n in args.stage_layers.split(",")) if args.stage_layers else None
    if args.stage:
        run_stage(args.stage[0], int(args.stage[1]), args.microbatches, args.stage[2],
                  not args.unfused_grad_accumulation, args.half_blocks, stage_layers, args.cat_flat_gradients)
        return
    import torch

    import fxshard
    from fxshard.models import GPT, GPTConfig
    from fxshard.passes.pipeline import chunk_costs, split_stages
    from fxshard.schedule import build, simulate, unit_costs
    from pipeline import measured_costs

    os.makedirs(args.out, exist_ok=True)
    with torch.device("meta"):
        model = GPT(GPTConfig.preset("1b"))
    batch = {k: torch.zeros(1, 2048, dtype=torch.long) for k in ("idx", "tgt")}
    program = fxshard.trace(model, lambda m, b: m.loss(b), batch, optimizer=fxshard.optim.AdamW(lr=1e-4),
                            config=fxshard.Config(layers=HALF_BLOCKS if args.half_blocks else None))
    report = {}
    suffix = ("_unfused" if args.unfused_grad_accumulation else "") + ("_halves" if args.half_blocks else "") \
        + ("_cat" if args.cat_flat_gradients else "") \
        + (f"_{args.stage_layers.replace(',', '-')}" if args.stage_layers else "")
    for schedule in args.schedules:
        name, virtual = SCHEDULES[schedule]
        ranks = []
        for rank in range(2):
            path = os.path.join(args.out, f"{schedule}{suffix}_rank{rank}.json")
            subprocess.run([sys.executable, __file__, "--out", args.out, "--microbatches", str(args.microbatches),
                            *(["--unfused-grad-accumulation"] if args.unfused_grad_accumulation else []),
                            *(["--half-blocks"] if args.half_blocks else []),
                            *(["--cat-flat-gradients"] if args.cat_flat_gradients else []),
                            *(["--stage-layers", args.stage_layers] if args.stage_layers else []),
                            "--stage", schedule, str(rank), path], check=True)
            with open(path) as handle:
                ranks.append(json.load(handle))
        plan = build(name, 2, args.microbatches, virtual)
        flops = chunk_costs(split_stages(program, 2 * virtual, list(stage_layers) if stage_layers else None), plan)
        measured = measured_costs(ranks)
        # the FLOP model in ms: scaled so that its total forward time is the measured one
        forward_ms = sum(v for k, v in measured.items() if k.startswith("F"))
        scale = forward_ms / sum(v for k, v in flops.items() if k.startswith("F"))
        rows = {key: {"measured_ms": measured.get(key), "flop_model_ms": flops[key] * scale} for key in sorted(flops)}
        result = {"per_chunk": rows, "opt_and_other_ms": measured.get("OPT"),
                  "bubble_simulated_units": simulate(plan, unit_costs(plan)).bubble_fraction,
                  "bubble_simulated_flops": simulate(plan, flops).bubble_fraction,
                  "bubble_simulated_measured": simulate(plan, measured).bubble_fraction,
                  "bubble_simulated_measured_no_opt": simulate(plan, {**measured, "OPT": 0.0}).bubble_fraction,
                  "makespan_measured_ms": simulate(plan, measured).makespan,
                  "pipeline": [r["pipeline"] for r in ranks], "busy_ms": [r.get("busy_ms") for r in ranks],
                  "fuse_grad_accumulation": not args.unfused_grad_accumulation}
        report[schedule] = result
        print(f"\n{schedule}: " + "; ".join(result["pipeline"]))
        print(f"{'action':<8} {'measured ms':>12} {'FLOP model ms':>14}")
        for key, row in rows.items():
            got = "n/a" if row["measured_ms"] is None else f"{row['measured_ms']:.2f}"
            print(f"{key:<8} {got:>12} {row['flop_model_ms']:>14.2f}")
        print("GPU busy per rank (ms): " + ", ".join(f"{b:.2f}" for b in result["busy_ms"]))
        print(f"busy outside F/B/W per rank (OPT in the simulation): {result['opt_and_other_ms']:.2f} ms")
        print(f"simulated bubble: textbook units {result['bubble_simulated_units']:.1%}, FLOP costs "
              f"{result['bubble_simulated_flops']:.1%}, measured costs {result['bubble_simulated_measured']:.1%} "
              f"(without OPT {result['bubble_simulated_measured_no_opt']:.1%}); simulated step "
              f"{result['makespan_measured_ms']:.1f} ms")
    with open(os.path.join(args.out, f"pipeline_fake_stages{suffix}.json"), "w") as handle:
        json.dump(report, handle, indent=1)


if __name__ == "__main__":
    main()
