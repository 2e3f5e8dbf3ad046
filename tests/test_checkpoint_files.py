"""Checkpoint directories on one process: what a bad input says (and that it changes nothing), a save
killed while writing, and asynchronous saves."""

import json
import os
import shutil
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

import fxshard
from fxshard.checkpoint import read_tensors
from fxshard.models import GPT, GPTConfig

ADAMW = fxshard.optim.AdamW(lr=3e-3)


def batches(count=6):
    generator = torch.Generator().manual_seed(0)
    return [{"idx": torch.randint(0, 64, (2, 8), generator=generator),
             "tgt": torch.randint(0, 64, (2, 8), generator=generator)} for _ in range(count)]


def shard(optimizer=ADAMW, **overrides):
    torch.manual_seed(0)
    return fxshard.shard(GPT(GPTConfig.preset("tiny", **overrides)), lambda m, b: m.loss(b), batches()[0], optimizer)


def snapshot(step):
    return {key: value.clone() for key, value in step.state.items()}, step.step_count


def assert_unchanged(step, before):
    state, count = before
    assert step.step_count == count
    for key, value in state.items():
        assert torch.equal(step.state[key], value), key


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A GPT tiny checkpoint after 3 AdamW steps, and the losses of steps 4 and 5 of that run."""
    step = shard()
    data = batches()
    for batch in data[:3]:
        step(batch)
    path = tmp_path_factory.mktemp("ck") / "gpt"
    fxshard.save(step, path, extra={"epoch": 1})
    return path, [step(batch)["loss"].item() for batch in data[3:5]]


def test_another_model_is_refused_naming_its_keys_and_nothing_changes(saved):
    path, _ = saved
    for overrides, expected in ((dict(n_layer=3), r"missing \(\d+\): model\.layers\.2\."),
                                (dict(n_layer=1), r"unexpected \(\d+\): model\.layers\.1\."),
                                (dict(d_ff=96), r"shape differs \(\d+\): model\.layers\.0\.mlp\.down\.weight "
                                                r"\(64, 128\) != \(64, 96\)")):
        step = shard(**overrides)
        step(batches()[0])
        before = snapshot(step)
        with pytest.raises(fxshard.FxShardError, match=expected):
            fxshard.load(step, path)
        assert_unchanged(step, before)


def test_another_optimizers_state_is_refused(saved):
    step = shard(fxshard.optim.SGD(lr=0.1, momentum=0.9))
    with pytest.raises(fxshard.FxShardError, match=r"holds AdamW state .* trains with SGD"):
        fxshard.load(step, saved[0])


def test_a_checkpoint_saved_with_other_parameters_frozen_says_so(saved):
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny"))
    model.tok_emb.weight.requires_grad_(False)
    step = fxshard.shard(model, lambda m, b: m.loss(b), batches()[0], ADAMW)
    with pytest.raises(fxshard.FxShardError, match=r"saved with other parameters frozen \(requires_grad\) than this "
                                                   r"step's \(frozen now, trained when saved: tok_emb.weight\)"):
        fxshard.load(step, saved[0])


def test_damaged_and_partial_checkpoints_are_refused_and_nothing_changes(saved, tmp_path):
    step = shard()
    before = snapshot(step)
    truncated = tmp_path / "truncated"
    shutil.copytree(saved[0], truncated)
    data = next(f for f in os.listdir(truncated) if f.endswith(".distcp"))
    with open(truncated / data, "r+b") as handle:
        handle.truncate(os.path.getsize(truncated / data) // 2)
    with pytest.raises(fxshard.FxShardError, match=f"is damaged: {data} is truncated"):
        fxshard.load(step, truncated)
    unfinished = tmp_path / "unfinished"
    shutil.copytree(saved[0], unfinished)
    os.remove(unfinished / "fxshard.json")
    with pytest.raises(fxshard.FxShardError, match="not a complete fxshard checkpoint"):
        fxshard.load(step, unfinished)
    os.rename(unfinished, tmp_path / "interrupted.partial")
    with pytest.raises(fxshard.FxShardError, match=r"interrupted.partial is an interrupted save"):
        fxshard.load(step, tmp_path / "interrupted")
    # bytes overwritten in place (0xff...: NaN in float32), the file's length unchanged
    overwritten = tmp_path / "overwritten"
    shutil.copytree(saved[0], overwritten)
    storage = dcp.FileSystemReader(str(overwritten)).read_metadata().storage_data
    info = max((info for index, info in storage.items() if index.fqn.startswith("optim.")), key=lambda i: i.length)
    with open(overwritten / info.relative_path, "r+b") as handle:  # the middle of the item: its data
        handle.seek(info.offset + info.length // 2)
        handle.write(b"\xff" * 64)
    with pytest.raises(fxshard.FxShardError, match=rf"is damaged: {info.relative_path} is not the file the save wrote "
                                                   r"\(CRC-32 [0-9a-f]{8} of bytes 0-\d+, recorded [0-9a-f]{8}\)"):
        fxshard.load(step, overwritten)
    without_checksums(overwritten)  # as a checkpoint from before 2026-12-01: the values are still checked
    with pytest.raises(fxshard.FxShardError, match=r"holds values that are not finite in opt_state .*the step is unchanged"):
        fxshard.load(step, overwritten)
    assert_unchanged(step, before)


def without_checksums(path):
    manifest = json.loads((path / "fxshard.json").read_text())
    del manifest["checksums"], manifest["manifest_crc32"]
    (path / "fxshard.json").write_text(json.dumps(manifest))


def test_a_flipped_bit_anywhere_in_a_checkpoint_is_refused_naming_the_file(saved, tmp_path):
    """A bit flipped in a tensor's bytes (a finite value still), in DCP's metadata, or in the manifest's
    step count loads nothing; the same checkpoint without checksums (older) loads the flipped weight."""
    step = shard()
    before = snapshot(step)
    storage = dcp.FileSystemReader(str(saved[0])).read_metadata().storage_data
    info = next(info for index, info in storage.items() if index.fqn == "model.tok_emb.weight")
    for name, offset in ((info.relative_path, info.offset + info.length // 2), (".metadata", None)):
        damaged = tmp_path / name.strip(".")
        shutil.copytree(saved[0], damaged)
        with open(damaged / name, "r+b") as handle:
            handle.seek(offset if offset is not None else os.path.getsize(damaged / name) // 2)
            byte = handle.read(1)[0]
            handle.seek(-1, os.SEEK_CUR)
            handle.write(bytes([byte ^ 0x01]))  # the lowest mantissa bit of a float32 element
        with pytest.raises(fxshard.FxShardError, match=rf"is damaged: {name} is not the file the save wrote"):
            fxshard.load(step, damaged)
        with pytest.raises(fxshard.FxShardError, match=rf"is damaged: {name} is not the file"):
            read_tensors(damaged)
    without_checksums(tmp_path / info.relative_path.strip("."))
    fxshard.load(step, tmp_path / info.relative_path.strip("."))  # unchecked: the flip is not noticed
    assert not torch.equal(step.parameters()["tok_emb.weight"], read_tensors(saved[0])["model.tok_emb.weight"])
    step = shard()
    manifest = tmp_path / "manifest"
    shutil.copytree(saved[0], manifest)
    text = (manifest / "fxshard.json").read_text()
    assert '"step_count": 3' in text
    (manifest / "fxshard.json").write_text(text.replace('"step_count": 3', '"step_count": 7'))
    with pytest.raises(fxshard.FxShardError, match=r"is damaged: fxshard.json changed after the save"):
        fxshard.load(step, manifest)
    assert_unchanged(step, before)
    os.remove(manifest / os.path.basename(info.relative_path))
    (manifest / "fxshard.json").write_text(text)
    with pytest.raises(fxshard.FxShardError, match=rf"is damaged: {info.relative_path} is missing"):
        fxshard.load(step, manifest)


def test_checksums_cover_pieces_of_files_and_name_the_piece_that_changed(tmp_path, monkeypatch):
    import fxshard.checkpoint.dcp as checkpoint

    monkeypatch.setattr(checkpoint, "PIECE", 4096)
    step = shard()
    step(batches()[0])
    fxshard.save(step, tmp_path / "ck")
    manifest = json.loads((tmp_path / "ck" / "fxshard.json").read_text())
    data = next(name for name in manifest["checksums"]["files"] if name.endswith(".distcp"))
    size = os.path.getsize(tmp_path / "ck" / data)
    recorded = manifest["checksums"]["files"][data]
    assert manifest["checksums"]["piece"] == 4096 and recorded["bytes"] == size
    assert len(recorded["crc32"]) == -(-size // 4096) > 2
    monkeypatch.setattr(checkpoint, "PIECE", 64 << 20)  # a load checks in the pieces the save recorded
    with open(tmp_path / "ck" / data, "r+b") as handle:
        handle.seek(4096 + 100)
        byte = handle.read(1)[0]
        handle.seek(-1, os.SEEK_CUR)
        handle.write(bytes([byte ^ 0x80]))
    with pytest.raises(fxshard.FxShardError, match=rf"{data} is not the file the save wrote \(CRC-32 [0-9a-f]{{8}} of "
                                                   r"bytes 4096-8191, recorded"):
        fxshard.load(shard(), tmp_path / "ck")
    with open(tmp_path / "ck" / data, "r+b") as handle:
        handle.seek(4096 + 100)
        handle.write(bytes([byte]))  # as saved again ...
    fxshard.load(shard(), tmp_path / "ck")
    with open(tmp_path / "ck" / data, "ab") as handle:  # ... but one byte longer
        handle.write(b"\0")
    with pytest.raises(fxshard.FxShardError, match=rf"{data} is not the file the save wrote: {size + 1} bytes, "
                                                   rf"{size} when saved"):
        fxshard.load(shard(), tmp_path / "ck")


def test_any_flipped_byte_of_the_manifest_or_metadata_is_an_fxshard_error(saved, tmp_path):
    """Every byte of fxshard.json and of DCP's .metadata, its high bit flipped (a byte that is no longer
    UTF-8, a pickle that unpickles to anything): the load refuses with FxShardError, never a raw error;
    a flipped .metadata is caught by its checksum before it is unpickled."""
    step = shard()
    copy = tmp_path / "copy"
    for name, stride in (("fxshard.json", 7), (".metadata", 97)):
        original = (saved[0] / name).read_bytes()
        for at in range(0, len(original), stride):
            shutil.rmtree(copy, ignore_errors=True)
            shutil.copytree(saved[0], copy)
            (copy / name).write_bytes(original[:at] + bytes([original[at] ^ 0x80]) + original[at + 1:])
            with pytest.raises(fxshard.FxShardError) as raised:
                fxshard.load(step, copy)
            message = str(raised.value)
            assert "is damaged" in message or "checkpoint format" in message, (name, at, message)
            if name == ".metadata":
                assert ".metadata is not the file the save wrote" in message, (at, message)


def test_checksums_edited_out_of_shape_or_a_reader_that_fails_are_refused(saved, tmp_path, monkeypatch):
    """A checksum map edited by hand (its own CRC removed) that no longer fits is refused, not half
    used; a save whose checksum reading fails (in any thread, with any error) raises and leaves the
    checkpoint it would have replaced."""
    import fxshard.checkpoint.dcp as checkpoint

    step = shard()
    for edit, expected in ((lambda files, data: files[data].update(crc32=None), "an unreadable checksum for"),
                           (lambda files, data: files[data].update(crc32=[]), "an unreadable checksum for"),
                           (lambda files, data: files.pop(data), "has no checksum in fxshard.json"),
                           (lambda files, data: files.pop(".metadata"), "records no checksum of .metadata")):
        edited = tmp_path / "edited"
        shutil.rmtree(edited, ignore_errors=True)
        shutil.copytree(saved[0], edited)
        manifest = json.loads((edited / "fxshard.json").read_text())
        del manifest["manifest_crc32"]
        files = manifest["checksums"]["files"]
        edit(files, next(name for name in files if name.endswith(".distcp")))
        (edited / "fxshard.json").write_text(json.dumps(manifest))
        with pytest.raises(fxshard.FxShardError, match=expected):
            fxshard.load(step, edited)
    step(batches()[0])
    fxshard.save(step, tmp_path / "ck", extra="first")
    calls = []

    def failing(file, start, piece):
        calls.append(file)
        raise MemoryError("no memory for the block")
    monkeypatch.setattr(checkpoint, "_piece_crc", failing)
    with pytest.raises(fxshard.FxShardError, match=r"could not checksum what it wrote: MemoryError"):
        fxshard.save(step, tmp_path / "ck", extra="second")
    monkeypatch.undo()
    assert calls and fxshard.load(shard(), tmp_path / "ck") == "first"


def test_checksum_shares_cover_every_file_once():
    from fxshard.checkpoint.dcp import _share

    files = [f"f{i}" for i in range(7)]
    for world in (1, 2, 3, 8):
        shares = [_share(files, rank, world) for rank in range(world)]
        assert sorted(f for share in shares for f in share) == files


def test_a_save_never_replaces_a_directory_that_is_not_a_checkpoint(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(fxshard.FxShardError, match="exists and is not an fxshard checkpoint"):
        fxshard.save(shard(), tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "mine"


KILLED_SAVE = """
import os, sys, torch, fxshard
sys.path.insert(0, {tests!r})
from test_checkpoint_files import batches, shard

step = shard()
for batch in batches()[:3]:
    step(batch)
fxshard.save(step, {path!r}, extra={{"epoch": 1}})
for batch in batches()[3:5]:
    step(batch)

def dies(*args, **kwargs):  # the writer process is killed as it writes the new checkpoint's data
    os._exit(3)
torch.distributed.checkpoint.FileSystemWriter.write_data = dies
fxshard.save(step, {path!r}, extra={{"epoch": 2}})
"""


def run_script(template: str, path) -> subprocess.CompletedProcess:
    """`template` (formatted with this directory and `path`) in a fresh Python process."""
    code = template.format(tests=os.path.dirname(__file__), path=str(path))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(__file__)),
                                                       os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          timeout=300)


def test_a_save_killed_while_writing_leaves_the_last_checkpoint_loading_and_training_exactly(saved, tmp_path):
    path = tmp_path / "gpt"
    result = run_script(KILLED_SAVE, path)
    assert result.returncode == 3, result.stderr[-2000:]
    assert os.path.isdir(f"{path}.partial")  # the killed save's leftovers
    step = shard()
    assert fxshard.load(step, path) == {"epoch": 1} and step.step_count == 3
    assert [step(batch)["loss"].item() for batch in batches()[3:5]] == saved[1]
    # killed between its two renames: only <path>.previous is left, and it loads
    os.rename(path, f"{path}.previous")
    assert fxshard.load(shard(), path) == {"epoch": 1}


def test_an_async_save_holds_the_state_of_when_it_was_called(saved, tmp_path):
    step = shard()
    data = batches()
    for batch in data[:3]:
        step(batch)
    pending = fxshard.save(step, tmp_path / "async", extra={"epoch": 1}, async_save=True)
    later = [step(batch)["loss"].item() for batch in data[3:5]]  # the state changes while it writes
    pending.wait()
    assert pending.done() and later == saved[1]
    resumed = shard()
    fxshard.load(resumed, tmp_path / "async")
    assert [resumed(batch)["loss"].item() for batch in data[3:5]] == saved[1]


def test_saves_in_one_process_print_no_warning_of_torch_distributed(tmp_path):
    """One process without torch.distributed is a normal job: DCP's "assuming the intent is to save in a
    single process" warning is not shown, from the training thread or from an async save's thread."""
    step = shard()
    step(batches()[0])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fxshard.save(step, tmp_path / "sync")
        fxshard.save(step, tmp_path / "async", async_save=True).wait()
    assert not [w for w in caught if "torch.distributed is disabled" in str(w.message)]


def test_a_trailing_slash_names_the_same_checkpoint_and_extra_is_kept_as_it_was_at_the_call(tmp_path):
    """`extra` is pickled when save() is called (an async save must not see later changes), tensors in it
    included; "dir/" and "dir" are one checkpoint, its .partial / .previous beside it, not inside."""
    step = shard()
    step(batches()[0])
    seen = [1]
    for _ in range(2):  # the second save replaces the first through "<path>.previous"
        pending = fxshard.save(step, f"{tmp_path}/ck/", extra={"seen": seen, "t": torch.tensor([5])}, async_save=True)
        seen.append(2)
        pending.wait()
        seen.pop()
    assert sorted(os.listdir(tmp_path)) == ["ck"]
    extra = fxshard.load(shard(), f"{tmp_path}/ck/")
    assert extra["seen"] == [1] and torch.equal(extra["t"], torch.tensor([5]))
    step.set_lr(0.25)  # an override is state: it comes back with the checkpoint, which says so
    fxshard.save(step, tmp_path / "override")
    loaded = shard()
    with pytest.warns(UserWarning, match=r"learning rate set by set_lr \(0.25\).*set_lr\(None\)"):
        fxshard.load(loaded, tmp_path / "override")
    assert loaded.lr == 0.25
    loaded.set_lr(None)
    assert loaded.lr == ADAMW.lr
    # an async save that fails is reported, with its cause, by the next save (which does not start)
    # and by its own wait(), each time; the save after that works
    (tmp_path / "blocked").touch()
    failed = fxshard.save(step, tmp_path / "blocked" / "ck", async_save=True)
    with pytest.raises(fxshard.FxShardError, match="earlier asynchronous save failed.*rank 0: NotADirectoryError"):
        fxshard.save(step, tmp_path / "after")
    for _ in range(2):
        with pytest.raises(fxshard.FxShardError, match="blocked/ck is unchanged: rank 0: NotADirectoryError"):
            failed.wait()
    fxshard.save(step, tmp_path / "after")
    assert (tmp_path / "after" / "fxshard.json").exists()
    # a failure the caller saw through wait() is not reported again by the next save
    seen = fxshard.save(step, tmp_path / "blocked" / "ck", async_save=True)
    with pytest.raises(fxshard.FxShardError, match="blocked/ck is unchanged"):
        seen.wait()
    fxshard.save(step, tmp_path / "after")


def test_a_symlinked_path_saves_into_its_target_and_keeps_the_link(tmp_path):
    """`ckpt -> scratch/run` (a link to another filesystem, as on clusters): every save replaces
    scratch/run, the link stays a link, and the second save works too."""
    step = shard()
    (tmp_path / "scratch").mkdir()
    os.symlink(tmp_path / "scratch" / "run", tmp_path / "ckpt")  # dangling until the first save
    for batch in batches()[:2]:
        step(batch)
        fxshard.save(step, tmp_path / "ckpt", extra=step.step_count)
    assert os.path.islink(tmp_path / "ckpt") and sorted(os.listdir(tmp_path)) == ["ckpt", "scratch"]
    assert os.listdir(tmp_path / "scratch") == ["run"]
    assert fxshard.load(shard(), tmp_path / "ckpt") == 2


def test_rolling_back_past_a_non_finite_step_forgets_its_flag_and_a_corrupt_manifest_is_refused(tmp_path):
    from strategies import MLPStack, mse, regression_batch

    data = [regression_batch(torch.Generator().manual_seed(i), 4) for i in range(4)]
    data[2]["y"][0, 0] = float("nan")
    torch.manual_seed(0)
    step = fxshard.shard(MLPStack([4, 4]), mse, data[0], ADAMW)  # Config(nonfinite="raise")
    step(data[0])
    step(data[1])
    fxshard.save(step, tmp_path / "good")
    assert step(data[2])["loss"].isnan()  # its flag is read two calls later ...
    fxshard.load(step, tmp_path / "good")  # ... but the load discards that step
    for batch in (data[1], data[3], data[3]):
        assert step(batch)["loss"].isfinite()
    (tmp_path / "good" / "fxshard.json").write_text("{not json")
    with pytest.raises(fxshard.FxShardError, match="is damaged: fxshard.json is not JSON"):
        fxshard.load(step, tmp_path / "good")


def test_a_zero_element_buffer_round_trips(tmp_path):
    class WithEmpty(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(3, 1)
            self.register_buffer("nothing", torch.zeros(0))

        def forward(self, x):
            return self.lin(x)

    batch = {"x": torch.randn(4, 3), "y": torch.randn(4, 1)}

    def loss(model, b):
        return ((model(b["x"]) - b["y"]) ** 2).mean()
    step = fxshard.shard(WithEmpty(), loss, batch, ADAMW)
    step(batch)
    fxshard.save(step, tmp_path / "c")
    fresh = fxshard.shard(WithEmpty(), loss, batch, ADAMW)
    fxshard.load(fresh, tmp_path / "c")
    assert fresh.step_count == 1 and torch.equal(fresh.parameters()["lin.weight"], step.parameters()["lin.weight"])


class Rotary(torch.nn.Module):
    """A table the model computes from its config (RoPE's), registered persistent or not, and a count
    of calls the step updates (its per-rank copy is saved beside the global tensors)."""

    def __init__(self, base: float, persistent: bool = False):
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)
        self.register_buffer("table", base ** -torch.arange(4.0), persistent=persistent)
        self.register_buffer("calls", torch.zeros(()), persistent=persistent)

    def forward(self, x):
        self.calls.add_(1)
        return self.lin(x * self.table)


def test_buffers_registered_not_persistent_are_neither_saved_nor_loaded(tmp_path):
    """As torch's state_dict: a resume with another RoPE base computes with its own table, not the
    checkpoint's; a checkpoint that holds the table (saved while it was persistent, or before
    session 50) loads all the same, the table left as the model has it."""
    batch = {"x": torch.randn(4, 4), "y": torch.randn(4, 1)}

    def loss(model, b):
        return ((model(b["x"]) - b["y"]) ** 2).mean()
    for persistent in (False, True):
        torch.manual_seed(0)
        step = fxshard.shard(Rotary(2.0, persistent), loss, batch, ADAMW)
        step(batch)
        assert ("model.table" in step.state_dict()) == persistent
        fxshard.save(step, tmp_path / f"saved_{persistent}")
        fresh = fxshard.shard(Rotary(3.0), loss, batch, ADAMW)
        fxshard.load(fresh, tmp_path / f"saved_{persistent}")
        assert torch.equal(fresh.buffers()["table"], 3.0 ** -torch.arange(4.0))
        assert fresh.buffers()["calls"].item() == 0  # not from the per-rank copy either
        assert torch.equal(fresh.parameters()["lin.weight"], step.parameters()["lin.weight"])


EXITS_DURING_ASYNC_SAVE = """
import sys, fxshard
sys.path.insert(0, {tests!r})
from test_checkpoint_files import batches, shard
step = shard()
step(batches()[0])
fxshard.save(step, {path!r}, async_save=True)  # and the program ends at once
"""


def test_a_program_that_ends_during_an_async_save_finishes_it_first(tmp_path):
    path = tmp_path / "last"
    result = run_script(EXITS_DURING_ASYNC_SAVE, path)
    assert result.returncode == 0, result.stderr[-2000:]
    step = shard()
    fxshard.load(step, path)
    assert step.step_count == 1


def test_load_state_dict_is_strict_about_keys_and_shapes_and_changes_nothing_when_it_refuses():
    step = shard()
    source = shard()
    source(batches()[1])
    plain = {f"model.{name}": value for name, value in source.parameters().items()}
    before = snapshot(step)
    for state, expected in (({**plain, "model.lm_head.wieght": torch.zeros(1)}, r"unexpected \(1\): model\.lm_head\.wieght"),
                            (plain, r"missing \(\d+\): optim\."),
                            ({**plain, "model.tok_emb.weight": torch.zeros(3, 3)},
                             r"shape differs \(1\): model\.tok_emb\.weight \(3, 3\) != \(64, 64\)"),
                            # another step's own form (Boxes), of a wider model: its shapes are checked too
                            (shard(d_ff=96).state_dict(), r"shape differs \(\d+\): model\.layers\.0\.mlp"),
                            # values, and the progress entry, are checked before anything is copied too
                            ({**plain, "fxshard.progress": {"step_count": 10}}, r"progress must be a dict with step_count"),
                            ({**plain, "fxshard.progress": {"step_count": 1, "lr_override": float("nan")}},
                             r"lr_override must be None or a finite float"),
                            ({**plain, "fxshard.progress": {"step_count": 1, "lr_override": None, "loss_scale": [1e39, 0]}},
                             r"loss_scale must be \[scale in \[2\*\*-126, 2\*\*126\]"),  # inf in float32
                            ({**plain, "model.head.weight": plain["model.head.weight"] * float("nan")},
                             r"not finite \(NaN or inf\): model\.head\.weight"),
                            ({**plain, "model.head.weight": plain["model.head.weight"].tolist()},
                             r"not tensors: model\.head\.weight"),
                            ({**plain, "model.head.weight": plain["model.head.weight"].to("meta")},
                             r"on the meta device \(no values\): model\.head\.weight")):
        with pytest.raises(fxshard.FxShardError, match=expected):
            step.load_state_dict(state)
        assert_unchanged(step, before)
    # model.state_dict()'s names, without the prefix: even strict=False would load nothing, so it says so
    unprefixed = {name.removeprefix("model."): value for name, value in plain.items()}
    for strict in (True, False):
        with pytest.raises(fxshard.FxShardError, match=r"none of the \d+ keys names a tensor of this step .* prefix"):
            step.load_state_dict(unprefixed, strict=strict)
    with pytest.raises(fxshard.FxShardError, match="takes a dict of tensors by key, got list"):
        step.load_state_dict(list(plain.values()))
    assert_unchanged(step, before)
    step.load_state_dict(plain, strict=False)  # the parameters, the optimizer state as it was
    for name, value in source.parameters().items():
        assert torch.equal(step.parameters()[name], value), name
    step.load_state_dict(step.state_dict())  # its own form is complete


def test_an_async_saves_thread_leaves_the_training_loops_warning_filters_alone():
    import threading
    import warnings

    from fxshard.checkpoint.dcp import _quiet

    entered, release = threading.Event(), threading.Event()

    def save_thread():
        with _quiet(False):
            entered.set()
            release.wait(10)

    with warnings.catch_warnings():
        thread = threading.Thread(target=save_thread)
        thread.start()
        entered.wait(10)
        warnings.filterwarnings("ignore", message="set by the training loop")
        release.set()
        thread.join()
        assert any(f[1] is not None and f[1].pattern == "set by the training loop" for f in warnings.filters)


def test_checkpoint_calls_given_a_model_a_bad_path_an_unpicklable_extra_or_damaged_json_say_so(tmp_path):
    """A helper's review of user errors: each of these raised AttributeError, TypeError or OSError."""
    step = shard()
    model = GPT(GPTConfig.preset("tiny"))
    for call in (fxshard.save, fxshard.load, fxshard.export_hf, fxshard.load_hf):
        with pytest.raises(fxshard.FxShardError, match=r"takes the step fxshard.shard returned, got GPT"):
            call(model, tmp_path / "x")
        with pytest.raises(fxshard.FxShardError, match=r"takes a directory path \(str or os.PathLike\), got NoneType"):
            call(step, None)
    with pytest.raises(fxshard.FxShardError, match=r"extra=...\) must be picklable"):
        fxshard.save(step, tmp_path / "ck", extra={"position": lambda: 1})
    assert not (tmp_path / "ck").exists() and not (tmp_path / "ck.partial").exists()
    fxshard.save(step, tmp_path / "ck", extra={"position": 3})
    (tmp_path / "ck" / "fxshard.json").write_text("[]")
    with pytest.raises(fxshard.FxShardError, match=r"is damaged: fxshard.json holds list"):
        fxshard.load(step, tmp_path / "ck")
    (tmp_path / "file").write_text("")
    with pytest.raises(fxshard.FxShardError, match=r"export_hf: .*file/hf cannot be written \(NotADirectoryError"):
        fxshard.export_hf(step, tmp_path / "file" / "hf")
    fxshard.export_hf(step, tmp_path / "hf")
    (tmp_path / "hf" / "config.json").write_text("{not json")
    with pytest.raises(fxshard.FxShardError, match=r"config.json is not JSON .*fix or remove it"):
        fxshard.load_hf(step, tmp_path / "hf")


def test_copy_to_puts_trained_weights_and_buffers_into_a_model_whose_wrappers_rename_its_state_dict():
    """torch's checkpoint_wrapper (torchtitan's activation checkpointing) names parameters
    `..._checkpoint_wrapped_module.weight` but strips that from state_dict keys and adds it back on
    load: the README's earlier recipe, load_state_dict(step.parameters(), strict=False), dropped every
    wrapped block's weights silently. copy_to copies by named_parameters() / named_buffers()."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    def build():
        torch.manual_seed(0)
        blocks = [checkpoint_wrapper(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)),
                                     preserve_rng_state=False) for _ in range(2)]
        return torch.nn.Sequential(*blocks, torch.nn.Linear(4, 1))
    batch = {"x": torch.randn(8, 4), "y": torch.randn(8, 1)}

    def loss(model, b):
        return ((model(b["x"]) - b["y"]) ** 2).mean()
    model = build()
    step = fxshard.shard(model, loss, batch, ADAMW)
    for _ in range(2):
        step(batch)
    step.copy_to(model)
    trained, buffers = step.parameters(), step.buffers()
    assert "0._checkpoint_wrapped_module.0.weight" in trained
    for name, value in model.named_parameters():
        assert torch.equal(value, trained[name]), name
    for name, value in model.named_buffers():
        assert torch.equal(value, buffers[name]), name
    with pytest.raises(fxshard.FxShardError, match="copy_to: the model has no parameter"):
        step.copy_to(torch.nn.Linear(4, 1))
    other = build()  # a block's BatchNorm one feature wider: refused before anything is copied
    other[1]._checkpoint_wrapped_module[1] = torch.nn.BatchNorm1d(5)
    before = {name: value.clone() for name, value in other.state_dict().items()}
    with pytest.raises(fxshard.FxShardError, match="is \\(5,\\) in the model, \\(4,\\) in the step"):
        step.copy_to(other)
    assert all(torch.equal(value, before[name]) for name, value in other.state_dict().items())


def test_copy_to_refuses_a_model_whose_weight_the_step_ties_is_separate():
    class Tied(torch.nn.Module):
        def __init__(self, tie=True):
            super().__init__()
            self.emb, self.head = torch.nn.Embedding(8, 4), torch.nn.Linear(4, 8, bias=False)
            if tie:
                self.head.weight = self.emb.weight

        def forward(self, idx):
            return self.head(self.emb(idx))
    batch = {"idx": torch.randint(0, 8, (2, 3))}

    def loss(model, b):
        return model(b["idx"]).square().mean()
    tied = Tied()
    step = fxshard.shard(tied, loss, batch, ADAMW)
    step(batch)
    step.copy_to(tied)  # the tie holds: one tensor, copied once
    assert torch.equal(tied.head.weight, step.parameters()["emb.weight"])
    with pytest.raises(fxshard.FxShardError, match="'head.weight' is none of the step's"):
        step.copy_to(Tied(tie=False))


def test_a_save_or_load_longer_than_a_few_seconds_says_so(tmp_path, monkeypatch, capsys):
    import fxshard.checkpoint.dcp as checkpoint

    step = shard()
    fxshard.save(step, tmp_path / "quick")
    fxshard.load(step, tmp_path / "quick")
    assert "fxshard: saved" not in capsys.readouterr().err  # under REPORT_AFTER_S: quiet
    monkeypatch.setattr(checkpoint, "REPORT_AFTER_S", 0.0)
    fxshard.save(step, tmp_path / "slow")
    fxshard.load(step, tmp_path / "slow")
    said = capsys.readouterr().err
    assert f"fxshard: saved {tmp_path / 'slow'}: 0.00 GB in 2 files" in said and \
        f"fxshard: loaded {tmp_path / 'slow'} (step 0)" in said, said
