"""Pipeline benchmark: fxshard's schedules, eager and graphed, next to torch.distributed.pipelining.

    python bench/pipeline.py --gpus 2 --out bench/pipeline.json                      # 2x H200, the issue's job
    python bench/pipeline.py --device cpu --model tiny --n-layer 4 --seq 64 --gpus 2  # CPU smoke test (gloo)
    python bench/pipeline.py --gpus 2 --stage-layers 9,9 4,5,5,4                     # another cut, peer included
    python bench/pipeline.py --gpus 2 --half-blocks --stage-layers 10,10,9,7         # a cut inside a block (fxshard only)

GPT 1b (fxshard.models.GPT, untied head), pp=P (--gpus), M=8 microbatches of 1x2048, bf16 compute with fp32
master weights, AdamW, the same data (seed 0) in every mode. Every mode runs in its own spawned job of P
processes (NCCL; gloo with --device cpu), so a failing mode is reported and the others go on; each row prints
as its mode completes, and the modes can be split over several invocations (--peers, --schedules, --replays,
another --out). Modes:

    pipelining-1f1b       torch.distributed.pipelining, Schedule1F1B, one chunk per rank
    pipelining-interleaved  the peer the issue names: ScheduleInterleaved1F1B, V=2 chunks per rank placed in a
                          loop (rank r holds chunks r and r+P)
    pipelining-interleaved-compile  the same with torch.compile on each transformer block (torchtitan's recipe)
    <schedule>-eager      fxshard, Mesh(pp=P), Config(schedule=...), eager replay of each stage's program
    <schedule>-graphed    the same replayed from one CUDA graph per rank (Config(cuda_graphs=True); GPU only)

with <schedule> one of --schedules: 1f1b, interleaved-v2 (interleaved 1F1B, V=2, loop placement), zb-h1
(zero bubble, weight gradients split off), and, opt-in (--schedules ... dualpipev), dualpipev (two chunks
per rank in V placement, B / W split), skipped with the reason where fxshard.schedule.build does not know
it. fxshard modes use the default codegen (Inductor on CUDA, aten replay on CPU), no data parallelism
(sharding="no_shard"), bf16 compute and fp32 gradients (reduce_dtype), accumulated over the microbatches
in fp32; --bf16-grads adds each mode again as <mode>-gbf16 with bf16 gradients, the peer's precision.

The peer, as a user of torch.distributed.pipelining would write it: one nn.Module per chunk (the embedding and
its blocks, or its blocks and the final norm and head), cut at the same layers as fxshard's chunks (fxshard's
own split of the traced program, balanced by FLOPs; fxshard modes print their cut and it is checked against the
peer's; not with --half-blocks, below), `PipelineStage` per chunk, loss = the model's cross entropy (GPT.loss) per microbatch, gradients
scaled by 1/M (the mean over microbatches, as fxshard). Precision (--peer-precision): "bf16" (default) holds
the stage modules in bf16 and fp32 master copies; after the schedule's step the bf16 gradients (accumulated
over microbatches in bf16) are copied into the masters, fused torch.optim.AdamW steps the masters, and
`torch._foreach_copy_` writes them back into the bf16 modules: bf16 activations everywhere, as fxshard's
param_dtype. "autocast": fp32 modules, the step under torch.autocast(bf16) (weights cast once per step by
autocast's cache; the residual stream stays fp32, so activations and point-to-point are twice the bytes).

Columns: ms/step (median over --steps, each step timed alone between a barrier and a synchronize, the
slowest rank; the barriers are gloo's, on the host: no GPU work of theirs in a step's window),
tokens/s (the pipeline's M x batch x seq per step), "vs peer" = pipelining-interleaved's ms / this mode's ms (> 1: faster than the peer), "vs best peer" the same against the fastest
pipelining mode of the job, "vs eager" = the same schedule's eager ms / graphed ms, peak GiB (max over
ranks, after setup), the loss of the first and the last warm-up step (the same model, data and optimizer in
every mode: they should agree to bf16 rounding).

--half-blocks makes each block's attention and its MLP layers of their own for the fxshard modes
(Config(layers=("layers.*.attn", "layers.*.mlp")): what runs between them, a norm and a residual add,
belongs to the one before), so a cut can fall inside a block, where a rank's share of the work can
be evened out by half a block; --stage-layers then counts half-blocks for them. The peers keep their
FLOP cut of whole blocks (torch.distributed.pipelining is given modules), and the eager rows leave out
the per-layer diagnostics, which compare blocks.

Measured bubble: after timing, one more step per mode under torch.profiler (CUDA activity only), after
one profiled and discarded (the profiler's start-up would otherwise leave the GPU idle for ~2.7 ms at the
start of the window). Per rank,
busy = the union of GPU kernel, memset and device-to-device memcpy intervals that are not communication
(NCCL kernels, peer-to-peer memcpys), window = first to last GPU activity of the step on that rank (NCCL
included), bubble = 1 - busy / window; the table shows the mean over ranks (the simulator's bubble is its
mean over ranks too), the JSON each rank's and their max. The optimizer's kernels count as busy and lie
in the window (not subtracted; the simulator has no optimizer). "of it waits": the part of the bubble in
idle stretches of at least 20 us (WAIT_US), what a schedule's model can predict; the rest is gaps
between kernels (launches, dependencies), which a profile of thousands of kernels adds up (JSON
`short_gaps_ms` per rank). Kernels replayed from a CUDA graph appear in the trace or not depending on torch
and CUPTI: a graphed mode gets a bubble only where the trace holds kernels launched by its graph launch
(matched by correlation id), else "n/a" with the reason, never an estimate. On CPU it is always n/a.
During the timed steps nvidia-smi samples each rank's SM clock, power draw, temperature and
clock-event reasons every 20 ms (bench/common.py `GpuClocks`; JSON `gpu_clocks` per rank, one details
line per rank), and each row gets its energy a step (`energy_j_per_step`: both ranks' mean power x
ms/step), printed beside the targets against the lowest-energy peer row: on 2 H200s (session 44) every
busy mode runs at the 700 W power cap, a graphed step, with no launch gaps, at a lower clock than its
eager replay, so a GPU-bound step takes its joules over the cap.
The profiled step of an eager mode carries the profiler's own host overhead (CPU activity too, for the
region ranges below), which a host-bound step shows as extra bubble. --trace-dir keeps each mode's trace per rank (chrome://tracing, Perfetto).
--p2p-ctas N runs each fxshard schedule again with its point-to-point transfers on at most N CTAs
(Config(nccl_max_ctas={"pp": N})): an NCCL receive holds its SMs from when it is posted until the
peer sends, and a persistent GEMM beside it waits for them (session 26, 2x H200: stage 0's backward
GEMMs ran 1.8x longer beside the 16-CTA receive posted before it). --p2p-receives early late runs
each with receives issued late (Config(p2p_receives)'s default since session 27) and early
("<schedule>-early"; session 26's rows named late receives "<schedule>-late").
Simulated bubble: fxshard.schedule.simulate on the schedule with each chunk's F, B (and W) timed by
their GEMM FLOPs (passes/pipeline.py `chunk_costs`: a last chunk holding the head takes longer),
communication free; the JSON also has it with the textbook units F=1, B=2 (F=B=W=1 where W is split
off), `bubble_simulated_units`. A pipelining mode gets the fxshard schedule of the same kind (1F1B,
interleaved 1F1B V=2), whose order may differ slightly from torch's, on the same cut.
Simulated with measured costs ("sim. meas."): the profiled step of an fxshard eager mode names each
codegen region's call after its pipeline action (fxshard/codegen.py), so each kernel is attributed to
its action (`action_times`); the simulator then times every chunk's F / B / W by the mean of its
actions' GPU time over microbatches and ranks, and OPT by the busy GPU time in no such action
(optimizer, casts, custom ops), and times the transfers as the ranks' programs issue them
(`simulate(order=...)`: a pair's messages one at a time, in issue order), each as long as the
shortest NCCL point-to-point kernel of the step (a send or receive whose peer was ready; mean over
ranks). Its graphed mode runs the same kernels in the same order, so its own trace is timed the same
way: its kernel names lined up with the eager profile's (difflib) give each kernel its action
(`graphed_action_times`; where they do not line up, the eager profile's costs; JSON
`action_costs_from`). An eager step's profile carries host overhead, and on 2x H100 (2026-11-28) its
kernels alone were 8% busier than the graphed step's on one rank. The JSON also has it with
free transfers (`bubble_simulated_measured_free`), and with every compute action timed by its own
kernels rather than its chunk's mean (`bubble_simulated_actions`, printed beside the targets as a
diagnostic: what the schedule's model predicts once costs that vary over the microbatches are
known). The gap between this and the measured bubble is
what the model leaves out: NCCL sharing the SMs, host stalls, kernel gaps inside an action.
A graphed mode's JSON also has `drift` (`action_drift`, printed after the targets): per rank, each
action's measured start and end against the simulator's, and where the measured step falls behind.
A graphed mode also gets a diagnostic that counts those gaps as work on both sides: the simulator
fed each chunk's shortest action span (first kernel's start to last kernel's end, over microbatches
and ranks: `graphed_action_spans`, JSON `bubble_simulated_spans`), against the measured waits (idle
stretches of at least WAIT_US), which leave the gaps out of the bubble too. It is printed beside the
target, not as it.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import gc
import inspect
import json
import os
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import fxshard  # noqa: E402
from fxshard import meta  # noqa: E402
from fxshard.launch import run_local  # noqa: E402
from fxshard.models import GPT, GPTConfig  # noqa: E402
from fxshard.models.blocks import rope_tables  # noqa: E402
from fxshard.passes.pipeline import assign_layers, chunk_costs, split_stages  # noqa: E402
from fxshard.schedule import Action, build, simulate, unit_costs  # noqa: E402
from common import GpuClocks, device_name, gemms_beside, kernels_by_range, write_json  # noqa: E402

# fxshard schedule -> (Config(schedule=...), virtual stages)
SCHEDULES = {"1f1b": ("1f1b", 1), "interleaved-v2": ("interleaved-1f1b", 2), "zb-h1": ("zb-h1", 1),
             "dualpipev": ("dualpipev", 2)}
# pipelining mode -> (chunks per rank, torch.compile each block)
PEERS = {"pipelining-1f1b": (1, False), "pipelining-interleaved": (2, False),
         "pipelining-interleaved-compile": (2, True)}
PEER = "pipelining-interleaved"  # the issue's yardstick: ScheduleInterleaved1F1B
AGAIN = "-again"  # a peer's row run a second time, after fxshard's modes (--peers-again)
PEER_SCHEDULE = {1: ("1f1b", 1), 2: ("interleaved-1f1b", 2)}  # the fxshard schedule a peer is simulated as


def is_peer(mode: str) -> bool:
    """A peer's row, first run or again."""
    return mode.removesuffix(AGAIN) in PEERS


@dataclass(frozen=True)
class Setup:
    """What every mode's job shares."""

    model: str
    n_layer: int | None
    device: str           # "cuda" or "cpu"
    microbatches: int
    batch: int            # sequences per microbatch
    seq: int
    warmup: int
    steps: int
    peer_precision: str   # "bf16" or "autocast"
    trace_dir: str | None
    cuts: tuple = ()      # (chunks, fxshard's layer groups) pairs: the peer is cut where fxshard cuts
    stage_layers: tuple = ()  # (chunks, blocks per chunk) pairs from --stage-layers: those cuts instead of fxshard's
    nccl_high_priority: bool = False  # --nccl-high-priority: Config(nccl_high_priority) in every fxshard mode
    layers: tuple | None = None  # --half-blocks: Config(layers) of the fxshard modes (their --stage-layers count those)
    gc: str = "default"   # --gc freeze: gc.freeze() after the warm-up, before the timed steps (every mode)
    dispatched_ops: bool = False  # --dispatched-ops: Config(direct_calls=False) in every fxshard mode

    def config(self) -> GPTConfig:
        overrides = {} if self.n_layer is None else {"n_layer": self.n_layer}
        return GPTConfig.preset(self.model, **overrides)


def build_model(setup: Setup, device) -> GPT:
    torch.manual_seed(0)
    with torch.device(device):
        return GPT(setup.config())


def batch_for(setup: Setup, device) -> dict[str, torch.Tensor]:
    """The whole step's batch, M x batch rows, the same on every rank and in every mode."""
    generator = torch.Generator().manual_seed(0)
    rows, vocab = setup.batch * setup.microbatches, setup.config().vocab_size
    return {"idx": torch.randint(0, vocab, (rows, setup.seq), generator=generator).to(device),
            "tgt": torch.randint(0, vocab, (rows, setup.seq), generator=generator).to(device)}


def this_device(setup: Setup) -> torch.device:
    if setup.device == "cpu":
        return torch.device("cpu")
    device = torch.device("cuda", dist.get_rank())
    torch.cuda.set_device(device)
    return device


def synchronize(setup: Setup) -> None:
    if setup.device == "cuda":
        torch.cuda.synchronize()


def fxshard_split(model: GPT, setup: Setup, chunks: int, layers: tuple | None = None):
    """fxshard's split of `model` into `chunks` pipeline chunks (passes/pipeline.py: the program of one
    microbatch, traced, blocks balanced by FLOPs with the head counted in the last chunk, or as
    --stage-layers says); `model` may be on meta. `layers`: Config(layers) (--half-blocks, whose
    --stage-layers count half-blocks: a split of whole blocks then takes the FLOP cut)."""
    rows = setup.batch
    batch = {key: value[:rows].cpu() for key, value in batch_for(setup, "cpu").items()}
    program = fxshard.trace(model, lambda m, b: m.loss(b), batch, optimizer=fxshard.optim.AdamW(lr=1e-4),
                            config=fxshard.Config(layers=layers))
    counts = dict(setup.stage_layers).get(chunks) if layers == setup.layers else None
    return split_stages(program, chunks, counts)


def chunk_layers(setup: Setup, chunks: int) -> list[list[str]]:
    """The layers of each of fxshard's `chunks` chunks, as `main` traced them (Setup.cuts)."""
    return [list(group) for group in dict(setup.cuts)[chunks]]


def stage_parameter_names(model: GPT, groups: list[list[str]], rank_of, stages: int) -> list[list[str]]:
    """The parameter names each rank holds when chunk c lives on rank `rank_of(c)`, sorted."""
    prefixes = {meta.PRE: ["tok_emb."], meta.POST: ["norm.", "head."]}
    names: list[set[str]] = [set() for _ in range(stages)]
    for c, group in enumerate(groups):
        for layer in group:
            for prefix in prefixes.get(layer, [layer + "."]):
                names[rank_of(c)] |= {n for n, _ in model.named_parameters() if n.startswith(prefix)}
    return [sorted(n) for n in names]


class GPTChunk(nn.Module):
    """One pipeline chunk of GPT for torch.distributed.pipelining: the embedding (first chunk) and/or the
    final norm and head (last chunk) around its blocks. Takes token ids (first chunk) or the residual
    stream; returns the residual stream or the logits. Holds the model's own modules (no copy)."""

    def __init__(self, model: GPT, layers: list[str], seq: int):
        super().__init__()
        cfg = model.cfg
        self.tok_emb = model.tok_emb if meta.PRE in layers else None
        blocks = [layer for layer in layers if layer not in (meta.PRE, meta.POST)]
        self.layers = nn.ModuleList(model.get_submodule(layer) for layer in blocks)
        self.norm = model.norm if meta.POST in layers else None
        self.head = model.head if meta.POST in layers else None
        # fp32 tables, computed once (plain attributes: a .to(bf16) of the module leaves them fp32, as in GPT)
        self.cos, self.sin = rope_tables(seq, cfg.d_model // cfg.n_head, cfg.rope_theta, model.head.weight.device)

    def forward(self, x):
        if self.tok_emb is not None:
            x = self.tok_emb(x)
        for layer in self.layers:
            x = layer(x, self.cos, self.sin)
        if self.head is not None:
            x = self.head(self.norm(x))
        return x


def cross_entropy(logits, target):
    """GPT.loss on one microbatch's logits."""
    return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())


def run_peer(mode: str, setup: Setup) -> dict:
    """One rank of a torch.distributed.pipelining mode (see the module docstring)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

    rank, world = dist.get_rank(), dist.get_world_size()
    device = this_device(setup)
    virtual, compiled = PEERS[mode]
    model = build_model(setup, device)
    groups = chunk_layers(setup, world * virtual)
    indices = [rank + v * world for v in range(virtual)]  # loop placement, as fxshard's chunk c on rank c mod P
    modules = [GPTChunk(model, groups[c], setup.seq) for c in indices]
    del model  # the other ranks' blocks are freed with it
    params = [p for module in modules for p in module.parameters()]
    if setup.peer_precision == "bf16":
        masters = [nn.Parameter(p.detach().clone()) for p in params]
        for module in modules:
            module.to(torch.bfloat16)
        params = [p for module in modules for p in module.parameters()]
        optimizer = torch.optim.AdamW(masters, lr=1e-4, fused=True)
    else:
        masters = None
        optimizer = torch.optim.AdamW(params, lr=1e-4, fused=True)
    if compiled:
        for module in modules:
            for block in module.layers:
                block.compile()
    stages = [PipelineStage(module, c, world * virtual, device) for module, c in zip(modules, indices)]
    if virtual == 1:
        schedule = Schedule1F1B(stages[0], n_microbatches=setup.microbatches, loss_fn=cross_entropy)
    else:
        schedule = ScheduleInterleaved1F1B(stages, n_microbatches=setup.microbatches, loss_fn=cross_entropy)
    # the merged logits of all microbatches (M x S x vocab) are not needed: skip them where torch allows
    quiet = {"return_outputs": False} if "return_outputs" in inspect.signature(schedule.step).parameters else {}
    data = batch_for(setup, device)

    def step():
        losses: list[torch.Tensor] = []
        with torch.autocast(setup.device, dtype=torch.bfloat16, enabled=setup.peer_precision == "autocast"):
            if rank == 0:  # chunk 0 (the embedding) lives on rank 0
                schedule.step(data["idx"], **quiet)
            elif rank == world - 1:  # the last chunk (head, loss) on rank P-1
                schedule.step(target=data["tgt"], losses=losses, **quiet)
            else:
                schedule.step(**quiet)
        if masters is not None:
            for master, low in zip(masters, params):
                master.grad = low.grad.float()
                low.grad = None
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if masters is not None:
            with torch.no_grad():
                torch._foreach_copy_(params, masters)
        return torch.stack(losses).mean() if losses else None

    result = measure(step, setup, mode, graphed=False)
    result["params_by_stage"] = None
    return result


def run_fxshard(schedule_name: str, virtual: int, graphed: bool, label: str, setup: Setup,
                p2p_ctas: int | None = None, receives: str = "late", fuse_accumulation: bool = True,
                grads: str = "fp32", memsets: str = "kernels", marks: bool = True) -> dict:
    """One rank of an fxshard mode: Mesh(pp=P), the schedule, eager replay or CUDA graphs, the
    point-to-point transfers on at most `p2p_ctas` CTAs (Config(nccl_max_ctas={"pp": ...})), receives
    issued `receives` (Config(p2p_receives)), gradient accumulation in the wgrad GEMMs with
    `fuse_accumulation` (Config(fuse_grad_accumulation)), gradients accumulated and kept in `grads`
    ("fp32" or "bf16", as the peer's: Config(reduce_dtype)), the captured graph's library memsets as
    kernel nodes or kept (`memsets`: Config(cuda_graph_memsets)), the waits for NCCL marked under CUDA graphs
    or not (`marks`: Config(wait_marks))."""
    world = dist.get_world_size()
    device = this_device(setup)
    model = build_model(setup, device)
    data = batch_for(setup, device)
    config = fxshard.Config(schedule=schedule_name, virtual_stages=virtual, microbatches=setup.microbatches,
                            param_dtype=torch.bfloat16, sharding="no_shard",
                            reduce_dtype=torch.bfloat16 if grads == "bf16" else torch.float32,
                            cuda_graphs=graphed, nccl_max_ctas={"pp": p2p_ctas} if p2p_ctas else None,
                            p2p_receives=receives, fuse_grad_accumulation=fuse_accumulation,
                            stage_layers=dict(setup.stage_layers).get(world * virtual),
                            nccl_high_priority=setup.nccl_high_priority, layers=setup.layers,
                            cuda_graph_memsets=memsets, wait_marks=marks, direct_calls=not setup.dispatched_ops)
    started = time.perf_counter()
    step = fxshard.shard(model, lambda m, b: m.loss(b), data, optimizer=fxshard.optim.AdamW(lr=1e-4),
                         mesh=fxshard.Mesh(pp=world), config=config)
    compile_s = time.perf_counter() - started
    del model
    if setup.device == "cuda":
        torch.cuda.empty_cache()
    actions = [str(a) for a in step.program.stage.actions]
    result = measure(lambda: step(data)["loss"], setup, label, graphed, actions)
    result["actions"] = actions
    result["compile_s"] = compile_s
    result["direct_calls"] = step.direct_calls  # fxshard op calls past the dispatcher (0 with --dispatched-ops)
    result["wait_marks"] = step.wait_marks.count  # waits for NCCL marked (runtime/wait_marks.py; graphed only)
    replay = step._replay
    result["graph_memsets"] = replay.memsets.line() if replay is not None and replay.memsets is not None else None
    result["pipeline"] = step.program.notes.get("pipeline")
    plan = step.program.stage
    result["params_by_stage"] = [sorted(names) for names in plan.params_by_stage] if plan is not None else None
    return result


def measure(step_fn, setup: Setup, label: str, graphed: bool, actions: list[str] | None = None) -> dict:
    """Warm up, time `setup.steps` steps one by one, then profile one more (the bubble). `step_fn()`
    trains one step and returns its loss (or None on a rank that does not compute it), read during
    the warm-up only: the same model and data in every mode, so the losses should agree to bf16.
    `actions`: an fxshard stage's actions (StagePlan.actions), to time each from its kernels."""
    if setup.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    warmup_losses = []
    for _ in range(setup.warmup):
        loss = step_fn()
        if loss is not None:
            warmup_losses.append(loss.item())
    synchronize(setup)
    warmup_s = time.perf_counter() - started
    if setup.gc == "freeze":  # what the warm-up and the compile left is never looked at again
        gc.collect()
        gc.freeze()
    step_ms, host = [], {"issue_ms": [], "thread_cpu_ms": [], "process_cpu_ms": [], "gc_ms": []}
    with HostClock() as clock, GpuClocks() as clocks:
        for _ in range(setup.steps):
            synchronize(setup)
            host_barrier()
            clock.start()
            step_fn()
            clock.issued()
            synchronize(setup)
            step_ms.append(clock.end(host))
    peak = torch.cuda.max_memory_allocated() if setup.device == "cuda" else None
    bubble = profile_bubble(step_fn, setup, label, graphed, actions)
    return {"step_ms": step_ms, "warmup_s": warmup_s, "peak_bytes": peak, "warmup_losses": warmup_losses,
            "host": host, "gpu_clocks": clocks.summary(), **bubble}


class HostClock:
    """Where a timed step's host time went (is an eager replay held up by its host?): `issue_ms` until
    the step call returned (an eager replay's launches; a graph's one launch), `thread_cpu_ms` of it on
    the CPU in this thread, `process_cpu_ms` of every thread of the process over the whole step, and
    `gc_ms` in Python's cyclic garbage collector (timed by gc.callbacks). Thread CPU under issue_ms:
    the thread waited or was not scheduled. A launch into a full queue spins in the driver, which
    counts as CPU: an issue time under the GPU's time is paced by the GPU, one over it is the host's."""

    def __enter__(self):
        self.gc_s, self.gc_started = 0.0, None
        gc.callbacks.append(self._gc)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self._gc)

    def _gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self.gc_started = time.perf_counter()
        elif self.gc_started is not None:
            self.gc_s += time.perf_counter() - self.gc_started
            self.gc_started = None

    def start(self) -> None:
        self.gc_s = 0.0
        self.wall, self.thread, self.process = time.perf_counter(), time.thread_time(), time.process_time()

    def issued(self) -> None:
        self.issue_wall, self.issue_thread = time.perf_counter(), time.thread_time()

    def end(self, host: dict) -> float:
        """The step's wall ms; its host times appended to `host`'s lists."""
        now = time.perf_counter()
        host["issue_ms"].append((self.issue_wall - self.wall) * 1e3)
        host["thread_cpu_ms"].append((self.issue_thread - self.thread) * 1e3)
        host["process_cpu_ms"].append((time.process_time() - self.process) * 1e3)
        host["gc_ms"].append(self.gc_s * 1e3)
        return (now - self.wall) * 1e3


def profile_bubble(step_fn, setup: Setup, label: str, graphed: bool, actions: list[str] | None = None) -> dict:
    """One step under torch.profiler; this rank's bubble from its GPU activity (see the module docstring)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CUDA if setup.device == "cuda" else ProfilerActivity.CPU]
    if actions and not graphed and setup.device == "cuda":  # codegen's region ranges are CPU-side events
        activities.append(ProfilerActivity.CPU)
    synchronize(setup)
    host_barrier()
    synchronize(setup)
    with tempfile.TemporaryDirectory() as scratch:
        path = os.path.join(scratch, "trace.json")
        # One step profiled and discarded first: CUPTI allocates its activity buffers inside the first
        # CUDA call it records (2.6-2.8 ms with the GPU idle, at the window's start: 1.6 pp of bubble).
        # With a schedule, the active step's trace exists only in on_trace_ready.
        with profile(activities=activities, schedule=torch.profiler.schedule(wait=0, warmup=1, active=1),
                     on_trace_ready=lambda finished: finished.export_chrome_trace(path)) as prof:
            for _ in range(2):
                host_barrier()
                synchronize(setup)
                step_fn()
                synchronize(setup)
                prof.step()
        with open(path) as handle:
            events = json.load(handle).get("traceEvents", [])
        if setup.trace_dir:
            os.makedirs(setup.trace_dir, exist_ok=True)
            shutil.copy(path, os.path.join(setup.trace_dir, f"{label}_rank{dist.get_rank()}.json"))
    kernels = kernels_in_order(events, actions, graphed) if actions and setup.device == "cuda" else None
    by_layer = layer_kernels(events) if actions and not graphed else None
    return {**gpu_bubble(events, graphed), "action_ms": action_times(events, actions) if actions else None,
            "p2p_kernel_ms": point_to_point_times(events), "kernels_in_order": kernels,
            "action_kernels": action_kernels(events, actions) if actions and not graphed else None,
            "layer_ms": layer_times(by_layer) if by_layer is not None else None,
            "layer_excess": layer_excess(by_layer) if by_layer is not None else None,
            "gemms_beside_us": gemms_beside(events) if setup.device == "cuda" else None}


def kernels_in_order(events: list[dict], actions: list[str], graphed: bool) -> list[tuple]:
    """This rank's compute kernels (not communication) in the order they ran: for an eager step
    (name, owner), owner the action whose codegen region launched it (`action_times`) or "other"; for a
    graphed step (name, start us, end us) of the kernels its graph launch ran. `graphed_kernels_by_action`
    lines the second up with the first."""
    if not graphed:
        return [(name, owner_of(label, actions)) for _, _, name, label in
                kernels_by_range(events, REGION_RANGE, is_communication)]
    launches = graph_launches(events)
    kernels = [(str(e["name"]), float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))) for e in events
               if e.get("ph") == "X" and (e.get("args") or {}).get("correlation") in launches
               and (str(e.get("cat", "")).lower() in ("kernel", "gpu_memset")
                    or str(e.get("cat", "")).lower() == "gpu_memcpy" and "DtoD" in str(e.get("name", "")))
               and not is_communication(e)]
    return sorted(kernels, key=lambda kernel: kernel[1])


def owner_of(label: str | None, actions: list[str]) -> str:
    """The action a region's label names where it is a compute action (F / B / W), else "other"."""
    return actions[int(label)] if label is not None and actions[int(label)][0] in "FBW" else "other"


MIN_ALIGNED = 0.98  # of a graphed step's kernels that must line up with the eager step's, by name and order


def kernel_key(name: str) -> str:
    """A kernel's name as both traces write it: a memset's memory kind reads "Device" when launched
    eagerly and "Unknown" from a graph, where Config(cuda_graph_memsets) makes most of them the fill
    kernel of runtime/graph_memsets.py."""
    if name == "fxshard_fill32":
        return "Memset"
    return name.split(" (")[0] if name.startswith(("Memset", "Memcpy")) else name


def graphed_kernels_by_action(eager: list[tuple], graphed: list[tuple]) -> dict[str, list] | None:
    """A graphed step's kernel intervals per action: its graph runs the eager program's kernels in the
    same order, so the two name sequences line up (difflib; on 2x H100, 3,757 of 3,761 kernels on one
    rank) and each graphed kernel takes the action of its eager twin. Unmatched kernels (the few the
    capture adds or drops around the optimizer's all-reduces) count as "other". None where fewer than
    MIN_ALIGNED of them line up: then the sequences are not the same program's."""
    matcher = difflib.SequenceMatcher(None, [kernel_key(name) for name, _ in eager],
                                      [kernel_key(name) for name, _, _ in graphed], autojunk=False)
    owners = ["other"] * len(graphed)
    matched = 0
    for block in matcher.get_matching_blocks():
        for k in range(block.size):
            owners[block.b + k] = eager[block.a + k][1]
        matched += block.size
    if not graphed or matched < MIN_ALIGNED * len(graphed):
        return None
    per_action: dict[str, list[tuple[float, float]]] = {}
    for owner, (_, start, end) in zip(owners, graphed):
        per_action.setdefault(owner, []).append((start, end))
    return per_action


def graphed_action_times(per_action: dict[str, list]) -> dict[str, float]:
    """`action_times` for a graphed step, from its own kernels (`graphed_kernels_by_action`): per
    action, the union of its kernels' intervals."""
    return {owner: union_length(intervals) / 1e3 for owner, intervals in per_action.items()}


def graphed_action_spans(per_action: dict[str, list]) -> dict[str, float]:
    """Per compute action of a graphed step (`graphed_kernels_by_action`), from its first kernel's
    start to its last kernel's end (ms): its kernels and the gaps between them (~1.7 us after each
    kernel, even in a graph), and whatever wait for a transfer fell inside it. `span_costs` keeps the
    shortest per chunk and kind, the one that waited least."""
    return {owner: (max(end for _, end in intervals) - min(start for start, _ in intervals)) / 1e3
            for owner, intervals in per_action.items() if owner != "other"}


def point_to_point_times(events: list[dict]) -> list[float]:
    """Durations (ms, sorted) of this rank's NCCL point-to-point kernels in one step's trace. A send or
    receive kernel runs from its launch until its message is through, waiting for the peer included:
    the shortest ones, whose peer was already there, are the transfer itself."""
    return sorted(float(e.get("dur", 0.0)) / 1e3 for e in events
                  if e.get("ph") == "X" and str(e.get("cat", "")).lower() == "kernel"
                  and "sendrecv" in str(e.get("name", "")).lower())


def is_communication(event: dict) -> bool:
    name = event.get("name", "")
    return "nccl" in name.lower() or "PtoP" in name


def graph_launches(events: list[dict]) -> set:
    """Correlation ids of the trace's CUDA graph launches: the kernels a graph replay ran carry them."""
    return {(e.get("args") or {}).get("correlation") for e in events if e.get("ph") == "X"
            and str(e.get("cat", "")).lower() in ("cuda_runtime", "cuda_driver")
            and str(e.get("name", "")).startswith(("cudaGraphLaunch", "cuGraphLaunch"))}


def gpu_bubble(events: list[dict], graphed: bool = False) -> dict:
    """busy / window of the GPU activity in one process's chrome trace (its own GPU; timestamps in
    microseconds). A `graphed` step gets a bubble only where the trace holds kernels launched by its
    graph launch (matched by correlation id): the few kernels outside the graph are not the step."""
    activity, launches, launched_by = [], graph_launches(events), []
    for event in events:
        category = str(event.get("cat", "")).lower()
        args = event.get("args") or {}
        if event.get("ph") != "X":
            continue
        if category not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        start = float(event["ts"])
        end = start + float(event.get("dur", 0.0))
        is_copy_elsewhere = category == "gpu_memcpy" and "DtoD" not in event.get("name", "")
        activity.append((start, end, is_communication(event) or is_copy_elsewhere))
        if category == "kernel":
            launched_by.append(args.get("correlation"))
    result = {"bubble": None, "kernels": len(launched_by), "graph_kernels": None, "busy_ms": None, "window_ms": None,
              "bubble_note": None}
    if graphed:
        result["graph_kernels"] = sum(1 for c in launched_by if c in launches)
        if not launches:
            return {**result, "bubble_note": "no CUDA graph launch in the trace"}
        if not result["graph_kernels"]:
            return {**result, "bubble_note": "the CUDA graph's kernels are not in the trace"}
    if not launched_by:
        return {**result, "bubble_note": "no GPU kernels in the trace"}
    first, last = min(start for start, _, _ in activity), max(end for _, end, _ in activity)
    window = last - first
    busy_intervals = [(start, end) for start, end, is_comm in activity if not is_comm]
    busy = union_length(busy_intervals)
    gaps = idle_gaps(busy_intervals, first, last)
    short = sum(gap for gap in gaps if gap < WAIT_US)
    result.update(window_start_us=first)
    result.update(bubble=1 - busy / window if window > 0 else None, busy_ms=busy / 1e3, window_ms=window / 1e3,
                  bubble_waits=(window - busy - short) / window if window > 0 else None, short_gaps_ms=short / 1e3)
    return result


WAIT_US = 20.0  # idle stretches at least this long are waits (for data, a transfer); shorter ones launch gaps


def idle_gaps(intervals: list[tuple[float, float]], first: float, last: float) -> list[float]:
    """Lengths of the stretches of [first, last] that no interval covers."""
    gaps, reach = [], first
    for start, end in sorted(intervals):
        if start > reach:
            gaps.append(start - reach)
        reach = max(reach, end)
    if last > reach:
        gaps.append(last - reach)
    return gaps


REGION_RANGE = re.compile(r"^fxshard region_\d+ \[.* action (\d+)\]$")


def action_times(events: list[dict], actions: list[str]) -> dict[str, float] | None:
    """GPU time of this rank's pipeline actions in one process's chrome trace: each kernel (not
    communication) is attributed to the codegen region whose profiler range (`fxshard region_<i>
    [... action <a>]`, fxshard/codegen.py) launched it, by correlation id, and so to the stage's action
    `actions[a]`. A kernel launched between two ranges of the same action (a fixed node inside it:
    a custom op such as MoE's grouped GEMMs) counts for that action too. Per action, the union of its
    kernels' intervals. Returns {"F<c>:<mb>": ms, ..., "other": ms of busy GPU time in no F / B / W
    action (optimizer, once-per-step casts)}, or None where the trace holds no region ranges (CUDA
    graphs replay without them; codegen off)."""
    kernels = kernels_by_range(events, REGION_RANGE, is_communication)
    if not kernels:
        return None
    per_action: dict[str, list[tuple[float, float]]] = {}
    for start, end, _, label in kernels:
        per_action.setdefault(owner_of(label, actions), []).append((start, end))
    return {owner: union_length(intervals) / 1e3 for owner, intervals in per_action.items()}


LAYER_RANGE = re.compile(r"^fxshard region_\d+ \[\S+ (\S+)(?: mb \d+ action \d+)?\]$")


def layer_kernels(events: list[dict]) -> list[tuple[float, float, str, str | None]]:
    """One process's kernels, each with the layer ("pre", "layers.3", "post") of the codegen region that
    launched it (as `action_times` attributes them): what `layer_times` and `layer_excess` read."""
    return kernels_by_range(events, LAYER_RANGE, is_communication)


def layer_times(kernels: list[tuple]) -> dict[str, float] | None:
    """GPU time per layer in `layer_kernels`, forward, backward and optimizer together, in ms; None
    where the trace holds no region ranges."""
    if not kernels:
        return None
    per_layer: dict[str, list[tuple[float, float]]] = {}
    for start, end, _, layer in kernels:
        if layer not in (None, "-"):
            per_layer.setdefault(layer, []).append((start, end))
    return {layer: union_length(intervals) / 1e3 for layer, intervals in per_layer.items()}


TRITON_INDEX = re.compile(r"^(triton_.*)_\d+$")  # a generated kernel's name and its index in its region


def layer_excess(kernels: list[tuple], over: float = 0.05, top: int = 4) -> dict[str, list] | None:
    """The blocks in `layer_kernels` that take over `over` more GPU time than the median block
    (sessions 29 and 31: blocks at a chunk boundary 13-16 ms a step against 10.4; it found the
    first microbatch's whole forward in one codegen region named by one layer, fixed in codegen):
    for each, the `top` kernel names whose time exceeds the median block's most, as [name, ms a step
    more], and the median block's name under "reference". None without region ranges."""
    if not kernels:
        return None
    per_layer: dict[str, dict[str, float]] = {}
    for start, end, name, layer in kernels:
        if layer not in (None, "-", meta.PRE, meta.POST):
            table = per_layer.setdefault(layer, {})
            name = TRITON_INDEX.sub(r"\1", name)  # the same fusion is `..._view_1` in one region, `..._view_3` in another
            table[name] = table.get(name, 0.0) + (end - start) / 1e3
    if not per_layer:
        return None
    totals = {layer: sum(table.values()) for layer, table in per_layer.items()}
    reference = sorted(totals, key=totals.__getitem__)[len(totals) // 2]
    base = per_layer[reference]
    excess = {}
    for layer, table in per_layer.items():
        if totals[layer] > (1 + over) * totals[reference]:
            more = {name: ms - base.get(name, 0.0) for name, ms in table.items()}
            excess[layer] = [[name[:60], round(ms, 3)] for name, ms in
                             sorted(more.items(), key=lambda item: -item[1])[:top] if ms > 0]
    return {"reference": reference, **excess}


def time_balanced_cut(ranks: list[dict], order: list[str], chunks: int) -> tuple[dict[str, float], list[int]] | None:
    """Every layer's measured GPU time a step (`layer_times` of the rank that holds it) and the cut into
    `chunks` that makes the costliest chunk cheapest by those times (fxshard's `assign_layers`, the
    same DP as its FLOP cut), as Config(stage_layers) counts; `order`: the layers, pre to post. None
    without region ranges (graphed steps, codegen off)."""
    if any(r.get("layer_ms") is None for r in ranks):
        return None
    measured: dict[str, float] = {}
    for rank in ranks:
        for layer, ms in rank["layer_ms"].items():
            measured[layer] = measured.get(layer, 0.0) + ms
    blocks = [layer for layer in order if layer not in (meta.PRE, meta.POST)]
    groups = assign_layers(blocks, chunks, measured)
    return measured, block_counts(groups)


def block_counts(groups: list[list[str]]) -> list[int]:
    """Config(stage_layers) for a cut given as its chunks' layers: the blocks in each, pre and post left out."""
    return [sum(1 for layer in group if layer not in (meta.PRE, meta.POST)) for group in groups]


def action_kernels(events: list[dict], actions: list[str], top: int = 4) -> dict[str, list] | None:
    """Per chunk and kind (F0, B0, ...): the `top` kernels it spends most GPU time in, as [name, ms per
    microbatch], attributed as in `action_times`: what one chunk's action does that another's does not
    (session 25: stage 0's backward took 3.15x its forward, stage 1's 2.26x). None without region ranges."""
    kernels = kernels_by_range(events, REGION_RANGE, is_communication)
    if not kernels:
        return None
    totals: dict[str, dict[str, float]] = {}
    microbatches: dict[str, set] = {}
    for start, end, name, label in kernels:
        owner = owner_of(label, actions)
        if owner == "other":
            continue
        key = owner.split(":")[0]
        table = totals.setdefault(key, {})
        table[name] = table.get(name, 0.0) + (end - start) / 1e3
        microbatches.setdefault(key, set()).add(owner)
    return {key: [[name[:50], round(ms / len(microbatches[key]), 3)]
                  for name, ms in sorted(table.items(), key=lambda item: -item[1])[:top]]
            for key, table in sorted(totals.items())}


def measured_costs(ranks: list[dict]) -> dict[str, float] | None:
    """The simulator's `cost` from every rank's `action_times`: per chunk and kind (F, B, W), the mean
    over microbatches in ms; OPT the mean over ranks of the busy time in no F / B / W action; P2P, one
    transfer, the mean over ranks of their shortest point-to-point kernel (`point_to_point_times`)."""
    if any(r.get("action_ms") is None for r in ranks):
        return None
    samples: dict[str, list[float]] = {}  # an action that launched nothing (zb-h1's B of the first chunk) takes 0
    for rank in ranks:
        for action in rank["actions"]:
            if action[0] in "FBW" and action not in rank["action_ms"]:
                samples.setdefault(action.split(":")[0], []).append(0.0)
        for action, ms in rank["action_ms"].items():
            if action != "other":
                samples.setdefault(action.split(":")[0], []).append(ms)
    costs = {key: sum(values) / len(values) for key, values in samples.items()}
    costs["OPT"] = sum(r["action_ms"].get("other", 0.0) for r in ranks) / len(ranks)
    transfers = [r["p2p_kernel_ms"][0] for r in ranks if r.get("p2p_kernel_ms")]
    if transfers:  # each rank's shortest send / receive kernel: a transfer whose peer was ready
        costs["P2P"] = sum(transfers) / len(transfers)
    return costs


def span_costs(spans: list[dict[str, float]], costs: dict[str, float]) -> dict[str, float]:
    """`costs` (measured_costs) with each compute action's cost the shortest span of that chunk and
    kind over microbatches and ranks (`graphed_action_spans`): the gaps between its kernels count as
    its work, a wait inside it mostly does not. OPT and P2P stay as measured."""
    shortest: dict[str, float] = {}
    for rank in spans:
        for action, ms in rank.items():
            key = action.split(":")[0]
            shortest[key] = min(ms, shortest.get(key, ms))
    return {**costs, **shortest}


def union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by `intervals` (overlapping streams count once)."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


def simulated_bubble(schedule_name: str, stages: int, microbatches: int, virtual: int, split) -> tuple[float, float]:
    """The simulator's mean idle fraction with each chunk's actions timed by their FLOPs
    (`chunk_costs` of fxshard's `split`), and with the textbook units (F=1, B=2, or F=B=W=1)."""
    schedule = build(schedule_name, stages, microbatches, virtual)
    return (simulate(schedule, chunk_costs(split, schedule)).bubble_fraction,
            simulate(schedule, unit_costs(schedule)).bubble_fraction)


def unavailable_schedule(name: str, stages: int, microbatches: int) -> str | None:
    """Why this fxshard cannot build schedule `name` (dualpipev is new), or None."""
    schedule_name, virtual = SCHEDULES[name]
    try:
        build(schedule_name, stages, microbatches, virtual)
    except Exception as error:  # noqa: BLE001 - any reason is reported, and the mode skipped
        return f"{type(error).__name__}: {error}"
    return None


HOST_GROUP = None  # gloo, for the harness's barriers (`job`)


def host_barrier() -> None:
    """The ranks meet on the host: an NCCL barrier would put an all-reduce (and a wait for the slowest
    rank) on the GPU, inside the profiled step's window (2x H200: 0.4-0.9 ms of it before the step)."""
    dist.barrier(group=HOST_GROUP)


def job(kind: str, name: str, setup: Setup, graphed: bool = False) -> dict:
    """One mode on this rank (the function each spawned process runs)."""
    global HOST_GROUP
    HOST_GROUP = dist.new_group(backend="gloo")
    if kind == "peer":
        return run_peer(name, setup)
    schedule_name, virtual, ctas, receives, fused, grads, memsets, marks = schedule_of(name)
    return run_fxshard(schedule_name, virtual, graphed, f"{name}-{'graphed' if graphed else 'eager'}", setup, ctas,
                       receives, fused, grads, memsets, marks)


def schedule_of(name: str) -> tuple[str, int, int | None, str, bool, str, str, bool]:
    """An fxshard mode's schedule, virtual stages, the pp group's NCCL CTAs, Config(p2p_receives),
    Config(fuse_grad_accumulation) (on unless "-unfused"; "-fga", which named it on before session 34
    made it the default, reads as on), the gradients' dtype (Config(reduce_dtype)) and
    Config(cuda_graph_memsets) ("keep" with "-memsets") and Config(wait_marks) (off with "-nomarks"):
    "1f1b-ctas2-early-unfused-gbf16-memsets-nomarks" -> ("1f1b", 1, 2, "early", False, "bf16", "keep", False),
    "1f1b" -> ("1f1b", 1, None, "late", True, "fp32", "kernels", True)."""
    name, nomarks, _ = name.partition("-nomarks")
    name, keep, _ = name.partition("-memsets")
    name, bf16, _ = name.partition("-gbf16")
    name, unfused, _ = name.partition("-unfused")
    name, _, _ = name.partition("-fga")
    name, early, _ = name.partition("-early")
    base, found, ctas = name.partition("-ctas")
    return (*SCHEDULES[base], int(ctas) if found else None, "early" if early else "late", not unfused,
            "bf16" if bf16 else "fp32", "keep" if keep else "kernels", not nomarks)


def median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def combine(mode: str, ranks: list[dict], setup: Setup, simulated: float, simulated_units: float) -> dict:
    """One table row from every rank's result."""
    step_ms = [max(values) for values in zip(*(r["step_ms"] for r in ranks))]  # each step: the slowest rank
    ms = median(step_ms)
    bubbles = [r["bubble"] for r in ranks]
    measured = None if any(b is None for b in bubbles) else sum(bubbles) / len(bubbles)
    waits = [r.get("bubble_waits") for r in ranks]
    measured_waits = None if measured is None or any(w is None for w in waits) else sum(waits) / len(waits)
    peaks = [r["peak_bytes"] for r in ranks if r["peak_bytes"] is not None]
    losses = next((r["warmup_losses"] for r in reversed(ranks) if r["warmup_losses"]), [])
    note = next((f"rank {i}: {r['bubble_note']}" for i, r in enumerate(ranks) if r.get("bubble_note")), None)
    return {"mode": mode, "ms_per_step": ms, "tokens_per_s": setup.microbatches * setup.batch * setup.seq / (ms / 1e3),
            "bubble_measured": measured, "bubble_measured_max": None if measured is None else max(bubbles),
            "bubble_measured_waits": measured_waits,
            "bubble_simulated": simulated, "bubble_simulated_units": simulated_units, "bubble_note": note, "peak_bytes": max(peaks) if peaks else None,
            "warmup_losses": losses, "step_ms_all": step_ms,
            "per_rank": [{k: r.get(k) for k in PER_RANK} for r in ranks]}


PER_RANK = ("bubble", "bubble_waits", "short_gaps_ms", "bubble_note", "kernels", "graph_kernels", "busy_ms",
            "window_ms", "peak_bytes", "warmup_s", "compile_s", "pipeline", "host", "direct_calls", "gpu_clocks")  # what the JSON keeps of each rank's result


HEADER = (f"{'mode':<32} {'ms/step':>9} {'tokens/s':>9} {'vs peer':>8} {'vs best peer':>12} {'vs eager':>8} "
          f"{'bubble meas.':>12} {'of it waits':>11} {'sim. FLOPs':>10} {'sim. meas.':>10} {'peak GiB':>8} "
          f"{'loss warm-up 1st, last':>22}")


def format_row(row: dict, rows: list[dict]) -> str:
    by_mode = {r["mode"]: r for r in rows}
    peers = [r["ms_per_step"] for r in rows if is_peer(r["mode"])]

    def ratio(other_ms):
        return f"{other_ms / row['ms_per_step']:.2f}x" if other_ms else "-"

    peer = by_mode.get(PEER)
    eager = by_mode.get(row["mode"].replace("-graphed", "-eager")) if row["mode"].endswith("-graphed") else None

    def percent(value):
        return "n/a" if value is None else f"{value:.1%}"

    peak = "-" if row["peak_bytes"] is None else f"{row['peak_bytes'] / 2**30:.1f}"
    losses = row["warmup_losses"]
    loss = f"{losses[0]:.4f}, {losses[-1]:.4f}" if losses else "-"
    return (f"{row['mode']:<32} {row['ms_per_step']:>9.1f} {row['tokens_per_s']:>9.0f} "
            f"{ratio(peer['ms_per_step'] if peer else None):>8} {ratio(min(peers) if peers else None):>12} "
            f"{ratio(eager['ms_per_step'] if eager else None):>8} {percent(row['bubble_measured']):>12} "
            f"{percent(row.get('bubble_measured_waits')):>11} {percent(row['bubble_simulated']):>10} "
            f"{percent(row.get('bubble_simulated_measured')):>10} "
            f"{peak:>8} {loss:>22}")


def planned_modes(args) -> list[tuple[str, str, bool]]:
    """(kind, name, graphed) of every mode to run, in order: the peers, then each fxshard schedule eager
    and graphed (graphed on CUDA only; a schedule this fxshard cannot build is skipped, saying why),
    then again with each of `--p2p-ctas` ("1f1b-ctas2"), for each of `--p2p-receives` ("1f1b-early");
    with `--peers-again`, the peers once more at the end ("<peer>-again"): the host's speed moves the
    peers' times between minutes of one job (bench/RESULTS.md, session 43), so they bracket fxshard's."""
    modes = [("peer", name, False) for name in args.peers]
    replays = [r for r in args.replays if args.device == "cuda" or r == "eager"]
    for name in args.schedules:
        reason = unavailable_schedule(name, args.gpus, args.microbatches)
        if reason:
            print(f"{name}: not in this fxshard ({reason[:200]}); skipped", flush=True)
            continue
        modes += [("fxshard", name + (f"-ctas{ctas}" if ctas else "") + ("-early" if receives == "early" else "")
                   + ("" if fused else "-unfused") + ("-gbf16" if grads == "bf16" else "")
                   + ("-memsets" if keep else "") + ("" if marks else "-nomarks"), replay == "graphed")
                  for grads in ["fp32", *(["bf16"] if args.bf16_grads else [])]
                  for fused in sorted({True, not args.unfused_grad_accumulation}, reverse=True)
                  for receives in args.p2p_receives
                  for ctas in [None, *args.p2p_ctas] for replay in replays
                  for keep in [False, *([True] if args.keep_graph_memsets and replay == "graphed" else [])]
                  for marks in [True, *([False] if args.no_wait_marks and replay == "graphed" else [])]]
    return modes + [("peer" + AGAIN, name, False) for name in args.peers if args.peers_again]


def run_mode(kind: str, name: str, graphed: bool, setup: Setup, gpus: int, model: GPT,
             splits: dict) -> tuple[dict, list[dict]] | None:
    """One mode in its own job of `gpus` processes: its table row and every rank's result, or None
    (the failure printed). `splits`: {"peer" or "fxshard": {virtual stages: the split its kind runs}}.
    Kind "peer-again": the peer `name` run again, its row named "<name>-again"."""
    again = kind == "peer" + AGAIN
    kind = "peer" if again else kind
    mode = name + (AGAIN if again else "") if kind == "peer" else f"{name}-{'graphed' if graphed else 'eager'}"
    started = time.perf_counter()
    try:
        ranks = run_local(job, gpus, kind, name, setup, graphed,
                          backend="nccl" if setup.device == "cuda" else "gloo")
    except Exception as error:  # report and go on: one failing mode must not hide the others
        print(f"{mode:<32} failed after {time.perf_counter() - started:.0f}s: {type(error).__name__}: "
              f"{str(error)[-600:]}", flush=True)
        return None
    schedule_name, virtual = PEER_SCHEDULE[PEERS[name][0]] if kind == "peer" else schedule_of(name)[:2]
    row = combine(mode, ranks, setup, *simulated_bubble(schedule_name, gpus, setup.microbatches, virtual,
                                                        splits[kind][virtual]))
    row["schedule"] = (schedule_name, virtual)
    row["issued"] = [r["actions"] for r in ranks] if kind == "fxshard" else None  # each rank's program order
    time_by_measured_costs(row, measured_costs(ranks) if kind == "fxshard" else None, gpus, setup.microbatches,
                           [r["action_ms"] for r in ranks] if kind == "fxshard" else None)
    row["action_costs_from"] = "eager profile" if row["action_costs_ms"] else None
    row["job_s"] = time.perf_counter() - started
    details = [f"warm-up {max(r['warmup_s'] for r in ranks):.1f}s",
               f"kernels traced per rank {[r['kernels'] for r in ranks]}"]
    if ranks[0].get("graph_memsets"):
        details.append("rank 0 " + ranks[0]["graph_memsets"])
    if ranks[0].get("wait_marks"):
        details.append(f"waits for NCCL marked per rank {[r.get('wait_marks') for r in ranks]}")
    if kind == "fxshard":
        details.insert(0, f"fxshard.shard {max(r['compile_s'] for r in ranks):.1f}s")
        placement = build(schedule_name, gpus, setup.microbatches, virtual).rank_of
        expected = stage_parameter_names(model, chunk_layers(setup, gpus * virtual), placement, gpus)
        # fxshard's own cut against the one the peer is built with (--half-blocks: another cut on purpose)
        if not setup.layers and ranks[0]["params_by_stage"] != expected:
            details.append(f"WARNING: fxshard's stages hold other parameters than this bench's cut "
                           f"({[len(n) for n in ranks[0]['params_by_stage']]} vs {[len(n) for n in expected]})")
    if all(r.get("host") for r in ranks):  # is a replay held up by its host? (HostClock)
        details.append("host a step, median per rank (issue / its thread's CPU / process CPU / gc): " + ", ".join(
            f"rank {i} " + " / ".join(f"{median(r['host'][key]):.1f}" for key in
                                      ("issue_ms", "thread_cpu_ms", "process_cpu_ms", "gc_ms"))
            for i, r in enumerate(ranks)) + " ms")
    busy = [r.get("busy_ms") for r in ranks]
    if all(b is not None for b in busy) and len(busy) > 1:  # a cut balanced in FLOPs may not be in time
        details.append(f"GPU busy per rank {[round(b, 1) for b in busy]} ms, the busiest "
                       f"{max(busy) / (sum(busy) / len(busy)) - 1:.1%} above the mean")
    if any(r.get("gpu_clocks") for r in ranks):  # a denser step may run at a lower clock (GpuClocks)
        details.extend(f"rank {index} timed steps: {GpuClocks.line(r.get('gpu_clocks'))}"
                       for index, r in enumerate(ranks))
        if all(r.get("gpu_clocks") for r in ranks):  # at the power cap, a step's time is its energy / the cap
            row["energy_j_per_step"] = sum(r["gpu_clocks"]["power_w_mean"] for r in ranks) * row["ms_per_step"] / 1e3
            details.append(f"~{row['energy_j_per_step']:.0f} J a step on {len(ranks)} GPUs (mean power while "
                           f"timing x ms/step; the barriers between timed steps included)")
    for index, rank in enumerate(ranks):  # the point-to-point kernels' cost to the GEMMs they overlap
        if rank.get("gemms_beside_us"):
            us = rank["gemms_beside_us"]
            details.append(f"rank {index} GEMMs {us['gemm_us'] / 1e3:.1f} ms, {us['gemm_beside_us'] / 1e3:.1f} of it "
                           f"beside NCCL kernels, ~{us['gemm_beside_extra_us'] / 1e3:.1f} ms longer than alone")
    if kind == "fxshard" and not graphed and not setup.layers:  # the cut the measured layer times would make
        order = [layer for group in chunk_layers(setup, gpus * virtual) for layer in group]
        balanced = time_balanced_cut(ranks, order, gpus * virtual)
        if balanced is not None:
            measured, counts = balanced
            blocks = [ms for layer, ms in measured.items() if layer not in (meta.PRE, meta.POST)]
            row["layer_ms"], row["time_balanced_stage_layers"] = measured, counts
            current = block_counts(chunk_layers(setup, gpus * virtual))
            details.append(f"measured ms a step: pre {measured.get(meta.PRE, 0.0):.1f}, blocks "
                           f"{min(blocks, default=0):.1f}-{max(blocks, default=0):.1f}, post "
                           f"{measured.get(meta.POST, 0.0):.1f}; a cut balanced by them: --stage-layers "
                           f"{','.join(map(str, counts))} (this one: {','.join(map(str, current))})")
    if kind == "fxshard" and not graphed and not setup.layers:  # what makes a block slower than the median one
        row["layer_excess"] = [r.get("layer_excess") for r in ranks]
        for index, excess in enumerate(row["layer_excess"]):
            for layer, table in (excess or {}).items():
                if layer != "reference":
                    details.append(f"rank {index} {layer}, ms a step over {excess['reference']}: "
                                   + ", ".join(f"{name} +{ms}" for name, ms in table))
    if kind == "fxshard" and not graphed:  # what each action spends its time in, chunk by chunk
        row["action_kernels"] = [r.get("action_kernels") for r in ranks]
        for index, kernels in enumerate(row["action_kernels"]):
            for key, table in (kernels or {}).items():
                details.append(f"rank {index} {key} heaviest kernels (ms a microbatch): "
                               + ", ".join(f"{name} {ms:.2f}" for name, ms in table))
    row["details"] = details
    return row, ranks


def time_graphed_actions(row: dict, ranks: list[dict], eager_ranks: list[dict] | None, eager_row: dict | None,
                         gpus: int, microbatches: int) -> None:
    """A graphed row's measured costs: its own kernels' times, each kernel given its action by lining
    the graph's kernels up with the eager step's (`graphed_action_times`); where they do not line up on
    every rank, the eager profile's costs (the same kernels, timed in another step). The row says which
    (`action_costs_from`)."""
    costs, source, per_action, action_ms = None, None, None, None
    if eager_ranks and all(r.get("kernels_in_order") for r in ranks + eager_ranks):
        per_action = [graphed_kernels_by_action(e["kernels_in_order"], g["kernels_in_order"])
                      for e, g in zip(eager_ranks, ranks)]
        if all(p is not None for p in per_action):
            action_ms = [graphed_action_times(p) for p in per_action]
            costs = measured_costs([{**g, "action_ms": ms} for g, ms in zip(ranks, action_ms)])
            source = "graphed trace"
    if costs is None and eager_row and eager_row["action_costs_ms"]:
        costs, source = eager_row["action_costs_ms"], "eager profile"
    time_by_measured_costs(row, costs, gpus, microbatches, action_ms)
    row["action_costs_from"] = source
    # A diagnostic beside the target: the gaps between kernels as work of the actions (span costs),
    # against the measured waits, which leave those gaps out of the bubble too.
    row["action_span_costs_ms"] = row["bubble_simulated_spans"] = None
    row["drift"] = None
    if source == "graphed trace":
        row["action_span_costs_ms"] = span_costs([graphed_action_spans(p) for p in per_action], costs)
        row["bubble_simulated_spans"] = simulated_as_issued(row, row["action_span_costs_ms"], gpus, microbatches)
        if all(r.get("window_start_us") is not None for r in ranks):
            spans = [{owner: ((min(s for s, _ in iv) - r["window_start_us"]) / 1e3,
                              (max(e for _, e in iv) - r["window_start_us"]) / 1e3)
                      for owner, iv in p.items() if owner != "other"} for r, p in zip(ranks, per_action)]
            row["drift"] = action_drift(row, spans, costs, gpus, microbatches)


def action_drift(row: dict, spans: list[dict], costs: dict, gpus: int, microbatches: int, top: int = 4) -> list[dict]:
    """Where a graphed step falls behind the simulator's timing of it. Per rank, each compute action's
    measured (start, end) in ms from the rank's window start (`spans`; each rank's own clock) against
    the simulated ones under `costs` and the ranks' issue order, as `timeline` rows [action, start,
    end, simulated start, simulated end]; and the `top` places where the lag (measured - simulated
    start) grows most: an action that ran longer than its cost ("longer"), or one that started later
    after the action before it than the simulation has it ("later": a wait the model does not have,
    or work outside any action, e.g. the step's start). A span runs from the action's first kernel to
    its last: a chunk's first forward, whose casts run before the wait for its input, counts that
    wait as "longer" (and starts "later" by less, or earlier). Session 40 found the casts after a
    receive's wait, and the gradients' flattening in a chunk's last backward, this way."""
    sim, order = simulate_as_issued(row, costs, gpus, microbatches)
    drift = []
    for rank, actions in enumerate(order):
        timeline, growth, lag = [], [], 0.0
        for index, action in enumerate(actions):
            if str(action) not in spans[rank]:
                continue
            start, end = spans[rank][str(action)]
            sim_start, sim_end = sim.start[rank, index], sim.end[rank, index]
            timeline.append([str(action), round(start, 3), round(end, 3), round(sim_start, 3), round(sim_end, 3)])
            growth.append([str(action), "later", round(start - sim_start - lag, 3)])
            growth.append([str(action), "longer", round((end - start) - (sim_end - sim_start), 3)])
            lag = end - sim_end
        growth.sort(key=lambda item: -item[2])
        drift.append({"timeline": timeline, "growth": growth[:top], "lag_at_end_ms": round(lag, 3)})
    return drift


def print_drift(rows: list[dict]) -> None:
    """`action_drift` of each graphed row, one line per rank."""
    drifting = [row for row in rows if row.get("drift")]
    if drifting:
        print("\nwhere each graphed step falls behind the simulation with measured costs (ms; each rank's clock):")
    for row in drifting:
        for rank, item in enumerate(row["drift"]):
            print(f"  {row['mode']} rank {rank}: last action ends {item['lag_at_end_ms']:+.2f} behind; most at "
                  + ", ".join(f"{action} {how} {ms:+.2f}" for action, how, ms in item["growth"]))


def time_by_measured_costs(row: dict, costs: dict | None, gpus: int, microbatches: int,
                           action_ms: list[dict] | None = None) -> None:
    """`row`'s action costs and the bubble the simulator gives its schedule under them (None without):
    `bubble_simulated_measured` with the transfers timed as the ranks issued them
    (`simulated_as_issued`), `bubble_simulated_measured_free` with free transfers. With `action_ms`
    (each rank's time per action), `bubble_simulated_actions`: every compute action timed by its own
    kernels instead of its chunk's mean over microbatches (a diagnostic: a first microbatch's casts,
    a last one's gradient flattening, the clock drifting over the step, where they fall)."""
    row["action_costs_ms"] = costs
    row["bubble_simulated_measured"] = row["bubble_simulated_measured_free"] = row["bubble_simulated_actions"] = None
    if costs:
        schedule = build(row["schedule"][0], gpus, microbatches, row["schedule"][1])
        row["bubble_simulated_measured_free"] = simulate(schedule, {**costs, "P2P": 0.0}).bubble_fraction
        row["bubble_simulated_measured"] = simulated_as_issued(row, costs, gpus, microbatches)
        if action_ms and all(action_ms):
            own = {action: ms for rank in action_ms for action, ms in rank.items() if action != "other"}
            row["bubble_simulated_actions"] = simulated_as_issued(row, {**costs, **own}, gpus, microbatches)


def simulated_as_issued(row: dict, costs: dict, gpus: int, microbatches: int) -> float:
    """The simulated bubble of `row`'s schedule under `costs`, with the transfers timed as the ranks
    issued them (`simulate_as_issued`)."""
    return simulate_as_issued(row, costs, gpus, microbatches)[0].bubble_fraction


def simulate_as_issued(row: dict, costs: dict, gpus: int, microbatches: int):
    """`simulate` of `row`'s schedule under `costs` with each rank's actions in its program's order
    (`row["issued"]`; the transfers one at a time per pair of ranks, each `costs["P2P"]` long), and
    that order (None where the row has none)."""
    schedule = build(row["schedule"][0], gpus, microbatches, row["schedule"][1])
    issued = row.get("issued")
    order = [tuple(Action.parse(token) for token in actions) for actions in issued] if issued else None
    return simulate(schedule, costs, order=order), order


def eager_host(row: dict) -> str:
    """What held an eager row's steps: its host's issue time (HostClock, the median step of its
    slowest rank) against its busiest rank's GPU time. An issue time under the GPU time: the GPU paced
    the launches, and a graph saves only the gaps between kernels. Over it: the host was the limit,
    which a graph removes. Empty where either is unknown (a CPU run)."""
    ranks = row.get("per_rank") or []
    issue = [median(r["host"]["issue_ms"]) for r in ranks if (r.get("host") or {}).get("issue_ms")]
    busy = [r["busy_ms"] for r in ranks if r.get("busy_ms") is not None]
    if not issue or not busy or len(issue) != len(ranks):
        return ""
    limit = "the host is the limit" if max(issue) > max(busy) else "the GPU paces it"
    return f"; eager's host issued a step in {max(issue):.1f} ms against {max(busy):.1f} ms of GPU work: {limit}"


def against(peer: dict, row: dict) -> str:
    """`row`'s speedup over a peer row and, for a graphed row, whether it meets the 1.2x target."""
    speedup = peer["ms_per_step"] / row["ms_per_step"]
    verdict = ('met' if speedup >= 1.2 else 'NOT met') if row["mode"].endswith("-graphed") else "no target"
    return f"{speedup:.2f}x ({verdict})"


def print_targets(rows: list[dict]) -> None:
    """The issue's targets per fxshard mode: graphed >= 1.1x eager, >= 1.2x the peer, measured bubble
    within 2 points of the simulated one (an eager row: the last two, for reference)."""
    by_mode = {r["mode"]: r for r in rows}
    peer = by_mode.get(PEER)
    fastest = min((r for r in rows if is_peer(r["mode"])), key=lambda r: r["ms_per_step"], default=None)
    print("\ntargets (graphed >= 1.1x eager, >= 1.2x pipelining-interleaved, |bubble measured - simulated| <= 2 pp;"
          " the same 1.2x against the fastest peer row, the strongest baseline a user would pick):")
    for row in rows:
        if is_peer(row["mode"]):
            continue
        eager = by_mode.get(row["mode"].replace("-graphed", "-eager")) if row["mode"].endswith("-graphed") else None
        parts = []
        if eager:
            speedup = eager["ms_per_step"] / row["ms_per_step"]
            parts.append(f"vs eager {speedup:.2f}x ({'met' if speedup >= 1.1 else 'NOT met'}{eager_host(eager)})")
        if peer:
            parts.append(f"vs peer {against(peer, row)}")
        if fastest and fastest is not peer:
            parts.append(f"vs the fastest peer row ({fastest['mode']}, {fastest['ms_per_step']:.1f} ms) "
                         f"{against(fastest, row)}")
        lowest = min((r for r in rows if is_peer(r["mode"]) and r.get("energy_j_per_step")),
                     key=lambda r: r["energy_j_per_step"], default=None)
        if lowest and row.get("energy_j_per_step"):  # at the power cap a GPU-bound step takes its joules / the cap
            parts.append(f"energy a step {row['energy_j_per_step']:.0f} J against {lowest['mode']}'s "
                         f"{lowest['energy_j_per_step']:.0f} J, {lowest['energy_j_per_step'] / row['energy_j_per_step']:.2f}x "
                         f"(diagnostic: the ratio of two steps both held by the GPUs' power cap)")
        if row["bubble_measured"] is None:
            parts.append("bubble n/a")
        for key, what in (("bubble_simulated", "FLOP costs"), ("bubble_simulated_measured", "measured costs")):
            if row["bubble_measured"] is not None and row.get(key) is not None:
                gap = (row["bubble_measured"] - row[key]) * 100
                parts.append(f"bubble vs simulated with {what} {gap:+.1f} pp ({'met' if abs(gap) <= 2 else 'NOT met'})")
        if row.get("bubble_measured_waits") is not None and row.get("bubble_simulated_measured") is not None:
            gap = (row["bubble_measured_waits"] - row["bubble_simulated_measured"]) * 100
            parts.append(f"waits alone vs simulated with measured costs {gap:+.1f} pp (diagnostic, not the target)")
        if row["bubble_measured"] is not None and row.get("bubble_simulated_actions") is not None:
            gap = (row["bubble_measured"] - row["bubble_simulated_actions"]) * 100
            parts.append(f"bubble vs simulated with each action's own measured time "
                         f"({row['bubble_simulated_actions']:.1%}) {gap:+.1f} pp (diagnostic, not the target)")
        if row.get("bubble_measured_waits") is not None and row.get("bubble_simulated_spans") is not None:
            gap = (row["bubble_measured_waits"] - row["bubble_simulated_spans"]) * 100
            parts.append(f"waits alone vs simulated with action spans ({row['bubble_simulated_spans']:.1%}: gaps between "
                         f"kernels as the actions' work) {gap:+.1f} pp (diagnostic, not the target)")
        print(f"  {row['mode']}: " + ", ".join(parts))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", type=int, default=2, help="pipeline stages P (one process each)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--model", default="1b", help="GPTConfig preset")
    parser.add_argument("--n-layer", type=int, help="override the preset's block count (tiny has 2: use 4 for V=2)")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--batch", type=int, default=1, help="sequences per microbatch")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=4, help="steps before timing (CUDA graphs capture at the 3rd)")
    parser.add_argument("--peers", nargs="*", default=list(PEERS), choices=list(PEERS))
    parser.add_argument("--peers-again", action="store_true",
                        help="run the peers again after fxshard's modes: their times move with the host's speed")
    parser.add_argument("--schedules", nargs="*", default=["1f1b", "interleaved-v2", "zb-h1"], choices=list(SCHEDULES))
    parser.add_argument("--replays", nargs="+", default=["eager", "graphed"], choices=["eager", "graphed"])
    parser.add_argument("--peer-precision", choices=["bf16", "autocast"], default="bf16")
    parser.add_argument("--trace-dir", help="keep each mode's profiler trace per rank here")
    parser.add_argument("--stage-layers", nargs="*", default=[], metavar="N,N,...",
                        help="blocks per chunk for the cut with that many chunks, e.g. 9,9 (pp=2) and 4,5,5,4 (V=2): "
                             "fxshard and the peer cut there instead of fxshard's FLOP balance")
    parser.add_argument("--p2p-ctas", nargs="*", type=int, default=[], metavar="N",
                        help="each fxshard schedule again with Config(nccl_max_ctas={'pp': N}), as <schedule>-ctasN: "
                             "its point-to-point kernels, which hold their SMs from when they are posted, on N CTAs")
    parser.add_argument("--p2p-receives", nargs="+", default=["late"], choices=["early", "late"],
                        help="Config(p2p_receives) of the fxshard modes, each a mode (early: <schedule>-early)")
    parser.add_argument("--unfused-grad-accumulation", action="store_true",
                        help="each fxshard mode again with Config(fuse_grad_accumulation=False), as <mode>-unfused: "
                             "each microbatch's weight gradients added into their fp32 totals by a cast-and-add of "
                             "their own, not by the wgrad GEMMs (the default since session 34)")
    parser.add_argument("--nccl-high-priority", action="store_true",
                        help="Config(nccl_high_priority=True) in every fxshard mode: the point-to-point kernels on "
                             "high-priority streams (compare a run without it)")
    parser.add_argument("--bf16-grads", action="store_true",
                        help="each fxshard mode again with its gradients accumulated in bf16 (Config(reduce_dtype="
                             "torch.bfloat16)), as <mode>-gbf16: the peer's precision (--peer-precision bf16 accumulates "
                             "in its bf16 modules' .grad)")
    parser.add_argument("--keep-graph-memsets", action="store_true",
                        help="each graphed fxshard mode again with Config(cuda_graph_memsets='keep'), as "
                             "<mode>-memsets-graphed: cuBLAS's and cuDNN's memsets left as memset nodes in the graph "
                             "(the default since session 39 makes them kernel nodes)")
    parser.add_argument("--no-wait-marks", action="store_true",
                        help="each graphed fxshard mode again with Config(wait_marks=False), as <mode>-nomarks-graphed: "
                             "no stream memory write before each wait for an NCCL transfer or collective "
                             "(runtime/wait_marks.py), what the marks cost")
    parser.add_argument("--half-blocks", action="store_true",
                        help="the fxshard modes take each block's attention and MLP as layers (Config(layers)), so a "
                             "cut can fall inside a block; --stage-layers then counts half-blocks for them, and the "
                             "peers keep their own FLOP cut of whole blocks")
    parser.add_argument("--gc", choices=["default", "freeze"], default="default",
                        help="freeze: gc.collect() and gc.freeze() after each mode's warm-up, so Python's collector "
                             "never walks what compiling left (the host-time lines say how long it ran a step)")
    parser.add_argument("--dispatched-ops", action="store_true",
                        help="Config(direct_calls=False) in every fxshard mode: fxshard's ops called through the "
                             "dispatcher, as before the runtime called them as their bodies in eager replay "
                             "(fxshard/runtime/direct_calls.py): the host-time lines of its eager rows against a run "
                             "without it")
    parser.add_argument("--out", default="bench/pipeline.json")
    args = parser.parse_args()
    try:
        stage_layers = tuple((len(counts), counts) for counts in
                             (tuple(int(n) for n in spec.split(",")) for spec in args.stage_layers))
    except ValueError:
        parser.error(f"--stage-layers takes comma-separated block counts per chunk, got {args.stage_layers}")
    setup = Setup(args.model, args.n_layer, args.device, args.microbatches, args.batch, args.seq,
                  max(args.warmup, 1), args.steps, args.peer_precision, args.trace_dir, stage_layers=stage_layers,
                  nccl_high_priority=args.nccl_high_priority, gc=args.gc,
                  dispatched_ops=args.dispatched_ops,
                  layers=("layers.*.attn", "layers.*.mlp") if args.half_blocks else None)
    model = build_model(setup, "meta")
    params = sum(p.numel() for p in model.parameters())
    print(f"GPT {args.model} ({params / 1e9:.2f}B, {setup.config().n_layer} blocks), pp={args.gpus}, "
          f"M={args.microbatches}, microbatch {args.batch}x{args.seq}, {device_name()}, torch {torch.__version__}, "
          f"peer precision {args.peer_precision}", flush=True)
    virtuals = sorted({PEERS[p][0] for p in args.peers} | {SCHEDULES[s][1] for s in args.schedules})
    splits = {virtual: fxshard_split(model, setup, args.gpus * virtual) for virtual in virtuals}
    setup = dataclasses.replace(setup, cuts=tuple((len(split.chunks), tuple(c.layers for c in split.chunks))
                                                  for split in splits.values()))
    own = {virtual: fxshard_split(model, setup, args.gpus * virtual, setup.layers) for virtual in virtuals} \
        if setup.layers else splits
    for who, cuts in (("", splits), ("fxshard's half-blocks ", own if setup.layers else {})):
        for split in cuts.values():
            print(f"  {who}cut into {len(split.chunks)} chunks: " + " | ".join(", ".join(c.layers) for c in split.chunks),
                  flush=True)
    splits = {"peer": splits, "fxshard": own}
    modes = planned_modes(args)
    print(HEADER, flush=True)
    rows, ranks_of = [], {}
    for kind, name, graphed in modes:
        result = run_mode(kind, name, graphed, setup, args.gpus, model, splits)
        if result is not None:
            row, ranks_of[result[0]["mode"]] = result
            rows.append(row)
            print(format_row(row, rows), flush=True)
            print(f"  {row['job_s']:.0f}s in all; " + "; ".join(row["details"]), flush=True)
    for row in rows:
        if row["mode"].endswith("-graphed"):
            time_graphed_actions(row, ranks_of[row["mode"]], ranks_of.get(row["mode"].replace("-graphed", "-eager")),
                                 next((r for r in rows if r["mode"] == row["mode"].replace("-graphed", "-eager")), None),
                                 args.gpus, args.microbatches)
    print("\nall modes (ratios against every row of the job):")
    print(HEADER)
    for row in rows:
        print(format_row(row, rows))
    for row in rows:
        if row["bubble_note"]:
            print(f"  {row['mode']}: bubble n/a, {row['bubble_note']}")
    print_targets(rows)
    print_drift(rows)
    write_json(args.out, model=args.model, params=params, gpus=args.gpus, microbatches=args.microbatches,
               batch=args.batch, seq=args.seq, peer_precision=args.peer_precision,
               nccl_high_priority=args.nccl_high_priority, stage_layers=args.stage_layers, gc=args.gc,
               dispatched_ops=args.dispatched_ops,
               layers=list(setup.layers) if setup.layers else None, rows=rows)


if __name__ == "__main__":
    main()
