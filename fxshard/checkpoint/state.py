"""A step's training state as torch.distributed.checkpoint (DCP) sees it: global tensors by model name.

`step_state_dict(step)` gives, per checkpoint key (fxshard/checkpoint/items.py), a `Boxes` object:
the rectangles of that global tensor this rank holds, each a view of one of its state tensors. DCP
writes each rectangle once (the rank whose piece `writes`) and, on load, reads into every rank's
rectangles whatever the checkpoint's rectangles overlap: that is the resharding, any layout to any
other. `SavePlanner` / `LoadPlanner` are DCP's default planners taught to find a rectangle in a
`Boxes` (DCP's own lookup knows only tensors, DTensors and ShardedTensors).

Beside the tensors: `fxshard.progress` (step count, learning-rate override), `rng.rank<r>` (this
rank's CPU and CUDA generator states; on a pipeline stage that draws random values, its own stream
too, fxshard/runtime/rng.py) and `buffers.rank<r>` (this rank's copies of the buffers its
step updates), plain objects DCP pickles.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Mapping

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from ..loss_scale import MAX_GROWTH_INTERVAL, NAME as LOSS_SCALE, in_range
from ..program import InputKind, OutputKind
from ..runtime.rng import rng_state, set_rng_state
from .items import Piece, boxes, global_tensors, model_key, state_pieces

PROGRESS = "fxshard.progress"


def rng_key(rank: int) -> str:
    return f"rng.rank{rank}"


def buffers_key(rank: int) -> str:
    """This rank's own copies of the buffers its step updates (BatchNorm statistics, counters): each
    data-parallel rank updates them from its own batches, so they differ between ranks. `model.<name>`
    holds one rank's copy (the first along dp), which a load under another layout gives every rank."""
    return f"buffers.rank{rank}"


class Boxes:
    """One global tensor (`size`, `dtype`) as one rank holds it: box offsets -> a view of that box.
    A save writes the boxes in `written` (this rank's are the ones saved); a load fills all of them
    (every replica needs the values)."""

    def __init__(self, size: tuple[int, ...], dtype: torch.dtype):
        self.global_size, self.dtype = torch.Size(size), dtype
        self.boxes: dict[tuple[int, ...], torch.Tensor] = {}
        self.written: set[tuple[int, ...]] = set()

    def size(self) -> torch.Size:  # what DCP's load plan compares with the checkpoint's size
        return self.global_size

    def __create_write_items__(self, fqn: str, obj) -> list[WriteItem]:
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(offsets)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(
                              chunk=ChunkStorageMetadata(torch.Size(offsets), view.size()),
                              properties=TensorProperties.create_from_tensor(view), size=self.global_size))
                for offsets, view in self.boxes.items() if offsets in self.written]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(torch.Size(offsets), view.size()) for offsets, view in self.boxes.items()]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        return self.boxes[tuple(index.offset)]


class SavePlanner(DefaultSavePlanner):
    def __init__(self, **options):  # the state dict is flat already: progress and RNG dicts stay one object
        super().__init__(**{"flatten_state_dict": False, "flatten_sharded_tensors": False, **options})

    def lookup_object(self, index: MetadataIndex):
        value = self.state_dict[index.fqn]
        return value.__get_tensor_shard__(index) if isinstance(value, Boxes) else super().lookup_object(index)


class LoadPlanner(DefaultLoadPlanner):
    def __init__(self, **options):
        super().__init__(**{"flatten_state_dict": False, "flatten_sharded_tensors": False, **options})

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        # DCP's own set-up maps every value through a function that knows only tensors and turns
        # anything else, our Boxes included, into None
        self.original_state_dict = self.state_dict = state_dict
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        value = self.state_dict[index.fqn]
        return value.__get_tensor_shard__(index) if isinstance(value, Boxes) else super().lookup_tensor(index)


def pieces_of(step) -> list[Piece]:
    """This rank's pieces of the checkpoint's tensors: its state but the buffers registered with
    persistent=False, which torch's state_dict leaves out too (a RoPE table is the model's code's: a
    resume with another base computes with the new one)."""
    transient = {model_key(name) for name in step.transient_buffers}
    return [piece for piece in state_pieces(step.program, step.programs[0], step.coords) if piece.key not in transient]


def boxes_of(step, pieces: list[Piece], tensors: dict) -> dict[str, Boxes]:
    """Key -> Boxes whose views lie in `tensors` ((kind, name) -> flat-viewable state tensor)."""
    shapes = global_tensors(step.programs[0])
    result: dict[str, Boxes] = {}
    for piece in pieces:
        shape, _ = shapes[piece.key]
        held = result.setdefault(piece.key, Boxes(shape, tensors[piece.state].dtype))
        flat = tensors[piece.state].view(-1)
        for offsets, sizes, start in boxes(shape, piece.start, piece.start + piece.numel):
            begin = piece.local + start - piece.start
            held.boxes[offsets] = flat[begin:begin + math.prod(sizes)].view(sizes)
            if piece.writes:
                held.written.add(offsets)
    return result


def step_state_dict(step, copy: bool = False) -> dict:
    """The DCP state dict of `step` on this rank: every key this rank holds, as views of the step's
    state tensors (what a save writes and a load fills), or, with `copy`, only what this rank writes,
    as views of host copies (a snapshot later steps do not change; the host buffers, pinned for a
    fast device-to-host copy, are kept on the step and reused by the next copy, which `fxshard.save`
    starts only after the last one is written)."""
    pieces = pieces_of(step)
    if copy:
        pieces = [piece for piece in pieces if piece.writes]
    tensors = {piece.state: step.state[piece.state] for piece in pieces}
    if copy:
        tensors = host_copies(step, tensors)
    state = dict(boxes_of(step, pieces, tensors))
    state[PROGRESS] = {"step_count": step.step_count, "lr_override": step._lr_override,
                       "skipped_steps": step.skipped_steps}
    scale = step.state.get((InputKind.LOSS_SCALE, LOSS_SCALE))
    if scale is not None:  # a dynamic loss scale: [scale, good steps], the same on every rank
        state[PROGRESS]["loss_scale"] = scale.tolist()
    state[rng_key(step.rank)] = rng_state(step.device)
    if step._stream is not None:  # a pipeline stage's own random stream (runtime/rng.py)
        state[rng_key(step.rank)]["stage_stream"] = step._stream.saved()
    return state


def own_buffers(step) -> dict:
    """`buffers_key`'s value: host copies of this rank's buffers that its step updates."""
    updated = {spec.name for spec in step.program.outputs_of(OutputKind.BUFFER)} - set(step.transient_buffers)
    return {name: value.detach().cpu().clone() for (kind, name), value in step.state.items()
            if kind is InputKind.BUFFER and name in updated}


def host_copies(step, tensors: dict) -> dict:
    buffers = getattr(step, "_host_staging", None) or {}
    copies = {}
    for key, value in tensors.items():
        buffer = buffers.get(key)
        if buffer is None or buffer.shape != value.shape or buffer.dtype != value.dtype:
            buffer = torch.empty(value.shape, dtype=value.dtype, pin_memory=value.device.type == "cuda")
        copies[key] = buffer.copy_(value, non_blocking=True)
    if step.device.type == "cuda":
        torch.cuda.current_stream().synchronize()
    step._host_staging = copies
    return copies


def staging_state_dict(step) -> tuple[dict, dict]:
    """A DCP state dict for loading: every key this rank holds, as views of fresh copies of its state
    tensors (a failed load leaves the step as it was), and those copies ((kind, name) -> tensor)."""
    pieces = pieces_of(step)
    copies = {piece.state: step.state[piece.state].clone() for piece in pieces}
    state = dict(boxes_of(step, pieces, copies))
    state[PROGRESS] = {"step_count": 0, "lr_override": None, "skipped_steps": 0}
    return state, copies


def apply_loaded(step, copies: dict, progress: dict, rng: dict | None, buffers: dict | None = None) -> None:
    """Make the loaded copies the step's state: copied into the step's own tensors, whose addresses
    a captured CUDA graph reads; then this rank's own copies of updated buffers (`buffers_key`)."""
    with torch.no_grad():
        for key, value in copies.items():
            step.state[key].copy_(value)
        set_own_buffers(step, buffers)
    set_progress(step, progress, rng)


def set_own_buffers(step, buffers: dict | None) -> None:
    """`buffers` (an `own_buffers` value) into the step's buffers of the same name and shape."""
    for name, value in (buffers or {}).items():
        held = step.state.get((InputKind.BUFFER, name))
        if held is not None and held.shape == value.shape:
            held.copy_(value)


def set_progress(step, progress: dict | None, rng: dict | None) -> None:
    step._unchecked.clear()  # non-finite flags of steps the loaded state replaces
    # and a step that stopped mid-update: the loaded state replaces what it left
    step._interrupted = None
    step._lr_trail = hashlib.sha256()  # every rank loads the same state: the lrs before it no longer matter
    if progress is not None:
        step.step_count = int(progress["step_count"])
        step._lr_override = progress["lr_override"]
        if step._lr_override is not None:
            import warnings

            warnings.warn(f"fxshard: the loaded state holds a learning rate set by set_lr ({step._lr_override}), "
                          f"which replaces this step's optimizer lr or schedule from now on; step.set_lr(None) "
                          f"returns to the optimizer's", stacklevel=3)
        step._skipped.fill_(int(progress.get("skipped_steps", 0)))
        scale = step.state.get((InputKind.LOSS_SCALE, LOSS_SCALE))
        if scale is not None and progress.get("loss_scale") is not None:  # else (saved without one) it stays
            scale.copy_(torch.tensor(progress["loss_scale"], dtype=scale.dtype))
    if rng is not None:
        set_rng_state(rng, step.device)
    if step._stream is not None:  # the stage's stream where this stage saved it, else derived again
        step._stream.restore((rng or {}).get("stage_stream"))


def load_state_dict(step, state: dict, strict: bool = True) -> None:
    """`step.load_state_dict`: a state dict of `step_state_dict`'s form (its views filled by DCP), or
    plain global tensors by key. Plain tensors must have their global shapes; with `strict`, every
    tensor this rank holds must be there and every key must name something of the model's (a key held
    by another pipeline stage is not unexpected). Checked before anything is copied."""
    step._refuse_if_aborted()
    check_state_dict(step, state, strict)
    load_state_dict_into(step, state, step.state)
    set_progress(step, state.get(PROGRESS), state.get(rng_key(step.rank)))


def check_state_dict(step, state: dict, strict: bool) -> None:
    """FxShardError, naming the keys, for tensors of the wrong shape and (with `strict`) for tensors
    this rank holds that `state` lacks and for keys that are neither the model's nor progress, RNG or
    updated-buffer entries."""
    from ..errors import FxShardError

    if not isinstance(state, Mapping):
        raise FxShardError(f"load_state_dict takes a dict of tensors by key, got {type(state).__name__}")
    shapes = global_tensors(step.programs[0])
    if state and not any(key in shapes or key == PROGRESS or re.fullmatch(r"(rng|buffers)\.rank\d+", str(key))
                         for key in state):  # strict=False would load nothing
        example = next(iter(state))
        hint = ("; model.state_dict()'s names need the prefix: {f'model.{name}': value for name, value in "
                "model.state_dict().items()}" if f"model.{example}" in shapes else "")
        raise FxShardError(f"load_state_dict: none of the {len(state)} keys names a tensor of this step (e.g. "
                           f"{example!r}); keys are `model.<parameter or buffer>` and `optim.<parameter>.<slot>` "
                           f"(step.state_dict() lists this rank's){hint}")
    given = {key: _global_shape(value) for key, value in state.items() if key in shapes}
    mis_shaped = sorted(f"{key} {shape} != {shapes[key][0]}" for key, shape in given.items()
                        if shape is not None and shape != shapes[key][0])
    missing, unexpected = [], []
    if strict:
        missing = sorted({piece.key for piece in pieces_of(step)} - set(state))
        unexpected = sorted(key for key in state if key not in shapes and key != PROGRESS
                            and not re.fullmatch(r"(rng|buffers)\.rank\d+", str(key)))
    problems = key_differences(missing, unexpected, mis_shaped)
    not_tensors = sorted(str(key) for key, value in state.items() if key in shapes and not (
        isinstance(value, (torch.Tensor, Boxes)) or hasattr(value, "read")))
    on_meta = sorted(str(key) for key, value in state.items() if key in shapes and isinstance(value, torch.Tensor)
                     and value.is_meta)
    not_finite = sorted(str(key) for key, value in state.items() if key in shapes and isinstance(value, torch.Tensor)
                        and not value.is_meta and value.is_floating_point() and not bool(torch.isfinite(value).all()))
    problems = "; ".join(p for p in (problems, _progress_problem(state.get(PROGRESS)),
                                     f"not tensors: {', '.join(not_tensors[:8])}" if not_tensors else "",
                                     f"on the meta device (no values): {', '.join(on_meta[:8])}" if on_meta else "",
                                     f"not finite (NaN or inf): {', '.join(not_finite[:8])}" if not_finite else "") if p)
    if problems:
        raise FxShardError(
            f"load_state_dict: the state dict does not fit this step ({problems}); nothing was loaded. Keys are "
            f"`model.<parameter or buffer>` and `optim.<parameter>.<slot>` with the model's global shapes "
            f"(step.state_dict() lists this rank's); load_state_dict(state, strict=False) loads the tensors "
            f"present and ignores unknown keys")


def _progress_problem(progress) -> str:
    """What is wrong with a state dict's progress entry (step count, lr override), or ""."""
    from ..optim import is_learning_rate

    if progress is None:
        return ""
    if not isinstance(progress, dict) or not {"step_count", "lr_override"} <= set(progress):
        return f"{PROGRESS} must be a dict with step_count and lr_override, got {progress!r}"
    count, lr = progress["step_count"], progress["lr_override"]
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        return f"{PROGRESS} step_count must be an int >= 0, got {count!r}"
    if lr is not None and not is_learning_rate(lr):
        return f"{PROGRESS} lr_override must be None or a finite float >= 0, got {lr!r}"
    scale = progress.get("loss_scale")
    if scale is not None and not (isinstance(scale, (list, tuple)) and len(scale) == 2 and in_range(scale[0])
                                  and isinstance(scale[1], (int, float)) and not isinstance(scale[1], bool)
                                  and 0 <= scale[1] <= MAX_GROWTH_INTERVAL):
        return (f"{PROGRESS} loss_scale must be [scale in [2**-126, 2**126], good steps in [0, 2**24]], "
                f"got {scale!r}")
    return ""


def _global_shape(value) -> tuple[int, ...] | None:
    """The global shape a state dict's value stands for (a tensor, `Boxes` from another step's
    `state_dict()`, a source with a `shape`), or None where it does not say."""
    if isinstance(value, Boxes):
        return tuple(value.global_size)
    shape = getattr(value, "shape", None)
    return tuple(shape) if shape is not None else None


def key_differences(missing: list[str], unexpected: list[str], mis_shaped: list[str], shown: int = 8) -> str:
    """Keys that do not fit, as one line ("missing (2): a, b; shape differs (1): c (2,) != (3,)"), or ""."""
    return "; ".join(f"{label} ({len(items)}): {', '.join(items[:shown])}{', ...' if len(items) > shown else ''}"
                     for label, items in (("missing", missing), ("unexpected", unexpected),
                                          ("shape differs", mis_shaped)) if items)


def load_state_dict_into(step, state: dict, targets: dict) -> None:
    """Copy this rank's pieces of the global tensors in `state` (by key: Boxes, plain tensors, or
    anything with `read(offsets, sizes)`, such as fxshard/checkpoint/hf.py's sources) into `targets`
    ((kind, name) -> state tensor)."""
    shapes = global_tensors(step.programs[0])
    with torch.no_grad():
        for piece in pieces_of(step):
            value = state.get(piece.key)
            if value is None:
                continue
            target = targets[piece.state].view(-1)
            for offsets, sizes, start in boxes(shapes[piece.key][0], piece.start, piece.start + piece.numel):
                begin = piece.local + start - piece.start
                source = read_box(value, offsets, sizes)
                destination = target[begin:begin + math.prod(sizes)].view(sizes)
                if source.data_ptr() != destination.data_ptr():
                    destination.copy_(source)


def read_box(value, offsets, sizes) -> torch.Tensor:
    """The rectangle (`offsets`, `sizes`) of a global tensor held as Boxes, a tensor or a source."""
    if isinstance(value, Boxes):
        return value.boxes[tuple(offsets)]
    if not isinstance(value, torch.Tensor):
        return value.read(offsets, sizes)
    for dim, (offset, size) in enumerate(zip(offsets, sizes)):
        value = value.narrow(dim, offset, size)
    return value

