"""Shared fixtures: run a test body on every transport, and check that no
process outlives the test (the runtime's promise, checked after every test)."""

import time

import pytest

import macroflow as mf
from common import our_processes
from macroflow.transport import mpi as _mpi

TRANSPORTS = ["inproc", "local", "tcp"]
#: why the mpi transport cannot run here (mpi4py or mpiexec missing), or None
MPI_MISSING = _mpi.available()
if MPI_MISSING is None:
    TRANSPORTS.append("mpi")


@pytest.fixture(params=TRANSPORTS)
def transport(request):
    """The name of a transport; a test using it runs once per transport."""
    return request.param


@pytest.fixture
def run(transport):
    """``run(main, contexts=N, **kw)``: mf.run on the test's transport."""

    def _run(main, *args, contexts=3, **kw):
        return mf.run(main, *args, contexts=contexts, transport=transport, **kw)

    return _run


@pytest.fixture(autouse=True)
def no_leftover_processes():
    yield
    mf.shutdown()
    left = our_processes()  # spawned MPI ranks included
    # a spawned MPI rank may still be on its way out (its job has let it go;
    # MPI's process manager reaps it): left behind is one that stays
    deadline = time.monotonic() + 5
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = our_processes()
    assert left == [], f"processes left behind: {left}"
