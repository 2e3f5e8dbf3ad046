"""Executes Programs: `CompiledStep` replays one per-rank program on the host process's device, op by op,
as Inductor-compiled regions, or captured in a CUDA graph."""

from .step import CompiledStep

__all__ = ["CompiledStep"]
