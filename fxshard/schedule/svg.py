"""A simulated schedule as an SVG timeline."""

from __future__ import annotations

from .model import Schedule
from .simulator import Simulation


_COLORS = {"F": "#6fa8dc", "B": "#e69138", "W": "#93c47d"}
_COLLECTIVE_COLORS = {"U": "#8e7cc3", "G": "#c27ba0"}


def to_svg(schedule: Schedule, simulation: Simulation, scale: float = 24.0) -> str:
    """A timeline: one lane per rank, one block per compute action, labelled with its microbatch; a
    ZeRO collective that takes time (U, G) is a thin bar under the lane (its communication stream)."""
    lane, width = 28, simulation.makespan * scale + 70
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" '
             f'height="{lane * len(schedule.ranks) + 30}" font-family="monospace" font-size="10">',
             f'<text x="4" y="{lane * len(schedule.ranks) + 20}">{schedule.name}: makespan '
             f'{simulation.makespan:g}, bubble {simulation.bubble_fraction:.1%}</text>']
    for rank, actions in enumerate(schedule.ranks):
        y = rank * lane + 4
        parts.append(f'<text x="2" y="{y + 16}">r{rank}</text>')
        for index, action in enumerate(actions):
            x0, x1 = simulation.start[rank, index] * scale + 30, simulation.end[rank, index] * scale + 30
            if action.kind in _COLLECTIVE_COLORS and x1 > x0:
                parts.append(f'<rect x="{x0:.1f}" y="{y + lane - 7}" width="{x1 - x0:.1f}" height="3" '
                             f'fill="{_COLLECTIVE_COLORS[action.kind]}"><title>{action}</title></rect>')
            if action.kind not in _COLORS:
                continue
            x0, x1 = simulation.start[rank, index] * scale + 30, simulation.end[rank, index] * scale + 30
            parts.append(f'<rect x="{x0:.1f}" y="{y}" width="{max(x1 - x0, 1):.1f}" height="{lane - 6}" '
                         f'fill="{_COLORS[action.kind]}" stroke="#333"><title>{action}</title></rect>')
            parts.append(f'<text x="{x0 + 2:.1f}" y="{y + 15}">{action.kind}{action.mb}</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"
