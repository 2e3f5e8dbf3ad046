"""Which modules are layers, and the hooks that annotate their forward while tracing.

A layer is a module whose forward (and, through aot_autograd's metadata link, whose backward) is
tagged with its module path. Everything traced before the first layer runs is "pre", everything after
the last layer has run is "post", and what runs between one layer and the next, outside both,
belongs to the one before (with Config(layers=("layers.*.attn", "layers.*.mlp")), a block's residual
add after its attention is the attention's). The model needs no edits: hooks do the tagging and are
removed when tracing ends.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch

import torch.fx.traceback as fx_traceback
import torch.nn as nn

from . import meta
from .errors import FxShardError


def find_layers(model: nn.Module, patterns: tuple[str, ...] | None = None) -> list[str]:
    """Module paths of the layers, in registration order: the children of `patterns`' matches, or
    by default of the container holding the most parameters among the ModuleLists, Sequentials and
    ModuleDicts of one module type and the ModuleLists and ModuleDicts whose children all hold
    parameters (a hybrid model's blocks: Jamba's attention and Mamba layers). A Sequential of mixed
    types is a model of its own (Linear, ReLU, Linear), not a list of blocks."""
    if patterns is not None:
        paths = [name for name, _ in model.named_modules() if name and
                 any(fnmatch.fnmatchcase(name, p) for p in patterns)]
        # A match nested in another match belongs to the outer one.
        paths = [p for p in paths if not any(p.startswith(q + ".") for q in paths)]
        if not paths:
            raise FxShardError(
                f"Config(layers={list(patterns)}) matched no module; module paths look like "
                f"{[n for n, _ in model.named_modules() if n][:6]}")
        return paths
    sizes = {name: sum(p.numel() for p in module.parameters())
             for name, module in model.named_modules() if _holds_blocks(module)}
    best, best_size = None, 0
    for name, size in sizes.items():
        if size > best_size:
            best, best_size = name, size
    if best is None:
        return []
    _warn_other_block_lists(best, sizes)
    prefix = f"{best}." if best else ""
    return [f"{prefix}{key}" for key in _children(model.get_submodule(best))]


def _warn_other_block_lists(best: str, sizes: dict[str, int]) -> None:
    """An encoder-decoder model (T5, Bart) has two lists of blocks: the default takes the larger (the
    decoder, with its cross-attention), and the encoder's blocks run inside `pre`, one ZeRO unit that
    a pipeline never cuts. Said, with the Config(layers) that takes both, where another outermost block
    list outside `best` holds at least a quarter of its parameters."""
    def inside(name: str, other: str) -> bool:
        return other == "" or name == other or name.startswith(other + ".")

    apart = [name for name in sizes if not inside(name, best) and not inside(best, name)]
    outermost = [name for name in apart if not any(inside(name, other) for other in apart if other != name)]
    others = [name for name in outermost if 4 * sizes[name] >= sizes[best]]
    if others:
        import warnings

        from .errors import user_stacklevel

        patterns = ", ".join(f'"{name}.*"' for name in sizes if name in (best, *others))  # in model order
        warnings.warn(f"fxshard: the layers are {best}'s children; {', '.join(others)} also holds blocks "
                      f"({', '.join(f'{sizes[o]:,}' for o in others)} parameters against {sizes[best]:,}), which run "
                      f"inside 'pre' or 'post' as one unit that ZeRO gathers whole and a pipeline does not cut. "
                      f"Config(layers=({patterns})) makes them layers too (listed in the order they are registered: "
                      f"list them in the order the forward runs them, which a pipeline needs)",
                      stacklevel=user_stacklevel())


def _holds_blocks(module: nn.Module) -> bool:
    children = list(_children(module).values())
    if not children:
        return False
    if len({type(child) for child in children}) == 1:
        return True
    return not isinstance(module, nn.Sequential) and all(any(True for _ in c.parameters()) for c in children)


def _children(module: nn.Module) -> dict[str, nn.Module]:
    """A container's children by the name their path uses: ModuleList / Sequential by index,
    ModuleDict (torchtitan keeps its blocks in one) by key, in registration order; {} otherwise."""
    if isinstance(module, nn.ModuleDict):
        return dict(module.items())
    if isinstance(module, (nn.ModuleList, nn.Sequential)):
        return {str(index): child for index, child in enumerate(module)}
    return {}


@dataclasses.dataclass
class LayerTrace:
    """What annotate_layers saw of one traced step: how many times a layer's forward was entered."""
    entries: int = 0

    def layer_of(self, annotation: "str | tuple[int, str]") -> str:
        """The layer an op's annotation names: a layer's path or "pre" (a string), or for an op traced
        after layer entry k outside any layer ((k, path)), that layer, or "post" after the step's last
        entry. (A step that runs its layers twice, e.g. a loss over two forwards, has its first
        forward's head in its last layer then.)"""
        if isinstance(annotation, str):
            return annotation
        entry, path = annotation
        return meta.POST if entry == self.entries else path


@contextlib.contextmanager
def annotate_layers(root: nn.Module, model: nn.Module, layer_paths: list[str], at_boundary=None):
    """While active, every op traced inside a layer's forward carries that layer's path, and every op
    traced after it outside any layer says so (`LayerTrace.layer_of` reads both); yields the
    LayerTrace. `at_boundary()` runs as each layer starts (its ops the region's before it) and as it
    ends (its ops the layer's).

    `root` is the module whose call is one traced step (it wraps loss_fn): each call starts "pre".
    aot_autograd runs it more than once (metadata pass, joint trace), so the state resets per call.
    """
    regions: list[contextlib.ExitStack] = []
    open_layers: dict[int, contextlib.AbstractContextManager] = {}
    trace = LayerTrace()

    def start_step(module, args):
        region = contextlib.ExitStack()
        region.enter_context(fx_traceback.annotate({meta.ANNOTATION_LAYER: meta.PRE}))
        regions.append(region)
        trace.entries = 0

    def end_step(module, args, output):
        regions.pop().close()

    # A layer's forward run outside a step's call (activation checkpointing's recompute, in the
    # backward) is neither annotated nor counted.
    def enter(path):
        def pre_hook(module, args):
            if not regions:
                return
            if at_boundary is not None:
                at_boundary()
            cm = fx_traceback.annotate({meta.ANNOTATION_LAYER: path})
            cm.__enter__()
            open_layers[id(module)] = cm
            trace.entries += 1
        return pre_hook

    def leave(path):
        def hook(module, args, output):
            if id(module) not in open_layers:
                return
            if at_boundary is not None:
                at_boundary()
            open_layers.pop(id(module)).__exit__(None, None, None)
            # From here on, ops outside any layer are this entry's, or "post" if no layer follows. The
            # contexts nest properly: this one opens after the layer's own context closed, and the
            # step's region closes them in reverse.
            regions[-1].enter_context(fx_traceback.annotate({meta.ANNOTATION_LAYER: (trace.entries, path)}))
        return hook

    handles = [root.register_forward_pre_hook(start_step), root.register_forward_hook(end_step)]
    for path in layer_paths:
        module = model.get_submodule(path)
        handles.append(module.register_forward_pre_hook(enter(path)))
        handles.append(module.register_forward_hook(leave(path)))
    try:
        yield trace
    finally:  # a trace that failed midway leaves contexts open: close them innermost first
        for cm in reversed(list(open_layers.values())):
            cm.__exit__(None, None, None)
        for region in reversed(regions):
            region.close()
        for handle in handles:
            handle.remove()
