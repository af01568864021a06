"""Shared fixtures: run a test body on every transport, and check that no
process outlives the test (the runtime's promise, checked after every test)."""

import signal
import time

import pytest

import macroflow as mf
from common import our_processes
from macroflow.transport import mpi as _mpi

# A suite started in the background by a shell without job control inherits
# SIGINT ignored, and so would every program the tests start (Python installs
# no KeyboardInterrupt handler then): the tests that send Ctrl-C could not.
# A handler of our own is reset to the default in the programs we start.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

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
    _clear(left)  # (so that one test's leftovers fail it alone, not the tests after it)
    assert left == [], f"processes left behind: {left}"


def _clear(left) -> None:
    """Kill what a test left running and reap this process's children that
    have ended (a test that failed before it waited for its subprocess)."""
    import os
    import signal
    for p in left:
        try:
            p.send_signal(signal.SIGKILL)
        except Exception:
            pass
    for p in our_processes(zombies=True):
        try:
            if p.ppid() == os.getpid():
                p.wait(5)
        except Exception:
            pass


_SESSION_START = time.time()


def _open_anywhere() -> set:
    """Every file some process of this host holds open (as far as /proc shows)."""
    import glob
    import os
    held = set()
    for fd in glob.glob("/proc/[0-9]*/fd/*"):
        try:
            held.add(os.readlink(fd))
        except OSError:
            pass
    return held


def pytest_sessionfinish(session, exitstatus):
    """MPICH's process manager writes a topology file to /tmp for each job
    (TMPDIR or not) and leaves it there when the job does not end in order
    (an MPI_Abort, or ranks that never called MPI_Init), as some tests make
    it do on purpose: the ones this test run made, that nothing holds open
    any more, go with it."""
    import glob
    import os
    paths = []
    for p in glob.glob("/tmp/hydra_hwloc_xmlfile_*"):
        try:
            st = os.stat(p)
        except OSError:
            continue
        if st.st_mtime >= _SESSION_START and st.st_uid == os.getuid():
            paths.append(p)
    if not paths:
        return
    held = _open_anywhere()
    for p in paths:
        if p not in held:
            try:
                os.unlink(p)
            except OSError:
                pass
