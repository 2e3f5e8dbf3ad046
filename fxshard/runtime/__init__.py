"""Executes Programs: `CompiledStep` replays one program eagerly on the host process's device."""

from .step import CompiledStep

__all__ = ["CompiledStep"]
