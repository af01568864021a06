"""What a rank that ``MPI_Comm_spawn`` started runs first, before it imports
macroflow: it reports to its spawner's death watch, starts MPI and merges
with its spawner.

Why first: ``MPI_Comm_spawn`` and the merge after it return in the spawner
only once every new rank has started MPI and merged, and MPICH spins a core
meanwhile. A rank that imported macroflow first (50 to 150 ms) kept its
spawner spinning that long, on cores the new ranks needed for that very
import; merged first, the spawner waits for their hellos asleep. Measured
(``mf.run`` of 3 contexts, 12 runs each way): the spawner's CPU 110 to 196 ms
against 134 to 328; the wall time the same on an idle machine (312 to 435
ms against 274 to 419), and shorter with a core taken by another program
(bare mpi4py spawns of two ranks: 390 to 510 ms against 445 to 815).

The spawned rank's command line loads this file by its path, not as a
module of the package, which would import the package first; so it uses
the standard library alone. The package imports it as a module too, for
:func:`ended` and the watch's address.
"""

import os
import signal
import socket
import struct
import threading
import time
from typing import Any, Iterable, List, Optional, Tuple

#: seconds a spawned rank waits for its spawner to merge with it
MERGE_WAIT = 60.0
#: what a rank sends a death watch first: its pid
PID = struct.Struct("<Q")


def watch_address(name: str) -> bytes:
    """The address of the death watch called ``name`` (an abstract Unix socket).

    Example:
        >>> watch_address("x1")
        b'\\x00macroflow-watch-x1'
    """
    # (a name, not the address, is passed to spawned ranks: MPI's process
    # manager drops the backslashes of their arguments)
    return f"\0macroflow-watch-{name}".encode()


def ended(pid: int) -> bool:
    """Whether process ``pid`` has ended: gone, or a zombie its parent has
    not reaped yet.

    Example:
        >>> ended(os.getpid())
        False
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X")
    except OSError:
        return True


def report(names: Iterable[str]) -> List[socket.socket]:
    """Connect to the death watches ``names`` and say this process's pid; the
    connections, which the watch hears close when this process ends (none
    for a watch that cannot be reached).

    Example:
        >>> report(["no-such-watch"])
        []
    """
    out = []
    for name in names:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(watch_address(name))
            s.sendall(PID.pack(os.getpid()))
        except OSError:
            s.close()
            continue
        out.append(s)
    return out


def start(watches: Iterable[str], spawner: int,
          signals: Iterable[int]) -> Tuple[Any, List[socket.socket]]:  # pragma: no cover - in a rank
    """Report to ``watches``, start MPI with ``signals`` blocked (MPI's own
    threads take this thread's mask, and a signal one of them took would not
    interrupt the main thread's waits), and merge with the spawner; returns
    (the merged communicator, the watches' connections)."""
    reporting = report(watches)
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        from mpi4py import MPI
        merged = threading.Event()
        # (started while the signals are blocked: the thread keeps them blocked)
        threading.Thread(target=watch_spawner, args=(spawner, merged, MERGE_WAIT),
                         daemon=True, name="macroflow-merge-watch").start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    comm = MPI.Comm.Get_parent().Merge(high=True)
    merged.set()
    return comm, reporting


def watch_spawner(spawner: int, until: threading.Event,
                  wait: Optional[float] = None) -> None:  # pragma: no cover - in a rank
    """Until ``until`` is set, leave this rank (removing MPICH's files that
    only it still maps) if its spawner has ended or ``wait`` seconds have
    passed. The spawner merges with its new ranks as soon as MPI has started
    them; one that ended in between never does, and its ranks waited in the
    merge for ever, spinning (``until``: merged, within MERGE_WAIT s). A rank
    then waits for context 0's setup: context 0 interrupted in between left
    it waiting for ever too (``until``: it has its setup; no ``wait``, since
    context 0 may be slow, but not gone)."""
    deadline = None if wait is None else time.monotonic() + wait
    while not until.wait(0.2):
        if ended(spawner) or (deadline is not None and time.monotonic() > deadline):
            from macroflow.transport.mpi import _leave_orphaned
            _leave_orphaned()


def bye(reporting: Iterable[socket.socket]) -> None:
    """Tell the death watches of ``reporting`` (see :func:`report`) that this
    process ends in order, so that its end is not reported as a death.

    Example:
        >>> bye([])
    """
    for s in reporting:
        try:
            s.sendall(b"B")
        except OSError:
            pass


def load(comm: Any, reporting: List[socket.socket], tag: int) -> Any:  # pragma: no cover - in a rank
    """macroflow's ``_spawned``, imported; if it cannot be, the spawner is
    told why (as a hello of ``tag``, with the traceback) and this rank
    leaves in order: its watches told (``reporting``) and MPI ended, or
    MPICH's shared-memory files would stay behind."""
    try:
        from macroflow.transport.mpi import _spawned
        return _spawned
    except BaseException:
        import traceback
        try:
            comm.send(("error", traceback.format_exc()), dest=0, tag=tag)
            bye(reporting)
            from mpi4py import MPI
            MPI.Finalize()
        finally:
            # (C's exit, as macroflow's ranks end: the network modules' own
            # exit handlers close their connections and files)
            import ctypes
            ctypes.CDLL(None).exit(1)
