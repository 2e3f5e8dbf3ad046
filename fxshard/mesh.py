"""Mesh: the shape of the device grid, by named axis. Only `dp` exists so far; `ep` and `pp` follow."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import FxShardError


@dataclass(frozen=True)
class Mesh:
    """`Mesh(dp=N)`: N data-parallel ranks. Passes see only the sizes and the axis names; the runtime
    binds each axis name to a real process group (built with torch.distributed.device_mesh)."""

    dp: int = 1

    def __post_init__(self):
        if not isinstance(self.dp, int) or self.dp < 1:
            raise FxShardError(f"Mesh(dp={self.dp!r}): dp must be an int >= 1")

    @property
    def size(self) -> int:
        return self.dp

    @property
    def axes(self) -> dict[str, int]:
        return {"dp": self.dp}

    def groups(self) -> dict[str, list[int]]:
        """Axis name -> the global ranks of rank 0's group along it (for the SPMD simulator)."""
        return {"dp": list(range(self.dp))}
