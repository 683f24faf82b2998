import gc
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import plasticity_callbacks

sys.path.insert(0, str(Path(__file__).parent))  # tiny.py, ddp_harness.py

# Two cores: one intra-op thread per test process keeps timings stable and leaves room for DDP ranks.
torch.set_num_threads(1)

# A test that starts a process carries one of these markers (pyproject.toml registers them), so that
# `pytest -m "not multiprocess and not cli"` runs exactly the in-process tests (`and not slow`: the fast ones).
PROCESS_MARKERS = ("multiprocess", "cli")
OURS = (Path(__file__).resolve().parent, Path(plasticity_callbacks.__file__).resolve().parent)  # tests, package


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


_running: list[pytest.Item] = []  # the test being set up, run or torn down (module fixtures start in its set-up)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _running.append(item)
    try:
        return (yield)
    finally:
        _running.pop()
        if nextitem is None or getattr(nextitem, "module", None) is not getattr(item, "module", None):
            freeze_what_lives()  # the module's fixtures are torn down: what is left lives on


@pytest.fixture(autouse=True, scope="session")
def _processes_only_where_marked():
    """A process started by this folder's or the package's code while an unmarked test is set up (its module
    and session fixtures included), run or torn down fails that test, naming the marker to add, so the fast
    subset stays in-process; a library's helper (a compiler that ``torch.compile`` calls) is not such a process."""
    start = subprocess.Popen._execute_child

    def refuse_ours(self, args, *rest, **kwargs):
        item = _running[-1] if _running else None
        if item is None or any(item.get_closest_marker(name) for name in PROCESS_MARKERS):
            return start(self, args, *rest, **kwargs)
        caller = sys._getframe(1)
        while caller is not None and Path(caller.f_code.co_filename).name == "subprocess.py":
            caller = caller.f_back
        if caller is not None and any(Path(caller.f_code.co_filename).resolve().is_relative_to(d) for d in OURS):
            command = " ".join(map(str, args)) if isinstance(args, (list, tuple)) else str(args)
            pytest.fail(f"{item.nodeid} starts a process ({command[:120]}), in its own code or a fixture it uses: "
                        "mark it @pytest.mark.cli (runs a command) or @pytest.mark.multiprocess (trains on several "
                        "processes)", pytrace=False)
        return start(self, args, *rest, **kwargs)

    subprocess.Popen._execute_child = refuse_ours
    yield
    subprocess.Popen._execute_child = start


@pytest.fixture(scope="session")
def _ddp_launch(request, tmp_path_factory):
    """One DDP launch for the ``ddp_run`` runs of every test this session selected (``ddp_harness.py``)."""
    from ddp_harness import SharedLaunch, ddp_spec

    runs = {}
    for item in request.session.items:
        marker = item.get_closest_marker("ddp_run")
        if marker is not None:
            runs[item.nodeid] = ddp_spec(*marker.args, **marker.kwargs)
    return SharedLaunch(tmp_path_factory.mktemp("ddp"), runs)


@pytest.fixture
def ddp_run(request, _ddp_launch):
    """This test's DDP run (its ``ddp_run`` marker: ``ddp_harness.ddp_spec``'s arguments), each rank's results."""
    if request.node.get_closest_marker("ddp_run") is None:
        pytest.fail(f"{request.node.nodeid} uses the ddp_run fixture without a @pytest.mark.ddp_run(...) marker")
    return _ddp_launch[request.node.nodeid]


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Under ``pytest -n 2 --dist loadgroup`` (CI) the ``ddp_run`` tests of every file run on one worker, since
    their runs share one launch, and a file's process-starting tests on one worker, since they share its module
    fixtures (an FSDP2 launch, a stopped run); the in-process tests go to whichever worker is free."""
    if not config.getoption("loadgroup", False):  # xdist sets it on each worker under --dist loadgroup
        return
    for item in items:
        if item.get_closest_marker("ddp_run"):
            item.add_marker(pytest.mark.xdist_group("ddp_launch"))
        elif any(item.get_closest_marker(name) for name in PROCESS_MARKERS):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))


def pytest_collection_finish(session):
    freeze_what_lives()


def freeze_what_lives():
    """Collect, then leave what survives out of every later garbage collection (``gc.freeze``).

    What collection imported (torch, Lightning, transformers, Hydra: half a million objects and more), and what
    a test file leaves behind (modules it imported, caches), lives until the session ends, yet every full
    collection would walk it again: Python's own, and those libraries ask for (accelerate's ``free_memory`` as
    each Hugging Face ``Trainer.train`` starts, pytest's at exit), up to half a CPU-second each. Frozen after
    collection and after each test file, a collection walks only what the current file made. (A frozen object
    that a later reference cycle drops is not freed: what a test file leaves are modules and caches, which stay.)"""
    gc.collect()
    gc.freeze()
