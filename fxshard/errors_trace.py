"""Turn a tracer failure into an FxShardError that names the cause and the user's source line."""

from __future__ import annotations

import linecache
import os
import traceback

import torch

from .errors import FxShardError

_TORCH_DIR = os.path.dirname(torch.__file__)
_FXSHARD_DIR = os.path.dirname(os.path.abspath(__file__))
_STDLIB_DIR = os.path.dirname(os.__file__)

_CAUSES = {
    "DataDependentOutputException":
        "the model reads a tensor's value on the host (.item(), .tolist(), int(t), a tensor in an `if`)",
    "GuardOnDataDependentSymNode":
        "control flow depends on tensor values (data-dependent control flow)",
    "DynamicOutputShapeException":
        "an op's output shape depends on tensor values (nonzero, unique, masked_select, bincount, boolean "
        "indexing)",
}
# causes recognised by their message: (text in torch's message, cause, fix)
_MESSAGES = (
    ("Cannot access data pointer of Tensor",
     "the model runs a kernel that reads a tensor's memory directly (a C++/CUDA extension, or a Triton "
     "kernel launched by hand), which a traced tensor does not have",
     "register that kernel as an op with torch.library.custom_op and give it a fake implementation "
     "(register_fake: output shapes and dtypes from input shapes), as fxshard/ops/adamw.py does"),
    ("Cannot backprop through mirrored meta",
     "loss_fn calls .backward() (or torch.autograd.grad) itself",
     "return the loss instead: fxshard traces the backward and the optimizer update into the step"),
    ("Please convert all Tensors to FakeTensors first",
     "the model reads a real tensor that is neither a parameter, a buffer nor part of the batch (a plain "
     "attribute such as `self.scale = torch.tensor(2.0)`, a class attribute, a global)",
     "register it as a buffer (self.register_buffer('scale', torch.tensor(2.0), persistent=False)), make it "
     "inside forward from a Python number, or use the number itself"),
    ("mutating a non-functional tensor with a functional tensor",
     "the step updates in place a tensor it does not carry: a plain tensor attribute or a global "
     "(`self.seen = torch.zeros(4)`, then `self.seen.add_(...)`), or a buffer updated in a backward hook",
     "keep such state in a buffer (self.register_buffer('seen', torch.zeros(4))) and update it in the "
     "forward (under torch.no_grad()), where the step carries the update as eager PyTorch does"),
    (".numpy() is not supported for tensor subclasses",
     "the model converts a tensor to NumPy (.numpy()), which needs its values on the host",
     "keep the computation in torch ops"),
)
_FIX = ("fxshard traces one static-shape graph; compute the value with tensor ops instead "
        "(torch.where instead of `if`, masks instead of boolean indexing, fixed-size outputs). An MoE layer "
        "that loops over the experts its tokens chose: register a forward for it written with fxshard.moe "
        "(fxshard.register_moe), without editing the model")


def _chain(error: BaseException):
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


def user_frame(error: BaseException) -> str | None:
    """'file:line in function: source' of the deepest frame outside torch, fxshard's core and stdlib."""
    best = None
    for link in _chain(error):
        for frame in traceback.extract_tb(link.__traceback__):
            path = os.path.abspath(frame.filename)
            if path.startswith((_TORCH_DIR, _FXSHARD_DIR, _STDLIB_DIR)) or path.startswith("<"):
                continue
            source = (frame.line or linecache.getline(frame.filename, frame.lineno)).strip()
            best = f"{frame.filename}:{frame.lineno} in {frame.name}: {source}"
    return best


_NN_DIR = os.path.join(_TORCH_DIR, "nn", "")
# fixes for torch modules that read a tensor on the host in some configurations: (text of the line, fix)
_MODULE_FIXES = (
    ("num_batches_tracked",
     "a BatchNorm with momentum=None averages its running statistics by its batch count, read on the host; "
     "give it a numeric momentum (e.g. momentum=0.1, torch's default)"),
)


_MODULE_CALL = os.path.join(_TORCH_DIR, "nn", "modules", "module.py")  # nn.Module.__call__'s dispatch


def _is_user(path: str) -> bool:
    return not (path.startswith((_TORCH_DIR, _FXSHARD_DIR, _STDLIB_DIR)) or path.startswith("<"))


def library_frame(error: BaseException) -> str | None:
    """'module:line in function: source' of the deepest frame in a torch.nn module's own code below
    the user's deepest frame (a host read inside torch's BatchNorm, say), or None: a read in the
    user's own code has no such frame (nn.Module's call dispatch does not count)."""
    best = None
    for link in _chain(error):
        frames = traceback.extract_tb(link.__traceback__)
        paths = [os.path.abspath(frame.filename) for frame in frames]
        last_user = max((i for i, path in enumerate(paths) if _is_user(path)), default=-1)
        for frame, path in list(zip(frames, paths))[last_user + 1:]:
            if path.startswith(_NN_DIR) and path != _MODULE_CALL:
                source = (frame.line or linecache.getline(frame.filename, frame.lineno)).strip()
                module = os.path.relpath(frame.filename, os.path.dirname(_TORCH_DIR))[:-3].replace(os.sep, ".")
                best = f"{module}:{frame.lineno} in {frame.name}: {source}"
    return best


def explain_trace_failure(error: BaseException) -> FxShardError:
    where = user_frame(error)
    location = f"\n  at {where}" if where else ""
    for link in _chain(error):
        cause = _CAUSES.get(type(link).__name__)
        if cause:
            inside = library_frame(error)
            fix = next((f for text, f in _MODULE_FIXES if inside and text in inside), _FIX)
            location += f"\n  inside {inside}" if inside else ""
            return FxShardError(f"cannot trace the training step: {cause}.{location}\n  {fix}")
    for link in _chain(error):
        for text, cause, fix in _MESSAGES:
            if text in str(link):
                return FxShardError(f"cannot trace the training step: {cause}.{location}\n  {fix}")
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return FxShardError(
        f"cannot trace the training step: {type(error).__name__}: {first_line}{location}\n"
        f"  the model and loss_fn must run on fake tensors with static shapes; the chained "
        f"exception above has torch's full message")
