"""Mesh: the shape of the device grid, by named axis: `pp` (pipeline stages) and `dp` (data parallel);
`ep` follows. Ranks are laid out with dp varying fastest: rank = pp_index * dp + dp_index."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import FxShardError


@dataclass(frozen=True)
class Mesh:
    """`Mesh(dp=N)`: N data-parallel ranks; `Mesh(pp=P, dp=N)`: P pipeline stages of N ranks each.
    Passes see only the sizes and the axis names; the runtime binds each axis name to a real
    process group (built with torch.distributed.device_mesh)."""

    dp: int = 1
    pp: int = 1

    def __post_init__(self):
        for axis in ("dp", "pp"):
            value = getattr(self, axis)
            if not isinstance(value, int) or value < 1:
                raise FxShardError(f"Mesh({axis}={value!r}): {axis} must be an int >= 1")

    @property
    def size(self) -> int:
        return self.dp * self.pp

    @property
    def axes(self) -> dict[str, int]:
        return {"pp": self.pp, "dp": self.dp}

    def coords(self, rank: int) -> dict[str, int]:
        return {"pp": rank // self.dp, "dp": rank % self.dp}

    def rank_of(self, pp: int, dp: int) -> int:
        return pp * self.dp + dp

    def groups(self) -> dict[str, list[int]]:
        """Axis name -> the global ranks of rank 0's group along it (for the SPMD simulator)."""
        return {"dp": list(range(self.dp)), "pp": [self.rank_of(p, 0) for p in range(self.pp)]}

    def __str__(self) -> str:
        return f"Mesh(dp={self.dp})" if self.pp == 1 else f"Mesh(pp={self.pp}, dp={self.dp})"
