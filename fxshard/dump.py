"""Graph dumps: the readable code, a per-node listing, a summary and a Graphviz file per program.

Files are numbered in pipeline order (`00_traced`, `01_fsdp`, ...) so `diff 00_traced.nodes.txt
01_fsdp.nodes.txt` shows what a pass did. `python -m fxshard.dump DIR` prints a dump's summaries.
"""

from __future__ import annotations

import os
import re
import sys
from collections import Counter, defaultdict

import torch
import torch.fx as fx

from . import meta
from .graph import flops, is_view
from .ops.p2p import P2P_OPS
from .program import InputKind, Program

_PHASE_COLORS = {meta.FWD: "#cfe2ff", meta.BWD: "#ffd8cc", meta.OPTIM: "#d4f0d0"}


# every file fxshard writes into a dump folder is listed here, one name per line: what the next run
# clears (nothing else in the folder is touched); a pipeline writes one stage<s>/ folder per stage
WRITTEN = ".fxshard-dump"
_STAGE_DIR = re.compile(r"^stage\d+$")


def write_dump_file(directory, name: str, text: str) -> str:
    """Write `text` to `directory/name` and list `name` among the files fxshard wrote there."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, name)
    with open(path, "w") as handle:
        handle.write(text)
    listed = _listed(directory)
    if name not in listed:
        with open(os.path.join(directory, WRITTEN), "a") as handle:
            handle.write(name + "\n")
    return path


def _listed(directory) -> list[str]:
    try:
        with open(os.path.join(directory, WRITTEN)) as handle:
            return [line.strip() for line in handle if line.strip() and "/" not in line and line.strip() != ".."]
    except OSError:
        return []


def clear_stale_dumps(directory, stage: int | None = None, stages: int = 1) -> list[str]:
    """Remove what an earlier run dumped into `directory`: the files fxshard listed as written there
    (`WRITTEN`), nothing else, so the folder shows this run alone (an FSDP program of yesterday's run
    next to today's one-device program would read as part of it). `stage`: the pipeline stage whose
    folder `directory` is; stage 0 also clears its parent and the stage folders this pipeline does
    not have. Without a stage, an earlier pipeline's stage folders are cleared. A stage folder left
    empty is removed. Returns the paths removed."""
    removed = []

    def clear(folder):
        for name in _listed(folder):
            path = os.path.join(folder, name)
            if os.path.isfile(path) and not os.path.islink(path):
                os.remove(path)
                removed.append(path)
        if os.path.isfile(os.path.join(folder, WRITTEN)):
            os.remove(os.path.join(folder, WRITTEN))

    def clear_stage_folders(folder, keep):
        for name in (os.listdir(folder) if os.path.isdir(folder) else ()):
            path = os.path.join(folder, name)
            if _STAGE_DIR.match(name) and int(name[len("stage"):]) not in keep and os.path.isdir(path) \
                    and not os.path.islink(path) and os.path.isfile(os.path.join(path, WRITTEN)):
                clear(path)
                if not os.listdir(path):
                    os.rmdir(path)
                    removed.append(path)

    clear(directory)
    if stage is None:
        clear_stage_folders(directory, keep=())
    elif stage == 0:
        parent = os.path.dirname(os.path.abspath(directory))
        clear(parent)
        clear_stage_folders(parent, keep=range(stages))
    return removed


def dump_programs(programs: list[Program], directory) -> list[str]:
    return [path for index, program in enumerate(programs) for path in dump_program(program, directory, index)]


def dump_program(program: Program, directory, index: int = 0) -> list[str]:
    stem = f"{index:02d}_{program.name}"
    files = {
        f"{stem}.py": program.graph_module.print_readable(print_output=False, include_stride=False,
                                                          include_device=False),
        f"{stem}.nodes.txt": listing(program),
        f"{stem}.summary.txt": summarize(program),
        f"{stem}.dot": to_dot(program),
    }
    return [write_dump_file(directory, name, text) for name, text in files.items()]


def still_dumped(program: Program, directory, index: int) -> bool:
    """Whether `directory` still holds `program`'s dump at `index` (its summary as written), so a file
    written there later (evaluate's program, compiled on its first call) belongs with it: a later run
    that dumped into the same folder cleared it."""
    try:
        with open(os.path.join(directory, f"{index:02d}_{program.name}.summary.txt")) as handle:
            return handle.read() == summarize(program)
    except OSError:
        return False


def dump_routing(routing: dict, directory) -> str | None:
    """Write the MoE routing a step reported (`step.routing(metrics)`, i.e. `Program.routing`: per
    layer, kept rows per expert and drops, summed over the ranks) to `routing.txt`; returns the
    path, or None where there is no routing."""
    if not routing:
        return None
    lines = [f"{'layer':<16} {'routed':>8} {'dropped':>8} {'max/mean':>9}  rows per expert"]
    for layer, values in routing.items():
        counts = values["tokens_per_expert"].detach().cpu().double()
        balance = (counts.max() / counts.mean()).item() if counts.sum() > 0 else 0.0
        lines.append(f"{layer:<16} {int(counts.sum()):>8} {int(values['dropped']):>8} {balance:>9.2f}  "
                     f"{counts.long().tolist()}")
    return write_dump_file(directory, "routing.txt", "\n".join(lines) + "\n")


def _value(node: fx.Node):
    return node.meta.get("val")


def _nbytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


def _shape(value) -> str:
    if isinstance(value, torch.Tensor):
        dtype = str(value.dtype).replace("torch.", "")
        return f"{dtype}{list(value.shape)}"
    if isinstance(value, (list, tuple)):
        return "(" + ", ".join(_shape(v) for v in value) + ")"
    return type(value).__name__ if value is not None else "-"


def _op_name(node: fx.Node) -> str:
    if node.op == "call_function":
        return getattr(node.target, "__name__", str(node.target)).replace(".default", "")
    return node.op


def format_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return f"{n} B"


def listing(program: Program) -> str:
    """One line per node: name = op(inputs)  phase  layer  shape  [param]."""
    lines = []
    for node in program.graph.nodes:
        if node.op == "output":
            lines.append(f"output({', '.join(str(a) for a in node.args[0])})")
            continue
        inputs = ", ".join(n.name for n in node.all_input_nodes)
        extra = f"  param={meta.param(node)}" if meta.param(node) else ""
        if meta.ACTION in node.meta:  # a pipeline stage's schedule action (and so its microbatch)
            extra += f"  action={node.meta[meta.ACTION]}"
        elif meta.MICROBATCH in node.meta:
            extra += f"  mb={node.meta[meta.MICROBATCH]}"
        if _is_communication(node):
            extra += f"  unit={node.meta.get(meta.UNIT, '-')} bytes={_communication_bytes(node)} group={_group(node)}"
            if node.target in P2P_OPS:
                extra += f" peer={node.args[-2]}"
        lines.append(f"{node.name} = {_op_name(node)}({inputs})  [{meta.phase(node)} {meta.layer(node)}] "
                     f"{_shape(_value(node))}{extra}")
    return "\n".join(lines) + "\n"


def saved_activation_bytes(program: Program) -> int:
    """Bytes of forward values that the backward reads (what autograd would save)."""
    return sum(_nbytes(_value(n)) for n in program.graph.nodes
               if meta.phase(n) == meta.FWD and n.op != "placeholder"
               and any(meta.phase(u) == meta.BWD for u in n.users))


def _aliases(node: fx.Node) -> bool:
    """A node whose result is memory another node made: a view, or the wait of a collective (it
    returns the collective's own output)."""
    return is_view(node) or _op_name(node) == "wait_tensor"


def _is_communication(node: fx.Node) -> bool:
    """A collective's issue or a point-to-point send / receive."""
    return node.op == "call_function" and (node.target in meta.COLLECTIVE_ISSUES or node.target in P2P_OPS)


def _communication_bytes(node: fx.Node) -> int:
    """The bytes a collective or transfer moves per rank as its pass recorded them (meta.COMM_BYTES),
    else its input's (a receive: its output's)."""
    if meta.COMM_BYTES in node.meta:
        return node.meta[meta.COMM_BYTES]
    if node.target is torch.ops.fxshard.recv.default:
        return _nbytes(_value(node))
    return _nbytes(_value(node.args[0])) if isinstance(node.args[0], fx.Node) else 0


def _group(node: fx.Node) -> str:
    """The process group (mesh axis) a collective or transfer runs on: its last string argument."""
    return next((a for a in reversed(node.args) if isinstance(a, str) and a not in ("sum", "avg")), "-")


def written_bytes_by_op(program: Program) -> Counter:
    """Bytes each op writes per step (the sizes of the new tensors it produces; views and
    placeholders write nothing, nor does a collective's wait, which returns the collective's output),
    keyed by op name. Memory traffic the GEMM count does not show: casts, flattening copies, temporaries."""
    written = Counter()
    for node in program.graph.nodes:
        if node.op == "call_function" and not _aliases(node):
            written[_op_name(node)] += _nbytes(_value(node))
    return written


def peak_live_bytes(program: Program) -> int:
    """Peak bytes of live tensors while the graph runs in order: all inputs, plus every produced
    tensor from its node until the last use of it or of any view of it (views cost nothing but keep
    their base alive: the members viewed out of an all-gathered flat unit; multi-output nodes count
    once; a collective's wait is its output, not a new tensor). This is the per-rank memory the
    program asks for, before allocator effects."""
    nodes = list(program.graph.nodes)
    base = {}  # a view -> the node whose memory it aliases
    for node in nodes:
        if node.op == "call_function" and _aliases(node) and node.all_input_nodes:
            source = node.all_input_nodes[0]
            base[node] = base.get(source, source)
    last_use = {}
    for index, node in enumerate(nodes):
        for source in node.all_input_nodes:
            last_use[source] = index
            if source in base:
                last_use[base[source]] = index
    inputs = sum(_nbytes(_value(n)) for n in nodes if n.op == "placeholder")
    live, peak, frees = 0, 0, defaultdict(list)
    for index, node in enumerate(nodes):
        if node.op in ("call_function", "call_module") and not _aliases(node):
            size = _nbytes(_value(node))
            live += size
            frees[last_use.get(node, index)].append(size)
        peak = max(peak, live)
        live -= sum(frees.pop(index, []))
    return inputs + peak


def _updates_lines(program: Program) -> list[str]:
    """The optimizer phase (`Program.updates`): how many tensors it updates, over which axes each
    one's squared gradient norm is summed, which this rank leaves to another, and which it updates
    without weight decay."""
    if not program.updates:
        return []
    by_axes = Counter(" x ".join(u.norm_axes) or "this rank" for u in program.updates)
    line = (f"optimizer phase: {len(program.updates)} updates"
            + (f" ({program.train.optimizer.__class__.__name__})" if program.train is not None else "")
            + "; gradient norm summed over " + ", ".join(f"{axes} ({n})" for axes, n in by_axes.items()))
    elsewhere = [u.name for u in program.updates if not u.counted]
    if elsewhere:
        line += "; counted by another rank: " + ", ".join(elsewhere)
    undecayed = [u.name for u in program.updates if not u.decay]
    if undecayed and program.train is not None and program.train.optimizer.weight_decay:
        line += "; without weight decay (no_decay): " + ", ".join(undecayed)
    return [line, ""]


def summarize(program: Program) -> str:
    nodes = [n for n in program.graph.nodes if n.op not in ("placeholder", "output")]
    by_phase = Counter(meta.phase(n) for n in nodes)
    lines = [f"Program {program.name!r}: {len(nodes)} nodes "
             f"({', '.join(f'{p} {by_phase[p]}' for p in meta.PHASES)}); "
             f"{len(program.inputs)} inputs, {len(program.outputs)} outputs"]
    lines.append("")
    lines.append(f"{'input kind':<12} {'count':>6} {'bytes':>12}")
    placeholders = dict(zip(program.inputs, program.placeholders()))
    for kind in InputKind:
        specs = program.inputs_of(kind)
        if specs:
            size = sum(_nbytes(_value(placeholders[s])) for s in specs)
            lines.append(f"{kind.value:<12} {len(specs):>6} {format_bytes(size):>12}")
    lines.append(f"{'activations':<12} {'':>6} {format_bytes(saved_activation_bytes(program)):>12}"
                 f"   (forward values read by the backward)")
    lines.append(f"{'peak live':<12} {'':>6} {format_bytes(peak_live_bytes(program)):>12}"
                 f"   (inputs + live intermediates, per rank)")
    lines.append("")
    lines.extend(_updates_lines(program))
    table: dict[str, Counter] = defaultdict(Counter)
    for node in nodes:
        table[meta.layer(node)][meta.phase(node)] += 1
    lines.append(f"{'layer':<24} " + " ".join(f"{p:>6}" for p in meta.PHASES))
    for layer_name in [*_layer_order(program), None]:
        counts = table.get(layer_name)
        if counts:  # None: nodes a pass added without a layer (the optimizer phase it rebuilt)
            lines.append(f"{layer_name or '(no layer)':<24} " + " ".join(f"{counts[p]:>6}" for p in meta.PHASES))
    lines.extend(_collectives_table(program))
    lines.append("")
    ops = Counter(_op_name(n) for n in nodes if n.op == "call_function")
    lines.append("ops: " + ", ".join(f"{op} {count}" for op, count in ops.most_common()))
    lines.append("bytes written per step, largest: " + ", ".join(
        f"{op} {format_bytes(size)}" for op, size in written_bytes_by_op(program).most_common(10)))
    for key, value in program.notes.items():
        lines.append(f"{key}: {value}")
    return "\n".join(lines) + "\n"


_GEMMS = ("mm", "addmm", "bmm", "grouped_mm", "grouped_mm_wgrad", "grouped_mlp_fwd", "grouped_mlp_dgrad",
          "grouped_mlp_wgrad", "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
          "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_backward",
          "_scaled_dot_product_efficient_attention_backward",
          "_scaled_dot_product_flash_attention_for_cpu_backward")


def _format_flops(n: float) -> str:
    for unit in ("", "K", "M", "G"):
        if n < 1000:
            return f"{n:.3g} {unit}FLOP"
        n /= 1000
    return f"{n:,.2f} TFLOP"


def _collectives_table(program: Program) -> list[str]:
    """Every collective and point-to-point transfer in the program: position, op, unit (or, for one
    no unit owns, its group: the gradient norm's and the loss's all-reduces, a pipeline's sends and
    receives), phase, bytes, and what overlaps it (the GEMM-class ops between its issue and its
    wait, and their FLOPs); then totals per op. Bytes: each rank's input, as the passes count them
    (an all-gather's shard, a reduce-scatter's whole input; a receive's output)."""
    nodes = list(program.graph.nodes)
    position_of = {node: i for i, node in enumerate(nodes)}
    rows, totals = [], Counter()
    for position, node in enumerate(nodes):
        if not _is_communication(node):
            continue
        op, size = _op_name(node), _communication_bytes(node)
        totals[op] += size
        waits = [position_of[u] for u in node.users if _op_name(u) == "wait_tensor"]
        window = nodes[position + 1:min(waits)] if waits else []
        gemms = sum(_op_name(n) in _GEMMS for n in window)
        work = _format_flops(sum(flops(n) for n in window))
        overlap = f"{gemms} GEMM{'s' if gemms != 1 else ''}, {work} / {len(window)} ops" if waits else "-"
        owner = node.meta.get(meta.UNIT) or f"({_group(node)}" + (f" peer {node.args[-2]})" if node.target in P2P_OPS
                                                                   else ")")
        rows.append(f"{position:>8} {op:<24} {owner:<20} {meta.phase(node):<6} {format_bytes(size):>12}   {overlap}")
    if not rows:
        return []
    lines = ["", f"{'position':>8} {'collective':<24} {'unit':<20} {'phase':<6} {'bytes/rank':>12}   "
                 f"overlaps (issue to wait; dropless grouped GEMMs' FLOPs an upper bound)", *rows]
    lines.append("collective bytes per step (per rank): " + ", ".join(
        f"{op} {format_bytes(size)}" for op, size in totals.items()) +
        f"; total {format_bytes(sum(totals.values()))}")
    return lines


def _layer_order(program: Program) -> list[str]:
    seen = []
    for node in program.graph.nodes:
        name = meta.layer(node)
        if name is not None and name not in seen and meta.phase(node) == meta.FWD:
            seen.append(name)
    rest = sorted({meta.layer(n) for n in program.graph.nodes if meta.layer(n) is not None} - set(seen))
    return seen + rest


def to_dot(program: Program) -> str:
    """Graphviz: one cluster per layer, nodes colored by phase."""
    clusters: dict[str, list[str]] = defaultdict(list)
    edges = []
    for node in program.graph.nodes:
        if node.op == "output":
            continue
        color = _PHASE_COLORS.get(meta.phase(node), "#eeeeee")
        label = f"{node.name}\\n{_op_name(node)}\\n{_shape(_value(node))}"
        clusters[meta.layer(node) or "?"].append(
            f'    "{node.name}" [label="{label}", style=filled, fillcolor="{color}"];')
        edges.extend(f'  "{source.name}" -> "{node.name}";' for source in node.all_input_nodes)
    lines = [f'digraph "{program.name}" {{', "  node [shape=box, fontsize=9];"]
    for index, (name, body) in enumerate(clusters.items()):
        lines += [f"  subgraph cluster_{index} {{", f'    label="{name}";', *body, "  }"]
    lines += edges + ["}"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or not os.path.isdir(argv[0]):
        print("usage: python -m fxshard.dump DIR   (a folder written with Config(dump_dir=DIR))",
              file=sys.stderr)
        return 2
    stages = sorted((d for d in os.listdir(argv[0]) if _STAGE_DIR.match(d) and os.path.isdir(os.path.join(argv[0], d))),
                    key=lambda d: int(d[len("stage"):]))
    summaries = [os.path.join(folder, f) for folder in ["", *stages]  # a pipeline: one folder per stage
                 for f in sorted(os.listdir(os.path.join(argv[0], folder))) if f.endswith(".summary.txt")]
    if not summaries:
        print(f"{argv[0]} holds no *.summary.txt (nor stage*/ folders with them); is it a fxshard dump folder?",
              file=sys.stderr)
        return 1
    for name in summaries:
        with open(os.path.join(argv[0], name)) as handle:
            print(f"== {name[:-len('.summary.txt')]}")
            print(handle.read())
    return 0


def dump_schedule(schedule, plan, directory, pairs=(), receives: str = "late") -> list[str]:
    """A pipeline stage's schedule next to its programs: `pipeline.txt` (every rank's actions as the
    schedule gives them and as the lowered programs issue them, the combined 1F1B's interleaved
    pairs, ZeRO's collectives, the simulator's makespan / bubble / peak activations) and
    `pipeline.svg` (timeline, one lane per rank). The simulator times each chunk's actions by their
    FLOPs (`plan.costs`), or with `unit_costs` (backward = 2x forward, or B = W = F where W is split
    off) where the plan has none."""
    from .schedule import Schedule, issue_order, simulate, to_svg, unit_costs

    os.makedirs(directory, exist_ok=True)
    costs = dict(plan.costs) or unit_costs(schedule)
    simulation = simulate(schedule, costs)
    issued = Schedule(issue_order(schedule, plan.costs, receives, pairs), schedule.stages, schedule.virtual, schedule.microbatches,
                      schedule.name, schedule.placement)
    lines = [f"schedule {schedule.name}: P={schedule.stages} V={schedule.virtual} M={schedule.microbatches} "
             f"placement={schedule.placement}; "
             f"this is stage {plan.stage}",
             "", "actions per rank:", str(schedule), "",
             f"as the lowered programs issue them (receives {receives}; one transfer order per pair of ranks):",
             str(issued), "",
             *(["combined 1F1B, pairs run interleaved at their all-to-alls (`interleave` pass):"]
               + [f"rank {rank}: " + (" ".join(f"{a}+{b}" for a, b in mine) or "none")
                  for rank, mine in enumerate(pairs)] + [""] if any(pairs) else []),
             *_zero_legend(schedule),
             "simulated, each action timed by " + _describe_costs(plan.costs, schedule) + ":",
             f"  makespan {simulation.makespan:.4g}, bubble {simulation.bubble_fraction:.1%}, "
             f"peak live activations per rank {simulation.peak_activations}"]
    return [write_dump_file(directory, "pipeline.txt", "\n".join(lines) + "\n"),
            write_dump_file(directory, "pipeline.svg", to_svg(schedule, simulation))]


def _describe_costs(costs, schedule) -> str:
    """How the simulator timed the actions: per chunk from FLOPs, or the textbook units."""
    from .schedule import unit_costs

    if not costs:
        return "textbook units (" + ", ".join(f"{k}={v:g}" for k, v in unit_costs(schedule).items()) + ")"
    per_chunk = [" ".join(f"{key[0]}={value:.3g}" for key, value in costs if key[1:] == str(c))
                 for c in range(schedule.chunks)]
    return ("its chunk's FLOPs, a stage's forward = 1 on average (" +
            "; ".join(f"chunk {c}: {text}" for c, text in enumerate(per_chunk)) + ")")


def _zero_legend(schedule) -> list[str]:
    """What the U / R / G actions in the listing mean, and how many each rank runs."""
    counts = [{kind: sum(a.kind == kind for a in actions) for kind in "URG"} for actions in schedule.ranks]
    if not any(sum(c.values()) for c in counts):
        return []
    return ["ZeRO over dp: U c all-gathers chunk c's parameters (fsdp issues it there, waits at first use), "
            "R c frees the gathered copy, G c reduces chunk c's gradients; per rank "
            + ", ".join(f"r{rank} {c['U']} U {c['G']} G" for rank, c in enumerate(counts)), ""]


if __name__ == "__main__":
    sys.exit(main())
