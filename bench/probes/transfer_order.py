"""What the order of a pair of ranks' transfers costs, simulated with measured action times (CPU only).

    python bench/probes/transfer_order.py [--costs bench/pipeline_fake_stages_1xh100_2026-11-25.json] [--out JSON]

Takes the per-chunk F / B times and the optimizer time that bench/probes/pipeline_fake_stages.py
measured (GPT 1b, pp=2, M=8, one H100) and times bench/pipeline.py's fxshard schedules with
`fxshard.schedule.simulate(order=...)`: transfers in issue order, one at a time per pair of ranks,
each P2P ms long, for the issue order made from textbook units (F=1, B=2: what the lowering used
before), from the FLOP model's chunk costs (what it uses now) and from the measured costs. Prints the
simulated step time (ms) and bubble for a range of transfer times; the schedule's own time (free
transfers, no order) is the bound every order reaches at P2P=0.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from fxshard.schedule import build, issue_order, simulate  # noqa: E402

SCHEDULES = {"1f1b": ("1f1b", 1), "interleaved-v2": ("interleaved-1f1b", 2)}
TRANSFER_MS = (0.0, 0.05, 0.1, 0.3, 0.5, 1.0)


def main() -> None:
    parser = argparse.ArgumentParser()
    here = os.path.dirname(__file__)
    parser.add_argument("--costs", default=os.path.join(here, "..", "pipeline_fake_stages_1xh100_2026-11-25.json"))
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--out", help="also write the table here as JSON")
    args = parser.parse_args()
    rows = []
    with open(args.costs) as handle:
        measured_all = json.load(handle)
    print(f"{'schedule':<16} {'P2P ms':>6} {'own':>14} {'units order':>14} {'FLOP order':>14} {'measured order':>15}")
    for key, (name, virtual) in SCHEDULES.items():
        if key not in measured_all:
            continue
        per_chunk = measured_all[key]["per_chunk"]
        measured = {chunk: value["measured_ms"] for chunk, value in per_chunk.items()}
        measured["OPT"] = measured_all[key]["opt_and_other_ms"]
        flops = {chunk: value["flop_model_ms"] for chunk, value in per_chunk.items()}
        schedule = build(name, 2, args.microbatches, virtual)
        # the early order this probe was written for (issue_order's default became "late" in session 29)
        orders = {"units": issue_order(schedule, None, "early"), "flops": issue_order(schedule, flops, "early"),
                  "measured": issue_order(schedule, measured, "early")}
        own = simulate(schedule, measured)
        for transfer in TRANSFER_MS:
            cells, row = [], {"schedule": key, "p2p_ms": transfer, "own_ms": own.makespan,
                              "own_bubble": own.bubble_fraction}
            for label, order in orders.items():
                timed = simulate(schedule, {**measured, "P2P": transfer}, order=order)
                cells.append(f"{timed.makespan:7.1f} ({timed.bubble_fraction:5.1%})")
                row.update({f"{label}_order_ms": timed.makespan, f"{label}_order_bubble": timed.bubble_fraction})
            rows.append(row)
            print(f"{key:<16} {transfer:>6.2f} {own.makespan:7.1f} ({own.bubble_fraction:5.1%}) "
                  f"{cells[0]:>14} {cells[1]:>14} {cells[2]:>15}")
    if args.out:
        with open(args.out, "w") as handle:
            json.dump({"costs": os.path.basename(args.costs), "microbatches": args.microbatches, "rows": rows},
                      handle, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
