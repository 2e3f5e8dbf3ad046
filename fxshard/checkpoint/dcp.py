"""`fxshard.save` / `fxshard.load`: a step's whole training state in a directory, via
torch.distributed.checkpoint, loadable under any other mesh, strategy, pipeline cut or ep size.

A checkpoint directory holds DCP's files (`.metadata` and one data file per rank) and `fxshard.json`
(what was saved: optimizer, expert layouts, step count, mesh, and a CRC-32 of every other file and of
itself). A save writes `<path>.partial`, checks that every item DCP recorded is in its file, records
the checksums, and only then swaps it in for `<path>` (the previous checkpoint moves to
`<path>.previous` for the instant of the swap): a save killed at any point leaves the last good
checkpoint loadable. A load checks the directory (complete, every file as it was written, same keys
and shapes, same optimizer) before it touches the step, reads into copies of the state, and swaps
them in only after every rank read everything. The ranks share the checksum work: each reads every
world-size-th file.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import math
import os
import pickle
import shutil
import sys
import threading
import time
import uuid
import warnings
import weakref
import zlib

import torch
import torch.distributed.checkpoint as dcp

from ..errors import FxShardError
from .experts import ExpertLayout, convert_expert_tensors
from .items import global_tensors, model_key, optimizer_key
from .state import (PROGRESS, LoadPlanner, SavePlanner, apply_loaded, buffers_key, key_differences,
                    load_state_dict_into, own_buffers, rng_key, staging_state_dict, step_state_dict)

MANIFEST = "fxshard.json"
FORMAT = 1


def extra_key(rank: int) -> str:
    return f"extra.rank{rank}"


class PendingSave:
    """A save in progress (`async_save=True`) or done. `wait()` returns once the checkpoint is in
    place on every rank, and raises what the save raised (each time it is called; the next save
    reports a failure its caller has not seen through wait())."""

    def __init__(self, thread: threading.Thread | None = None):
        self._thread, self._error, self.reported = thread, None, False

    def done(self) -> bool:
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            self.reported = True
            raise self._error


def save(step, path: str | os.PathLike, extra=None, async_save: bool = False) -> PendingSave:
    """Write `step`'s training state (parameters, optimizer state, buffers, step count and lr
    override, every rank's RNG state) and `extra` (any picklable object, e.g. the data loader's
    position; each rank's own) to the directory `path`. Every rank calls it.

    `async_save=True` copies the state to host memory and writes it in a background thread: the
    step stalls only for the device-to-host copy; call `.wait()` on the result before relying on
    the files (a later save waits for an earlier one itself)."""
    require_step(step, "save")
    path = _real(path_argument(path, "save"))

    def checks():
        step.refuse_if_interrupted()  # a partly updated state is no checkpoint
        step._raise_if_nonfinite()  # under Config(nonfinite="raise"), a step not checked yet (the last ones)
        previous, step._pending_save = getattr(step, "_pending_save", None), None
        if previous is not None and not previous.reported:  # an earlier async save's failure no wait() raised yet
            try:
                previous.wait()
            except Exception as error:  # noqa: BLE001  (a gloo barrier's RuntimeError too): every rank says it
                raise FxShardError(f"an earlier asynchronous save failed, so this one did not start (call save "
                                   f"again): {error}") from error
        if os.path.exists(path) and not (os.path.isdir(path) and (not os.listdir(path) or
                                                                   os.path.exists(os.path.join(path, MANIFEST)))):
            raise FxShardError(f"{path} exists and is not an fxshard checkpoint (no {MANIFEST}); a save replaces the "
                               f"directory it writes to, so choose a new or checkpoint path")
        try:  # as it is now, whatever the caller changes later
            return pickle.dumps(extra)
        except Exception as error:
            raise FxShardError(f"save(extra=...) must be picklable (each rank's extra is written with pickle): "
                               f"{type(error).__name__}: {error}; pass plain data, e.g. the data loader's position "
                               f"as numbers") from error
    pickled_extra = _on_every_rank(checks, f"save to {path}", _job(step))
    step._check_same_lr()  # collective: after the checks every rank passed
    distributed = _is_distributed()
    staging = f"{path}.partial"
    if _rank() == 0:
        shutil.rmtree(staging, ignore_errors=True)  # what a killed save left
    state = step_state_dict(step, copy=async_save)
    state[extra_key(_rank())] = pickled_extra
    state[buffers_key(step.rank)] = own_buffers(step)
    manifest = _manifest(step)
    if not async_save:  # DCP's collectives wait for every rank's I/O: the default group's timeout, not the step's
        _write(state, staging, path, manifest, None, distributed)
        return PendingSave()
    if distributed and getattr(step, "_checkpoint_group", None) is None:
        import torch.distributed as dist

        step._checkpoint_group = dist.new_group(backend="gloo")  # the background thread's own collectives
    group = getattr(step, "_checkpoint_group", None)
    pending = PendingSave()

    def run():
        try:
            _write(state, staging, path, manifest, group, distributed)
        except BaseException as error:  # noqa: BLE001 - handed to wait()
            pending._error = error

    if not distributed:  # the thread cannot swap the filters (_quiet): this one message, for the process
        warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_WARNING)
    pending._thread = threading.Thread(target=run, name="fxshard-save", daemon=True)
    pending._thread.start()
    step._pending_save = pending
    atexit.register(_finish_at_exit, weakref.ref(pending), path)
    return pending


def _finish_at_exit(pending_ref, path: str) -> None:
    """A program that ends while an async save still writes waits for it (its daemon thread would be
    killed, and the checkpoint silently not written), and says so."""
    pending = pending_ref()
    if pending is None or pending.done():
        return
    print(f"fxshard: waiting for the async save to {path} before exiting", file=sys.stderr, flush=True)
    try:
        pending.wait()
    except Exception as error:  # noqa: BLE001 - at exit there is no caller left to raise to
        print(f"fxshard: the async save to {path} failed: {error}", file=sys.stderr, flush=True)


def _write(state, staging, path, manifest, group, distributed):
    _barrier(group, distributed)  # the staging directory is clean before anyone writes into it
    started = time.perf_counter()
    with _quiet(distributed), _as_fxshard_error(f"saving to {staging}; {path} is unchanged"):
        dcp.save(state, storage_writer=dcp.FileSystemWriter(staging), planner=SavePlanner(),
                 process_group=group, no_dist=not distributed)
    problem = _missing_items(staging)  # every rank reads the same files: every rank raises, or none
    if problem:
        raise FxShardError(f"the checkpoint written to {staging} is incomplete ({problem}); {path} is unchanged")
    checksums = _checksums(staging, group, distributed)  # collective; every rank's share, on every rank
    _barrier(group, distributed)  # every rank has checked the staging directory before it moves
    failed = None
    if _rank() == 0:
        try:
            manifest["seconds_to_write"] = round(time.perf_counter() - started, 3)
            manifest["checksums"] = checksums
            manifest["manifest_crc32"] = _manifest_crc(manifest)
            with open(os.path.join(staging, MANIFEST), "w") as handle:
                json.dump(manifest, handle, indent=1)
                handle.flush()
                os.fsync(handle.fileno())
            _swap_in(staging, path)
        except OSError as error:
            failed = f"{type(error).__name__}: {error}"
    if distributed:  # every rank learns how rank 0's part went (and none waits for a rank that failed)
        import torch.distributed as dist

        told = [failed]
        dist.broadcast_object_list(told, src=0, group=group)
        failed = told[0]
    if failed is not None:
        raise FxShardError(f"saving to {path}: rank 0 could not put the written checkpoint in place ({failed}); "
                           f"{path} is unchanged, or, if the swap was cut, {path}.previous holds the last "
                           f"checkpoint (load finds it)")
    size = sum(entry["bytes"] for entry in checksums["files"].values())
    _report(f"saved {path}: {size / 1e9:.2f} GB in {len(checksums['files'])} files", started)


REPORT_AFTER_S = 5.0  # a save or load that takes longer says so on stderr (rank 0), as a long compile does


def _report(what: str, started: float) -> None:
    elapsed = time.perf_counter() - started
    if elapsed > REPORT_AFTER_S and _rank() == 0:
        print(f"fxshard: {what}, {elapsed:.1f} s", file=sys.stderr, flush=True)


def _swap_in(staging: str, path: str) -> None:
    """`staging` becomes `path`; an existing `path` is removed only once `staging` holds its name.
    Killed between the two renames, `<path>.previous` is the last good checkpoint (load finds it)."""
    previous = f"{path}.previous"
    if os.path.exists(path):
        shutil.rmtree(previous, ignore_errors=True)
        os.rename(path, previous)
    os.rename(staging, path)
    _sync_directory(os.path.dirname(os.path.abspath(path)))  # the renames survive a power loss
    shutil.rmtree(previous, ignore_errors=True)


def _sync_directory(directory: str) -> None:
    """fsync a directory's entries (the files' data DCP's writer has synced already); a filesystem
    that cannot sync directories is left as it is."""
    try:
        handle = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(handle)
    except OSError:
        pass
    finally:
        os.close(handle)


def _manifest(step) -> dict:
    optimizer = step.optimizer
    return {"format": FORMAT, "optimizer": type(optimizer).__name__, "slots": list(optimizer.slots),
            "step_count": step.step_count, "mesh": step.mesh_description, "extra": "pickled",
            "sizes": _sizes(step.mesh), "save_id": uuid.uuid4().hex,  # rank 0's: load compares it across ranks
            "expert_layouts": {prefix: layout.as_dict() for prefix, (layout, _) in step.expert_layouts.items()}}


def _metadata(directory: str):
    """(DCP's metadata of `directory`, None) or (None, why it cannot be read): any failure to unpickle
    a damaged `.metadata` is a reason, not a raw exception."""
    try:
        return dcp.FileSystemReader(directory).read_metadata(), None
    except Exception as error:  # noqa: BLE001  a flipped bit makes unpickling raise almost anything
        return None, f"no readable .metadata: {type(error).__name__}: {str(error)[:200]}"


def _missing_items(directory: str, metadata=None) -> str | None:
    """Why `directory` is not a complete DCP checkpoint, or None: `.metadata` readable, and every
    item it records inside a file that is long enough."""
    if metadata is None:
        metadata, problem = _metadata(directory)
        if problem:
            return problem
    sizes = {}
    for info in (metadata.storage_data or {}).values():
        if info.relative_path not in sizes:
            file = os.path.join(directory, info.relative_path)
            sizes[info.relative_path] = os.path.getsize(file) if os.path.isfile(file) else -1
        if sizes[info.relative_path] < info.offset + info.length:
            return (f"{info.relative_path} is missing" if sizes[info.relative_path] < 0 else
                    f"{info.relative_path} is truncated: {sizes[info.relative_path]} bytes, items end at "
                    f"{info.offset + info.length}")
    return None


def _checkpoint_files(metadata) -> list[str]:
    """The files a checksum covers: `.metadata` and every data file it names, sorted (the order that
    shares them out among the ranks). Taken from the metadata, which every rank reads alike, not from
    a directory listing, which ranks on different hosts may see differently."""
    return sorted({".metadata", *(info.relative_path for info in (metadata.storage_data or {}).values())})


PIECE = 64 << 20  # bytes a checksum covers: the pieces of a file are read by threads side by side


def _piece_crc(file: str, start: int, piece: int) -> str:
    """CRC-32 (8 hex digits) of the `piece` bytes of `file` from `start` (fewer at its end), read in
    16 MiB blocks (zlib and the reads release the GIL: threads run side by side, and an async save's
    thread does not stall the training loop)."""
    crc, block, done = 0, bytearray(16 << 20), 0
    with open(file, "rb", buffering=0) as handle:
        handle.seek(start)
        while done < piece and (read := handle.readinto(memoryview(block)[:min(len(block), piece - done)])):
            crc, done = zlib.crc32(memoryview(block)[:read], crc), done + read
    return f"{crc:08x}"


def _crcs(directory: str, names: list[str], piece: int) -> dict[str, dict]:
    """Each named file's size and CRC-32 per `piece` bytes (`{"bytes": n, "crc32": [...]}`, one CRC for
    an empty file), computed by up to 8 threads (plain threads, not concurrent.futures: an async save
    may checksum at interpreter exit; where no thread can be started, this one reads them all).
    Raises what reading a piece raised."""
    sizes = {name: os.path.getsize(os.path.join(directory, name)) for name in names}
    pieces = [(name, start) for name in names for start in range(0, max(sizes[name], 1), piece)]
    crcs, failures, taken = [None] * len(pieces), [], iter(range(len(pieces)))
    lock = threading.Lock()

    def work():
        while not failures:
            with lock:
                index = next(taken, None)
            if index is None:
                return
            try:
                crcs[index] = _piece_crc(os.path.join(directory, pieces[index][0]), pieces[index][1], piece)
            except BaseException as error:  # noqa: BLE001  handed to the caller: no piece left unchecked
                failures.append(error)
    threads = []
    for _ in range(min(8, os.cpu_count() or 1, len(pieces)) - 1):
        thread = threading.Thread(target=work, name="fxshard-crc", daemon=True)
        try:
            thread.start()
        except RuntimeError:  # no new thread (a process limit, or Python 3.12.0-1 at exit): fewer readers
            break
        threads.append(thread)
    work()  # this thread reads too
    for thread in threads:
        thread.join()
    if failures:
        raise failures[0]
    result = {name: {"bytes": sizes[name], "crc32": []} for name in names}
    for (name, _), crc in zip(pieces, crcs):
        result[name]["crc32"].append(crc)
    return result


def _share(files: list[str], rank: int, world: int) -> list[str]:
    """The files rank `rank` of `world` checksums: every world-size-th, so the ranks read each file once."""
    return files[rank::world]


def _checksums(directory: str, group, distributed: bool) -> dict:
    """`{"algorithm": "crc32", "piece": PIECE, "files": {name: {"bytes", "crc32": [per piece]}}}` of
    the files DCP wrote into `directory`, each rank reading its share; every rank gets the whole map
    (collective where `distributed`), or every rank raises FxShardError where one could not read."""
    world = _world_size() if distributed else 1
    try:
        metadata, problem = _metadata(directory)
        if problem:
            raise OSError(problem)
        mine = _crcs(directory, _share(_checkpoint_files(metadata), _rank(), world), PIECE)
    except Exception as error:  # noqa: BLE001  gathered like a result: every rank raises, none waits for this one
        mine = f"rank {_rank()} could not checksum what it wrote: {type(error).__name__}: {error}"
    everyone = [mine]
    if distributed:
        import torch.distributed as dist

        everyone = [None] * world
        dist.all_gather_object(everyone, mine, group=group)
    failed = next((part for part in everyone if isinstance(part, str)), None)
    if failed is not None:
        raise FxShardError(f"checksumming the checkpoint written to {directory}: {failed}; the checkpoint it "
                           f"replaces is unchanged")
    return {"algorithm": "crc32", "piece": PIECE, "files": {name: crcs for part in everyone for name, crcs in part.items()}}


def _manifest_crc(manifest: dict) -> str:
    """The CRC-32 of the manifest's own content (without this field), as canonical JSON: a flipped
    digit in the step count or a checksum is caught, not only text that is no longer JSON."""
    content = json.dumps({k: v for k, v in manifest.items() if k != "manifest_crc32"}, sort_keys=True)
    return f"{zlib.crc32(content.encode()):08x}"


def _recorded_checksums(manifest: dict) -> tuple[dict | None, int, str | None]:
    """(the manifest's checksums by file, their piece size, None), (None, 0, None) for a checkpoint
    written before 2026-12-01 (none recorded), or (None, 0, why they cannot be used)."""
    checksums = manifest.get("checksums")
    if checksums is None:
        return None, 0, None
    unreadable = f"{MANIFEST} records checksums this fxshard cannot read ({str(checksums)[:80]})"
    if not isinstance(checksums, dict) or checksums.get("algorithm") != "crc32":
        return None, 0, unreadable
    piece, files = checksums.get("piece"), checksums.get("files")
    if not isinstance(piece, int) or isinstance(piece, bool) or piece < 1 or not isinstance(files, dict):
        return None, 0, unreadable
    for name, entry in files.items():
        size = entry.get("bytes") if isinstance(entry, dict) else None
        crcs = entry.get("crc32") if isinstance(entry, dict) else None
        if not isinstance(size, int) or size < 0 or not isinstance(crcs, list) or \
                len(crcs) != max(1, -(-size // piece)) or \
                not all(isinstance(c, str) and len(c) == 8 and all(ch in "0123456789abcdef" for ch in c) for c in crcs):
            return None, 0, f"{MANIFEST} records an unreadable checksum for {name} ({str(entry)[:80]})"
    return files, piece, None


def _changed_files(path: str, recorded: dict, piece: int, names: list[str]) -> str | None:
    """Why a file of `names` is not as the save wrote it (its size, or a piece's CRC-32), or None."""
    present = [name for name in names if os.path.isfile(os.path.join(path, name))]
    if len(present) < len(names):
        return f"{next(name for name in names if name not in present)} is missing"
    for name in names:
        size, saved = os.path.getsize(os.path.join(path, name)), recorded[name]["bytes"]
        if size != saved:
            return (f"{name} is {'truncated' if size < saved else 'not the file the save wrote'}: {size} bytes, "
                    f"{saved} when saved")
    try:
        found = _crcs(path, names, piece)  # in the saving fxshard's pieces
    except Exception as error:  # noqa: BLE001
        return f"its files cannot be read ({type(error).__name__}: {error})"
    for name in names:
        ours, theirs = found[name]["crc32"], recorded[name]["crc32"]
        wrong = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
        if wrong is not None:
            return (f"{name} is not the file the save wrote (CRC-32 {ours[wrong]} of bytes {wrong * piece}-"
                    f"{min((wrong + 1) * piece, found[name]['bytes']) - 1}, recorded {theirs[wrong]}): it changed on "
                    f"disk since")
    return None


def load(step, path: str | os.PathLike):
    """Load a checkpoint written by `save` (under any mesh) into `step`; returns this rank's `extra`
    (rank 0's where the saving job had fewer ranks). Every rank calls it. On any error the step is
    left unchanged and every rank raises `FxShardError`."""
    require_step(step, "load")
    path = path_argument(path, "load")
    started = time.perf_counter()
    step._refuse_if_aborted()  # its process groups cannot be trusted: a load's collectives would pair with a stuck peer

    def checks():
        nonlocal started
        resolved = _resolve(_real(path))
        pending, step._pending_save = getattr(step, "_pending_save", None), None
        if pending is not None and not pending.reported:  # as save: a failure its wait() raised is not raised again
            try:
                pending.wait()
            except Exception as error:  # noqa: BLE001
                raise FxShardError(f"an earlier asynchronous save failed, so this load did not start (call load "
                                   f"again): {error}") from error
        started = time.perf_counter()  # the load's own time, not the earlier save's it waited for
        manifest, metadata = _read_checks(resolved, _rank(), _world_size())
        expected, conversions = _expected_keys(step, manifest)
        _check_keys(step, resolved, manifest, metadata.state_dict_metadata, expected)
        for layer in conversions:
            layer.check_shapes(resolved, metadata.state_dict_metadata)
        return resolved, manifest, metadata, conversions
    path, manifest, metadata, conversions = _on_every_rank(checks, f"load {path}", _job(step))
    _check_same_checkpoint(path, manifest, _job(step))
    state, copies = staging_state_dict(step)
    for key in _unread_state(step.programs[0]) - set(metadata.state_dict_metadata):
        state.pop(key, None)  # saved by a layout none of whose programs held it: this step's value stays
    for layer in conversions:
        for key in layer.ours:
            state.pop(key, None)  # the pieces of it this rank holds come from the conversion
        state.update({key: torch.empty(metadata.state_dict_metadata[key].size,
                                       dtype=metadata.state_dict_metadata[key].properties.dtype)
                      for key in layer.theirs})
    saved = metadata.state_dict_metadata
    own_extra = extra_key(_rank()) if extra_key(_rank()) in saved else extra_key(0)
    objects = [own_extra] + ([rng_key(step.rank)] if rng_key(step.rank) in saved else [])
    own = _own_buffer_keys(step, manifest, saved)
    objects += own
    state.update({key: None for key in objects})
    with _quiet(_is_distributed()), _as_fxshard_error(f"reading {path}; the step is unchanged"):
        dcp.load(state, storage_reader=dcp.FileSystemReader(path), planner=LoadPlanner(),  # waits for every
                 no_dist=not _is_distributed())  # rank's reads: the default group's timeout, not the step's
    for layer in conversions:
        layer.apply(step, state, copies)
    _on_every_rank(lambda: _refuse_nonfinite(copies, path), f"load {path}", _job(step))
    buffers = {name: value for key in own for name, value in state[key].items()
               if name not in step.transient_buffers}  # persistent=False: not loaded (an older checkpoint has them)
    apply_loaded(step, copies, state[PROGRESS], state.get(rng_key(step.rank)), buffers)
    if rng_key(step.rank) not in saved:
        warnings.warn(f"fxshard: {path} holds no random state for rank {step.rank} (the saving job had fewer "
                      f"ranks): this rank keeps its generators' own state, and its extra is rank 0's. Stages of a "
                      f"pipeline that draw batches from torch's generator then draw different ones; keep the data "
                      f"loader's state in extra instead", stacklevel=2)
    extra = state.get(own_extra)
    _report(f"loaded {path} (step {manifest.get('step_count')})", started)
    return pickle.loads(extra) if manifest.get("extra") == "pickled" and extra is not None else extra


def _job(step):
    """The step's group of every rank that times out after Config(collective_timeout_s) (None: the
    default group, as for a step built without fxshard.shard), for the agreements before and after a
    save's or load's I/O; the I/O's own collectives (DCP's, the staging barriers) wait on the default
    group, as long as the slowest rank's disk takes."""
    return getattr(step, "job_group", None)


def _check_same_checkpoint(path: str, manifest: dict, group=None) -> None:
    """Raise FxShardError on every rank where the ranks resolved different checkpoints (each its own
    "latest", or a path that differs by rank): their pieces would make one mixed state, at different
    step counts, silently. Compared by the manifest, which names the save (`save_id`)."""
    if not _is_distributed():
        return
    import torch.distributed as dist

    from ..runtime.agreement import waiting_for_peers

    mine = (json.dumps({k: v for k, v in manifest.items() if k != "seconds_to_write"}, sort_keys=True),
            path, manifest.get("step_count"))
    everyone = [None] * dist.get_world_size()
    with waiting_for_peers("the comparison of the checkpoints they load", group):
        dist.all_gather_object(everyone, mine, group=group)
    other = next((rank for rank, theirs in enumerate(everyone) if theirs[0] != everyone[0][0]), None)
    if other is not None:
        raise FxShardError(f"the ranks were given different checkpoints: rank 0 loads {everyone[0][1]} (step "
                           f"{everyone[0][2]}), rank {other} {everyone[other][1]} (step {everyone[other][2]}); every "
                           f"rank must load the same one (resolve the path once, e.g. on rank 0, and broadcast it). "
                           f"The steps are unchanged")


def _sizes(mesh) -> dict[str, int]:
    """The mesh's pipeline and data-parallel sizes, as the manifest records them."""
    return {"pp": mesh.pp if mesh is not None else 1, "dp": mesh.dp if mesh is not None else 1}


def _own_buffer_keys(step, manifest: dict, saved) -> list[str]:
    """The keys of the saved per-rank copies of updated buffers (`buffers_key`) that are this rank's own.
    Each data-parallel rank updates them from its own batches, and a pipeline stage holds only its
    layers': so, where the saving job had as many data-parallel ranks, the copies of every saved rank
    at this rank's data-parallel index (whatever the stages or their cut); otherwise none, and the
    first dp rank's copy in `model.<name>` stays. A checkpoint without `sizes` (before session 50)
    gives this rank its own rank's copy under the same mesh only."""
    sizes = manifest.get("sizes")
    if not isinstance(sizes, dict):
        same = manifest.get("mesh") == step.mesh_description and buffers_key(step.rank) in saved
        return [buffers_key(step.rank)] if same else []
    if sizes.get("dp") != _sizes(step.mesh)["dp"]:
        return []
    dp, index = sizes["dp"], step.coords.get("dp", 0)
    return [key for key in (buffers_key(stage * dp + index) for stage in range(int(sizes.get("pp", 1))))
            if key in saved]


def read_tensors(path: str | os.PathLike, prefix: str = "") -> dict[str, torch.Tensor]:
    """The checkpoint's global tensors whose keys start with `prefix` (`model.`, `optim.`), whole, on
    the CPU of this one process (for inspection, conversion, tests): any layout saved them."""
    path = _resolve(_real(path))
    _, metadata = _read_checks(path)
    state = {key: torch.empty(value.size, dtype=value.properties.dtype)
             for key, value in metadata.state_dict_metadata.items()
             if key.startswith(prefix) and key.startswith(("model.", "optim."))}
    with _quiet(False):
        dcp.load(state, storage_reader=dcp.FileSystemReader(path), planner=LoadPlanner(), no_dist=True)
    return state


def require_step(step, what: str) -> None:
    """FxShardError unless `step` is what fxshard.shard returned (a model given instead, say)."""
    from ..runtime.step import CompiledStep

    if not isinstance(step, CompiledStep):
        raise FxShardError(f"fxshard.{what} takes the step fxshard.shard returned, got {type(step).__name__}; "
                           f"the step holds the trained state (the model keeps its initial weights)")


def path_argument(path, what: str):
    if not isinstance(path, (str, os.PathLike)):
        raise FxShardError(f"fxshard.{what} takes a directory path (str or os.PathLike), got {type(path).__name__}")
    return path


def _real(path: str | os.PathLike) -> str:
    """The directory a checkpoint path names: "ckpt/" is "ckpt" (its ".partial" and ".previous" are
    siblings, not inside), and a symbolic link is its target (a save replaces the directory the link
    points to, beside it, and the link stays; renaming the link itself would move the checkpoint off
    the filesystem it points to and break the next save)."""
    return os.path.realpath(os.fspath(path))


def _resolve(path: str) -> str:
    if os.path.isdir(path):
        return path
    if os.path.isdir(f"{path}.previous"):  # a save was killed while swapping the new one in
        print(f"fxshard: {path} is missing but {path}.previous is complete (a save was interrupted while "
              f"replacing it); loading that", file=sys.stderr)
        return f"{path}.previous"
    hint = f" ({path}.partial is an interrupted save, not loadable)" if os.path.isdir(f"{path}.partial") else ""
    raise FxShardError(f"no checkpoint at {path}{hint}; pass the directory fxshard.save wrote")


def _read_checks(path: str, rank: int = 0, world: int = 1):
    """The checkpoint's manifest and DCP metadata, after checking that it is complete and its files
    are the ones the save wrote: the manifest against its own CRC, `.metadata` against its CRC before
    it is unpickled, then (this rank's share of) the data files; FxShardError naming what is damaged.
    A checkpoint written before 2026-12-01 has no checksums: only its completeness is checked."""
    manifest_file = os.path.join(path, MANIFEST)
    if not os.path.isfile(manifest_file):
        raise FxShardError(f"{path} is not a complete fxshard checkpoint (no {MANIFEST}: the save that wrote it did "
                           f"not finish, or it is not an fxshard checkpoint); load an earlier one")

    def damaged(problem):
        return FxShardError(f"{path} is damaged: {problem}; load an earlier checkpoint")
    with open(manifest_file, "rb") as handle:
        try:
            manifest = json.loads(handle.read().decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise damaged(f"{MANIFEST} is not JSON ({error})") from error
    if not isinstance(manifest, dict):
        raise damaged(f"{MANIFEST} holds {type(manifest).__name__}, not fxshard's object")
    if "manifest_crc32" in manifest and manifest["manifest_crc32"] != _manifest_crc(manifest):
        raise damaged(f"{MANIFEST} changed after the save (its own checksum differs)")
    if manifest.get("format") != FORMAT:
        raise FxShardError(f"{path} has checkpoint format {manifest.get('format')}; this fxshard reads {FORMAT}")
    recorded, piece, problem = _recorded_checksums(manifest)
    if recorded is not None and ".metadata" not in recorded:
        problem = f"{MANIFEST} records no checksum of .metadata"
    if recorded is not None and not problem:
        problem = _changed_files(path, recorded, piece, [".metadata"])  # on every rank: it is unpickled next
    if problem:
        raise damaged(problem)
    metadata, problem = _metadata(path)
    if problem:
        raise damaged(problem)
    files = _checkpoint_files(metadata)
    if recorded is not None:
        unrecorded = sorted(set(files) - set(recorded))
        if unrecorded:
            raise damaged(f"{unrecorded[0]} has no checksum in {MANIFEST} (the files do not belong together)")
    problem = _missing_items(path, metadata)
    if not problem and recorded is not None:
        problem = _changed_files(path, recorded, piece, _share([f for f in files if f != ".metadata"], rank, world))
    if problem:
        raise damaged(problem)
    return manifest, metadata


class _ExpertConversion:
    """An expert layer saved in another layout (grouped/indexed keys, GLU interleaving): its saved
    tensors are read whole and converted, in global coordinates, before this rank takes its pieces."""

    def __init__(self, prefix: str, theirs: ExpertLayout, ours: ExpertLayout, experts: int, keys: dict,
                 shapes: dict):
        self.prefix, self.source, self.target, self.experts = prefix, theirs, ours, experts
        self.groups = keys  # tensor group ("model" or a slot) -> (our keys, their keys), relative names
        self.ours = [k for group in keys.values() for k in group[0].values()]
        self.shapes = {key: shapes[key] for key in self.ours if key in shapes}  # our key -> global shape
        self.theirs = [k for group in keys.values() for k in group[1].values()]

    def check_shapes(self, path: str, saved: dict) -> None:
        """Raise, before anything is read, if the saved tensors do not convert into the shapes this
        step holds (another model's experts): the conversion runs on meta tensors of the saved shapes."""
        wrong, expected = [], self.shapes
        for our_keys, their_keys in self.groups.values():
            tensors = {rel: torch.empty(saved[key].size, dtype=saved[key].properties.dtype, device="meta")
                       for rel, key in their_keys.items() if key in saved}
            try:
                converted = convert_expert_tensors(tensors, self.source, self.target, self.experts, self.prefix)
            except (FxShardError, RuntimeError, IndexError, ValueError) as error:
                wrong.append(f"{self.prefix}: {error}")
                continue
            wrong += [f"{our_keys[rel]} {tuple(value.shape)} != {tuple(expected[our_keys[rel]])}"
                      for rel, value in converted.items()
                      if our_keys.get(rel) in expected and tuple(value.shape) != tuple(expected[our_keys[rel]])]
        if wrong:
            raise FxShardError(f"{path} is a checkpoint of another model: its experts of {self.prefix!r}, converted from "
                               f"the saved layout, do not fit this model's ({'; '.join(wrong[:4])}). Shard the model "
                               f"it was saved from (same config)")

    def apply(self, step, state: dict, copies: dict) -> None:
        full = {}
        for our_keys, their_keys in self.groups.values():
            tensors = {rel: state[key] for rel, key in their_keys.items()}
            converted = convert_expert_tensors(tensors, self.source, self.target, self.experts, self.prefix)
            full.update({our_keys[rel]: value for rel, value in converted.items()})
        load_state_dict_into(step, full, copies)


def _layer_keys(layout: ExpertLayout, experts: int, bias: bool) -> list[str]:
    names = ["weight"] + (["bias"] if bias else []) if layout.keys == "grouped" else \
        [f"weight{e}" for e in range(experts)] + ([f"bias{e}" for e in range(experts)] if bias else [])
    return names


def _expected_keys(step, manifest) -> tuple[dict, list[_ExpertConversion]]:
    """Key -> global shape this step needs from the checkpoint (None: shape decided by a conversion),
    and the expert layers to convert."""
    transient = {model_key(name) for name in step.transient_buffers}  # persistent=False: not saved, not loaded
    shapes = {key: shape for key, (shape, _) in global_tensors(step.programs[0]).items() if key not in transient}
    expected = dict(shapes)
    saved_layouts = manifest.get("expert_layouts", {})
    conversions = []
    for prefix, (layout, experts) in step.expert_layouts.items():
        if prefix not in saved_layouts or ExpertLayout.from_dict(saved_layouts[prefix]) == layout:
            continue
        theirs = ExpertLayout.from_dict(saved_layouts[prefix])
        bias = model_key(f"{prefix}bias" if layout.keys == "grouped" else f"{prefix}bias0") in expected
        ours_rel, theirs_rel = _layer_keys(layout, experts, bias), _layer_keys(theirs, experts, bias)
        groups = {"model": ({r: model_key(prefix + r) for r in ours_rel}, {r: model_key(prefix + r) for r in theirs_rel})}
        for slot in step.optimizer.slots:
            groups[slot] = ({r: optimizer_key(prefix + r, slot) for r in ours_rel},
                            {r: optimizer_key(prefix + r, slot) for r in theirs_rel})
        conversion = _ExpertConversion(prefix, theirs, layout, experts, groups, shapes)
        for key in conversion.ours:
            expected.pop(key, None)
        expected.update({key: None for key in conversion.theirs})
        conversions.append(conversion)
    return expected, conversions


def _unread_state(traced) -> set[str]:
    """Model keys of parameters and buffers the traced step neither reads nor updates (transformers'
    `rotary_emb.original_inv_freq`): no pipeline stage holds them, so a checkpoint saved under a
    pipeline lacks them, and their value changes nothing the step computes."""
    from ..program import InputKind, OutputKind

    updated = {spec.name for spec in traced.outputs if spec.kind in (OutputKind.PARAM, OutputKind.BUFFER)}
    return {model_key(spec.name) for spec, node in zip(traced.inputs, traced.placeholders())
            if spec.kind in (InputKind.PARAM, InputKind.BUFFER) and not node.users and spec.name not in updated}


def _refuse_nonfinite(copies: dict, path: str) -> None:
    """FxShardError for a loaded parameter or optimizer slot with a NaN or inf (a damaged file, or a save
    after an update that made it so): training from it would fail steps later, blaming the batch."""
    from ..program import InputKind

    for (kind, name), value in copies.items():
        if kind in (InputKind.PARAM, InputKind.OPT_STATE) and value.is_floating_point() and \
                not bool(torch.isfinite(value).all()):
            raise FxShardError(f"{path} holds values that are not finite in {kind.value} {name!r} (this rank's part): "
                               f"the checkpoint is damaged, or was saved after an update that made them so; the step "
                               f"is unchanged. Load an earlier checkpoint")


def _on_every_rank(check, what: str, group=None):
    """`check()`'s result; its FxShardError raised on every rank of a job, not only this one: where
    one rank's checks fail, the others would otherwise wait in DCP's collectives for it."""
    error, result = None, None
    try:
        result = check()
    except FxShardError as raised:
        error = raised
    if _is_distributed():
        from ..runtime.agreement import fail_together

        fail_together(error, what, group)
    if error is not None:
        raise error
    return result


def _check_keys(step, path, manifest, saved: dict, expected: dict) -> None:
    """Raise, naming them, for keys missing from the checkpoint, keys it has that the step lacks,
    shapes that differ, and another optimizer's state."""
    theirs_opt, ours_opt = manifest.get("optimizer"), type(step.optimizer).__name__
    if list(manifest.get("slots", [])) != list(step.optimizer.slots):
        raise FxShardError(f"{path} holds {theirs_opt} state (slots {manifest.get('slots')}), this step trains with "
                           f"{ours_opt} (slots {list(step.optimizer.slots)}); shard with the optimizer it was saved "
                           f"with")
    tensors = {key: value for key, value in saved.items() if key.startswith(("model.", "optim."))}
    empty = {key for key, shape in expected.items() if shape is not None and math.prod(shape) == 0}
    missing = sorted(set(expected) - set(tensors) - empty - _unread_state(step.programs[0]))  # no rank writes an empty tensor
    # a checkpoint from before session 50 holds the persistent=False buffers, which are not loaded
    unexpected = sorted(set(tensors) - set(expected) - {model_key(name) for name in step.transient_buffers})
    mis_shaped = sorted(f"{key} {tuple(tensors[key].size)} != {tuple(shape)}" for key, shape in expected.items()
                        if shape is not None and key in tensors and tuple(tensors[key].size) != tuple(shape))
    problems = key_differences(missing, unexpected, mis_shaped)
    # only optimizer slots differ, of parameters both have: the set of trainable parameters changed
    trained_then = {k.split(".", 1)[1].rsplit(".", 1)[0] for k in unexpected if k.startswith("optim.")}
    trained_now = {k.split(".", 1)[1].rsplit(".", 1)[0] for k in missing if k.startswith("optim.")}
    if problems and not mis_shaped and all(k.startswith("optim.") for k in missing + unexpected) and \
            all(model_key(name) in tensors for name in trained_then | trained_now):
        said = [f"frozen now, trained when saved: {', '.join(sorted(trained_then)[:4])}" if trained_then else "",
                f"trained now, frozen when saved: {', '.join(sorted(trained_now)[:4])}" if trained_now else ""]
        raise FxShardError(f"{path} was saved with other parameters frozen (requires_grad) than this step's "
                           f"({'; '.join(t for t in said if t)}): their optimizer state does not fit. Freeze the "
                           f"same parameters as when it was saved, or load the weights alone with fxshard.load_hf")
    if problems:
        raise FxShardError(f"{path} is a checkpoint of another model: {problems}. Shard the model it was "
                           f"saved from (same config), or load weights by name with fxshard.load_hf")


@contextlib.contextmanager
def _as_fxshard_error(what: str):
    """DCP's failures (a rank's I/O error, gathered onto every rank) as FxShardError, saying what
    was left as it was."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as error:  # its str is every rank's traceback: name each rank's error
        causes = "; ".join(f"rank {rank}: {type(failure[0]).__name__}: {failure[0]}"
                           for rank, failure in sorted(error.failures.items()))
        raise FxShardError(f"{what}: {causes[:1500]}") from error
    except OSError as error:
        raise FxShardError(f"{what}: {str(error).strip()[:1500]}") from error


@contextlib.contextmanager
def _quiet(distributed: bool):
    """One process without torch.distributed is a normal fxshard job: DCP need not warn about it.
    Only on the main thread: `warnings.catch_warnings` swaps the process's filter list and puts it back
    on exit, so on an async save's thread it could undo filters the training loop sets meanwhile (an
    async single-process save instead adds a filter for that one message before its thread starts)."""
    if distributed or threading.current_thread() is not threading.main_thread():
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_WARNING)
        yield


_SINGLE_PROCESS_WARNING = "torch.distributed is disabled, unavailable or uninitialized, assuming the intent is to"


def _is_distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if _is_distributed() else 0


def _world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if _is_distributed() else 1


def _barrier(group, distributed: bool) -> None:
    if distributed:
        import torch.distributed as dist

        dist.barrier(group=group)

