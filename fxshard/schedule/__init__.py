"""Pipeline schedules as data: per-rank action lists, their generators, and a simulator.

An action is one short token: `F1:3` (forward of chunk 1, microbatch 3), `B1:3` (its input
gradient, or the whole backward when W is not split off), `W1:3` (weight gradient), `SF1:3>2` /
`RF1:3<0` (send / receive of chunk 1's microbatch-3 activation to / from rank 2 / 0), `SB…`/`RB…`
for activation gradients, and `OPT`. P×V chunks for V virtual stages; the schedule's placement says which
rank holds each (`Schedule.rank_of`).

ZeRO over the data-parallel axis adds per-chunk collectives of the dp group (torch.distributed.
pipelining's UNSHARD / RESHARD / REDUCE_GRAD): `U1` all-gathers chunk 1's parameters, `R1` frees
the gathered copy, `G1` reduces chunk 1's gradients (reduce-scatter, or all-reduce without sharded
optimizer state). `add_zero_actions` places them; `simulate` runs U and G on a communication
stream of their own, concurrent with compute.

Generators: `gpipe`, `one_f_one_b`, `interleaved_one_f_one_b` (Megatron's order), `zero_bubble_h1`,
`dualpipe_v` (V placement). `simulate` checks a schedule without running a model (every
dependency satisfied, no deadlock) and reports makespan, bubble fraction and peak live activations
per rank.

Modules: `model` (Action, Schedule, placement, add_communication), `generators` (the named
schedules, `build`), `zero` (ZeRO's U / R / G actions), `simulator` (`simulate`), `order` (issue
order, combined pairs, the point-to-point deadlock check), `svg` (`to_svg`).
"""

from .generators import build, dualpipe_v, gpipe, interleaved_one_f_one_b, one_f_one_b, zero_bubble_h1
from .model import COMPUTE, PLACEMENTS, TRANSFERS, ZERO, Action, Schedule, add_communication, place
from .order import check_point_to_point, combine_pairs, issue_order, pair_actions
from .simulator import Simulation, simulate, unit_costs
from .svg import to_svg
from .zero import MAX_UNSHARDED, add_zero_actions, check_zero_actions, unshard_windows

__all__ = [
    "COMPUTE", "TRANSFERS", "ZERO", "PLACEMENTS", "Action", "Schedule", "place", "add_communication",
    "gpipe", "one_f_one_b", "interleaved_one_f_one_b", "zero_bubble_h1", "dualpipe_v", "build",
    "MAX_UNSHARDED", "add_zero_actions", "unshard_windows", "check_zero_actions",
    "Simulation", "simulate", "unit_costs",
    "issue_order", "pair_actions", "combine_pairs", "check_point_to_point",
    "to_svg",
]
