"""What the benchmarks share: the peak MFU is reported against, and how a result file is written."""

from __future__ import annotations

import bisect
import datetime
import json
import os
import re
import shutil
import statistics
import subprocess
import time

import torch

H200_BF16_DENSE_PEAK = 989e12  # dense bf16 FLOP/s of an H100 / H200 SXM: the denominator of every MFU here


def device_name() -> str:
    """The GPU's name, or "cpu" where there is none (the CPU smoke runs of a benchmark)."""
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def write_json(path: str, **fields) -> None:
    """`fields`, with the date, the GPU and torch's version first, as JSON at `path`; prints where."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as handle:
        json.dump({"date": datetime.date.today().isoformat(), "device": device_name(),
                   "torch": torch.__version__, **fields}, handle, indent=1)
    print(f"wrote {path}")


class GpuClocks:
    """The SM clock, power draw, temperature and clock-event reasons of this process's GPU, sampled by
    `nvidia-smi -lms` while the `with` block runs (the timed steps of a benchmark): does a denser step
    run at a lower clock? (Session 44: the same GEMMs ran 4-9% longer in a graphed pipeline step than in
    its eager replay, at a median SM clock of 1,710-1,725 against 1,770-1,905 MHz.) `summary()` is None
    where there is no GPU or no nvidia-smi, or it sampled nothing."""

    # the instantaneous power where the driver has it (power.draw is a 1 s average on Hopper)
    QUERIES = (("clocks.sm", "power.draw.instant", "temperature.gpu", "clocks_event_reasons.active"),
               ("clocks.sm", "power.draw", "temperature.gpu", "clocks_event_reasons.active"))
    REASONS = {"sw_power_cap": 0x4, "hw_slowdown": 0x8, "sw_thermal": 0x20, "hw_thermal": 0x40,
               "hw_power_brake": 0x80}  # bits of clocks_event_reasons (nvidia-smi -q -d PERFORMANCE)

    def __init__(self, interval_ms: int = 20):
        self.interval_ms, self.process, self.lines, self.fields = interval_ms, None, [], None

    def __enter__(self):
        smi = shutil.which("nvidia-smi")
        if smi is None or not torch.cuda.is_available():
            return self
        gpu = f"GPU-{torch.cuda.get_device_properties(torch.cuda.current_device()).uuid}"
        for fields in self.QUERIES:  # an older driver lacks a field's name: fewer fields, never wrong ones
            command = [smi, "-i", gpu, f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"]
            if subprocess.run(command, capture_output=True, timeout=20).returncode == 0:
                self.fields = fields
                self.process = subprocess.Popen(command + [f"-lms={self.interval_ms}"], stdout=subprocess.PIPE,
                                                stderr=subprocess.DEVNULL, text=True)
                break
        return self

    def __exit__(self, *exc):
        if self.process is not None:
            self.process.terminate()
            out, _ = self.process.communicate(timeout=20)
            self.lines = [line for line in out.splitlines() if line.strip()]

    def summary(self) -> dict | None:
        samples = []
        for line in self.lines:
            fields = [field.strip() for field in line.split(",")]
            try:
                samples.append((float(fields[0]), float(fields[1]), float(fields[2]), int(fields[3], 16)))
            except (ValueError, IndexError):
                continue
        if not samples:
            return None
        clocks, power, temperature, reasons = zip(*samples)
        return {"samples": len(samples), "power_field": self.fields[1],
                "sm_mhz_median": statistics.median(clocks), "sm_mhz_min": min(clocks), "sm_mhz_max": max(clocks),
                "power_w_median": statistics.median(power), "power_w_mean": statistics.fmean(power),
                "power_w_max": max(power),
                "temperature_c_first": temperature[0], "temperature_c_last": temperature[-1],
                "reasons": {name: sum(1 for r in reasons if r & bit) / len(samples)
                            for name, bit in self.REASONS.items()}}

    @staticmethod
    def line(summary: dict | None) -> str:
        if summary is None:
            return "no clock samples"
        reasons = ", ".join(f"{name} {share:.0%}" for name, share in summary["reasons"].items() if share)
        return (f"SM clock {summary['sm_mhz_median']:.0f} MHz median ({summary['sm_mhz_min']:.0f}-"
                f"{summary['sm_mhz_max']:.0f}), power {summary['power_w_median']:.0f} W median "
                f"({summary['power_w_max']:.0f} max), {summary['temperature_c_first']:.0f} -> "
                f"{summary['temperature_c_last']:.0f} C, clock held by: {reasons or 'nothing'} "
                f"({summary['samples']} samples)")


def timed(fn, warmup: int, iters: int) -> float:
    """ms per call of `fn` (a CUDA step) over `iters` calls after `warmup`."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - started) / iters * 1e3


def kernel_timeline(trace_path: str, steps: int, is_comm) -> dict:
    """From a profiler's chrome trace of `steps` steps: per step, how long the GPU ran any kernel, how long
    communication kernels (`is_comm(name)`) ran, how much of that other kernels ran alongside, and how much
    ran alone (exposed). Spans are unions over streams, so overlapping kernels count once. Copies
    (`gpu_memcpy`: the copy engines' work, peer-to-peer for copy-engine collectives) are no kernels:
    "copies_ms" is their union and "copies_overlapped_ms" how much of it kernels ran alongside."""
    with open(trace_path) as handle:
        events = json.load(handle)["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel" and "dur" in e]
    copies = _union([(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "gpu_memcpy" and "dur" in e])
    comm = _union([(e["ts"], e["ts"] + e["dur"]) for e in kernels if is_comm(e["name"])])
    compute = _union([(e["ts"], e["ts"] + e["dur"]) for e in kernels
                      if not is_comm(e["name"]) and not e["name"].startswith("nccl")])
    busy = _union([(e["ts"], e["ts"] + e["dur"]) for e in kernels])
    overlapped = _intersection(comm, compute)

    def per_step(microseconds):
        return microseconds / steps / 1e3

    comm_ms = per_step(sum(b - a for a, b in comm))
    classes: dict[str, float] = {}
    for event in kernels:
        kind = kernel_class(event["name"])
        classes[kind] = classes.get(kind, 0.0) + per_step(event["dur"])
    return {"gpu_busy_ms": per_step(sum(b - a for a, b in busy)), "comm_kernels_ms": comm_ms,
            "comm_overlapped_ms": per_step(overlapped), "comm_exposed_ms": comm_ms - per_step(overlapped),
            "kernels_per_step": len(kernels) / steps, "copies_ms": per_step(sum(b - a for a, b in copies)),
            "copies_overlapped_ms": per_step(_intersection(copies, busy)),
            "by_class_ms": dict(sorted(classes.items(), key=lambda item: -item[1])),
            **{key.replace("_us", "_ms"): per_step(us) for key, us in gemms_beside(events).items()},
            **idle_gaps(events, steps)}


IDLE_SHORT_US = 10.0  # an idle gap up to this long is a launch gap (one node to the next in a CUDA graph)


def idle_gaps(events: list[dict], steps: int, largest: int = 5, counts=None) -> dict:
    """Where the GPU ran nothing (no kernel, memset or copy on any stream; with `counts`, no event for
    which counts(event) holds) between the first and last such event of the trace, per step:
    "idle_ms", split into "idle_short_ms" (gaps up to IDLE_SHORT_US: one kernel to the next, launch
    latency) and "idle_long_ms" (the host or a dependency held the GPU back), how many gaps, and the
    `largest` gaps as [us, event before, event after]."""
    if counts is None:
        counts = lambda e: e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy")  # noqa: E731
    device = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events if "dur" in e and counts(e))
    gaps, reach, last = [], None, None
    for start, stop, name in device:
        if reach is not None and start > reach:
            gaps.append((start - reach, last, name))
        if reach is None or stop > reach:
            reach, last = stop, name
    short = [g for g in gaps if g[0] <= IDLE_SHORT_US]
    return {"idle_ms": sum(g[0] for g in gaps) / steps / 1e3,
            "idle_short_ms": sum(g[0] for g in short) / steps / 1e3, "idle_short_gaps": len(short) / steps,
            "idle_long_ms": sum(g[0] for g in gaps if g[0] > IDLE_SHORT_US) / steps / 1e3,
            "idle_long_gaps": (len(gaps) - len(short)) / steps,
            "idle_largest": [[round(us, 1), before[:60], after[:60]]
                             for us, before, after in sorted(gaps, key=lambda g: -g[0])[:largest]]}


KERNEL_CLASSES = (  # (class, substrings of a kernel's name), first match wins
    ("nccl", ("nccl",)),
    ("attention", ("flash", "sdpa", "fmha", "cudnn")),
    ("gemm", ("nvjet", "gemm", "cutlass", "xmma", "sm90_", "wgmma")),
    ("adamw", ("adamw",)),
    ("memcpy kernels", ("memcpy",)),
    ("triton", ("triton_",)),
    ("aten elementwise / reduce", ("at::native",)),
)


def kernel_class(name: str) -> str:
    """What a GPU kernel does, by its name: "gemm", "attention", "triton" (Inductor's fused kernels),
    "adamw", "nccl", ..., else "other". A step's kernel time per class, side by side for two modes,
    says where one spends more than the other."""
    lowered = name.lower()
    return next((kind for kind, parts in KERNEL_CLASSES if any(part in lowered for part in parts)), "other")


def holds_sms(name: str) -> bool:
    """A kernel that holds SMs while it waits for a peer or moves data: NCCL's, and the copy-engine
    collectives' one-block barriers (torch's symmetric-memory kernels)."""
    lowered = name.lower()
    return "nccl" in lowered or "symmetric_memory" in lowered or "barrier" in lowered


def gemms_beside(events: list[dict], holds=holds_sms) -> dict:
    """The GEMM kernels of a trace (`kernel_class` "gemm") that ran beside a kernel holding SMs
    (`holds(name)`), against the same-named GEMMs that ran alone: a persistent GEMM beside even one
    waiting block runs up to 1.3x longer, beside 16 up to 1.9x (bench/gemm_contention.py). In us over
    the whole trace: "gemm_us" (all), "gemm_beside_us" (those that overlapped a holder), and
    "gemm_beside_extra_us", what they took beyond the median of their name's lone runs (names with no
    lone run left out: "gemm_beside_unmatched_us")."""
    kernels = [e for e in events if e.get("cat") == "kernel" and "dur" in e]
    held = _union([(e["ts"], e["ts"] + e["dur"]) for e in kernels if holds(e["name"])])
    starts = [start for start, _ in held]
    runs: dict[str, tuple[list, list]] = {}
    for event in kernels:
        if kernel_class(event["name"]) != "gemm":
            continue
        start, stop = event["ts"], event["ts"] + event["dur"]
        at = bisect.bisect_left(starts, stop)  # held spans starting before this kernel ends
        beside = at > 0 and held[at - 1][1] > start
        runs.setdefault(event["name"], ([], []))[beside].append(event["dur"])
    total = beside_total = extra = unmatched = 0.0
    for alone, beside in runs.values():
        total += sum(alone) + sum(beside)
        beside_total += sum(beside)
        if alone:
            typical = statistics.median(alone)
            extra += sum(max(0.0, duration - typical) for duration in beside)
        else:
            unmatched += sum(beside)
    return {"gemm_us": total, "gemm_beside_us": beside_total, "gemm_beside_extra_us": extra,
            "gemm_beside_unmatched_us": unmatched}


def gemm_line(timeline: dict) -> str:
    """`kernel_timeline`'s GEMM figures as one line of a profile's report."""
    return (f"GEMMs {timeline['gemm_ms']:.2f} ms/step, {timeline['gemm_beside_ms']:.2f} of it beside kernels holding "
            f"SMs (NCCL, barriers), which took ~{timeline['gemm_beside_extra_ms']:.2f} ms longer than alone")


def exposed_copies(events: list[dict], steps: int, labels=(), largest: int = 6, is_compute=None) -> dict:
    """The peer-to-peer copies of a trace (copy-engine collectives: one "Memcpy PtoP" per collective
    and peer) by their place in the step: the k-th copy of every step is the same collective, named
    `labels[k]` where the labels (`CopyEngineLowering.described`, program order) are as many as the
    copies a step holds (world 2), else "copy k". For each: its mean duration and how much of it no
    compute kernel (`is_compute(name)`, default: not SM-holding communication and not a marker) ran
    beside, in us. "exposed_copies_us" (all, per step), "exposed_copies_largest": the `largest`
    [label, exposed us, duration us], and "exposed_copies_by_place": exposed us per copy index."""
    if is_compute is None:
        is_compute = lambda name: not holds_sms(name) and name != "mark"  # noqa: E731
    compute = _kernel_spans(events, is_compute)
    copies = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                    if e.get("cat") == "gpu_memcpy" and "dur" in e and "PtoP" in e.get("name", ""))
    per_step = len(copies) // steps if steps else 0
    if per_step == 0:
        return {"exposed_copies_us": 0.0, "exposed_copies_largest": [], "exposed_copies_by_place": []}
    names = list(labels) if len(labels) == per_step else [f"copy {k}" for k in range(per_step)]
    exposed, took = [0.0] * per_step, [0.0] * per_step
    for index, (start, stop) in enumerate(copies[:per_step * steps]):
        beside = _intersection([[start, stop]], [span for span in compute if span[1] > start and span[0] < stop])
        exposed[index % per_step] += (stop - start - beside) / steps
        took[index % per_step] += (stop - start) / steps
    order = sorted(range(per_step), key=lambda k: -exposed[k])[:largest]
    return {"exposed_copies_us": sum(exposed),
            "exposed_copies_largest": [[names[k][:90], round(exposed[k], 1), round(took[k], 1)] for k in order],
            "exposed_copies_by_place": [round(us, 1) for us in exposed]}


def idle_under_local_copies(events: list[dict], steps: int, is_compute) -> dict:
    """Compute idle (no `is_compute(name)` kernel running) while a device-to-device memcpy runs on a
    stream that also carries peer copies (a copy-engine collective's side stream: its own part, which
    `_exchange` copies as "Memcpy DtoD"), in us per step, and how many such copies a step holds
    (session 29: the compute stream idled under each, ~30 us)."""
    peer_streams = {(e.get("args") or {}).get("stream") for e in events
                    if e.get("cat") == "gpu_memcpy" and "PtoP" in e.get("name", "")}
    local = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                   if e.get("cat") == "gpu_memcpy" and "dur" in e and "DtoD" in e.get("name", "")
                   and (e.get("args") or {}).get("stream") in peer_streams)
    if not local or not steps:
        return {"idle_under_local_copies_us": 0.0, "local_copies": 0}
    compute = _kernel_spans(events, is_compute)
    spans = _union(local)
    idle = sum(stop - start for start, stop in spans) - _intersection(spans, compute)
    return {"idle_under_local_copies_us": idle / steps, "local_copies": len(local) // steps}


def _kernel_spans(events: list[dict], keep) -> list:
    """The merged time spans of a trace's kernels whose name `keep` accepts."""
    return _union([(e["ts"], e["ts"] + e["dur"]) for e in events
                   if e.get("cat") == "kernel" and "dur" in e and keep(e["name"])])


def _union(spans):
    merged = []
    for start, stop in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], stop)
        else:
            merged.append([start, stop])
    return merged


def _intersection(first, second) -> float:
    """Total length where two sorted lists of disjoint spans overlap."""
    total, i, j = 0.0, 0, 0
    while i < len(first) and j < len(second):
        (a, b), (c, d) = first[i], second[j]
        total += max(0.0, min(b, d) - max(a, c))
        if b < d:
            i += 1
        else:
            j += 1
    return total


def kernels_by_range(events: list[dict], pattern: re.Pattern, is_comm) -> list[tuple[float, float, str, str | None]]:
    """The GPU kernels, memsets and device-to-device copies of one process's chrome trace that are not
    communication (`is_comm(event)`), each as (start us, end us, name, label): `label` is group 1 of
    `pattern` matched on the CPU range (`torch.profiler.record_function`, e.g. codegen's
    `fxshard region_<i> [...]`) that launched it, matched by correlation id; a kernel launched between
    two ranges with the same label (a fixed node inside that work) takes it too; else None. Empty
    where the trace holds no such range."""
    ranges: dict[tuple, list[tuple[float, float, str]]] = {}
    launches: dict[object, tuple] = {}
    kernels = []
    for event in events:
        if event.get("ph") != "X":
            continue
        category, name = str(event.get("cat", "")).lower(), str(event.get("name", ""))
        start, end = float(event["ts"]), float(event["ts"]) + float(event.get("dur", 0.0))
        correlation = (event.get("args") or {}).get("correlation")
        if category == "user_annotation" and (match := pattern.match(name)):
            ranges.setdefault((event.get("pid"), event.get("tid")), []).append((start, end, match.group(1)))
        elif category in ("cuda_runtime", "cuda_driver") and correlation is not None:
            launches[correlation] = (event.get("pid"), event.get("tid"), start)
        elif category in ("kernel", "gpu_memset") or (category == "gpu_memcpy" and "DtoD" in name):
            if not is_comm(event):
                kernels.append((start, end, name, correlation))
    if not ranges:
        return []
    for spans in ranges.values():
        spans.sort()
    result = []
    for start, end, name, correlation in kernels:
        label = None
        if correlation in launches:
            pid, tid, when = launches[correlation]
            spans = ranges.get((pid, tid), [])
            k = bisect.bisect_right(spans, (when, float("inf"), "")) - 1
            if k >= 0 and (when <= spans[k][1] or k + 1 < len(spans) and spans[k][2] == spans[k + 1][2]):
                label = spans[k][2]
        result.append((start, end, name, label))
    return result
