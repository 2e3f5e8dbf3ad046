"""Config: every switch of the compiler in one frozen dataclass. Later features add fields, never rename."""

from __future__ import annotations

import os

import dataclasses
from dataclasses import dataclass

from typing import TYPE_CHECKING

import torch

from .errors import FxShardError

MESH_AXES = ("pp", "dp", "ep", "edp")  # the process groups' axes (Mesh.all_groups), for nccl_max_ctas

if TYPE_CHECKING:
    from .loss_scale import LossScale
    from .schedule import Schedule

# FSDP strategies, Megatron's names (ZeRO: none, 1, 2, 3); passes/fsdp.py documents each.
SHARDING_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
PIPELINE_SCHEDULES = ("1f1b", "interleaved-1f1b", "gpipe", "zb-h1", "dualpipev")
P2P_RECEIVES = ("early", "late")  # where fxshard.schedule.issue_order issues a receive
EP_INTERLEAVINGS = ("combined-1f1b", "dual-batch")
EP_ALL_TO_ALLS = ("auto", "nccl", "copy-engine")
FSDP_COLLECTIVES = ("auto", "nccl", "copy-engine")
CUDA_GRAPH_MEMSETS = ("kernels", "keep")  # runtime/graph_memsets.py
COPY_ENGINE_BARRIERS = ("kernel", "stream")  # runtime/copy_engine.py
COPY_ENGINE_OWN_PARTS = ("auto", "copy", "input")  # runtime/copy_engine.py resolve_own_part
CODEGENS = ("auto", "inductor", None)
CODEGEN_REGIONS = ("layer", "communication")
NONFINITE_MODES = ("raise", "skip", "ignore", None)  # None: "skip" under a dynamic loss scale, else "raise"
# the settings that take one of a few values, and those values
CHOICES = {"sharding": SHARDING_STRATEGIES, "p2p_receives": P2P_RECEIVES, "ep_interleave": EP_INTERLEAVINGS,
           "ep_all_to_all": EP_ALL_TO_ALLS, "fsdp_collectives": FSDP_COLLECTIVES,
           "copy_engine_barriers": COPY_ENGINE_BARRIERS, "copy_engine_own_part": COPY_ENGINE_OWN_PARTS,
           "cuda_graph_memsets": CUDA_GRAPH_MEMSETS, "nonfinite": NONFINITE_MODES, "codegen": CODEGENS,
           "codegen_regions": CODEGEN_REGIONS}


_COMPUTE_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


@dataclass(frozen=True)
class Config:
    """How `fxshard.shard` compiles a step.

    dump_dir: write the traced program and the program after every pass there (also `FXSHARD_DUMP`).
    layers: module paths (globs allowed, e.g. "blocks.*") whose modules are one layer each; default:
        the children of the model's ModuleList / Sequential / ModuleDict holding the most parameters
        (fxshard/layers.py). What runs
        between two layers outside both belongs to the one before, so ("layers.*.attn",
        "layers.*.mlp") lets a pipeline cut fall inside a block (Config(stage_layers) then counts
        half-blocks).
    clip_grad_norm: clip gradients to this global L2 norm before the update (None: no clipping).
    collective_timeout_s: a step that waits longer than this in one collective or transfer fails with
        an FxShardError naming it (kind, shape, phase, layer, unit, group) instead of hanging; fxshard's
        process groups are created with this timeout. The default, 10 minutes, leaves room for ranks
        that compile at different speeds. Under CUDA graphs on a mesh, where NCCL's watchdog does not
        see the replayed collectives, it is also the longest one step's replay may run: a longer one is
        reported on stderr and this rank's process groups are aborted, so the job fails instead of
        hanging (fxshard/runtime/replay_watch.py). Tested on gloo; in eager replay on NCCL the
        watchdog's own timeout error is raised, not yet mapped to the node that waited. The calls every
        rank makes outside the step (save, load, parameters(), state_dict(), evaluate()'s first
        compile) start with agreements that wait this long too, on a gloo group of every rank made at
        shard (api._job_group); a save's or load's file I/O waits on the default group, whose timeout
        (init_process_group(timeout=...)) bounds the slowest rank's disk.
    verbose: print what the runtime lowered (`step.lowerings()`) and every codegen region's progress to
        stderr (without it, only compiles longer than 5 s report progress).
    sharding: on a mesh, what FSDP shards over `dp` (Megatron's names): "no_shard" (DDP), "optim"
        (ZeRO-1), "optim_grads" (ZeRO-2; today the same program as "optim": gradients accumulate whole
        over microbatches and are reduce-scattered once a step), "optim_grads_params" (ZeRO-3).
    fsdp_prefetch: issue a unit's all-gather this many units ahead of its first use, counting only
        units of at least a tenth of the median all-gather's bytes (a norm gains' unit rides along). With Mesh(pp>1)
        under ZeRO-3: this many compute actions of the stage's schedule ahead of the chunk's first use
        (the schedule's U action, fxshard.schedule.add_zero_actions); the chunk then stays gathered
        while the step uses it (at most two chunks per rank at once).
    param_dtype: compute with parameters cast to this dtype (e.g. torch.bfloat16); masters and
        optimizer state keep the model's dtype. Under ZeRO-3 the cast happens on the shard, before the
        all-gather. BatchNorm's weight and bias stay in the model's dtype, next to its statistics (as
        torch FSDP's MixedPrecision keeps their weights; their gradients are still reduced in
        reduce_dtype). None: no cast.
    reduce_dtype: gradients are cast to this dtype before they are reduced, and summed over
        microbatches in it (None: param_dtype's; with param_dtype=torch.bfloat16 and microbatches,
        torch.float32 keeps the sum in fp32, as Megatron and torchtitan do).
    microbatches: split each step's batch into this many microbatches along dim 0 and accumulate their
        gradients before one reduction and one update (the loss is their mean).
    cuda_graphs: after two eager warm-up steps, capture the whole step into one CUDA graph and replay it
        (collectives included; with Mesh(pp>1) each stage's step, sends and receives included).
    cuda_graph_memsets: "kernels" (default) replaces the small memsets that cuBLAS and cuDNN capture
        into the graph with kernel nodes writing the same bytes (runtime/graph_memsets.py: on an H200
        a memset node leaves the GPU idle ~7 us around it, a kernel node ~0.5 us; GPT 1b's pipeline
        stage has 800 a step); "keep" leaves the captured graph as it is. The runtime lowerings line
        (`step.lowerings()`) says how many were replaced once the graph is captured.
    wait_marks: under CUDA graphs on a mesh, each wait for an NCCL collective or transfer first writes its
        number into pinned host memory (two stream memory operations, no kernel; runtime/wait_marks.py),
        so a step that a stalled peer holds past collective_timeout_s is reported with the collective or
        transfer it waits for, not only the step. False: no marks (the report names the step).
    direct_calls: in eager replay (no CUDA graphs), call fxshard's own ops outside the compiled regions
        as their Python bodies, past torch's dispatcher (runtime/direct_calls.py: 12-29 us of host time
        saved a call on an H200 machine's host, ~450 calls a step on a GPT 1b pipeline stage). The same
        code runs either way; False keeps every call through torch.ops, where a TorchDispatchMode or
        the profiler's op ranges see them.
    fuse_grad_accumulation: with microbatches (pipelines included), add each weight gradient into its
        float32 total inside the weight-gradient matmul instead of in a memory pass of its own
        (passes/fuse_grad_accumulation.py, `fxshard::matmul_accumulate`: on CUDA one GEMM whose
        epilogue adds into the total; Megatron's gradient-accumulation fusion). It applies where bf16
        (or fp16) compute meets float32 gradients, and changes rounding only: a microbatch's weight
        gradient is no longer rounded to bf16 before it is added. On by default: the runtime runs the
        GEMM in place on the total (one H200, GPT 1b at pp=2, M=8: each stage's GPU work 2.6-4.3%
        less; bench/RESULTS.md, session 34). False keeps a separate cast-and-add per microbatch.
    fuse_grouped_mlp: rewrite each MoE expert MLP (grouped GEMM -> activation -> grouped GEMM, forward
        and backward) into the fused `fxshard::grouped_mlp` op (passes/fuse_grouped_mlp.py).
    schedule: with Mesh(pp=P): "1f1b" (default), "interleaved-1f1b", "gpipe", "zb-h1" (zero bubble:
        weight gradients split off and delayed into the bubbles) or "dualpipev" (DeepSeek's DualPipeV:
        two chunks per rank placed in a V, rank r holding chunks r and 2P-1-r, so the first and the
        last chunk share rank 0; zero-bubble W's; M >= 2P-1; it sets virtual_stages to 2, and refuses
        any other value than 1 or 2); `microbatches` is the number of pipeline microbatches M,
        `virtual_stages` V chunks per rank (interleaved: M % P == 0).
        Or a `fxshard.schedule.Schedule` of one's own (per-rank action lists, e.g. read with
        `Schedule.from_json`; its `placement` says which rank holds each chunk, "loop" or "v"): it
        sets `microbatches` and `virtual_stages`, and `shard` checks it with
        the simulator (every dependency met, point-to-point deadlock-free) before lowering it.
    virtual_stages: with Mesh(pp=P), the chunks V each rank holds (P*V chunks in all); more than 1 needs
        an interleaved schedule ("interleaved-1f1b"; "dualpipev" sets 2).
    stage_layers: layers per pipeline chunk (P*V counts); default: balanced by FLOPs (head and embedding counted).
    p2p_receives: where a stage's program issues each point-to-point receive: "late" (default: just
        before the compute that reads it, or the next transfer with that peer) or "early" (right after
        the previous transfer with the same peer, so the data moves as soon as it is sent). An NCCL
        receive holds its SMs from when the device reaches it until the data has come, slowing the
        GEMMs the stage runs meanwhile: on 2x H200, GPT 1b, pp=2, early receives made stage 0's
        backward GEMMs 1.4-1.8x slower, and late ones made the graphed step 1.13x (1F1B) and 1.10x
        (interleaved V=2) faster (bench/RESULTS.md, session 27). "late" makes a receive wait where the
        stage would wait for the data anyway, at a cost: a message larger than NCCL's buffers (a
        channel holds 4 MiB by default) moves only once its receive is issued, so its transfer lands
        on the reader's path, and the sender's kernel holds its SMs until then. Both orders are
        checked deadlock-free (fxshard.schedule.check_point_to_point); with ep_overlap's combined 1F1B
        the pairs are chosen under early receives and the lowering re-checks them with late ones (an
        order that could hang is refused at shard(), not run).
    moe_capacity_factor: bound every `fxshard.moe.dispatch` call to ceil(factor * tokens * top_k /
        experts) assignments per expert (per call, i.e. per rank and microbatch; fxshard/moe.py gives
        the drop rule); None leaves each call's own setting (MoEGPT: dropless unless its config says).
        Under expert parallelism it also sizes the all-to-all buffers (dropless pads to the worst case).
    ep_overlap: with Mesh(ep>1), overlap the all-to-alls with compute: move work that does not
        need an all-to-all between its issue and its wait (passes/overlap.py: the weight gradients of
        the layer above, a shared expert), split each MoE layer's experts into `ep_chunks` groups so
        one chunk's all-to-alls run while another chunk's experts compute (passes/ep.py; default 1: no
        split, which measured faster on H200s: the split's own compute cost more than it hid), and
        with `microbatches` > 1 interleave two microbatches, switching at each all-to-all
        (passes/interleave.py; which two: `ep_interleave`).
    ep_chunks: with ep_overlap, split each rank's experts into this many groups, each with its own
        dispatch / experts / combine (default 1: no split).
    ep_interleave: "combined-1f1b" (backward m with forward m+1; Megatron) or "dual-batch" (forward
        m with forward m+1, backward m with backward m+1; DeepSeek's dual-batch overlap: every
        all-to-all has the other microbatch's compute to hide behind, two microbatches' activations
        alive at once).
    ep_sm_carveout: on CUDA, matmuls placed while an EP all-to-all is in flight leave this many SMs
        free for it (fxshard/runtime/carveout.py; torch's experimental SM carveout), so a persistent
        GEMM next to the all-to-all kernel does not spill into a second wave. None: off. Only with NCCL
        all-to-alls: copy-engine ones hold no SMs to leave room for.
    ep_all_to_all: how EP all-to-alls move data on CUDA: "nccl" (an NCCL kernel, which holds SMs
        while it runs), "copy-engine" (peer-to-peer memcpys through symmetric memory on a side
        stream, no SMs beyond two one-block barriers; GPUs of one host with peer access:
        fxshard/runtime/copy_engine.py) or "auto" (default: copy engines where they were measured
        faster, a step under CUDA graphs of 2 CUDA processes on one host with peer access; NCCL
        elsewhere, eager replay included, where each copy-engine collective costs ~10 host launches:
        `choose_auto`; `step.lowerings()` says what it chose and why). CPU/gloo always uses the process group's
        all-to-all.
    fsdp_collectives: how the fsdp pass's all-gathers and reduce-scatters move data on CUDA: "nccl",
        "copy-engine" (as ep_all_to_all: peer-to-peer memcpys, no SMs taken from the GEMMs they
        overlap; a reduce-scatter adds one summing kernel; GPUs of one host with peer access) or
        "auto" (default, as ep_all_to_all). Each collective's result lives in a region of one
        symmetric workspace per group, reused once no later node reads it
        (fxshard/runtime/workspace_plan.py; `step.lowerings()` prints its size). CPU/gloo always
        uses the process group's collectives.
    copy_engine_barriers: how the copy-engine collectives' two barriers wait: "kernel" (default:
        torch's symmetric-memory barrier, a one-block kernel that spins on an SM until every peer has
        arrived and traps after collective_timeout_s) or "stream" (CUDA stream memory operations,
        cuStreamWaitValue32: the side stream waits holding no SM). Measured on 2 H200s
        (bench/RESULTS.md, session 28): MoE with dual-batch overlap 57.67 ms against 57.95 (its GEMMs
        ~0.9 ms slower beside the barriers instead of ~3.8), ZeRO-3 no different. A stream wait cannot
        time out, and on H200 a device-side assert neither releases it nor could always be launched
        behind it: after collective_timeout_s the copy-engine watch names the collective on stderr,
        tries that assert, and the process exits with status 1 20 s later (every thread's stack on
        stderr) unless fxshard reported the error first. A stream wait blocks the hardware queue its
        stream is mapped to, which other streams may share (CUDA_DEVICE_MAX_CONNECTIONS, 8 by
        default; 1 is refused).
    copy_engine_own_part: where the readers of a copy-engine EP all-to-all's result take this rank's
        own rows: "copy" (the exchange copies them into its region, a device-to-device copy that holds
        compute up like a kernel), "input" (the exchange skips them and each reader reads
        `cat([region rows, input's own rows, region rows])`, which Inductor fuses into the reader's
        gather on CUDA; under aten replay the cat is written out) or "auto" (default: "input" under
        codegen, else "copy"). Measured on 2 H200s (bench/RESULTS.md, session 32): MoE with dual-batch
        overlap 0.65-0.72 ms a step faster with "input". `step.lowerings()` counts the all-to-alls
        rewritten; one whose readers cannot take it (an op with its own kernel, a view written into)
        keeps the copy.
    nccl_max_ctas: on NCCL, each process group fxshard makes runs its collectives on at most this many
        CTAs (thread blocks, one SM each; NCCL's `maxCTAs` config of the communicator). An NCCL
        collective holds its SMs while it runs, and the GEMMs overlapping it run on the rest: fewer
        CTAs leave more SMs to compute and make each collective slower (bench/fsdp.py `fxshard-ctasN`
        measures both sides; GPT 1b ZeRO-3 on 2 H200s got slower with 16, 8 and 4: README). A dict
        limits only the groups of the axes it names (a weight tied across some stages is reduced on a
        group of those stages, which takes the "pp" limit), e.g. {"pp": 2}: a pipeline's point-to-point
        transfers, whose receive kernels (16 CTAs by NCCL's choice on 2 H200s) wait on their SMs from
        when they are posted until the peer sends, next to the stage's GEMMs (bench/pipeline.py
        `--p2p-ctas`). None (default): NCCL's choice. Ignored by gloo and by copy-engine collectives
        (they use no SMs).
    nccl_high_priority: NCCL runs the collectives of the process groups fxshard makes on high-priority
        streams (ProcessGroupNCCL's `is_high_priority_stream`; CUDA graphs keep each kernel's priority).
        An NCCL kernel issued beside a kernel of many thread blocks otherwise gets SMs only as that
        kernel's blocks drain: 2x H200, MoE with ZeRO-1 (session 29), each all-gather of an updated
        shard started only when the expert AdamW kernel launched before it had finished, which left
        ~0.7 ms of gathers at the end of the step with no compute beside them. False (default): measured
        in session 31 it changed nothing (MoE and pipelines; bench/RESULTS.md). Ignored by gloo.
    codegen: "inductor" compiles the step's compute with Inductor, region by region between the nodes
        whose order fxshard chose (communication, custom ops), which keep their order
        (fxshard/codegen.py); None replays it aten op by op; "auto" (default): "inductor" on CUDA,
        None on CPU (Inductor's CPU backend compiles C++: tens of seconds per new program).
    codegen_regions: where compiled regions end besides those nodes. "layer" (default): also where a
        layer's forward or backward begins, so identical layers compile once (a shorter compile);
        "communication": only at those nodes (one device: the whole step is one region, which Inductor
        may fuse across layer boundaries; bench/codegen.py compares the two).
    recompute_pointwise: the backward computes again the values it reads that pointwise ops, views and
        casts make from other values, where that keeps fewer bytes alive between the forward and the
        backward (a minimum cut, as torch.compile's partitioner chooses: passes/recompute_pointwise.py;
        an RMSNorm in fp32 then keeps its bf16 input instead of two fp32 copies). None (default): where
        the step's compute is compiled (Config(codegen)), whose kernels take the copies in; True / False:
        on / off (without codegen each copy is a kernel of its own).
    nonfinite: what a step does whose gradients are not all finite (a NaN or inf anywhere, on any rank;
        checked in the graph from the global gradient norm; under a sharded optimizer without
        clipping or pipeline, the last units' part from their gradients before reduction, which
        skips alike except where their squares overflow float32: fxshard/optimizer_graph.py Deferred;
        not for gradients reduced in fp16, whose sum over the ranks can overflow). "raise" (default): the update is not
        applied and an FxShardError names the step and the first parameter (or FSDP unit) whose
        gradient was not finite, raised by the call after next (a call reads the flag of the step
        before the last, which is done by then, so the host keeps running one step ahead) or by the
        next `parameters()` / `state_dict()` / `evaluate()`.
        "skip": the update is not applied, on every rank together, and `metrics["skipped"]` says so
        (as torch.amp.GradScaler does; AdamW's bias correction counts applied updates only, the lr
        schedule counts calls). "ignore": no check (the weights become NaN). None (default): "skip"
        under a dynamic loss scale (whose overflowing steps are expected: it backs off), else "raise".
    loss_scale: multiply the loss by a scale before the backward and divide the gradients by it in
        float32 before the gradient norm, clipping and the update, so that fp16 gradients below 6e-8 do
        not become zero (fxshard/loss_scale.py). "dynamic": torch.amp.GradScaler's rule (from 2**16,
        halved on a step whose gradients overflow, which is skipped, doubled after 2000 applied steps in
        a row; `fxshard.LossScale(...)` sets those numbers); the scale is training state, saved by
        checkpoints, read by `step.loss_scale`. A number in [2**-126, 2**126]: a static scale. False:
        none. None (default): "dynamic" where param_dtype or reduce_dtype is torch.float16, else none.
        Pipelines (Mesh(pp>1)) take either. The gradient norm is summed from the scaled gradients: an
        explicit scale on fp32 / bf16 gradients overflows it (the step skips or raises) where a scaled
        element's square leaves float32 (|S * g| > 1.8e19), where GradScaler would still step.
    seed: initializes a model built on the meta device (fxshard.init: per module, seeded by its path).
    check_initial_weights: on a mesh, `shard` compares a checksum of every rank's initial parameters
        and persistent buffers (runtime/agreement.py `check_same_start`) and refuses ranks that start
        apart, which would train a mixture of their weights. False skips that comparison only (the
        optimizer, Config and batch shapes are still compared): for ranks that replace their weights
        right after `shard` (`fxshard.load`, `load_hf`) whatever they were built with.
    share_trace: ranks whose model, loss, batch shapes, optimizer and Config agree trace the step once
        (and `evaluate()`'s on its first call), on the lowest of them, and the others load its program
        (fxshard/share.py: a trace must not depend on the rank itself). None (default): on when the
        default process group is gloo, whose ranks share their host's cores (N ranks tracing at once
        take N times one trace's CPU); off on NCCL, where each rank traces on its own cores. False:
        every rank traces.
    share_compile: under codegen, the ranks on one host that use the same Inductor cache directory
        split the compiling of the regions their programs have in common (`fxshard.share.split_compiles`):
        each compiles its share, then takes the others' from Inductor's on-disk cache, so N ranks with
        the same program compile 1/N of it each rather than all of it at once. None (default): on when
        the default process group is gloo (ZeRO-3 over two gloo ranks on 2 cores: 22 s of codegen each
        instead of 28 s); off on NCCL, where it did not shorten compiling (2 H200s, GPT 1b: 21.7-22.8 s
        with it, 20.2-20.3 without: regions that create tensors name their GPU, so the ranks share 13 of
        21, and those took as long as compiling; bench/RESULTS.md, session 47). True / False: on / off.
    """

    dump_dir: str | None = None
    layers: tuple[str, ...] | None = None
    clip_grad_norm: float | None = None
    collective_timeout_s: float = 600.0
    sharding: str = "optim_grads_params"
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    microbatches: int = 1
    cuda_graphs: bool = False
    cuda_graph_memsets: str = "kernels"
    wait_marks: bool = True
    direct_calls: bool = True
    seed: int = 0
    check_initial_weights: bool = True
    fsdp_prefetch: int = 1
    verbose: bool = False
    fuse_grouped_mlp: bool = False
    fuse_grad_accumulation: bool = True
    schedule: "str | Schedule" = "1f1b"
    virtual_stages: int = 1
    stage_layers: tuple[int, ...] | None = None
    p2p_receives: str = "late"
    moe_capacity_factor: float | None = None
    ep_overlap: bool = False
    ep_chunks: int = 1
    ep_sm_carveout: int | None = None
    ep_interleave: str = "combined-1f1b"
    ep_all_to_all: str = "auto"
    fsdp_collectives: str = "auto"
    copy_engine_barriers: str = "kernel"
    copy_engine_own_part: str = "auto"
    nccl_max_ctas: "int | dict[str, int] | None" = None
    nccl_high_priority: bool = False
    codegen: str | None = "auto"
    codegen_regions: str = "layer"
    nonfinite: str | None = None
    share_trace: bool | None = None
    recompute_pointwise: bool | None = None
    share_compile: bool | None = None
    loss_scale: "float | str | LossScale | bool | None" = None

    def loss_scaling(self) -> "float | LossScale | None":
        """Config(loss_scale) resolved: None (no scaling), a static scale, or a dynamic LossScale."""
        from .loss_scale import resolve

        return resolve(self.loss_scale, self.param_dtype, self.reduce_dtype)

    def nonfinite_mode(self) -> str:
        """Config(nonfinite) resolved: None is "skip" under a dynamic loss scale, else "raise"."""
        from .loss_scale import LossScale

        if self.nonfinite is not None:
            return self.nonfinite
        return "skip" if isinstance(self.loss_scaling(), LossScale) else "raise"

    def _check_loss_scale(self) -> None:
        """loss_scale is one the program can apply; a dynamic one needs the non-finite check to skip."""
        from .loss_scale import LossScale

        scaling = self.loss_scaling()  # raises for a value it cannot take
        if not isinstance(scaling, LossScale):
            return
        if self.nonfinite in ("raise", "ignore"):
            raise FxShardError(f"nonfinite={self.nonfinite!r} with a dynamic loss scale: its steps that overflow are "
                               f"expected (the scale backs off from them) and must be skipped; leave nonfinite=None "
                               f"(\"skip\" under a dynamic scale), or use a static loss_scale (a number)")

    def nccl_ctas(self, axis: str) -> int | None:
        """The CTAs Config(nccl_max_ctas) allows the process groups along mesh axis `axis` (None: NCCL's choice)."""
        if isinstance(self.nccl_max_ctas, tuple):
            return dict(self.nccl_max_ctas).get(axis)
        return self.nccl_max_ctas

    def compiles_on(self, device) -> bool:
        """Whether Config(codegen) compiles the step's compute with Inductor on `device` ("auto": on CUDA)."""
        return self.codegen == "inductor" or (self.codegen == "auto" and device.type == "cuda")

    def _check_nccl_max_ctas(self) -> None:
        """An int for every group, or {axis: int} (kept as sorted pairs: a Config stays hashable)."""
        ctas = self.nccl_max_ctas
        pairs = ctas.items() if isinstance(ctas, dict) else ctas if isinstance(ctas, tuple) else None
        if pairs is not None and not all(isinstance(pair, tuple) and len(pair) == 2 for pair in pairs):
            pairs = [(None, None)]  # refused below
        per_axis = dict(pairs) if pairs is not None else None
        values = list(per_axis.values()) if per_axis is not None else [ctas]
        if not all(isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= 64 for v in values) or (
                per_axis is not None and not set(per_axis) <= set(MESH_AXES)):
            raise FxShardError(f"nccl_max_ctas must be an int from 1 to 64 (thread blocks, one SM each, per NCCL "
                               f"collective or transfer), a dict of mesh axis ({', '.join(MESH_AXES)}) -> such an "
                               f"int for those axes' groups only (e.g. {{'pp': 2}}), or None (NCCL's choice); "
                               f"got {ctas!r}")
        if per_axis is not None:  # {} limits nothing: the default
            object.__setattr__(self, "nccl_max_ctas", tuple(sorted(per_axis.items())) or None)

    def __post_init__(self):
        """Refuse what no step could run (FxShardError naming the field and what it takes), normalize
        sequences to tuples, and resolve the pipeline settings that imply others (a Schedule's sizes,
        virtual stages' schedule, dualpipev's two chunks): in this order."""
        self._normalize_layers()
        self._check_kinds()
        self._check_counts_and_dtypes()
        self._resolve_pipeline()
        self._check_limits()
        self._check_loss_scale()

    def _normalize_layers(self) -> None:
        if self.layers is not None:
            if isinstance(self.layers, str):
                object.__setattr__(self, "layers", (self.layers,))
            if not isinstance(self.layers, (tuple, list)) or not all(isinstance(p, str) for p in self.layers):
                raise FxShardError(f"layers must be a module path pattern or a sequence of them (strings such as "
                                   f"'layers.*'), got {self.layers!r}")
            object.__setattr__(self, "layers", tuple(self.layers))

    def _check_kinds(self) -> None:
        """Each field's type: bools, the choice settings (CHOICES), ints, the dump directory."""
        # "no" would read as True: every field whose default is a bool takes only a bool
        for name in (field.name for field in dataclasses.fields(self) if isinstance(field.default, bool)):
            if not isinstance(getattr(self, name), bool):
                raise FxShardError(f"{name} must be True or False, got {getattr(self, name)!r}")
        for name, choices in CHOICES.items():
            if getattr(self, name) not in choices:
                raise FxShardError(f"{name}={getattr(self, name)!r}; choose one of {choices}")
        for name in ("microbatches", "virtual_stages", "ep_chunks", "fsdp_prefetch", "seed"):  # True is an int
            if isinstance(getattr(self, name), bool) or not isinstance(getattr(self, name), int):
                raise FxShardError(f"{name} must be an int, got {getattr(self, name)!r}")
        if self.dump_dir is not None and not isinstance(self.dump_dir, (str, os.PathLike)):
            raise FxShardError(f"dump_dir must be a directory path or None, got {self.dump_dir!r}")
        if self.dump_dir is not None and os.path.exists(self.dump_dir) and not os.path.isdir(self.dump_dir):
            raise FxShardError(f"dump_dir {os.fspath(self.dump_dir)!r} is a file; name a directory (new or existing)")

    def _check_counts_and_dtypes(self) -> None:
        """fsdp_prefetch and microbatches as counts; param_dtype and reduce_dtype floating dtypes or None."""
        if not isinstance(self.fsdp_prefetch, int) or self.fsdp_prefetch < 0:
            raise FxShardError(f"fsdp_prefetch must be an int >= 0, got {self.fsdp_prefetch!r}")
        for name in ("param_dtype", "reduce_dtype"):
            value = getattr(self, name)
            if value is not None and value not in _COMPUTE_DTYPES:  # float8 has no matmul, norm or reduction of its own
                raise FxShardError(f"{name} must be one of torch.bfloat16, torch.float16, torch.float32, torch.float64 "
                                   f"or None, got {value!r}")
        if torch.float16 in (self.param_dtype, self.reduce_dtype) and self.loss_scale is False:
            import warnings

            warnings.warn("fxshard: Config(param_dtype / reduce_dtype=torch.float16, loss_scale=False): without loss "
                          "scaling, gradients below fp16's 6e-8 become zero and training can stall silently. "
                          "Config(loss_scale=None) (the default) scales dynamically, as torch.amp.GradScaler; "
                          "torch.bfloat16 has float32's range and needs none", stacklevel=4)  # the user's Config(...) line
        if not isinstance(self.microbatches, int) or self.microbatches < 1:
            raise FxShardError(f"microbatches must be an int >= 1, got {self.microbatches!r}")

    def _resolve_pipeline(self) -> None:
        """The schedule (a name, or a Schedule whose sizes become microbatches and virtual_stages),
        virtual_stages (more than one makes "1f1b" interleaved; dualpipev always has two) and stage_layers."""
        from .schedule import Schedule

        if isinstance(self.schedule, Schedule):  # a user's own: its sizes are the pipeline's
            object.__setattr__(self, "microbatches", self.schedule.microbatches)
            object.__setattr__(self, "virtual_stages", self.schedule.virtual)
        elif self.schedule not in PIPELINE_SCHEDULES:
            raise FxShardError(f"schedule={self.schedule!r}; choose one of {PIPELINE_SCHEDULES}, or pass an "
                               f"fxshard.schedule.Schedule")
        if not isinstance(self.virtual_stages, int) or self.virtual_stages < 1:
            raise FxShardError(f"virtual_stages must be an int >= 1, got {self.virtual_stages!r}")
        if self.virtual_stages > 1 and self.schedule == "1f1b":
            object.__setattr__(self, "schedule", "interleaved-1f1b")
        if self.schedule == "dualpipev":
            if self.virtual_stages not in (1, 2):
                raise FxShardError(f"schedule='dualpipev' runs two chunks per rank, got virtual_stages="
                                   f"{self.virtual_stages}; leave virtual_stages at 1 or set 2")
            object.__setattr__(self, "virtual_stages", 2)
        if self.stage_layers is not None:
            if not isinstance(self.stage_layers, (tuple, list)) or \
                    not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in self.stage_layers):
                raise FxShardError(f"stage_layers must list ints >= 1 (layers per pipeline chunk), got "
                                   f"{self.stage_layers!r}")
            object.__setattr__(self, "stage_layers", tuple(self.stage_layers))

    def _check_limits(self) -> None:
        """The numeric settings' ranges, and the settings whose None means a default."""
        if self.moe_capacity_factor is not None and (isinstance(self.moe_capacity_factor, bool) or not (
                isinstance(self.moe_capacity_factor, (int, float)) and self.moe_capacity_factor > 0)):
            raise FxShardError(f"moe_capacity_factor must be a number > 0 or None (dropless), got "
                               f"{self.moe_capacity_factor!r}")
        if not isinstance(self.ep_chunks, int) or self.ep_chunks < 1:
            raise FxShardError(f"ep_chunks must be an int >= 1, got {self.ep_chunks!r}")
        if self.ep_sm_carveout is not None and (isinstance(self.ep_sm_carveout, bool) or not (
                isinstance(self.ep_sm_carveout, int) and self.ep_sm_carveout >= 0)):
            raise FxShardError(f"ep_sm_carveout must be an int >= 0 (SMs) or None, got {self.ep_sm_carveout!r}")
        if self.nccl_max_ctas is not None:
            self._check_nccl_max_ctas()
        if self.recompute_pointwise is not None and not isinstance(self.recompute_pointwise, bool):
            raise FxShardError(f"recompute_pointwise={self.recompute_pointwise!r}; choose True, False or None (on where "
                               f"the step is compiled)")
        if self.share_trace is not None and not isinstance(self.share_trace, bool):
            raise FxShardError(f"share_trace={self.share_trace!r}; choose True, False or None (on for gloo)")
        if self.share_compile is not None and not isinstance(self.share_compile, bool):
            raise FxShardError(f"share_compile={self.share_compile!r}; choose True, False or None (on for gloo)")
        if not isinstance(self.collective_timeout_s, (int, float)) or isinstance(self.collective_timeout_s, bool) \
                or not 0 < self.collective_timeout_s < 1e7:  # inf: torch's timedelta cannot hold it
            raise FxShardError(f"collective_timeout_s must be a number of seconds > 0 (finite; under 1e7), got "
                               f"{self.collective_timeout_s!r}")
        if self.clip_grad_norm is not None and not (isinstance(self.clip_grad_norm, (int, float))
                                                    and not isinstance(self.clip_grad_norm, bool)
                                                    and self.clip_grad_norm > 0):
            raise FxShardError(f"clip_grad_norm must be > 0 or None, got {self.clip_grad_norm!r}")
