"""CompiledStep: owns one rank's training state and replays the final Program once per step."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import struct
import sys
import traceback
import weakref

import torch
import torch.fx as fx

from .. import meta
from ..batch import BatchSpec
from ..config import Config
from ..errors import FxShardError
from ..optim import Optimizer, is_learning_rate, lr_at
from ..loss_scale import NAME as LOSS_SCALE
from ..program import InputKind, OutputKind, Program
from ..ops.gloo import GLOO_ALL_GATHER, GLOO_ALL_GATHERS
from ..ops.p2p import P2P_OPS
from ..codegen import CodegenReport, compile_regions, progress_printer
from ..share import split_compiles
from ..graph import Graph, is_view, lazy_module, mutates, views_as_reshapes
from .nonfinite import keep_buffers_when_skipped, was_skipped
from .carveout import carve_out_sms_for_all_to_alls
from .copy_engine import CopyEngineLowering, Watch, lower_to_copy_engines, marker, resolve_auto, resolve_own_part
from .graph_memsets import MemsetReport, finish_capture, new_graph
from .gloo import gloo_group_names, lower_gloo_all_gathers
from .direct_calls import call_directly
from .flat_gradients import flat_gradients_in_place
from .reinplace import WRITE_BACK, accumulate_in_place, gather_updates_in_place, reinplace, write_back_positions
from .replay_watch import ReplayWatch, abort_groups, expire_process_groups
from .wait_marks import WaitMarks, mark_waits, words as wait_marks_words
from .rng import StageStream, draws_random_values
from .state import State, every_stage_tensors, full_parameters, gather_shard


def _communicates(node: fx.Node) -> bool:
    """Whether `node` issues a collective or transfer (NCCL's, or the gloo all-gather's) that peers wait on."""
    return node.target in P2P_OPS or node.target in meta.COLLECTIVE_ISSUES or node.target in GLOO_ALL_GATHERS


def bind_groups(graph_module: fx.GraphModule, group_names: dict[str, str]) -> fx.GraphModule:
    """A copy of the graph whose collectives and transfers name real process groups instead of mesh axes."""
    graph = Graph()
    graph.output(graph.graph_copy(graph_module.graph, {}))
    for node in graph.nodes:
        if node.op == "call_function" and (getattr(node.target, "namespace", None) == "_c10d_functional"
                                           or node.target in P2P_OPS):
            node.args = tuple(group_names.get(a, a) if isinstance(a, str) else a for a in node.args)
    return lazy_module(graph_module, graph)


@dataclasses.dataclass(frozen=True)
class StepOrigin:
    """Where a step's rank sits and what model it was traced from: what checkpoints and the Hugging
    Face export record and check (fxshard/checkpoint)."""

    coords: dict = dataclasses.field(default_factory=dict)  # this rank's index along each mesh axis
    rank: int = 0  # its global rank
    mesh: object = None  # the Mesh (None: one device)
    expert_layouts: dict = dataclasses.field(default_factory=dict)  # prefix -> (ExpertLayout, experts)
    model_class: str = ""  # the architecture's name, for the export
    model_config: object = None  # the reference models' config (their `cfg`)
    hf_config: dict | None = None  # a transformers model's own config, which load_hf checks against
    # buffers registered with persistent=False (RoPE tables): as torch's state_dict, checkpoints leave them out
    transient_buffers: frozenset = frozenset()
    # names a load may find beside the model's own: another name of a tied weight (lm_head.weight beside
    # embed_tokens.weight), and the patterns of a transformers class's _keys_to_ignore_on_load_unexpected
    # (old attention-mask buffers, multi-token-prediction layers), which from_pretrained skips too
    aliases: frozenset = frozenset()
    ignored_patterns: tuple = ()


class CompiledStep:
    """`step(batch)` runs forward, backward and the optimizer update of the compiled program.

    State (parameters, optimizer slots, buffers) lives here as plain tensors keyed by the names in
    the program's signature; each call feeds them in and takes the updated ones back. On a mesh,
    `groups` maps each axis to this rank's process group along it.
    """

    def __init__(self, programs: list[Program], state: State, batch_spec: BatchSpec, optimizer: Optimizer,
                 device: torch.device, groups: dict | None = None, config: Config = Config(), *,
                 share_compile: bool = False, origin: StepOrigin | None = None, evaluation=None, model=None,
                 first_batch_check=None, job_group=None):
        """`config` says how to run the program (the runtime lowerings, codegen, CUDA graphs, the
        non-finite policy); `share_compile` is Config(share_compile) resolved for the mesh; `origin`
        where this rank sits and what the model was (checkpoints); `evaluation` compiles evaluate()'s
        program on first use; `first_batch_check` a pipeline's check of its first batch; `job_group`
        every rank's group for what they do together outside the step, which times out after
        Config(collective_timeout_s) (api._job_group; None: the default group's)."""
        self.programs = programs
        self.program = programs[-1]
        origin = origin or StepOrigin()
        # where this rank sits, for checkpoints (fxshard/checkpoint): its index along each mesh axis,
        # its global rank, and the expert layers' storage layouts (prefix -> (ExpertLayout, experts))
        self.coords, self.rank, self.mesh = dict(origin.coords), origin.rank, origin.mesh
        self.mesh_description = str(origin.mesh) if origin.mesh is not None else "one device"
        self.expert_layouts = dict(origin.expert_layouts)
        # what the Hugging Face export needs to name the architecture, and a transformers model's own
        # config, which load_hf checks a directory against (fxshard/checkpoint/hf.py)
        self.model_class, self.model_config, self.hf_config = origin.model_class, origin.model_config, origin.hf_config
        self.transient_buffers = origin.transient_buffers
        self.aliases, self.ignored_patterns = origin.aliases, origin.ignored_patterns
        self.state = state
        self.batch_spec = batch_spec
        self.optimizer = optimizer
        self.device = device
        self.groups = groups or {}
        self.job_group = job_group
        self.step_count = 0
        self._lr_override: float | None = None
        self._lr_trail = hashlib.sha256()  # every step's lr since shard or the last load (_check_same_lr)
        self._last_lr: float | None = None  # the lr the last step applied (None: no step since shard)
        self._interrupted: str | None = None  # why a step stopped while its graph ran (refuse_if_interrupted)
        self._aborted: str | None = None  # why this rank's groups cannot be trusted (the replay watch aborted them,
        # or a call failed while peers may wait in it: _batch_error): the step is unusable, loads included
        # Config(nonfinite): the program skips updates whose gradients are not finite; the runtime
        # counts them on the device (AdamW's step input counts applied updates) and under "raise"
        # reads a step's flag two calls later, or when the state is next read (_raise_if_nonfinite)
        self.nonfinite = config.nonfinite_mode() if self.program.outputs_of(OutputKind.NONFINITE) else "ignore"
        self._skipped = torch.zeros((), dtype=torch.float32, device=device)
        self._unchecked: list[tuple[int, dict]] = []
        # evaluate(): `evaluation` compiles the eval-mode program on first use (runtime/evaluate.py)
        self._compile_evaluation, self._evaluation = evaluation, None
        self._evaluation_graph: EvaluationReplay | None = None  # with cuda_graphs, once training is captured
        self._codegen_on = config.compiles_on(device)
        self._codegen_by_layer, self._verbose = config.codegen_regions == "layer", config.verbose
        self._first_batch_check = first_batch_check  # a pipeline's: its stages got one batch (collective, once)
        self._compile_split = split_compiles if share_compile else None  # collective: every rank compiles
        # the model's train/eval mode at shard(): changing it later changes nothing, which __call__ says once
        # (a weak reference: the step must not keep the user's model and its weights alive)
        self._model = weakref.ref(model) if model is not None else None
        self._traced_training = model.training if model is not None else None
        # a pipeline stage that draws random values draws them from a stream of its own (runtime/rng.py)
        self._stream = (StageStream(device, self.program.stage, self.mesh_description)
                        if self.program.stage is not None and draws_random_values(self.program.graph) else None)
        if config.cuda_graphs and device.type != "cuda":
            raise FxShardError(f"Config(cuda_graphs=True) needs a CUDA device; the batch is on {device}")
        self._run = self._lower(self._bound(self.program), config)
        self._replay = (CudaGraphReplay(memsets_to_kernels=config.cuda_graph_memsets == "kernels")
                        if config.cuda_graphs else None)
        # NCCL's watchdog does not see collectives replayed from a graph: this one does (replay_watch.py)
        self._replay_watch = None
        if config.cuda_graphs and self.groups and config.collective_timeout_s:
            self._replay_watch = ReplayWatch(config.collective_timeout_s, self.rank,
                                             _expire_replay(weakref.ref(self), config.collective_timeout_s),
                                             where=_waiting_in(weakref.ref(self)))

    def _lower(self, run: fx.GraphModule, config: Config) -> fx.GraphModule:
        """The runtime lowerings, in order: the graph this rank runs. Each records how often it applied
        in an attribute that lowerings() reports (and tests read)."""
        device = self.device
        # a skipped step (Config(nonfinite)) leaves the buffers it updated as they were, too
        run, self.buffers_kept_when_skipped = keep_buffers_when_skipped(run, self.program)
        # all-gathers issued through gloo's _allgather_base (runtime/gloo.py)
        self.gloo_all_gathers = sum(node.target is GLOO_ALL_GATHER for node in run.graph.nodes)
        # optimizer updates write into the state tensors they read, and ZeRO-1/2's gathers of updated
        # shards into the flat parameters they update (see runtime/reinplace.py)
        run, self.in_place_updates = reinplace(run)
        # Config(fuse_grad_accumulation)'s GEMMs add into the gradient totals where they lie
        run, self.accumulations_in_place = accumulate_in_place(run)
        # ... and write the flat gradients the reductions and the optimizer read, with no cat (flat_gradients.py)
        run, self.flat_gradients_in_place = flat_gradients_in_place(run)
        run, self.gathers_in_place = gather_updates_in_place(run, write_back_positions(self.program))
        if self.groups:  # the program agrees across ranks (checked at shard()); how it is run must too
            from .agreement import check_runtime_agreement

            check_runtime_agreement(f"ep_all_to_all={config.ep_all_to_all!r}, "
                                    f"fsdp_collectives={config.fsdp_collectives!r}, "
                                    f"copy_engine_barriers={config.copy_engine_barriers!r}, "
                                    f"cuda_graphs={config.cuda_graphs}", device)
        # Config "auto" collectives made concrete (the same on every rank: runtime/copy_engine.py resolve_auto)
        all_to_all, fsdp_collectives, self.auto_collectives = resolve_auto(
            config.ep_all_to_all, config.fsdp_collectives, device, meshed=bool(self.groups),
            graphed=config.cuda_graphs)
        # runs of matmuls inside all-to-all windows that run narrower, CUDA only (copy engines hold no SMs)
        self.sm_carveout_stretches = 0
        if config.ep_sm_carveout is not None and device.type == "cuda" and all_to_all == "nccl":
            run, self.sm_carveout_stretches = carve_out_sms_for_all_to_alls(run, config.ep_sm_carveout)
        # collectives moved by peer memcpys through symmetric memory (no SMs), CUDA only
        self.copy_engine = CopyEngineLowering()
        if device.type == "cuda" and "copy-engine" in (all_to_all, fsdp_collectives):
            run, self.copy_engine = lower_to_copy_engines(
                run, all_to_alls=all_to_all == "copy-engine",
                gathers_and_scatters=fsdp_collectives == "copy-engine", timeout_s=config.collective_timeout_s,
                axes=self._group_axes(), barriers=config.copy_engine_barriers,
                own_part=resolve_own_part(config.copy_engine_own_part, self._codegen_on))
        # names the copy-engine collective a device stopped in (kernel barriers trap after the timeout;
        # with stream barriers the watch stops the device itself)
        self._watch = None
        if self.copy_engine.number:
            index = _device_index(device)
            self._watch = Watch(self.copy_engine, marker(index), config.collective_timeout_s, self.rank, index)
            self._watch.start()
        # under CUDA graphs NCCL's watchdog does not see the collectives: each wait for one writes its number
        # into host memory first, so a stall is reported with what the step waits for (wait_marks.py)
        self.wait_marks, self._evaluation_marks, self._marks_device = WaitMarks(), WaitMarks(), 0
        if config.wait_marks and config.cuda_graphs and self.groups and device.type == "cuda":
            self._marks_device = _device_index(device)
            run, self.wait_marks = mark_waits(run, self._marks_device, self._group_axes())
        # last: the compute between the nodes placed above is compiled; those nodes keep their order
        run, self.codegen = self._compiled(run)
        # Config(direct_calls), eager replay: fxshard's ops outside the regions run their bodies, past the
        # dispatcher (direct_calls.py); a graph's replay spends no host time on them
        self.direct_calls = 0
        if config.direct_calls and not config.cuda_graphs:
            run, self.direct_calls = call_directly(run)
        if config.cuda_graphs:
            _check_capturable(self.program)
        return run

    @property
    def copy_engine_all_to_alls(self) -> int:
        """EP all-to-alls moved by the copy engines (Config(ep_all_to_all="copy-engine"), CUDA only)."""
        return self.copy_engine.all_to_alls

    def _bound(self, program: Program) -> fx.GraphModule:
        """The program's graph with its collectives naming this rank's process groups (all-gathers on
        gloo groups issued through the entry point that is sound with several in flight)."""
        if not self.groups:
            return program.graph_module
        run = bind_groups(program.graph_module, {axis: g.group_name for axis, g in self.groups.items()})
        return lower_gloo_all_gathers(run, gloo_group_names(self.groups))[0]

    def _group_axes(self) -> dict[str, str]:
        """Process-group name -> the mesh axis it is, as errors name groups."""
        return {group.group_name: axis for axis, group in self.groups.items()}

    def lowerings(self) -> str:
        """One line: what the runtime changed in the program before running it."""
        return (f"runtime lowerings of {self.program.name!r}: {self.in_place_updates} in-place optimizer updates, "
                f"{self.gathers_in_place} gathers of updated shards into their parameters, {self.accumulations_in_place} "
                f"gradient accumulations in place, {self.flat_gradients_in_place} flat gradients accumulated where "
                f"they lie, {self.copy_engine.line()}"
                + (f" ({self.auto_collectives})" if self.auto_collectives else "") + f", {self.sm_carveout_stretches} "
                f"SM-carveout stretches, {self.gloo_all_gathers} gloo all-gathers through _allgather_base, "
                f"{self.direct_calls} calls of fxshard ops past the dispatcher, {self.wait_marks.line()}, "
                f"{self.buffers_kept_when_skipped} buffers kept on skipped steps; "
                f"{self.codegen.line() if self.codegen else 'codegen: off (aten replay)'}"
                + (f"; {self._replay.memsets.line()}" if self._replay is not None and self._replay.is_captured else ""))

    def runtime_code(self) -> str:
        """The readable code of the graph this step runs (the program after the runtime lowerings)."""
        return self._run.print_readable(print_output=False, include_stride=False, include_device=False)

    def set_lr(self, lr: float | None) -> None:
        """Use this learning rate from the next step on (overrides the optimizer's lr/schedule; a
        checkpoint keeps the override); None returns to the optimizer's."""
        if lr is None:
            self._lr_override = None
            return
        if not is_learning_rate(lr):
            raise FxShardError(f"set_lr needs a finite float >= 0 (below float32's largest: the step reads it in "
                               f"float32), got {lr!r}")
        self._lr_override = float(lr)

    def _check_same_lr(self) -> None:
        """FxShardError on every rank where the ranks' steps so far read different learning rates
        (set_lr called on some ranks only, or an lr schedule that depends on the rank): each rank
        applied its own update to what should be one model, and nothing else would notice. Asked where
        every rank calls in anyway: parameters(), state_dict(), evaluate(), fxshard.save."""
        if not self.groups:
            return
        import torch.distributed as dist

        from .agreement import waiting_for_peers

        # the last lr applied, not the next one: the schedule may end at the last training step
        ours = (self._lr_trail.hexdigest(), self.step_count, self._last_lr, self._lr_override)
        everyone = [None] * dist.get_world_size()
        with waiting_for_peers("the ranks' learning rates so far", self.job_group):
            dist.all_gather_object(everyone, ours, group=self.job_group)
        other = next((rank for rank, theirs in enumerate(everyone) if theirs[0] != ours[0]), None)
        if other is not None:
            def said(values):
                last = "no step yet" if values[2] is None else f"lr {values[2]:g} last"
                return last + (", set_lr now" if values[3] is not None else "")
            raise FxShardError(f"the ranks trained with different learning rates within the first {self.step_count} "
                               f"steps (rank {self.rank}: {said(ours)}; rank {other}: {said(everyone[other])}): "
                               f"every rank must call set_lr alike, and an lr schedule must not depend on the rank. "
                               f"Load the last checkpoint saved before that on every rank")

    @property
    def lr(self) -> float:
        """The learning rate the next step applies: set_lr's value, else the optimizer's (its schedule
        at step_count + 1)."""
        return self._lr_override if self._lr_override is not None else lr_at(self.optimizer, self.step_count + 1)

    def __call__(self, batch) -> dict[str, torch.Tensor]:
        try:
            return self._call(batch)
        except FxShardError:
            raise
        except Exception as error:
            self._raise_if_device_stopped(error)
            raise

    def _raise_if_device_stopped(self, error: BaseException) -> None:
        """`error` (a CUDA error) as an FxShardError naming the copy-engine collective whose barrier gave
        up, when the device stopped in one (runtime/copy_engine.py Watch)."""
        where = self._watch.waiting_in() if self._watch is not None else None
        if where is not None:
            self._watch.raising(where)
            raise FxShardError(
                f"this rank's device stopped in the copy-engine {where}: its barrier gave up after "
                f"Config(collective_timeout_s) because a rank of that group stalled or stopped (its own error or log "
                f"says why), and stopped the device, which leaves this process's CUDA context unusable. Restart the "
                f"job (from the last checkpoint). CUDA said: {str(error).strip().splitlines()[0][:200]}") from error

    def _call(self, batch) -> dict[str, torch.Tensor]:
        leaves = self.batch_spec.flatten(batch)
        self.refuse_if_interrupted()
        self._raise_if_nonfinite(keep=1)
        self.refuse_if_interrupted()  # the replay watch may have ended the step that check waited for
        self._warn_if_mode_changed()
        if self._first_batch_check is not None:  # cleared once it passes (every rank raises alike)
            self._first_batch_check(batch)
            self._first_batch_check = None
        with self._stream.drawn_from() if self._stream is not None else contextlib.nullcontext():
            return self._run_step(leaves)

    def _run_step(self, leaves) -> dict[str, torch.Tensor]:
        lr = self._last_lr = self.lr  # the schedule asked once a step
        self._lr_trail.update(struct.pack("<f", lr))  # what _check_same_lr compares across ranks
        if self._replay is not None and self._replay.is_captured:
            metrics = self._replay.replay(leaves, lr, float(self.step_count + 1), self._skipped)
            self.step_count += 1
            self._watch_replay(f"step {self.step_count}")
            return self._guarded(metrics)
        eager = self._watched(f"step {self.step_count + 1}", "eagerly, before its CUDA graph was captured",
                              lambda: self._eager_step(leaves, lr))
        metrics = self._guarded(eager)
        if self._replay is not None and self.step_count >= CudaGraphReplay.WARMUP_STEPS:
            with self._capturing(f"the capture of the CUDA graph after step {self.step_count}"):
                self._replay.capture(self)
            if self._verbose:
                print(f"fxshard: rank {self.rank}: the step's CUDA graph captured after step {self.step_count}; "
                      f"{self._replay.memsets.line()}", file=sys.stderr, flush=True)
        return metrics

    def _capturing(self, what: str):
        """Around a capture: the replay watch (if any) queries no event meanwhile and says if it hangs.
        The device is synchronized first, still watched: torch.cuda.graph synchronizes on entering, and
        a replay stalled on a dead peer must be aborted by its watch, not waited for unwatched."""
        if self._replay_watch is None:
            return contextlib.nullcontext()
        torch.cuda.synchronize()
        return self._replay_watch.capturing(what)

    def _watched(self, what: str, how: str, run):
        """run(), an eager warm-up step before the graph is captured, told to the replay watch where
        there is one (a mesh under CUDA graphs): a step not through on the host and the device within
        Config(collective_timeout_s) is said on stderr with every thread's stack (not aborted for:
        replay_watch.py says why)."""
        if self._replay_watch is None:
            return run()
        through: list = []  # the event recorded once the host is through, or None where run() raised
        self._replay_watch.launched(what, lambda: bool(through) and (through[0] is None or through[0].query()),
                                    how=how, abort=False)
        try:
            result = run()
            finished = torch.cuda.Event()
            finished.record()
        except BaseException:
            through.append(None)  # the error is the main thread's to raise, not the watch's to report
            raise
        through.append(finished)
        return result

    def _watch_replay(self, what: str) -> None:
        """Tell the replay watch (on a mesh under CUDA graphs) that `what` was just replayed."""
        if self._replay_watch is not None:
            replayed = torch.cuda.Event()
            replayed.record()
            self._replay_watch.launched(what, replayed.query)

    def _warn_if_mode_changed(self) -> None:
        model = self._model() if self._model is not None else None
        if model is None or model.training == self._traced_training:
            return
        import warnings

        mode = {True: "train", False: "eval"}
        warnings.warn(f"the model was switched to {mode[model.training]} mode after shard(); the compiled step "
                      f"keeps the mode it was traced in ({mode[self._traced_training]}). "
                      + ("Use step.evaluate(batch) to evaluate (eval mode, no update)" if self._traced_training else
                         "To train in train mode (dropout on), call model.train() before shard(), and shard again")
                      , stacklevel=3)
        self._model = None  # said once

    def routing(self, metrics: dict) -> dict[str, dict[str, torch.Tensor]]:
        """Each MoE layer's routing in a step's `metrics`, summed over the ranks: {layer:
        {"tokens_per_expert": ..., "dropped": ...}} (`Program.routing`; empty without expert
        parallelism). `fxshard.dump.dump_routing` writes it as a table."""
        return self.program.routing(metrics)

    @property
    def loss_scale(self) -> float | None:
        """The loss scale the next step multiplies its loss by (Config(loss_scale); reads the device's
        copy of a dynamic one: synchronizes), or None without loss scaling."""
        scaling = self.program.train.loss_scale
        state = self.state.get((InputKind.LOSS_SCALE, LOSS_SCALE))
        return float(state[0]) if state is not None else scaling

    @property
    def skipped_steps(self) -> int:
        """How many steps Config(nonfinite) skipped so far (reads a device counter: synchronizes)."""
        return int(self._skipped.item())

    def _guarded(self, metrics: dict) -> dict:
        """Metrics as the user sees them: with the non-finite guard, `skipped` (a 0-d bool tensor) in
        place of the per-tensor flags, which are kept for the check under "raise"."""
        if self.nonfinite == "ignore":
            return metrics
        flags = metrics.pop("nonfinite")
        skipped = was_skipped(flags)
        self._skipped += skipped
        metrics["skipped"] = skipped
        if self.nonfinite == "raise":
            self._unchecked.append((self.step_count, {"skipped": _read_later(skipped),
                                                      "grad_norm": metrics["grad_norm"], "flags": flags}))
        return metrics

    def _raise_if_nonfinite(self, keep: int = 0) -> None:
        """Under Config(nonfinite="raise"): read the flags of the steps not checked yet, all but the
        last `keep` of them, and raise on every rank alike if one was not finite (the norm that
        decided is global), naming the first parameter whose gradient was not. A call checks the step
        before the last (keep=1): its flag was copied to the host right after that step (_read_later),
        so reading it waits for that step alone, not for the one queued behind it, and the host keeps
        the GPU one step ahead (a plain read waits for everything queued: the GPU then idled each
        step while the host launched the next, ~0.3 ms on 2x H200, bench/RESULTS.md 2026-11-28).
        parameters() and state_dict(), which every rank calls, check every step (keep=0); buffers()
        and optimizer_state() are local and do not."""
        while len(self._unchecked) > keep:
            number, last = self._unchecked.pop(0)
            if last["skipped"]():
                from .nonfinite import nonfinite_error

                self._unchecked.clear()
                raise nonfinite_error(self, number, self.step_count, float(last["grad_norm"]), last["flags"])

    def evaluate(self, batch) -> dict[str, torch.Tensor]:
        """The loss (and loss_fn's metrics) of `batch` under the current parameters, in eval mode
        (dropout off), with no update: the training step traced again in eval mode on the first call,
        through the same passes (sharded parameters gathered as in training; pipelines included), cut
        to what the loss needs (runtime/evaluate.py), then replayed. Every rank must call it, with a
        batch shaped like the training batch."""
        self._refuse_if_aborted()
        self.refuse_if_interrupted()  # a partly updated state: no evaluation of it
        self._raise_if_nonfinite()
        self._check_same_lr()
        leaves = self.batch_spec.flatten(batch)
        if self._evaluation is None:
            self._evaluation = self._build_evaluation()
        program, run = self._evaluation
        if self._evaluation_graph is not None:
            outputs = self._evaluation_graph.replay(leaves)
            self._watch_replay(f"the evaluation after step {self.step_count}")
            return outputs
        with torch.no_grad():
            try:
                results = self._replay_graph(run, self._arguments(leaves, program))
            except Exception as error:
                failed = _failed_node(error, run)
                if failed is None or _communicates(failed) or \
                        failed.target is torch.ops._c10d_functional.wait_tensor.default:
                    raise
                raise self._batch_error(f"the evaluation after step {self.step_count}", failed, error,
                                        "and the training state is unchanged (an evaluation writes none)") from error
            if self._replay is not None and self._replay.is_captured:
                # the training state no longer moves (the training graph updates it in place): capture
                # the evaluation too, after this eager call has warmed it up
                with self._capturing(f"the capture of the evaluation's CUDA graph after step {self.step_count}"):
                    self._evaluation_graph = EvaluationReplay(self, program, run)
        return {spec.name: value.detach() for spec, value in zip(program.outputs, results)}

    def _build_evaluation(self):
        from .agreement import check_agreement, fail_together
        from .evaluate import check_reads_training_state

        if self._compile_evaluation is None:
            raise FxShardError("this step was not built by fxshard.shard, which gives it what evaluate() compiles")
        try:
            program, failure = self._compile_evaluation(), None
            check_reads_training_state(program, self.program, self.state)
        except Exception as error:  # noqa: BLE001  raised below, once every rank knows (as shard's compile)
            failure = error
        if self.groups:  # a rank whose trace failed must not leave the others waiting in the check below
            fail_together(failure, "compile the evaluation", self.job_group)
        if failure is not None:
            raise failure
        if self.groups:  # the eval programs' communication must agree across ranks too
            check_agreement(program.graph, self.groups, self.device,
                            self.program.stage.stage if self.program.stage is not None else None)
        run = self._bound(program)
        if self.wait_marks.count:  # its waits marked too, so a stalled evaluation's report says where it waits
            run, self._evaluation_marks = mark_waits(run, self._marks_device, self._group_axes())
        run, _ = self._compiled(run)
        return program, run

    def _compiled(self, run: fx.GraphModule) -> tuple[fx.GraphModule, CodegenReport | None]:
        """`run` with the compute between its placed nodes compiled by Inductor (Config(codegen)), or for
        aten replay with views whose input's real layout is not its fake one copying instead of failing."""
        if self._codegen_on:
            return compile_regions(run, progress=progress_printer(self._verbose), by_layer=self._codegen_by_layer,
                                   split=self._compile_split)
        return views_as_reshapes(run), None

    def _arguments(self, leaves, program: Program | None = None, lr: float = 0.0):
        """The inputs of `program` (default: the training step's) in order; `lr` the step's learning
        rate (the evaluation program updates nothing, and a capture's is filled in at each replay)."""
        leaves = iter(leaves)
        lr = torch.tensor(lr, dtype=torch.float32, device=self.device)
        # the optimizer's step count (1-based) counts applied updates: calls minus skipped steps
        step = torch.tensor(float(self.step_count + 1), dtype=torch.float32, device=self.device) - self._skipped
        args = []
        for spec in (program or self.program).inputs:
            if spec.kind is InputKind.BATCH:
                args.append(next(leaves))
            elif spec.kind is InputKind.LR:
                args.append(lr)
            elif spec.kind is InputKind.STEP:
                args.append(step)
            else:
                args.append(self.state[spec.kind, spec.name])
        return args

    @functools.cached_property
    def _writes_state(self) -> set[fx.Node]:
        """The nodes of the graph this step runs that write (in place) a tensor of the training state."""
        state = {node for node, spec in zip(self._run.graph.find_nodes(op="placeholder"), self.program.inputs)
                 if spec.kind in (InputKind.PARAM, InputKind.OPT_STATE, InputKind.BUFFER)}
        writers = set()
        for node in self._run.graph.nodes:
            if not mutates(node):
                continue
            for argument, value in zip(node.target._schema.arguments, node.args):
                while isinstance(value, fx.Node) and is_view(value) and value.args:
                    value = value.args[0]
                if argument.alias_info is not None and argument.alias_info.is_write and value in state:
                    writers.add(node)
        return writers

    def _replay_graph(self, run: fx.GraphModule, args: list):
        try:
            return run(*args)
        except Exception as error:  # a collective or transfer that timed out, or a peer that died
            where = self._failed_wait(error, run)
            if where is None:
                raise
            raise FxShardError(f"step {self.step_count + 1}: waiting for the {where} failed: "
                               f"{str(error).strip().splitlines()[0][:300]}. A rank of that group stalled (longer than "
                               f"Config(collective_timeout_s)) or stopped; its own error or log says why") from error

    def refuse_if_interrupted(self) -> None:
        """FxShardError where an earlier step stopped while its graph ran: its updates are written in
        place one tensor after another, so the state may be partly updated (some parameters and moments
        stepped, others not), and training on or saving it would go on from a state no step makes.
        Loading a checkpoint or a state dict clears it."""
        self._refuse_if_aborted()
        if self._interrupted is not None:
            raise FxShardError(f"step {self.step_count + 1} stopped while it ran ({self._interrupted}), so the training "
                               f"state may be partly updated; load the last checkpoint (fxshard.load) or a state "
                               f"dict (step.load_state_dict) before training on or saving"
                               + ("; where a collective or transfer failed (a rank stalled or stopped), this job's "
                                  "process groups cannot be trusted: restart the job from the last checkpoint"
                                  if self.groups else ""))

    def _batch_error(self, what: str, failed: fx.Node, error: Exception, unchanged: str) -> FxShardError:
        """The error for compute that failed on this batch (`failed`, a node of no collective) while the
        state stayed as it was. On one device the step may be called again. On a mesh it may not: this
        rank's peers may wait in the call's collectives or transfers (a later stage for its input, a
        group for a collective this rank had issued or not reached), and a next call would pair its
        own with theirs, so the step refuses further calls."""
        if self.groups:  # nothing to load: the process groups, not the state, are what cannot go on
            self._aborted = (f"{what} failed on this rank ({_one_line(error)}) while its peers may wait in that "
                             f"call's collectives or transfers, so this job's process groups cannot be trusted: "
                             f"restart the job (from the last checkpoint)")
        advice = ("Check this batch (token ids below the vocabulary size, targets in range, the dtypes the model "
                  "takes...); eager PyTorch runs the same op on it")
        if isinstance(error, AssertionError) and "expected size" in str(error) and "stride" in str(error):
            advice = ("That is a compiled region's check of its inputs' layouts, not the batch: a defect of fxshard's "
                      "codegen (please report it with the dump, Config(dump_dir)); Config(codegen=None) runs the step "
                      "op by op without it")
        return FxShardError(f"{what}: {failed.name} ({_op_label(failed)}) raised {_one_line(error)}, {unchanged}. "
                            f"{advice}"
                            + (". This rank's peers may wait in this call's collectives or transfers, so the step "
                               "takes no further calls: restart the job (from the last checkpoint)"
                               if self.groups else ""))

    def _refuse_if_aborted(self) -> None:
        """FxShardError where the replay watch aborted this rank's process groups (runtime/replay_watch.py) or a
        call failed while peers may wait in it (_batch_error): no collective can be trusted in this process any
        more, and loading a checkpoint does not bring them back."""
        if self._aborted is not None:
            raise FxShardError(self._aborted)

    def _eager_step(self, leaves, lr: float):
        try:
            results = self._replay_graph(self._run, self._arguments(leaves, lr=lr))
        except Exception as error:
            failed = _failed_node(error, self._run)
            if failed is None or failed in self._writes_state or _communicates(failed) or \
                    failed.target is torch.ops._c10d_functional.wait_tensor.default or \
                    any(n in self._writes_state for n in _nodes_before(failed)):
                self._interrupted = _one_line(error)
                raise
            # compute that failed before anything wrote the state (an index past the vocabulary, a shape
            # the model refuses): the step is unchanged, and on one device may be called again with a good
            # batch (on a mesh peers may wait in this call's collectives: _batch_error)
            raise self._batch_error(f"step {self.step_count + 1}", failed, error,
                                    "before anything of the training state was written (it is unchanged)") from error
        except BaseException as error:  # Ctrl-C, out of memory: the state is suspect
            self._interrupted = _one_line(error)
            raise
        metrics = {}
        for spec, value in zip(self.program.outputs, results):
            if spec.kind in WRITE_BACK:
                self.state[WRITE_BACK[spec.kind], spec.name] = value
            else:
                metrics[spec.name] = value.detach()
        self.step_count += 1
        return metrics

    def _failed_wait(self, error: BaseException, run: fx.GraphModule) -> str | None:
        """The collective or transfer whose issue or wait raised `error`, described, or None when the
        error came from elsewhere (the graph's generated code names one node per line)."""
        from .agreement import describe

        node = _failed_node(error, run)
        if node is not None and node.target is torch.ops._c10d_functional.wait_tensor.default:
            node = node.args[0]
        if node is None or not _communicates(node):
            return None
        return describe(node, self._group_axes().get(node.args[-1], node.args[-1]))

    def parameters(self) -> dict[str, torch.Tensor]:
        """Parameter name -> current full parameter tensor (all-gathered where sharded; under a
        pipeline every stage's, broadcast from the stage that holds it). Every rank must call it."""
        self.refuse_if_interrupted()
        self._raise_if_nonfinite()
        self._check_same_lr()
        local = full_parameters(self.program, self.state, self._gather)
        if self.program.stage is None:
            return local
        return every_stage_tensors(self.programs[0], self.program.stage, local, self.groups["pp"], self.device)

    def _gather(self, axis: str, shard: torch.Tensor) -> torch.Tensor:
        return gather_shard(shard, self.groups[axis])

    def copy_to(self, model: torch.nn.Module) -> None:
        """Copy the trained parameters and this rank's buffers into `model` (the one `shard` was given,
        or one built alike), by the names `named_parameters()` / `named_buffers()` give, so wrappers
        whose state_dict renames keys (torch's checkpoint_wrapper, torch.compile's `_orig_mod`) do not
        drop them. Values are cast to the model's dtypes, as load_state_dict casts. Under a pipeline
        the buffers are every stage's, those of this rank's data-parallel index (each stage's broadcast
        over `pp`). Every rank must call it (it gathers). Everything is checked before anything is copied."""
        params, buffers = self.parameters(), self.buffers()
        if self.program.stage is not None:
            buffers = every_stage_tensors(self.programs[0], self.program.stage, buffers, self.groups["pp"],
                                             self.device, InputKind.BUFFER)
        targets = {**dict(model.named_parameters(remove_duplicate=False)),
                   **dict(model.named_buffers(remove_duplicate=False))}
        missing = sorted(name for name in params if name not in targets)
        copied = {id(targets[name]) for name in params if name in targets}  # tied names share a tensor
        untrained = sorted(name for name, p in model.named_parameters(remove_duplicate=False)
                           if name not in params and id(p) not in copied)
        if missing or untrained:
            what = (f"the model has no parameter {missing[0]!r} ({len(missing)} of the step's missing)" if missing
                    else f"the model's parameter {untrained[0]!r} is none of the step's (a weight the step ties "
                         f"is separate in this model?)")
            raise FxShardError(f"copy_to: {what}; pass the model shard() was given, or one built the same way")
        pairs = [(name, target, params.get(name, buffers.get(name))) for name, target in targets.items()]
        pairs = [(name, target, value) for name, target, value in pairs if value is not None]
        for name, target, value in pairs:
            if target.is_meta:
                raise FxShardError(f"copy_to: the model's {name!r} is on the meta device; give it storage "
                                   f"first (model.to_empty(device='cpu'))")
            if value.shape != target.shape:
                raise FxShardError(f"copy_to: {name!r} is {tuple(target.shape)} in the model, "
                                   f"{tuple(value.shape)} in the step; pass a model built alike")
        with torch.no_grad():
            for _, target, value in pairs:
                target.copy_(value)

    def buffers(self) -> dict[str, torch.Tensor]:
        """This rank's buffers, as copies (later steps do not change them). Local: one rank may call it
        alone (a pending non-finite step is reported by the next step or parameters() call)."""
        return self._state_copies(InputKind.BUFFER)

    def optimizer_state(self) -> dict[str, torch.Tensor]:
        """This rank's optimizer slots as the program holds them, as copies: `<slot>/<param>`, or
        `<slot>/unit/<unit>` for parameters in flat units (FSDP's strategies, pipeline stages: a unit's
        flat shard, whatever the sharding). Local, as buffers(). Per parameter under global names:
        `state_dict()`'s `optim.<param>.<slot>` entries (this rank's rectangles of each), or a checkpoint."""
        return self._state_copies(InputKind.OPT_STATE)

    def _state_copies(self, kind: InputKind) -> dict[str, torch.Tensor]:
        self.refuse_if_interrupted()  # no collective here: reporting a non-finite step gathers from every rank
        return {name: value.detach().clone() for (held, name), value in self.state.items() if held is kind}

    def state_dict(self) -> dict:
        """This rank's training state for torch.distributed.checkpoint, by global names: `model.<name>`
        and `optim.<name>.<slot>` (each the rectangles of the global tensor this rank holds, views
        of the live state; a save writes each element from one rank), progress and RNG. Progress, RNG
        and buffers are those of the moment of the call: take a new state dict for each save.
        `dcp.save(sd, planner=fxshard.checkpoint.SavePlanner())` saves it, `dcp.load(sd,
        planner=fxshard.checkpoint.LoadPlanner())` then `step.load_state_dict(sd)` loads it;
        `fxshard.save` / `load` also check, stage and swap directories."""
        from ..checkpoint.state import step_state_dict

        self.refuse_if_interrupted()
        self._raise_if_nonfinite()
        self._check_same_lr()
        return step_state_dict(self)

    def load_state_dict(self, state: dict, strict: bool = True) -> None:
        """Copy into the live state this rank's parts of `state`: a dict like `state_dict()`'s
        (filled by `dcp.load(..., planner=fxshard.checkpoint.LoadPlanner())`) or plain global tensors
        by key (`model.<name>`, `optim.<name>.<slot>`). Like torch's: with `strict` (the default) a
        tensor this rank holds that `state` lacks, or a key that is not the model's, is an error;
        a wrong shape always is, and nothing is loaded then."""
        from ..checkpoint.state import load_state_dict

        load_state_dict(self, state, strict)


def _failed_node(error: BaseException, run: fx.GraphModule) -> fx.Node | None:
    """The node of `run` whose line of the generated code raised `error` (None: not found)."""
    nodes = {n.name: n for n in run.graph.nodes}
    for frame in reversed(traceback.extract_tb(error.__traceback__)):
        if frame.filename.startswith("<eval_with_key>") and frame.line:
            return nodes.get(frame.line.split("=")[0].strip())
    return None


def _nodes_before(node: fx.Node):
    while node.prev.op != "root":
        node = node.prev
        yield node


def _op_label(node: fx.Node) -> str:
    return str(node.target).replace("aten.", "").split(".default")[0] if node.op == "call_function" else node.op


def _one_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0][:200] if text else ''}"


_EXPERT_OPS = ("grouped_mm", "grouped_mm_wgrad", "grouped_mlp_fwd", "grouped_mlp_dgrad", "grouped_mlp_wgrad")


def _check_capturable(program: Program) -> None:
    """Refuse, on every rank alike and before any capture, a program with an op that syncs with the
    host (a capture would fail on one rank and leave the others waiting in a collective)."""
    from ..ops.grouped_mlp_backends import backend_for

    for node in program.graph.nodes:
        if node.op == "call_function" and getattr(node.target, "namespace", None) == "fxshard" and \
                node.target._opname in _EXPERT_OPS:
            tensors = [a.meta["val"] for a in node.args if isinstance(a, fx.Node) and a.meta["val"].is_floating_point()]
            backend = backend_for(*tensors)
            if getattr(backend, "host_sync", False):
                dtypes = sorted({str(t.dtype) for t in tensors})
                raise FxShardError(
                    f"Config(cuda_graphs=True): {node.name} ({node.target._opname}, {', '.join(dtypes)}) runs on the "
                    f"'{backend.name}' grouped-GEMM backend, which reads expert offsets on the host and cannot be "
                    f"captured; use bf16 expert compute on an sm90+ GPU (Config(param_dtype=torch.bfloat16), "
                    f"widths divisible by 8) or cuda_graphs=False")


def _waiting_in(step_ref):
    """What the step's stream was waiting for, by its wait marks (wait_marks.py), or None."""
    def where() -> str | None:
        step = step_ref()
        if step is None or not step.wait_marks.count:
            return None
        word = wait_marks_words(step._marks_device)
        return step.wait_marks.waiting_in(word) or step._evaluation_marks.waiting_in(word)
    return where


def _expire_replay(step_ref, timeout_s: float):
    """What the replay watch does once a replay ran too long: abort the step's process groups, so the
    replay stops, and make every later call say why (refuse_if_interrupted)."""
    def expire(what: str, seconds: float, how: str) -> None:
        step = step_ref()
        if step is None:
            return
        waiting = _waiting_in(step_ref)()
        step._aborted = (f"{what} ran {seconds:.0f} s {how}, longer than Config(collective_timeout_s)="
                         f"{timeout_s:g}: a rank stalled or stopped in a collective or transfer"
                         + (f" (this rank was at {waiting})" if waiting else "")
                         + ", so this rank aborted its process groups rather than hang. Restart the job from the last "
                         "checkpoint (in this process the groups are gone, the state may be partly updated, and the "
                         "process exits with status 1 at interpreter exit without tearing the groups down)")
        if step.groups:
            expire_process_groups(f"{what} on rank {step.rank}")
        for line in abort_groups(step.groups):
            print(f"fxshard: rank {step.rank}: could not abort process group {line}", file=sys.stderr, flush=True)
    return expire


def _read_later(flag: torch.Tensor):
    """A function that returns `flag` (0-d bool) as a Python bool. On CUDA the copy to the host starts
    now, behind the work that computes it, and the function waits for that copy alone: reading it after
    more steps were queued does not wait for them."""
    if flag.device.type != "cuda":
        return lambda: bool(flag)
    host = torch.empty((), dtype=flag.dtype, pin_memory=True)
    host.copy_(flag, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()

    def read() -> bool:
        copied.synchronize()
        return bool(host)

    return read


def _is_the_same_tensor(value: torch.Tensor, target: torch.Tensor) -> bool:
    """`value` is `target` or a view of all of it as it is (what an op that wrote into it returned)."""
    return value is target or (value.data_ptr() == target.data_ptr() and value.shape == target.shape
                               and value.stride() == target.stride() and value.dtype == target.dtype)


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


class CudaGraphReplay:
    """Captures the whole step into one CUDA graph after a few eager warm-up steps, then replays it.

    Inputs live at fixed addresses: the batch and the learning rate / step count are copied into
    them before each replay, and the captured graph writes every updated state tensor back into its
    input buffer (copy_), so the step's state stays where the graph reads it.
    """

    WARMUP_STEPS = 2

    def __init__(self, capture_error_mode: str = "global", memsets_to_kernels: bool = True):
        self.graph = None
        self.capture_error_mode = capture_error_mode
        self.memsets_to_kernels = memsets_to_kernels  # Config(cuda_graph_memsets), runtime/graph_memsets.py
        self.memsets: MemsetReport | None = None

    @property
    def is_captured(self) -> bool:
        return self.graph is not None

    def capture(self, step: CompiledStep) -> None:
        program = step.program
        leaves = [torch.zeros(leaf.shape, dtype=leaf.dtype, device=step.device) for leaf in step.batch_spec.leaves]
        args = [a.clone() if spec.kind in (InputKind.LR, InputKind.STEP) else a
                for spec, a in zip(program.inputs, step._arguments(leaves))]
        inputs = {(spec.kind, spec.name): arg for spec, arg in zip(program.inputs, args)}
        self.batch = [arg for spec, arg in zip(program.inputs, args) if spec.kind is InputKind.BATCH]
        self.lr = next(a for s, a in zip(program.inputs, args) if s.kind is InputKind.LR)
        self.step_number = next(a for s, a in zip(program.inputs, args) if s.kind is InputKind.STEP)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        graph = new_graph(self.memsets_to_kernels)
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream,
                                                         capture_error_mode=self.capture_error_mode):
            results = step._run(*args)
            self.metrics = {}
            for spec, value in zip(program.outputs, results):
                if spec.kind in WRITE_BACK:
                    target = inputs[WRITE_BACK[spec.kind], spec.name]
                    if not _is_the_same_tensor(value, target):  # else updated in place already
                        target.copy_(value)
                else:
                    self.metrics[spec.name] = value
        torch.cuda.current_stream().wait_stream(stream)
        del results
        self.memsets = finish_capture(graph, self.memsets_to_kernels, _device_index(step.device))
        self.graph = graph  # captured (is_captured) only once instantiated

    def replay(self, leaves, lr: float, step_number: float, skipped: torch.Tensor) -> dict[str, torch.Tensor]:
        for static, leaf in zip(self.batch, leaves):
            static.copy_(leaf, non_blocking=True)
        self.lr.fill_(lr)
        self.step_number.fill_(step_number).sub_(skipped)
        self.graph.replay()
        return {name: value.clone() for name, value in self.metrics.items()}


class EvaluationReplay:
    """step.evaluate's program captured into a CUDA graph, for steps with Config(cuda_graphs=True).

    Captured only once the training graph exists: from then on the training state stays at the
    addresses both graphs read (the training graph and checkpoint loads write into it in place). The
    batch is copied into fixed buffers before each replay; the results are cloned out.
    """

    def __init__(self, step: CompiledStep, program: Program, run: fx.GraphModule):
        leaves = [torch.zeros(leaf.shape, dtype=leaf.dtype, device=step.device) for leaf in step.batch_spec.leaves]
        args = [a.clone() if spec.kind in (InputKind.LR, InputKind.STEP) else a
                for spec, a in zip(program.inputs, step._arguments(leaves, program))]
        self.batch = [arg for spec, arg in zip(program.inputs, args) if spec.kind is InputKind.BATCH]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        rewrite = step._replay.memsets_to_kernels
        self.graph = new_graph(rewrite)
        with torch.no_grad(), torch.cuda.stream(stream), torch.cuda.graph(self.graph, stream=stream):
            self.outputs = {spec.name: value for spec, value in zip(program.outputs, run(*args))}
        torch.cuda.current_stream().wait_stream(stream)
        self.memsets = finish_capture(self.graph, rewrite, _device_index(step.device))

    def replay(self, leaves) -> dict[str, torch.Tensor]:
        for static, leaf in zip(self.batch, leaves):
            static.copy_(leaf, non_blocking=True)
        self.graph.replay()
        return {name: value.detach().clone() for name, value in self.outputs.items()}
