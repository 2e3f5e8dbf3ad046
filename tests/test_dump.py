"""Dumps: ordered files per program, with the layer and phase of every node, and a summary CLI."""

import os
import subprocess
import sys

import pytest
import torch

import fxshard
from fxshard.models import GPT, GPTConfig, MoEGPT, MoEGPTConfig


def test_dump_of_moe_gpt_tiny_names_every_node_and_prints_a_summary(tmp_path, monkeypatch):
    torch.manual_seed(0)
    batch = {"idx": torch.zeros(2, 8, dtype=torch.long), "tgt": torch.zeros(2, 8, dtype=torch.long)}
    monkeypatch.setenv("FXSHARD_DUMP", str(tmp_path))
    step = fxshard.shard(MoEGPT(MoEGPTConfig.preset("tiny")), lambda m, b: m.loss(b), batch)
    files = sorted(os.listdir(tmp_path))
    assert files == [".fxshard-dump", "00_traced.dot", "00_traced.nodes.txt", "00_traced.py", "00_traced.summary.txt",
                     "01_runtime.py"]
    assert sorted((tmp_path / ".fxshard-dump").read_text().split()) == files[1:]  # what the next run may clear

    listing = (tmp_path / "00_traced.nodes.txt").read_text().splitlines()
    body = [line for line in listing if not line.startswith("output(")]
    assert len(body) == len(step.program.graph.nodes) - 1
    for line in body:
        phase, layer = line.split("[", 1)[1].split("]", 1)[0].split()
        assert phase in ("fwd", "bwd", "optim") and layer in ("pre", "post", "layers.0", "layers.1"), line
    assert any("grouped_mm_wgrad" in line and "[bwd layers.1]" in line for line in listing)

    summary = (tmp_path / "00_traced.summary.txt").read_text()
    assert "layers.1" in summary and "activations" in summary and "grouped_mm" in summary
    assert summary == str(step.program)
    assert "def forward" in (tmp_path / "00_traced.py").read_text()
    dot = (tmp_path / "00_traced.dot").read_text()
    assert dot.startswith('digraph "traced"') and 'label="layers.0"' in dot

    cli = subprocess.run([sys.executable, "-m", "fxshard.dump", str(tmp_path)], capture_output=True, text=True)
    assert cli.returncode == 0 and "== 00_traced" in cli.stdout and "layers.0" in cli.stdout
    bad = subprocess.run([sys.executable, "-m", "fxshard.dump", str(tmp_path / "missing")],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "usage" in bad.stderr


def test_program_dump_method_and_code(tmp_path):
    program = fxshard.trace(torch.nn.Linear(3, 2), lambda m, b: m(b).sum(), torch.randn(4, 3))
    written = program.dump(tmp_path)
    assert all(os.path.exists(path) for path in written)
    assert "addmm" in program.code or "mm" in program.code
    assert program.graph_module.graph is program.graph


def test_bytes_written_show_no_pad_or_squared_copies_of_gradients():
    """The dump's bytes-written count: the optimizer phase and FSDP's gradient flattening write no
    temporaries of the size of every gradient (a squared copy for the norm, a padded copy)."""
    from fxshard.dump import written_bytes_by_op
    from fxshard.passes import run_pipeline

    torch.manual_seed(0)
    model = MoEGPT(MoEGPTConfig.preset("tiny"))
    batch = {"idx": torch.zeros(2, 8, dtype=torch.long), "tgt": torch.zeros(2, 8, dtype=torch.long)}
    config = fxshard.Config(sharding="optim", clip_grad_norm=1.0)
    program = run_pipeline(fxshard.trace(model, lambda m, b: m.loss(b), batch, optimizer=fxshard.optim.AdamW(lr=1e-3),
                                         config=config), fxshard.Mesh(dp=2, ep=2), config)[-1]
    written = written_bytes_by_op(program)
    params = sum(p.numel() * 4 for p in model.parameters())
    assert written["adamw_update"] >= params / 2  # this rank's shards of parameters and both moments
    assert written["constant_pad_nd"] == 0
    assert written.get("_unsafe_view", 0) == 0  # an alias of the matmul's result, though its schema does not say so
    optim_pow = sum(n.meta["val"].numel() for n in program.graph.nodes
                    if fxshard.meta.phase(n) == "optim" and "pow" in str(n.target))
    assert optim_pow < 64  # scalars only, not a squared gradient
    assert "bytes written per step, largest: " in fxshard.dump.summarize(program)


def test_the_graph_the_runtime_runs_is_dumped_and_reported(tmp_path, capsys):
    """After the passes' dumps comes NN_runtime.py, the program as CompiledStep runs it (runtime
    lowerings applied: here AdamW updates written into the state they read, and two bf16
    microbatches' weight and embedding gradients added into their fp32 totals where they lie), and
    verbose says what the runtime changed."""
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny"))
    batch = {"idx": torch.zeros(2, 8, dtype=torch.long), "tgt": torch.zeros(2, 8, dtype=torch.long)}
    config = fxshard.Config(dump_dir=str(tmp_path), verbose=True, microbatches=2, param_dtype=torch.bfloat16,
                            reduce_dtype=torch.float32)
    step = fxshard.shard(model, lambda m, b: m.loss(b), batch, optimizer=fxshard.optim.AdamW(lr=1e-3), config=config)
    assert step.in_place_updates > 0 and step.accumulations_in_place == step.program.notes["fuse_grad_accumulation"] > 0
    runtime = (tmp_path / f"{len(step.programs):02d}_runtime.py").read_text()
    assert "adamw_update_" in runtime and f"{step.in_place_updates} in-place optimizer updates" in runtime
    assert "matmul_accumulate_" in runtime and "embedding_accumulate_" in runtime
    # the first microbatch's products, written in fp32, by the op's body called past the dispatcher
    assert "fxshard_ops_matmul_accumulate_matmul_wide(" in runtime and "fxshard.matmul_wide" not in runtime
    assert f"{step.direct_calls} calls of fxshard ops past the dispatcher" in runtime and step.direct_calls > 0
    assert f"{step.accumulations_in_place} gradient accumulations in place" in runtime
    assert f"runtime lowerings of {step.program.name!r}: {step.in_place_updates} in-place" in capsys.readouterr().err


def test_collective_windows_are_given_in_flops():
    """Each collective's window is given in FLOPs as well as GEMMs: a Linear's forward and weight
    gradient are 2 * 4 * 8 * 16 each, causal attention 4 * B * H * S^2 * D forward (counted whole, as
    torch's flop counter does), and the fused grouped MLP the FLOPs of the grouped GEMMs it replaces."""
    import re

    from fxshard.dump import summarize
    from fxshard.graph import flops
    from fxshard.passes import run_pipeline

    program = fxshard.trace(torch.nn.Linear(8, 16, bias=False), lambda m, b: m(b).sum(), torch.randn(4, 8))
    assert sum(flops(n) for n in program.graph.nodes) == 2 * (2 * 4 * 8 * 16)

    torch.manual_seed(0)
    batch = {"idx": torch.zeros(2, 8, dtype=torch.long), "tgt": torch.zeros(2, 8, dtype=torch.long)}
    totals = {}
    for fused in (False, True):
        config = fxshard.Config(ep_overlap=True, fuse_grouped_mlp=fused)
        program = run_pipeline(fxshard.trace(MoEGPT(MoEGPTConfig.preset("tiny")), lambda m, b: m.loss(b), batch,
                                             config=config), fxshard.Mesh(dp=2, ep=2), config)[-1]
        grouped = [n for n in program.graph.nodes if "fxshard.grouped_" in str(n.target)]
        assert any("grouped_mlp" in str(n.target) for n in grouped) == fused
        totals[fused] = sum(flops(n) for n in grouped)
        if not fused:
            attention = next(n for n in program.graph.nodes if "scaled_dot_product" in str(n.target))
            b, h, s, d = attention.args[0].meta["val"].shape
            assert flops(attention) == 4 * b * h * s * s * d
            rows = [line for line in summarize(program).splitlines() if "layers.1:combine" in line and " bwd " in line]
            work = [float(m.group(1)) for row in rows for m in [re.search(r"([\d.e+-]+) [KMGT]?FLOP", row)] if m]
            assert rows and len(work) == len(rows) and max(work) > 0
    assert totals[True] == totals[False] > 0


def test_a_reused_dump_folder_shows_this_run_only_and_stage_folders_are_read(tmp_path, capsys):
    """What an earlier run wrote (listed in the folder's `.fxshard-dump`) goes, the user's files stay,
    even with dump-like names; `python -m fxshard.dump` reads a pipeline's stage<s>/ folders; a file
    is no dump folder."""
    from fxshard.dump import clear_stale_dumps, main, write_dump_file

    write_dump_file(tmp_path, "01_fsdp.summary.txt", "yesterday's FSDP program\n")
    write_dump_file(tmp_path, "02_runtime.py", "")
    write_dump_file(tmp_path / "stage1", "00_traced.summary.txt", "yesterday's stage 1\n")
    for mine in ("notes.md", "00_setup.py", "pipeline.txt"):  # never written by fxshard
        (tmp_path / mine).write_text("mine")
    torch.manual_seed(0)
    batch = {"idx": torch.zeros(2, 8, dtype=torch.long), "tgt": torch.zeros(2, 8, dtype=torch.long)}
    fxshard.shard(GPT(GPTConfig.preset("tiny")), lambda m, b: m.loss(b), batch,
                  config=fxshard.Config(dump_dir=str(tmp_path)))
    assert sorted(os.listdir(tmp_path)) == [".fxshard-dump", "00_setup.py", "00_traced.dot", "00_traced.nodes.txt",
                                            "00_traced.py", "00_traced.summary.txt", "01_runtime.py", "notes.md",
                                            "pipeline.txt"]
    assert (tmp_path / "00_setup.py").read_text() == "mine"
    for stage in range(2):  # as a pipeline writes them
        write_dump_file(tmp_path / f"stage{stage}", "00_traced.summary.txt", f"stage {stage} summary\n")
    capsys.readouterr()
    assert main([str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "== 00_traced\n" in printed and "== stage1/00_traced\nstage 1 summary" in printed
    with pytest.raises(fxshard.FxShardError, match="is a file; name a directory"):
        fxshard.Config(dump_dir=str(tmp_path / "notes.md"))
    # a pipeline's stage 0 also clears the folder above and the stage folders this pipeline has not
    write_dump_file(tmp_path / "stage5", "pipeline.txt", "")
    (tmp_path / "stage7").mkdir()
    (tmp_path / "stage7" / "mine.txt").write_text("mine")  # not fxshard's: stays
    clear_stale_dumps(tmp_path / "stage0", stage=0, stages=2)
    assert sorted(os.listdir(tmp_path)) == ["00_setup.py", "notes.md", "pipeline.txt", "stage0", "stage1", "stage7"]
    assert os.listdir(tmp_path / "stage0") == [] and os.listdir(tmp_path / "stage1")


def summary_tables(program):
    """The summary's per-layer node counts summed, and its collective rows (op, owner, phase)."""
    from fxshard.dump import summarize

    lines = summarize(program).splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("layer "))
    counted, index = 0, header + 1
    while index < len(lines) and lines[index].strip():
        counted += sum(int(x) for x in lines[index][25:].split())  # after the layer's name
        index += 1
    start = next((i for i, line in enumerate(lines) if line.strip().startswith("position")), None)
    rows = []
    for line in lines[start + 1:] if start is not None else []:
        if line.startswith("collective bytes"):
            break
        rows.append(line.split()[1:4])
    return lines, counted, rows


def test_the_summary_lists_every_collective_and_transfer_counts_every_node_and_no_wait_as_a_write():
    """The collective table lists what no unit owns too (the gradient norm's all-reduce, a pipeline's
    loss all-reduce, sends and receives, with their peer), the per-layer table adds up to the node
    count (nodes a pass added without a layer in a row of their own), and a collective's wait, which
    returns the collective's output, neither writes bytes nor adds to the peak."""
    from fxshard import meta
    from fxshard.api import _compile
    from fxshard.dump import peak_live_bytes, written_bytes_by_op
    from fxshard.graph import is_view

    torch.manual_seed(0)
    batch = {"idx": torch.zeros(2, 8, dtype=torch.long), "tgt": torch.zeros(2, 8, dtype=torch.long)}
    cases = [(fxshard.Mesh(dp=2), fxshard.Config(sharding="optim_grads_params"), 0),
             (fxshard.Mesh(pp=2), fxshard.Config(microbatches=2, schedule="1f1b"), 0)]
    for mesh, config, stage in cases:
        program = _compile(GPT(GPTConfig.preset("tiny")), lambda m, b: m.loss(b), batch, fxshard.optim.AdamW(),
                           mesh, config, (stage,))[-1]
        nodes = [n for n in program.graph.nodes if n.op not in ("placeholder", "output")]
        lines, counted, rows = summary_tables(program)
        assert counted == len(nodes), lines[0]
        communication = [n for n in nodes if n.target in meta.COLLECTIVE_ISSUES or
                         n.target in (torch.ops.fxshard.send.default, torch.ops.fxshard.recv.default)]
        assert len(rows) == len(communication) and communication
        assert ["all_reduce", "(dp)" if mesh.dp > 1 else "(pp)", "optim"] in rows  # the gradient norm's
        if mesh.pp > 1:
            assert {"send", "recv"} <= {row[0] for row in rows} and "(pp" in " ".join(r[1] for r in rows)
            assert "peer 1)" in "\n".join(lines)
        assert "wait_tensor" not in written_bytes_by_op(program)
        waits = [n for n in nodes if n.target is torch.ops._c10d_functional.wait_tensor.default]
        assert waits and not any(is_view(n) for n in waits)  # the schema does not say the wait aliases
        import fxshard.dump as dump

        aliases, dump._aliases = dump._aliases, is_view  # as before: each wait a new tensor
        try:
            counted_twice = peak_live_bytes(program)
        finally:
            dump._aliases = aliases
        if mesh.dp > 1:  # the gathered units' waits made the ZeRO-3 peak larger; a stage's receives do not
            assert peak_live_bytes(program) < counted_twice
        assert peak_live_bytes(program) <= counted_twice


def test_evaluates_program_is_dumped_beside_its_step_and_not_into_a_later_runs_folder(tmp_path):
    torch.manual_seed(0)
    batch = {"idx": torch.zeros(2, 8, dtype=torch.long), "tgt": torch.zeros(2, 8, dtype=torch.long)}
    first = fxshard.shard(GPT(GPTConfig.preset("tiny")), lambda m, b: m.loss(b), batch,
                          config=fxshard.Config(dump_dir=str(tmp_path)))
    second = fxshard.shard(GPT(GPTConfig.preset("tiny")), lambda m, b: m.loss(b), batch,
                           config=fxshard.Config(dump_dir=str(tmp_path), microbatches=2))
    with pytest.warns(UserWarning, match="evaluate's program is not dumped .* another run has dumped there"):
        first.evaluate(batch)
    assert not [name for name in os.listdir(tmp_path) if "evaluate" in name]
    second.evaluate(batch)
    evaluate = [name for name in os.listdir(tmp_path) if name.endswith("evaluate.summary.txt")]
    assert len(evaluate) == 1 and evaluate[0].startswith(f"{len(second.programs) + 1:02d}_")
