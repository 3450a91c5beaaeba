"""GPU tests run on every rank at once, under the launcher:

    python -m cupyep.launcher.gpu_tests          # 2, 4 and 8 ranks (MPS when they share a GPU)

Each test is collective: all ranks run the same tests in the same order.
Without a GPU (or outside MPI) they skip.
"""
import os
import sys

import pytest

from cupyep.runtime import gpu_count

TEST_TIMEOUT_S = float(os.environ.get("CUPYEP_TEST_TIMEOUT_S", "5"))


def pytest_collection_modifyitems(config, items):
    if gpu_count() == 0:
        skip = pytest.mark.skip(reason="no CUDA GPU")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


def pytest_runtest_logreport(report):
    """Print a failure on stderr the moment it happens, with the rank: when
    one rank fails a collective test the others may hang until the launcher's
    timeout kills them all, before pytest's summary would have printed it."""
    if report.failed:
        from cupyep.launcher.calls import env_rank
        rank = env_rank()
        sys.stderr.write(f"\n[rank {rank}] FAILED {report.nodeid} ({report.when})\n{report.longreprtext}\n")
        sys.stderr.flush()


@pytest.fixture(scope="session")
def group():
    import cupyep
    g = cupyep.init(timeout_s=TEST_TIMEOUT_S)
    yield g
    g.comm.Barrier()
    g.destroy()


@pytest.fixture(scope="session")
def nvshmem_session(group):
    """NVSHMEM for the whole session (it starts once per process): tests that
    need it take this fixture; cupyep.nvshmem.init/finalize inside them only
    count references. Skips without nvshmem4py."""
    pytest.importorskip("nvshmem.core")
    from cupyep import nvshmem as NV

    NV.init(group)
    yield
    group.comm.Barrier()
    NV.finalize()


@pytest.fixture(autouse=True)
def _clean_error_slot(request):
    """Tests that provoke timeouts reset the slot; make sure none leaks."""
    yield
    if "gpu" in request.keywords and "group" in request.fixturenames:
        g = request.getfixturevalue("group")
        g.check_errors()
