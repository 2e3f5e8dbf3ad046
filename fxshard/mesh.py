"""Mesh: the shape of the device grid, by named axis: `pp` (pipeline stages), `dp` (data parallel)
and `ep` (expert parallel, inside dp).

Ranks are laid out with dp varying fastest: rank = pp_index * dp + dp_index. With `ep=K`, the dp
ranks of a stage form dp/K expert-parallel groups of K consecutive ranks: ep_index = dp_index % K,
and `edp` (expert data parallel) = dp_index // K names the replicas of the same experts.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import FxShardError


@dataclass(frozen=True)
class Mesh:
    """`Mesh(dp=N)`: N data-parallel ranks; `Mesh(pp=P, dp=N)`: P pipeline stages of N ranks each;
    `Mesh(dp=N, ep=K)`: the N ranks split into N/K groups of K that share their MoE experts (each owns
    E/K of them); non-expert parameters are data-parallel over all N ranks, expert parameters over
    the N/K ranks that own the same experts (axis `edp`). `Mesh(pp=P, dp=N, ep=K)`: the same inside
    each of the P stages.
    Passes see only the sizes and the axis names; the runtime binds each axis name to a real
    process group (`api._new_groups`, with torch.distributed.new_group)."""

    dp: int = 1
    pp: int = 1
    ep: int = 1

    def __post_init__(self):
        for axis in ("dp", "pp", "ep"):
            value = getattr(self, axis)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:  # True is an int
                raise FxShardError(f"Mesh({axis}={value!r}): {axis} must be an int >= 1")
        if self.dp % self.ep:
            raise FxShardError(f"Mesh(dp={self.dp}, ep={self.ep}): ep must divide dp (expert-parallel groups are "
                               f"made of data-parallel ranks); choose ep among the divisors of {self.dp}")

    @property
    def size(self) -> int:
        """The number of ranks: pp x dp (ep splits dp; it adds none)."""
        return self.dp * self.pp

    @property
    def edp(self) -> int:
        """The expert-data-parallel size: how many ranks of a stage hold the same experts (dp / ep)."""
        return self.dp // self.ep

    def coords(self, rank: int) -> dict[str, int]:
        """`rank`'s index on each axis: {"pp", "dp"} (and "ep", "edp" with ep > 1). Draw a rank's batch
        by its "dp" index: the stages of one pipeline read the same batch."""
        dp_index = rank % self.dp
        coords = {"pp": rank // self.dp, "dp": dp_index}
        if self.ep > 1:
            coords.update(ep=dp_index % self.ep, edp=dp_index // self.ep)
        return coords

    def rank_of(self, pp: int, dp: int) -> int:
        """The global rank at pipeline stage `pp` and data-parallel index `dp`."""
        return pp * self.dp + dp

    def stage_groups(self, stages) -> list[list[int]]:
        """The groups of the ranks of `stages` (pipeline stage indices), one per data-parallel index:
        where a weight tied across those stages is summed."""
        return [[self.rank_of(p, d) for p in stages] for d in range(self.dp)]

    def all_groups(self) -> dict[str, list[list[int]]]:
        """Axis name -> every group along it, each as global ranks in group-rank order (what the SPMD
        simulator needs)."""
        stages = range(self.pp)
        result = {"dp": [[self.rank_of(p, d) for d in range(self.dp)] for p in stages],
                  "pp": self.stage_groups(stages)}
        if self.ep > 1:
            result["ep"] = [[self.rank_of(p, g * self.ep + e) for e in range(self.ep)]
                            for p in stages for g in range(self.edp)]
            result["edp"] = [[self.rank_of(p, g * self.ep + e) for g in range(self.edp)]
                             for p in stages for e in range(self.ep)]
        return result

    def __str__(self) -> str:
        parts = ([f"pp={self.pp}"] if self.pp > 1 else []) + [f"dp={self.dp}"] + \
            ([f"ep={self.ep}"] if self.ep > 1 else [])
        return f"Mesh({', '.join(parts)})"
