import importlib.util
import os

# Inductor checks each vector ISA the CPU reports by compiling a probe library and loading it in a
# child interpreter, once in every process that compiles: 19 s cold and 4 s warm on the 2-core CI
# machine, paid by each pytest-xdist worker and each gloo rank of the codegen tests. With gcc 12 every
# probe there passes, so the tests take the CPU's report as it stands (`TORCHINDUCTOR_VEC_ISA_OK=1`:
# the same ISAs, none built). Where the compiler lacks one, the codegen tests would fall back to aten
# and fail: export TORCHINDUCTOR_VEC_ISA_OK=probe to run the probes.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

# Tracing costs about a second per example: keep property tests to a handful of examples by default
# (FXSHARD_HYPOTHESIS=thorough runs more).
settings.register_profile("ci", max_examples=6, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("thorough", max_examples=60, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("FXSHARD_HYPOTHESIS", "ci"))

# Under pytest-xdist (the README's `-n 2`), the workers share the cores: one intra-op thread pool of
# the machine's size in each would fight over them (the gloo ranks size theirs in fxshard.launch).
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))


@pytest.fixture
def stream_writes(monkeypatch):
    """The stream memory writes (cuStreamWriteValue32) fxshard's runtime makes, recorded as (stream,
    address, value, flags) on a fake current stream 7: the CUDA calls a CPU test can check."""
    from fxshard.runtime import copy_engine

    calls = []

    def write(stream, address, value, flags):
        calls.append((stream, address, value, flags))
        return 0
    monkeypatch.setattr(copy_engine, "_stream_memory_operations", lambda: (write, None))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: type("Stream", (), {"cuda_stream": 7})())
    return calls


# Tests on real processes (several ranks each, 10-90 s on the 2-core CI machine) run first: under
# pytest-xdist the short in-process tests then fill both workers to the end, where a long test
# started last would leave one worker idle.
LONG_FIRST = ("_gloo.py", "test_train_example.py")
# Tests that must run on one pytest-xdist worker, in one unit: a module fixture that trains every
# case in one spawn serves them (split over two workers, each would train the whole matrix).
ONE_WORKER = ("tests/test_parity_models_gloo.py::test_distributed",)


def pytest_collection_modifyitems(config, items):
    has_gpu = torch.cuda.is_available()
    gpus = torch.cuda.device_count() if has_gpu else 0
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if "multigpu" in item.keywords and gpus < 2:
            item.add_marker(pytest.mark.skip(reason="needs at least 2 CUDA GPUs"))
    items.sort(key=lambda item: not item.path.name.endswith(LONG_FIRST))  # stable: the order within each part


if importlib.util.find_spec("xdist") is not None:
    def pytest_xdist_make_scheduler(config, log):
        """Under `-n N`: xdist's scheduling by scope, where a scope is one test, or all the tests under
        one ONE_WORKER prefix. (xdist's own `--dist loadgroup` groups by a suffix it writes into each
        test's id, which pytest 9 no longer lets it write: the groups it makes are single tests.)"""
        from xdist.scheduler import LoadScopeScheduling

        if config.getvalue("dist") not in ("load", "loadgroup"):
            return None  # the user asked for another distribution: xdist's own

        class OneWorkerGroups(LoadScopeScheduling):
            def _split_scope(self, nodeid: str) -> str:
                return next((prefix for prefix in ONE_WORKER if nodeid.startswith(prefix)), nodeid)

        return OneWorkerGroups(config, log)
