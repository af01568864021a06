"""The ``mpi`` protocol module: contexts are MPI ranks (mpi4py), on one host or a cluster.

Two ways to start, one transport:

- under ``mpiexec -n N python script.py`` every rank runs the script; when it
  calls ``mf.run`` or ``mf.init`` (which pick this transport by themselves,
  see :func:`world_from_environment`), rank 0 becomes context 0 and runs main,
  and ranks 1..N-1 serve until the computation ends, then end MPI and their
  process (MPI's end waits for rank 0's), so the code after ``mf.run`` runs
  once, on rank 0;
- from a plain process, ``mf.init(contexts=N, transport="mpi")`` spawns N-1
  fresh interpreters with ``MPI_Comm_spawn`` (same ``sys.path`` and working
  directory) and merges them with this process into one communicator. They
  are not forked: classes of ``__main__`` travel by value, the others are
  imported by name.

Wire format. Every message is between two ranks of a communicator that this
module owns (a duplicate of ``COMM_WORLD``, or the merged one), so its tags
are ours. A message of tag ``FRAME`` holds one or more records back to back:
``<II`` (number of buffers, sender's load), one ``<Q`` length per buffer, and
the buffers of at most :data:`INLINE` bytes. A larger buffer (a numpy array
out of band) is a message of its own, of tag ``DATA``, sent straight from the
sender's memory and received straight into a pooled numpy buffer: no pickle,
no copy (up to :data:`COPY_MAX` bytes, the sender sends a copy of its own, so
that the send returns before the receiver takes it, as a socket's kernel
buffer would let it). A record whose number of buffers is ``CONTROL``
carries a credit, a goodbye or its answer instead of a frame.

Order: MPI does not let messages of one tag between two ranks overtake each
other, and a receiver posts the receives of a frame's large buffers in the
order the frames come, so frames arrive in order per (sender, receiver).

Flow control. ``Isend`` is non-blocking and MPI buffers small messages at the
receiver as long as it has memory; so a sender keeps at most
:data:`WINDOW_MESSAGES` messages and :data:`WINDOW_BYTES` bytes in flight per
peer, and the receiver hands credits back as it takes messages out of MPI. A
sender waiting for credits (or for the receiver to take a large buffer) keeps
receiving meanwhile, so two ranks flooding each other both go on. A frame
with large buffers returns from :meth:`MpiTransport.send` once MPI has them
out of the sender's memory, so the caller may change its arrays at once
(call-by-value).

Waiting. MPI has no descriptor to sleep on. A waiting rank polls
(``Improbe``, under 1 us when nothing came) for ``spin_us``, yielding its
core between looks, then sleeps in ``select`` on a datagram socket of its
own (:class:`Waker`): a peer on the same host that sends it a frame also
sends it one byte there. Woken, it looks for the frame a few times before it
yields (MPI shows it a moment after the byte arrives). Peers on other hosts
cannot wake it: then it sleeps in naps, :data:`NAP_MIN` (timer slack 1 us)
while it was active in the last :data:`HOT` seconds, doubling up to
:data:`NAP_MAX` after. An idle rank thus wakes 1/SLEEP_MAX times a second
when every peer can wake it, 1/NAP_MAX when not; what that costs is in
docs/guide.md (section MPI). :meth:`MpiTransport.fileno` is the socket when
every peer can wake the rank, else None.

Rings (``rings=True``, as the launcher makes ranks unless MACROFLOW_RINGS=0;
never on a CPU without total store order, see :func:`ring.problem`): each
rank offers every peer of its host (those that can wake it) a shared-memory
ring in its :class:`~macroflow.transport.ring.RingHost`, by a control record
on MPI (its pid, the memfd's descriptor, where the ring is, and a number
written in the ring that the peer checks once it has mapped it through
``/proc/<pid>/fd``). The peer sends SWITCH on MPI, after every frame it sent
there, and from then on writes each frame of up to :data:`RING_FRAME_MAX`
bytes (half the ring, if less) to the ring: a copy and three stores, no MPI
call. A larger frame still goes by MPI, behind a MARK in the ring; the
reader holds the frames that come by MPI from a peer that switched until it
reaches their MARKs, so the order per pair is the order sent. A reader that
is about to sleep flags NAP (then looks at the rings once more), and a
writer that sees the flag clears it and wakes the reader (see
:class:`Waker`). A writer whose ring is full takes what comes for it while
it waits, as for MPI's window. A peer's goodbye comes by MPI after what its
ring holds, which is delivered first; its rings are unmapped at the next
poll. A rank switches to a peer's ring as soon as it has mapped it. Once
every peer of a rank writes to it by ring, the rank probes MPI only when
told to: a sender puts a POKE in the ring after each message it sends
there by MPI (a large frame, a credit, a goodbye), and the reader probes
until that message is in (and once in :data:`_QUIET_LOOK` passes all the
same), so a call between two ranks of one host makes no MPI call at all.
The rings are in memfds: nothing of them is left in ``/dev/shm``,
whatever ends a rank (a rank's wake-up page, see :class:`Waker`, is a file
there: one left by a killed rank is removed by the next job on the host).

Lost peers. A rank that leaves in order (its computation ended, or its
engine failed) says goodbye, and its peers report it lost. MPI cannot report
a rank that dies (a signal, ``os._exit``): its process manager ends the whole
job instead, every rank included, with a message naming the process.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import mmap
import os
import pickle
import shutil
import signal
import socket
import struct
import sys
import threading
import time
import traceback
import zlib
from collections import deque
from pickle import PickleBuffer
from typing import Any, Callable, Deque, Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple

from . import rank_start
from . import ring as _ring
from .base import Transport

FRAME, DATA, HELLO, SETUP = 1, 2, 3, 4  # message tags
GROW_TAG = 5  # of the intercommunicator that joins new ranks to the live ones
INLINE = 64 * 1024  # buffers up to this size travel inside their frame's message
COPY_MAX = 1 << 20  # larger buffers up to this size are sent from a copy (see send)
# a send larger than this may need its sender's progress to leave: measured with
# MPICH 5 between ranks of one host, the first frame of 5 KB to a peer left only
# when its sender next looked at MPI (100 ms later, the sender asleep), 4 KB at once
EAGER = 4 * 1024
SMALL = 64 * 1024  # queued frames are joined into one message up to this size
WINDOW_MESSAGES = 1024  # messages in flight per peer at most
WINDOW_BYTES = 8 << 20  # bytes of frame messages in flight per peer at most
CREDIT_EVERY = 4  # a receiver hands credits back at each quarter of a window
NAP_MIN = 20e-6  # seconds: the nap of a rank that was active within HOT seconds
HOT = 0.01
NAP_MAX = 1e-3  # the longest nap (an idle rank polls 1/NAP_MAX times a second)
SLEEP_MAX = 0.1  # the longest sleep of a rank that every peer can wake
SPIN_WOKEN = 200e-6  # a rank woken for a frame it cannot see yet polls this long
LINGER = 2.0  # seconds close() waits for its peers to take its last messages
_PREEMPTED = 1e-3  # a gap this long between two polls: someone else had our core
_CALM = 0.01  # then sleep instead of spinning for this long
_PROBES = 64  # messages taken per pass at most, so that sends get a turn
_MPI_LOOK = 8  # a spin with rings probes MPI this seldom (see _spin)
_EAGER_LOOKS = 8  # a rank woken for a frame looks this often before it yields its core
SPIN_GROWTH = 20  # the spin grows to at most this many times spin_us (see _adapt)
_RING_LOOK = 16  # while rings deliver, look at MPI every this many passes
_QUIET_LOOK = 64  # every peer on rings: MPI is probed unasked this seldom (see _requiet)
POLLING, SENT, OWNER = 0, 1, 2  # the words of a rank's shared page (see Waker)
_STATE_BYTES = 24
_REC = struct.Struct("<II")
_LEN1 = struct.Struct("<IIQ")  # the record of a one-buffer frame
_CREDIT = struct.Struct("<QQ")
CONTROL = 0xFFFFFFFF
CREDIT, BYE, ACK, GROW, OFFER, SWITCH = 1, 2, 3, 4, 5, 6
RING_BYTES = 1 << 20  # a shared-memory ring, one direction between two ranks of one host
# larger frames travel by MPI (a MARK in the ring); as on local: a 64 KiB array
# there and back took 90-126 us through the ring, 185-200 us by the bulk area
RING_FRAME_MAX = 128 * 1024
# or, when their large buffers fit, by the ring's bulk area (see ring.py)
BULK_BYTES = 64 << 20
BULK_MIN = 32 * 1024
# an OFFER: the reader's pid, its RingHost's fd, the ring's offset, bytes, and a
# number it wrote in the ring (word _NONCE), which tells the writer it mapped
# that very ring (a pid means another process in another pid namespace)
_OFFER = struct.Struct("<iiqiq")
_NONCE = 8  # a word of the ring's first line that the ring itself leaves unused

#: Environment variables that MPI launchers set in every rank: (rank, size).
LAUNCHER_VARIABLES = (("PMI_RANK", "PMI_SIZE"),  # MPICH, Intel MPI, MVAPICH (hydra), srun --mpi=pmi2
                      ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),  # Open MPI
                      ("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE"))  # MVAPICH (mpirun_rsh)

#: Memory counted per spawned context when checking that a computation fits:
#: a fresh interpreter with numpy, mpi4py and macroflow imported holds ~45 MB.
CONTEXT_MEMORY = 64 << 20


def world_from_environment(environ: Optional[Mapping[str, str]] = None) -> Optional[Tuple[int, int]]:
    """(rank, size) of this process if an MPI launcher started it, else None.

    Read from the variables of :data:`LAUNCHER_VARIABLES`, without importing
    mpi4py (which would start MPI).

    Example:
        >>> world_from_environment({"PMI_RANK": "2", "PMI_SIZE": "4"})
        (2, 4)
        >>> world_from_environment({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "8"})
        (0, 8)
        >>> world_from_environment({}) is None
        True
    """
    env = os.environ if environ is None else environ
    for rank_var, size_var in LAUNCHER_VARIABLES:
        rank, size = env.get(rank_var), env.get(size_var)
        if rank is not None and size is not None:
            try:
                return int(rank), int(size)
            except ValueError:
                continue
    return None


def available() -> Optional[str]:
    """None if this transport can be used here, else why not (without starting MPI).

    Example:
        >>> r = available()
        >>> r is None or "mpi4py" in r or "mpiexec" in r
        True
    """
    import importlib.util
    if importlib.util.find_spec("mpi4py") is None:
        return ("the mpi transport needs mpi4py: pip install \"macroflow[mpi]\" (mpi4py and the "
                "MPICH library), or pip install mpi4py built against this system's MPI")
    if world_from_environment() is None and _find_mpiexec() is None:
        return ("the mpi transport starts ranks through MPI's process manager, but no mpiexec "
                "was found beside this Python nor on PATH")
    return None


def _find_mpiexec() -> Optional[str]:
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if os.access(here, os.X_OK):
        return here
    return shutil.which("mpiexec")


_MPI: Any = None


def mpi() -> Any:
    """The ``mpi4py.MPI`` module: MPI starts (once per process) on first use.

    MPI cannot start again in a process once it has ended, so it ends only at
    exit (mpi4py's own handler). A process started without a launcher finds
    its process manager (``mpiexec``, which MPICH starts to spawn ranks) beside
    this Python, where the ``mpich`` wheel puts it, when PATH does not have one.

    Raises:
        ImportError: mpi4py is not installed (with how to install it).

    Example:
        >>> available() is not None or mpi().Is_initialized()
        True
    """
    global _MPI
    if _MPI is None:
        if world_from_environment() is None and shutil.which("mpiexec") is None:
            here = os.path.dirname(sys.executable)
            if os.access(os.path.join(here, "mpiexec"), os.X_OK):
                os.environ["PATH"] = here + os.pathsep + os.environ.get("PATH", "")
        world = world_from_environment()
        # MPI_Init waits for every rank of the job: a rank that never starts
        # MPI (a script that starts macroflow on rank 0 alone) left it waiting
        # for ever, saying nothing. It holds the interpreter meanwhile: what
        # says so is a process of its own
        # MPI may start threads of its own (UCX's "async"): they take this
        # thread's signal mask, and with these blocked there, the kernel gives
        # a signal sent to the process to the main thread, which runs its
        # handler at once (taken by such a thread, a SIGTERM waited for the
        # main thread's own wait to end: a method's sleep). One that would
        # end the process and comes meanwhile ends it still: the watcher sees
        # it pending
        main = threading.current_thread() is threading.main_thread()
        from ..core.threads import HANDLED_SIGNALS
        fatal = {s for s in HANDLED_SIGNALS if signal.getsignal(s) == signal.SIG_DFL} \
            if main else set()
        several = world is not None and world[1] > 1
        watch = _watch_init(world if several else None, fatal) if several or fatal else None
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, HANDLED_SIGNALS) if main else None
        try:
            from mpi4py import MPI
        except ImportError as e:
            raise ImportError(available() or f"mpi4py cannot be imported: {e}") from e
        finally:
            if blocked is not None:
                signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
            if watch is not None:
                try:
                    os.kill(watch, signal.SIGKILL)
                    os.waitpid(watch, 0)
                except OSError:
                    pass
        _MPI = MPI
    return _MPI


def _watch_init(world: Optional[Tuple[int, int]], fatal: Set[int]) -> Optional[int]:
    # A child that says what this rank waits for if MPI has not started
    # within init_warning_s() (``world``: a rank of a job of several), and
    # kills it if a signal of ``fatal`` (blocked meanwhile, and the end of
    # the process by default) is pending; until MPI has started (this rank
    # kills it then) or this rank has ended.
    from ..core.threads import fork
    wait, parent = init_warning_s(), os.getpid()
    mask = sum(1 << (s - 1) for s in fatal)
    try:
        pid = fork()
    except OSError:
        return None
    if pid:
        return pid
    try:
        deadline = time.monotonic() + wait
        while os.getppid() == parent:
            if mask and _pending(parent) & mask:
                os.kill(parent, signal.SIGKILL)  # (as the signal would have ended it)
                break
            if world is not None and deadline is not None and time.monotonic() >= deadline:
                _init_waits(world)
                deadline = None
            time.sleep(0.05)
    finally:
        os._exit(0)


def _pending(pid: int) -> int:
    # the signals pending for the process, and for its main thread
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        return int(fields.get("ShdPnd", "0"), 16) | int(fields.get("SigPnd", "0"), 16)
    except (OSError, ValueError):
        return 0


def init_warning_s() -> float:
    """Seconds MPI may take to start in a rank of an mpiexec job before the
    rank says what it waits for (MACROFLOW_MPI_INIT_WARN_S; default 30).

    Raises:
        ValueError: it is set to anything but a number of seconds >= 0.

    Example:
        >>> os.environ.pop("MACROFLOW_MPI_INIT_WARN_S", None) and None
        >>> init_warning_s()
        30.0
    """
    env = os.environ.get("MACROFLOW_MPI_INIT_WARN_S", "").strip()
    if not env:
        return 30.0
    try:
        value = float(env)
    except ValueError:
        value = -1.0
    if not value >= 0.0 or value == float("inf"):
        raise ValueError(f"the MACROFLOW_MPI_INIT_WARN_S environment variable must be a number "
                         f"of seconds >= 0 (how long a rank waits for MPI to start before it "
                         f"says so); got {env!r}")
    return value


def check_settings() -> None:
    """This transport's settings, checked at every start (see
    :func:`macroflow.launch.check_settings`): MACROFLOW_MPI_INIT_WARN_S is
    read only where MPI is first started in a process.

    Example:
        >>> check_settings()
    """
    init_warning_s()


def _init_waits(world: Tuple[int, int]) -> None:
    rank, size = world
    print(f"macroflow: rank {rank} of {size} has waited {init_warning_s():g} s for MPI to start: "
          f"it starts once every rank of the job has started it, so every rank must run "
          f"macroflow (mf.run, mf.init or mf.spmd: not under `if rank == 0`); a rank that "
          f"ended or failed before it leaves the others waiting", file=sys.stderr, flush=True)


def _children(pid: int) -> List[Tuple[int, bytes]]:
    """(pid, command line) of the processes whose parent is ``pid`` (from /proc)."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
            if ppid != pid:
                continue
            with open(f"/proc/{name}/cmdline", "rb") as f:
                out.append((int(name), f.read()))
        except (OSError, ValueError, IndexError):
            pass
    return out


def process_manager_pids() -> List[int]:
    """The pids of MPI's process manager that this process started, if any.

    A process that spawns ranks without a launcher makes MPICH start an
    ``mpiexec`` (and its proxy) that serve it until it ends; the ranks it
    spawns are children of that proxy, and end with their computation.

    Example:
        >>> all(isinstance(p, int) for p in process_manager_pids())
        True
    """
    if _MPI is None:
        return []
    found = []
    for pid, cmd in _children(os.getpid()):
        if b"-pmi_args" in cmd:  # singleton init: mpiexec -pmi_args PORT ...
            found.append(pid)
            found += [c for c, ccmd in _children(pid) if b"hydra_pmi_proxy" in ccmd]
    return found


class DeathWatch:
    """Hears of the spawned ranks of this process that die (a signal,
    ``os._exit``): MPI cannot tell, and its process manager then ends every
    spawned rank while this process, which MPI started alone, waits on.

    A listening socket in Linux's abstract namespace, served by a thread:
    each rank spawned from this process connects at its start and sends its
    pid; one that ends in order sends a byte first (:func:`_leave`). A
    connection that closes without it is a rank that died. Connections close
    as their processes end, in the order they end, before the process
    manager (which sees the same closing) can end the others: so the first
    reported is the one that died. ``on_death(pid, status)`` is called in the
    watcher's thread (``status`` is the wait status when it could be read
    from /proc before the process was reaped, else None).

    Example:
        >>> seen = []
        >>> w = DeathWatch("doc-example", lambda pid, status: seen.append(pid))
        >>> import subprocess, sys
        >>> code = ("import os; from macroflow.transport.mpi import DeathWatch; "
        ...         f"DeathWatch.report_to({w.name!r}); os._exit(3)")
        >>> p = subprocess.Popen([sys.executable, "-c", code]); _ = p.wait()
        >>> w.wait_for(1, 10.0) and seen == [p.pid]
        True
        >>> w.close()
    """

    WINDOW = 0.05  # seconds of deaths ordered together (see _tell)
    _mine: Optional["DeathWatch"] = None  # this process's, for the ranks it spawns
    _reporting: List[socket.socket] = []  # in a rank: its connections to watches
    PID = rank_start.PID

    def __init__(self, name: str, on_death: Callable[[int, Optional[int]], None]):
        self.name = name
        self.address = self.address_of(name)
        self.on_death = on_death
        self.deaths: List[int] = []
        #: the pids of the deaths being told that came together, in an order
        #: that says nothing of which came first (see _tell)
        self.together: Set[int] = set()
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(self.address)
        self.listener.listen(64)
        self._stop_r, self._stop_w = os.pipe()
        self._cond = threading.Condition()
        from ..core.threads import start_thread
        self.thread = start_thread(self._serve, "macroflow-death-watch")

    @classmethod
    def here(cls) -> Optional["DeathWatch"]:
        """This process's watch (started at its first spawn), or None where
        abstract sockets cannot be made."""
        if cls._mine is None:
            try:
                from ..launch import new_computation_id
                cls._mine = DeathWatch(f"{os.getpid()}-{new_computation_id()}", _report_death)
            except OSError:
                return None
        return cls._mine

    def _serve(self) -> None:
        import select
        conns: Dict[socket.socket, list] = {}  # -> [pid or None, bytes so far, bye said]
        pending: List[Tuple[int, Optional[int]]] = []  # deaths heard, not yet told
        until = 0.0  # when those are told
        try:
            while True:
                wait = None if not pending else max(0.0, until - time.monotonic())
                ready = select.select([self.listener, self._stop_r, *conns], [], [], wait)[0]
                if self._stop_r in ready:
                    if pending:
                        self._tell(pending)  # (what was heard is told)
                    return
                for c in ready:
                    if c is self.listener:
                        try:
                            conn, _ = self.listener.accept()
                        except OSError:
                            continue
                        conns[conn] = [None, b"", False]
                        continue
                    st = conns[c]
                    try:
                        data = c.recv(64)
                    except OSError:
                        data = b""
                    if data:
                        st[1] += data
                        if st[0] is None and len(st[1]) >= self.PID.size:
                            st[0] = self.PID.unpack_from(st[1])[0]
                            st[1] = st[1][self.PID.size:]
                        if st[1]:
                            st[2] = True
                        continue
                    pid, _, bye = conns.pop(c)
                    c.close()
                    if pid is not None and not bye:
                        if not pending:
                            until = time.monotonic() + self.WINDOW
                        pending.append((pid, _status_when_ended(pid)))
                if pending and time.monotonic() >= until:
                    self._tell(pending)
                    pending = []
        finally:
            for c in conns:
                c.close()

    def _tell(self, deaths: List[Tuple[int, Optional[int]]]) -> None:
        # A process closes its files in the order of their numbers as it
        # ends: MPI's process manager, which sees its connection close, may
        # have killed another rank (SIGKILL) before the watch's connection of
        # the first closed, now and then. So of the deaths heard within
        # WINDOW, one known to have ended of its own accord (an exit, a signal
        # other than SIGKILL) goes first; the others in the order heard (how
        # one ended is not always known: a SIGKILL first heard may be yours).
        def order(death: Tuple[int, Optional[int]]) -> int:
            status = death[1]
            if status is None:
                return 1
            return 1 if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL else 0
        deaths = sorted(deaths, key=order)
        # Several killed (or ended unread) and none of its own accord: the
        # first heard is no more likely the one that died first (a watch
        # hears them in one pass, 2 runs of 10 the wrong way): on_death may
        # say so (see together)
        self.together = {pid for pid, _ in deaths} \
            if len(deaths) > 1 and order(deaths[0]) == 1 else set()
        for pid, status in deaths:
            try:
                self.on_death(pid, status)
            except Exception:
                traceback.print_exc()
            with self._cond:  # (once told: see wait_for)
                self.deaths.append(pid)
                self._cond.notify_all()

    def wait_for(self, n: int, timeout: float) -> bool:
        """Wait until ``n`` deaths have been heard of and told to ``on_death``;
        True if they were."""
        with self._cond:
            return self._cond.wait_for(lambda: len(self.deaths) >= n, timeout)

    def close(self) -> None:
        os.write(self._stop_w, b"x")
        self.thread.join(5.0)
        self.listener.close()
        os.close(self._stop_r)
        os.close(self._stop_w)
        if DeathWatch._mine is self:
            DeathWatch._mine = None

    @staticmethod
    def address_of(name: str) -> bytes:
        return rank_start.watch_address(name)

    @classmethod
    def report_to(cls, name: str) -> None:
        """In a rank: connect to a watch (the parent's, or `macroflow run`'s;
        nothing if it cannot)."""
        cls._reporting = [*cls._reporting, *rank_start.report([name])]

    @classmethod
    def bye(cls) -> None:
        """In a rank that ends in order: say so before the connections close."""
        socks, cls._reporting = cls._reporting, []
        rank_start.bye(socks)


#: where this process's :class:`DeathWatch` reports the deaths it hears of
#: (set by the launcher of the computation that spawned the ranks)
_death_listeners: List[Callable[[int, Optional[int]], None]] = []


def _report_death(pid: int, status: Optional[int]) -> None:
    for listener in list(_death_listeners):
        listener(pid, status)


def _status_when_ended(pid: int, wait: float = 0.1) -> Optional[int]:
    """The wait status of process ``pid``, which is ending: its connections
    close before it is a zombie, which its parent soon reaps; so wait until
    it is one (``wait`` seconds at most), and read it then. None if it was
    reaped first, or cannot be watched."""
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        return _exit_status(pid)
    try:
        import select
        select.select([fd], [], [], wait)
        return _exit_status(pid)
    finally:
        os.close(fd)


def _stat(pid: int) -> Optional[List[bytes]]:
    """The fields of /proc/<pid>/stat after the command's name (state first),
    or None if the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields or None


def _exit_status(pid: int) -> Optional[int]:
    """The wait status of process ``pid`` while it is a zombie (from /proc), else None."""
    fields = _stat(pid)
    if fields is None or fields[0] != b"Z" or len(fields) < 50:
        return None
    try:
        return int(fields[49])  # exit_code, field 52 of the line
    except ValueError:
        return None


def _abort(comm: Any) -> None:  # pragma: no cover - ends the job
    """``comm.Abort(1)``, after unlinking the MPICH shared-memory files this
    process maps: an aborted job never unlinks them, and each left 2 MB in
    /dev/shm (unlinked, a file is freed once the last rank has gone)."""
    for path in _mapped_mpich_files():
        try:
            os.unlink(path)
        except OSError:
            pass
    comm.Abort(1)


def _mapped_mpich_files() -> Set[str]:
    """The MPICH shared-memory files this process has mapped.

    Example:
        >>> all(p.startswith("/dev/shm/mpich_shm_") for p in _mapped_mpich_files())
        True
    """
    try:
        with open("/proc/self/maps") as f:
            return {line.split(None, 5)[5].strip() for line in f
                    if "/dev/shm/mpich_shm_" in line and len(line.split(None, 5)) == 6}
    except OSError:
        return set()


def mpich_shm_files() -> Set[str]:
    """MPICH's shared-memory files in /dev/shm now.

    Example:
        >>> all(p.startswith("/dev/shm/mpich_shm_") for p in mpich_shm_files())
        True
    """
    import glob
    return set(glob.glob("/dev/shm/mpich_shm_*"))


def in_use(path: str, besides: int = 0) -> bool:
    """Whether any process here (but ``besides``) has ``path`` open or mapped.

    Example:
        >>> import tempfile
        >>> with tempfile.NamedTemporaryFile() as f:
        ...     in_use(f.name), in_use(f.name, besides=os.getpid())
        (True, False)
    """
    import glob
    for d in glob.glob("/proc/[0-9]*"):
        if d == f"/proc/{besides}":
            continue
        try:
            for fd in os.listdir(d + "/fd"):
                if os.readlink(f"{d}/fd/{fd}") == path:
                    return True
            with open(d + "/maps") as f:
                if path in f.read():
                    return True
        except OSError:
            continue
    return False


def sweep_segments(min_age: float = 10.0) -> List[str]:
    """Remove MPICH's shared-memory files (``/dev/shm/mpich_shm_*``) that no
    process here has open or mapped and that are at least ``min_age``
    seconds old; returns those. A job that did not end in order (a rank or
    the program that spawned them killed) leaves them: the next spawn
    removes them, as the next job removes ranks' wake-up pages. (A file MPI
    makes is mapped at once; the age, from its last write, keeps one just
    made out of reach.)

    Example:
        >>> sweep_segments(min_age=1e9)
        []
    """
    now = time.time()
    old = []
    for path in mpich_shm_files():
        try:
            st = os.stat(path)
        except OSError:
            continue
        if now - st.st_mtime >= min_age:
            old.append(path)
    return remove_unused(sorted(old)) if old else []


def remove_unused(paths: Iterable[str], besides: int = 0) -> List[str]:
    """Remove the files of ``paths`` that no process here (but ``besides``)
    has open or mapped; returns those (gone already or not).

    Example:
        >>> import tempfile
        >>> d = tempfile.mkdtemp()
        >>> open(os.path.join(d, "x"), "w").close()
        >>> remove_unused([os.path.join(d, "x")]) == [os.path.join(d, "x")], os.listdir(d)
        (True, [])
    """
    removed = []
    for path in paths:
        if not in_use(path, besides):
            removed.append(path)
            try:
                os.unlink(path)
            except OSError:
                pass
    return removed


#: MPICH's shared-memory files that appeared while this process spawned ranks
#: (MPICH removes them when the ranks end in order; not when one dies)
_spawn_segments: Set[str] = set()
#: why MPI in this process can start no computation any more (a spawned rank died)
_broken: Optional[str] = None


_exit_code: List[Any] = []  # what sys.exit was called with, once MPI here is broken
# the exception on its way out when MPI here broke (a Ctrl-C, an mf.Terminated
# raised by SIGTERM): what the process ends with, if nothing else is said
_ending: List[BaseException] = []


DISCONNECT_WAIT = 10.0  # seconds a disconnection from spawned ranks may take


def disconnect(comm: Any, ctx: int, wait: Optional[float] = None,
               stuck: Optional[Callable[[], None]] = None) -> bool:
    """Disconnect ``comm``; False if that did not end within ``wait`` seconds
    (:data:`DISCONNECT_WAIT`). A disconnection waits for every process of the
    communicator, and one that died before its death was heard of would hold
    it for ever (a test run hung so, in ``MPI_Comm_disconnect``, for more than
    6 minutes). Then this process goes on, and ends without ``MPI_Finalize``,
    which would wait as long (``stuck``, by default, arranges that); the
    disconnection is left to a daemon thread.

    Example:
        >>> class Stuck:
        ...     def Disconnect(self): threading.Event().wait()
        >>> import contextlib, io
        >>> with contextlib.redirect_stderr(io.StringIO()) as err:
        ...     disconnect(Stuck(), 0, wait=0.05, stuck=lambda: None)
        False
        >>> "did not end within 0.05 s" in err.getvalue()
        True
    """
    wait = DISCONNECT_WAIT if wait is None else wait
    from ..core.threads import start_thread
    t = start_thread(comm.Disconnect, f"macroflow-mpi-disconnect-{ctx}")
    t.join(wait)
    if not t.is_alive():
        return True
    print(f"macroflow: context {ctx}: disconnecting from spawned ranks did not end within "
          f"{wait:g} s (one may have died unheard of); this process ends without "
          f"MPI_Finalize", file=sys.stderr)
    (stuck or _disconnect_given_up)()
    return False


def _disconnect_given_up() -> None:
    # MPI here waits for a rank that will not answer: no more spawns, and
    # _at_exit ends the process before MPI_Finalize (which would wait too)
    global _broken
    if _broken is None:
        _broken = ("a disconnection from spawned ranks did not end (one may have died); MPI "
                   "here cannot spawn ranks again")
    _end_without_finalize()


def _end_without_finalize() -> None:
    """Once a spawned rank has died, MPICH's process manager has ended (it
    ends the spawned job), and MPI_Finalize at this process's exit would
    crash (SIGSEGV, measured with MPICH 4): so :func:`_at_exit` ends the
    process first, with the exit code Python would give it."""
    previous = sys.exit
    on_its_way = sys.exc_info()[1]
    if on_its_way is not None:
        _ending[:] = [on_its_way]
    if getattr(previous, "_macroflow", False):
        return

    def exiting(code: Any = None) -> None:
        _exit_code[:] = [code]
        previous(code)

    exiting._macroflow = True  # type: ignore[attr-defined]
    sys.exit = exiting


def _at_exit() -> None:  # pragma: no cover - ends the process
    """Python's last exit handler here (registered when this module is
    imported: handlers run in reverse), before mpi4py finalizes MPI from C:
    if a spawned rank died, remove the shared-memory files MPICH leaves and
    end the process without MPI_Finalize (see _end_without_finalize)."""
    if _broken is None:
        return
    try:
        import logging
        logging.shutdown()  # (registered before this module: it would not run)
        sys.stdout.flush()
        sys.stderr.flush()
    except Exception:
        pass
    for path in _spawn_segments | {f"/dev/shm/mpich_shm_{os.getpid():x}_0"}:
        try:
            os.unlink(path)
        except OSError:
            pass
    # (an uncaught SystemExit, mf.Terminated's 143 say, never reaches
    # sys.last_value: it is the exception MPI broke under, if any; any other
    # that did not end the program uncaught is not how it ends: the program
    # caught it, a rank's KeyboardInterrupt made its exit 1)
    last = getattr(sys, "last_value", None)
    if last is None and _ending and isinstance(_ending[0], SystemExit):
        last = _ending[0]
    if _exit_code or isinstance(last, SystemExit):
        code = _exit_code[0] if _exit_code else last.code  # type: ignore[union-attr]
        code = 0 if code is None else code if isinstance(code, int) else 1
    elif isinstance(last, KeyboardInterrupt):
        # as Python ends on an uncaught Ctrl-C: killed by SIGINT, so that a
        # shell running it as a loop stops too
        try:
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        except Exception:
            pass
        code = 128 + signal.SIGINT
    else:
        code = 1 if last is not None else 0
    os._exit(code)


def _leave(code: int = 0) -> None:  # pragma: no cover - ends the process
    """End this rank's process: MPI ends in order first, or its process manager
    would take the exit for a crash and end every rank of the job."""
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except Exception:
        pass
    DeathWatch.bye()  # this end is in order: the parent is not to report it
    try:
        # leaving already: a SIGTERM now (context 0 asking a slow rank to
        # leave) would run the computation's handler, which calls MPI, in
        # the middle of MPI_Finalize ("Attempting to use an MPI routine ...
        # after finalizing MPICH")
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    except ValueError:
        pass  # (not the main thread: no handler of ours runs there)
    try:
        if _MPI is not None and _MPI.Is_initialized() and not _MPI.Is_finalized():
            from ..core.threads import quiesce
            quiesce()  # no service thread may call MPI from here on
            _MPI.Finalize()
    finally:
        # C's exit, not os._exit: the network modules' own exit handlers close
        # their connections, without which the peers see an abnormal end
        ctypes.CDLL(None).exit(code)


class Waker:
    """A rank's wake-up socket: a datagram in Linux's abstract namespace.

    MPI gives a rank nothing to sleep on; so a rank that has polled for
    ``spin_us`` in vain sleeps in ``select`` on this socket, and a peer on the
    same host that sends it a frame also sends it one byte here. The byte
    only wakes the sleeper; the frame travels through MPI.

    A wake-up costs its sender a system call, and far more when it wakes a
    thread: so the rank also shares a page (``state``, in /dev/shm: spawned
    ranks are not forked from one another) of two words, POLLING (1 while the
    rank polls MPI: no wake-up needed) and SENT (the last value a sender
    stored before it sent a frame, unique per sender and frame). A sender
    stores SENT, posts its frame, and wakes the rank only if POLLING is 0. A
    rank that stops polling clears POLLING, looks at MPI once more, and
    sleeps only if SENT has not changed since it began to poll (else a frame
    is on its way, and it polls for it): a sender that saw POLLING at 1 wrote
    SENT before the rank looks at it, the MPI calls between each side's store
    and load ordering them (they take a lock, a full barrier on x86).

    Example:
        >>> a, b = Waker("doc-example", 0), Waker("doc-example", 1)
        >>> b.wake(Waker.address("doc-example", 0))
        >>> a.sleep(5.0), a.sleep(0.0)
        (True, True)
        >>> a.drain(), a.sleep(0.0)
        (1, False)
        >>> peer = Waker.peer_state("doc-example", 0)
        >>> a.state[POLLING] = 1
        >>> peer[POLLING], peer[SENT]
        (1, 0)
        >>> a.close(); b.close()
        >>> Waker.peer_state("doc-example", 0) is None    # its page went with it
        True
    """

    def __init__(self, name: str, rank: int):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            self.sock.bind(self.address(name, rank))
        except OSError:
            self.sock.close()
            raise
        self.sock.setblocking(False)
        self.fd = self.sock.fileno()
        self.path: Optional[str] = None
        self.state: Any = None  # [POLLING, SENT, OWNER], or None: peers always wake us
        _sweep_pages()
        path = self.state_path(name, rank)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError:
            return
        try:
            os.ftruncate(fd, _STATE_BYTES)
            self._mm = mmap.mmap(fd, _STATE_BYTES)
            self.state = (ctypes.c_uint64 * 3).from_buffer(self._mm)
            self.state[OWNER] = os.getpid()
            self.path = path
        except (OSError, ValueError):
            os.unlink(path)
        finally:
            os.close(fd)

    @staticmethod
    def address(name: str, rank: int) -> bytes:
        return f"\0macroflow-mpi-{name}-{rank}".encode()

    @staticmethod
    def state_path(name: str, rank: int) -> str:
        return f"/dev/shm/macroflow-mpi-{name}-{rank}"

    @staticmethod
    def peer_state(name: str, rank: int) -> Any:
        """The shared page of rank ``rank`` (see above), or None if it has none."""
        try:
            fd = os.open(Waker.state_path(name, rank), os.O_RDWR)
        except OSError:
            return None
        try:
            if os.fstat(fd).st_size < _STATE_BYTES:
                return None  # being made: look again next time
            return (ctypes.c_uint64 * 3).from_buffer(mmap.mmap(fd, _STATE_BYTES))
        except (OSError, ValueError):
            return None
        finally:
            os.close(fd)

    def wake(self, addr: bytes) -> None:
        try:
            self.sock.sendto(b"w", addr)
        except OSError:
            pass  # its buffer is full (it has wake-ups to read already), or it is gone

    def drain(self) -> int:
        """Read every wake-up that came; returns how many."""
        recv = self.sock.recv
        n = 0
        try:
            while True:
                recv(64)
                n += 1
        except OSError:
            return n

    def sleep(self, timeout: float) -> bool:
        """Wait until woken or ``timeout`` seconds; True if woken."""
        import select
        try:
            return bool(select.select([self.fd], [], [], timeout)[0])
        except InterruptedError:
            return True

    def close(self) -> None:
        self.sock.close()
        if self.path is not None:
            try:
                os.unlink(self.path)
            except OSError:
                pass
            self.path = None


def _sweep_pages() -> None:
    """Remove the shared pages (see Waker) of ranks that ended without closing
    (killed, or ended by MPI_Abort): their process, named in OWNER, is gone."""
    import glob
    for path in glob.glob("/dev/shm/macroflow-mpi-*"):
        try:
            with open(path, "rb") as f:
                owner = struct.unpack_from("<Q", f.read(_STATE_BYTES), 8 * OWNER)[0]
            if owner:
                os.kill(owner, 0)
        except ProcessLookupError:
            try:
                os.unlink(path)
            except OSError:
                pass
        except (OSError, struct.error):
            pass  # being made, or another user's


class _Frame:
    __slots__ = ("parts", "load", "reqs")

    def __init__(self, parts: List[Any], load: int, reqs: List[Any]):
        self.parts = parts
        self.load = load
        self.reqs = reqs


class MpiTransport(Transport):
    """Frames between the ranks of one communicator, as seen by one rank.

    ``comm`` is a communicator that this transport alone uses (its tags are
    ours); context ids are ranks. ``release`` lists communicators to
    disconnect when the transport closes (those of spawned ranks).

    Example (one rank sending to itself on ``COMM_SELF``, where mpi4py is installed):
        >>> got = []
        >>> if available() is None:
        ...     t = MpiTransport(mpi().COMM_SELF.Dup())
        ...     t.attach(lambda src, bufs, load: got.append((src, bytes(bufs[0]), load)), None)
        ...     sent = t.send(0, [b"hello"], 7)
        ...     arrived = t.poll(1.0)
        ...     t.close()
        ... else:
        ...     arrived, got = True, [(0, b"hello", 7)]
        >>> arrived, got
        (True, [(0, b'hello', 7)])
    """

    name = "mpi"

    def __init__(self, comm: Any, spin_us: float = 0.0, release: Sequence[Any] = (),
                 wake: Optional[Tuple[str, Mapping[int, str]]] = None,
                 members: Optional[Sequence[int]] = None, window: bool = False,
                 rings: bool = False, ring_bytes: int = RING_BYTES, bulk_bytes: int = BULK_BYTES):
        super().__init__()
        MPI = mpi()
        self.MPI = MPI
        self.comm = comm
        # Several communicators once contexts were added (see grow): each
        # lists the context of each of its ranks, and a peer is reached by
        # the first one that holds us both, which both ends agree on.
        self.links: List[Any] = []
        self.members: List[List[int]] = []
        self.rx: List[Tuple[Any, Optional[List[int]]]] = []  # (comm, members or None: ranks are ids)
        self.dcomm: List[Any] = []  # per context: the communicator that reaches it (None: cannot)
        self.drank: List[int] = []  # ... and its rank there
        self.ctx = -1
        self.size = 0
        self.release = list(release)
        self.spin_s = spin_us / 1e6
        self.spin_cur = self.spin_s  # the spin now (see _adapt)
        self.spin_max = SPIN_GROWTH * self.spin_s
        self.status = MPI.Status()
        self.any_source = MPI.ANY_SOURCE
        self.byte = MPI.BYTE
        from .local import BufferPool
        self.pool = BufferPool()
        self.gone: Set[int] = set()  # peers that said goodbye (or that we gave up on, or never knew)
        self.closed = False
        self.closing = False  # in close(): frames that come are taken and dropped
        self.acked: Set[int] = set()  # peers that answered our goodbye
        self.leaving: List[int] = []  # the peers we said goodbye to
        self.lingered_out = False  # close() gave up waiting for its peers
        # flow control, per peer: messages and bytes sent / credited back
        self.sent_msgs: List[int] = []
        self.sent_bytes: List[int] = []
        self.acked_msgs: List[int] = []
        self.acked_bytes: List[int] = []
        # and as a receiver: taken out of MPI / credited to the sender
        self.got_msgs: List[int] = []
        self.got_bytes: List[int] = []
        self.credited_msgs: List[int] = []
        self.credited_bytes: List[int] = []
        self.grows: List[Dict[str, Any]] = []  # plans of context 0 to add ranks, to carry out
        self.peer_comm: Any = None  # context 0, while it adds ranks: itself and them
        self._natives: Optional["MpiCollectives"] = None
        # a rank added while running: its communicator is not the one the
        # job's first ranks share, so MPI's own collectives could never match
        # theirs (they go by the tree, having more than one link)
        self.added = members is not None
        self.unfinished: Deque[Tuple[Any, Any]] = deque()  # (request, buffer) of our sends
        self.pushing = 0  # sends in `unfinished` too large to leave without our progress
        self.sends = 0
        self.inflight: Dict[int, Deque[_Frame]] = {}  # frames waiting for their large buffers
        self.wbuf: Dict[int, bytearray] = {}  # frames queued per peer until flush
        self.blocked_on: Optional[int] = None  # the peer a send waits for room at (if any)
        self.calm_until = 0.0
        self.spins_preempted = 0
        self.naps = 0
        self.active_at = 0.0  # when this rank last sent or received a frame
        self.nap_len = 0.0  # the last nap of an idle rank (they double)
        self.sleeps = 0
        self.empty_wakes = 0
        self.expect = False  # woken for a frame MPI has not shown yet
        _fine_timer_slack()
        # wake-up sockets of the peers on this host (see Waker)
        self.waker: Optional[Waker] = None
        self.wakes: Dict[int, bytes] = {}
        self.woken_by_all = False
        self.wake_name: Optional[str] = None
        self.hosts: Dict[int, str] = {}
        self.states: Dict[int, Any] = {}  # the shared pages of the peers that can wake us
        self.wakeups = 0  # wake-ups sent
        self.abandoned: List[Tuple[Any, Any]] = []  # requests MPI would not cancel, and their buffers
        # shared-memory rings with the ranks of this host (see the module's
        # notes), where this CPU orders stores; per peer: the ring we offered
        # it, the one it writes to us (after its SWITCH), the one it offered
        # us (mapped, written from our next send), the one we write to
        self.rings = bool(rings) and _ring.problem() is None and hasattr(os, "memfd_create")
        self.ring_bytes = ring_bytes
        self.bulk_bytes = bulk_bytes
        self.rmax = min(RING_FRAME_MAX, (ring_bytes >> 1) - 16)  # see _switch
        self.host: Optional[_ring.RingHost] = None  # the rings we read (made at the first offer)
        self.bell_seen = 0  # the host's BELL when we last looked at the rings
        self.offers: Dict[int, _ring.Ring] = {}
        self.rin: Dict[int, _ring.Ring] = {}
        self.rins: List[Tuple[int, _ring.Ring]] = []  # rin's items, replaced whole on change
        self.rout_next: Dict[int, _ring.Ring] = {}
        self.rout: Dict[int, _ring.Ring] = {}
        self.offered: Set[int] = set()  # the peers we offered a ring to (once)
        self.held: Dict[int, Deque[_Frame]] = {}  # frames by MPI waiting for their MARK
        self.reading: Set[int] = set()  # peers whose ring _ring_read goes through
        self.pokes: Set[int] = set()  # peers with frames queued in their ring: see flush
        # MPI probed only when told (see _requiet): per peer that writes to us
        # by ring, the messages its POKEs announced less those taken from
        # MPI; the peers that owe some; whether every peer writes by ring
        self.owed: Dict[int, int] = {}
        self.owing: Set[int] = set()
        self.marked: Set[int] = set()  # peers whose ring waits at a MARK for its frame
        self.quiet = False
        self.quiet_passes = 0  # passes of _progress since MPI was last probed
        self.probe_passes = 0  # passes of _progress that probed MPI
        self.mapped: List[_ring.Ring] = []  # the peers' rings we write to
        self.dead: List[_ring.Ring] = []  # rings of peers that left, unmapped at the next poll
        # peers whose process died, and how (see DeathWatch): appended by
        # another thread, reported lost at the next poll
        self.died: List[Tuple[int, str]] = []
        self.broken = False  # a peer died: MPI cannot disconnect from it any more
        self.lost_later: Dict[int, str] = {}  # peers that left, reported once their frames are in
        self.bulk_sent = self.bulk_got = 0  # frames with buffers in a bulk area
        self.heard_loss = False  # a peer left during this pass (see _progress)
        self.ring_sent = 0  # frames written to rings
        self.ring_got = 0  # frames read from rings
        self.ring_waits = 0  # sends that found a ring full
        self.ring_passes = 0  # passes of _progress that rings delivered in
        self.signalling = False
        if members is None:
            members = list(range(comm.Get_size()))
        self.ctx = members[comm.Get_rank()]
        self.stamp = (self.ctx + 1) << 40  # what we store in a peer's SENT (see Waker)
        self._link(comm, members)
        self.gone.update(c for c in range(self.size) if self.dcomm[c] is None and c != self.ctx)
        # collective: every rank of comm makes it here, at the same point
        self._window = MpiWindow(MPI, comm, members) if window else None
        if wake is not None:
            self.wake_name = wake[0]
            self.waker = Waker(wake[0], self.ctx)
            self._learn_hosts(wake[1])
            self._offer_rings()

    def _link(self, comm: Any, members: Sequence[int]) -> None:
        """Reach, through ``comm`` (whose rank r is context members[r]), every
        context of it that no communicator of ours reached before."""
        members = list(members)
        size = max(self.size, max(members) + 1)
        grow = size - self.size
        if grow > 0:
            for a in (self.sent_msgs, self.sent_bytes, self.acked_msgs, self.acked_bytes,
                      self.got_msgs, self.got_bytes, self.credited_msgs, self.credited_bytes):
                a.extend([0] * grow)
            self.dcomm.extend([None] * grow)
            self.drank.extend([-1] * grow)
            self.size = size
        for r, c in enumerate(members):
            if c >= 0 and self.dcomm[c] is None:
                self.dcomm[c] = comm
                self.drank[c] = r
                self.gone.discard(c)
        self.links.append(comm)
        self.members.append(members)
        self.rx.append((comm, None if members == list(range(len(members))) else members))
        self._requiet()  # (new peers write by MPI until their SWITCH)

    def _learn_hosts(self, hosts: Mapping[int, str]) -> None:
        """Which contexts run on which host: those on ours can wake us."""
        self.hosts.update(hosts)
        if self.waker is None:
            return
        me = self.hosts.get(self.ctx)
        self.wakes = {p: Waker.address(self.wake_name, p) for p, h in self.hosts.items()  # type: ignore[arg-type]
                      if h == me and p != self.ctx and p < self.size and self.dcomm[p] is not None}
        reachable = sum(1 for c in self.dcomm if c is not None) - 1  # less ourselves
        self.woken_by_all = len(self.wakes) == reachable

    # -- what core asks ----------------------------------------------------
    def fileno(self) -> Optional[int]:
        # readable when a frame comes, if every peer can wake us (same host)
        return self.waker.sock.fileno() if self.waker is not None and self.woken_by_all else None

    def signal_arrivals(self, on: bool, again: bool = False) -> bool:
        """While ``on``, the kernel sends this process SIGIO when a peer wakes
        it (see :class:`Waker`): a peer on this host sends a wake-up with
        every frame. False, and nothing done, when some peer cannot wake
        this rank (another host)."""
        if self.waker is None or not self.woken_by_all:
            return False
        from .local import _set_async
        if on:
            # ring frames wake us while signals are on. Never cleared here:
            # this runs in the service's thread, perhaps while the engine's
            # sleep relies on the flag; its next wake clears it
            self.nap(True)
        self.signalling = on
        _set_async(self.waker.fd, on)
        return True

    def native_collectives(self, members: Sequence[int]) -> Optional["MpiCollectives"]:
        """MPI's own non-blocking collectives among the contexts ``members``:
        only while they are exactly the ranks of the communicator this
        context started with (no context added or gone since); else None."""
        if self.added or len(self.links) != 1 or self.gone or list(members) != self.members[0]:
            return None
        if self._natives is None:
            self._natives = MpiCollectives(self.MPI, self.links[0])
        return self._natives

    def window(self) -> Optional["MpiWindow"]:
        """The job's dynamic MPI window (one-sided reads of registered memory
        without the owner's CPU), or None: made only under mpiexec, where
        every rank is bound to the others until the job ends anyway."""
        return self._window

    def peers(self) -> List[int]:
        return [p for p in range(self.size) if p != self.ctx and p not in self.gone]

    def address(self) -> Tuple[str, str]:
        return ("mpi", f"{self.MPI.Get_processor_name()}:{os.getpid()}:rank{self.ctx}")

    # -- sending -------------------------------------------------------------
    def queue(self, dest: int, parts: Sequence[object], load: int) -> int:
        self._check(dest)
        r = self.rout.get(dest)
        if r is None and dest in self.rout_next:
            r = self._switch(dest)
        if r is not None:
            self.pokes.add(dest)  # flush() sees whether it naps
            return self._ring_send(dest, r, parts, load, False)
        rec = _record(parts, load)
        if rec is None or len(rec) > SMALL:
            return self.send(dest, parts, load)
        w = self.wbuf.get(dest)
        if w is None:
            self.wbuf[dest] = bytearray(rec)
        else:
            w += rec
            if len(w) >= SMALL:
                self._flush_one(dest)
        return len(rec)

    def flush(self) -> None:
        if self.pokes:
            pokes, self.pokes = self.pokes, set()
            for dest in pokes:
                r = self.rout.get(dest)
                if r is not None:
                    self._wake_ring(dest, r)
        for dest in list(self.wbuf):
            self._flush_one(dest)

    def _flush_one(self, dest: int) -> None:
        data = self.wbuf.pop(dest, None)
        if data and dest not in self.gone:
            self._post(dest, data, counted=True)

    def send(self, dest: int, parts: Sequence[object], load: int) -> int:
        r = self.rout.get(dest)
        if r is not None and not self.closing:
            # the common case on one host, first: a peer we write to in its
            # ring (which it is only until it leaves)
            self.sends += 1
            if self.sends % 3 == 0 and self._mpi_waiting():
                # MPI too, when it holds something (a goodbye: a peer that left
                # is found within three sends, as off the rings); a whole pass
                # every 3rd send, found or not, cost the null call 5-7%
                self._progress_aside()
                r = self.rout.get(dest)
            if r is not None:
                if len(parts) == 1:
                    # the commonest frame: _ring_send's first case, inline
                    d = parts[0]
                    if (type(d) is bytes or type(d) is bytearray) and len(d) <= self.rmax:
                        k = r.send1(d, load)  # written, and the reader's NAP looked at
                        self.ring_sent += 1
                        if k != 1:
                            if k == 0:
                                self._wait_ring(dest, r, d, load, 0)
                            self._wake_ring(dest, r)
                        return 16 + len(d)
                return self._ring_send(dest, r, parts, load, True)
        self._check(dest)
        if dest in self.wbuf:
            self._flush_one(dest)  # the frames queued before this one go first
        # a peer that left is found here, within three sends (looking costs
        # a probe: not on every send)
        self.sends += 1
        if self.sends % 3 == 0:
            self._progress_aside()
            if dest in self.gone:
                raise ConnectionError(f"context {dest} has left")
        r = self.rout.get(dest)
        if r is None and dest in self.rout_next:
            r = self._switch(dest)
        if r is not None:
            return self._ring_send(dest, r, parts, load, True)
        return self._mpi_send(dest, parts, load)

    def _mpi_send(self, dest: int, parts: Sequence[object], load: int) -> int:
        if dest in self.wbuf:
            self._flush_one(dest)  # the frames queued before this one go first
        rec = _record(parts, load)
        if rec is not None:
            self._post(dest, rec, counted=True)
            return len(rec)
        views = [_view(p) for p in parts]
        lens = [v.nbytes for v in views]
        head = bytearray(_REC.pack(len(views), load))
        head += struct.pack(f"<{len(views)}Q", *lens)
        for v in views:
            if v.nbytes <= INLINE:
                head += v
        self._post(dest, head, counted=True,
                   extra=sum(n for n in lens if INLINE < n <= COPY_MAX))
        byte, isend, rank = self.byte, self.dcomm[dest].Isend, self.drank[dest]
        reqs = []
        for v in views:
            if v.nbytes > COPY_MAX:
                reqs.append(isend([v, byte], rank, DATA))
            elif v.nbytes > INLINE:
                # a copy of our own (as a socket copies into the kernel): the
                # send returns before the peer takes it, within the window
                c = bytearray(v)
                self.unfinished.append((isend([c, byte], rank, DATA), c))
                self.pushing += 1
        self._wait_sent(dest, reqs, views)
        return len(head) + sum(n for n in lens if n > INLINE)

    def _check(self, dest: int) -> None:
        if self.closed:
            raise ConnectionError("the transport is closed")
        if not isinstance(dest, int) or not 0 <= dest < self.size:
            raise ConnectionError(f"no context {dest} (ranks 0..{self.size - 1})")
        if dest in self.gone:
            raise ConnectionError(f"context {dest} has left")

    def _post(self, dest: int, data: Any, counted: bool, extra: int = 0, wake: bool = False) -> None:
        """Isend one FRAME message, within the peer's window when ``counted``
        (``extra``: bytes of DATA messages that follow it and count too);
        the peer is woken for it when ``counted`` or ``wake``."""
        if counted:
            n = len(data) + extra
            if (self.sent_msgs[dest] - self.acked_msgs[dest] >= WINDOW_MESSAGES
                    or (self.sent_bytes[dest] - self.acked_bytes[dest] + n > WINDOW_BYTES
                        and self.sent_bytes[dest] > self.acked_bytes[dest])):
                self._wait_room(dest, n)
            self.sent_msgs[dest] += 1
            self.sent_bytes[dest] += n
            self.active_at = time.monotonic()
        w = st = None
        if counted or wake:  # (credits are for ranks that poll: no wake-up)
            w = self.wakes.get(dest)
            if w is not None:
                st = self.states.get(dest)
                if st is None:
                    st = self.states[dest] = Waker.peer_state(self.wake_name, dest)  # type: ignore[arg-type]
                    if st is None:
                        del self.states[dest]  # not made yet: wake it every time meanwhile
                if st is not None:
                    self.stamp += 1
                    st[SENT] = self.stamp  # before the frame: see Waker
        self.unfinished.append((self.dcomm[dest].Isend([data, self.byte], self.drank[dest], FRAME),
                                data))
        if len(data) > EAGER:
            self.pushing += 1
        r = self.rout.get(dest)
        if r is not None:
            # it reads us by ring, and looks at MPI only when told so (see
            # _requiet): a POKE in the ring, after the message, tells it
            if not r.put(b"", 0, _ring.POKE):
                self._wait_ring(dest, r, b"", 0, _ring.POKE)
        if len(self.unfinished) > 32:
            self._reap()
        if w is not None and (st is None or not st[POLLING]):
            self.wakeups += 1
            self.waker.wake(w)  # type: ignore[union-attr]

    def _wait_room(self, dest: int, n: int) -> None:
        # the peer has not taken our last window yet: take what comes for us
        # meanwhile (credits among it), so that two ranks flooding each other
        # both go on
        self.blocked_on = dest
        try:
            while (self.sent_msgs[dest] - self.acked_msgs[dest] >= WINDOW_MESSAGES
                   or (self.sent_bytes[dest] - self.acked_bytes[dest] + n > WINDOW_BYTES
                       and self.sent_bytes[dest] > self.acked_bytes[dest])):
                if self.died:
                    # its watcher heard of a death (dest's, it may be: a dead
                    # peer never credits, and this loop went on for ever)
                    self._on_died()
                if dest in self.gone:
                    raise ConnectionError(f"context {dest} has left")
                if not self._progress_aside():
                    self._nap(NAP_MIN)
        finally:
            self.blocked_on = None

    def _wait_sent(self, dest: int, reqs: List[Any], views: List[Any]) -> None:
        """Wait until MPI has the large buffers out of our memory, receiving meanwhile."""
        if not reqs:
            return
        Testall = self.MPI.Request.Testall
        self.blocked_on = dest
        try:
            while not Testall(reqs):
                if self.died:
                    self._on_died()  # (its watcher heard of a death: it may be dest's)
                if dest in self.gone:
                    self._abandon(reqs, views)
                    raise ConnectionError(f"context {dest} left before taking a frame")
                if not self._progress_aside() and not self._moved:
                    # the peer copies out of our memory as it makes progress:
                    # a short nap at most, or the copy waits for us
                    self._nap(NAP_MIN)
        finally:
            self.blocked_on = None

    def _abandon(self, reqs: List[Any], bufs: Any) -> None:
        for r in reqs:
            try:
                r.Cancel()
            except Exception:
                pass
        # a cancelled request completes at once; one MPI could not cancel keeps
        # its buffer alive for as long as this transport lives
        if not self.MPI.Request.Testall(reqs):
            self.abandoned.append((reqs, bufs))

    def _reap(self) -> None:
        """Forget the sends MPI has finished with (they finish in order, or nearly)."""
        u = self.unfinished
        while u and u[0][0].Test():
            if len(u.popleft()[1]) > EAGER and self.pushing:
                self.pushing -= 1
        if self.pushing and u:
            # one that waits for its peer must not hold back the others' count
            self.pushing = sum(1 for r, b in u if len(b) > EAGER and not r.Test())

    def _credit(self, src: int) -> None:
        self.credited_msgs[src] = self.got_msgs[src]
        self.credited_bytes[src] = self.got_bytes[src]
        rec = _REC.pack(CONTROL, CREDIT) + _CREDIT.pack(self.got_msgs[src], self.got_bytes[src])
        self._post(src, rec, counted=False)

    def _control(self, dest: int, kind: int, wake: bool = False) -> None:
        self._post(dest, _REC.pack(CONTROL, kind) + _CREDIT.pack(0, 0), counted=False, wake=wake)

    # -- shared-memory rings ---------------------------------------------------
    def bulk_counts(self) -> Dict[str, int]:
        """Frames sent and received with buffers in a ring's bulk area, and
        the buffers received so that are still in use here."""
        return _ring.bulk_counts(self.bulk_sent, self.bulk_got, (r for _, r in self.rins))

    def _offer_rings(self) -> None:
        """Offer a ring to every peer of this host not offered one yet."""
        if not self.rings:
            return
        for p in sorted(self.wakes):
            if p not in self.offered and p not in self.gone:
                self.offered.add(p)
                self._offer(p)

    def _offer(self, p: int) -> None:
        try:
            if self.host is None:
                self.host = _ring.RingHost()
            r = self.host.ring(self.ring_bytes, bulk=self.bulk_bytes)
        except OSError:
            return  # no memfd here (or no memory): MPI alone
        nonce = int.from_bytes(os.urandom(7), "little") + 1
        r.words[_NONCE] = nonce
        self.offers[p] = r
        body = _OFFER.pack(os.getpid(), self.host.fd, r.offset, r.cap, nonce)
        self._post(p, _REC.pack(CONTROL, OFFER) + _CREDIT.pack(len(body), 0) + body,
                   counted=False)

    def _offered(self, src: int, body: Any) -> None:
        """``src`` offers us its ring: we write there from our next send."""
        pid, fd, offset, cap, nonce = _OFFER.unpack_from(body)
        if not self.rings or src not in self.wakes or src in self.rout or src in self.rout_next:
            return
        try:
            r = _ring.Ring.open(pid, fd, offset, cap, self.ctx + 1)
        except (OSError, ValueError):
            return  # not ours to open (another user, no /proc): MPI alone
        if r.words[_NONCE] != nonce:
            r.close()  # the pid is another process here: not the same pid namespace
            return
        self.mapped.append(r)
        self.rout_next[src] = r

    def _switched(self, src: int) -> None:
        """``src`` writes to us in its ring from here on (after all it sent by MPI)."""
        r = self.offers.pop(src, None)
        if r is None:
            return
        self.rin[src] = r
        self.rins = list(self.rin.items())
        self.bell_seen = -1  # look at every ring at the next pass
        self._requiet()

    def _switch(self, dest: int) -> _ring.Ring:
        """Write to ``dest``'s ring from now on: the frames queued for MPI go
        first, then SWITCH, which tells the peer to look there."""
        self._flush_one(dest)
        self._post(dest, _REC.pack(CONTROL, SWITCH) + _CREDIT.pack(0, 0), counted=False)
        r = self.rout[dest] = self.rout_next.pop(dest)
        return r

    def _ring_send(self, dest: int, r: _ring.Ring, parts: Sequence[object], load: int,
                   now: bool) -> int:
        # an entry of up to half the ring fits once the reader has caught up,
        # wherever the ring's end falls (rmax); a larger one might never fit
        d = parts[0] if len(parts) == 1 else None
        if (type(d) is bytes or type(d) is bytearray) and len(d) <= self.rmax:  # type: ignore[arg-type]
            n = len(d)  # type: ignore[arg-type]
            if not r.put(d, load):
                self._wait_ring(dest, r, d, load, 0)
        else:
            rec = _record(parts, load)
            if rec is None or len(rec) > self.rmax:
                if r.bulk is not None:
                    views = [_view(p) for p in parts]
                    if max(v.nbytes for v in views) >= BULK_MIN:
                        body = r.bulk_body(views, load, BULK_MIN, self.rmax)
                        if body is not None:  # its large buffers are in the bulk area
                            self.bulk_sent += 1
                            if not r.put(body, 0, _ring.BULK):
                                self._wait_ring(dest, r, body, 0, _ring.BULK)
                            self.ring_sent += 1
                            if now:
                                self._wake_ring(dest, r)
                            return 16 + len(body) + sum(v.nbytes for v in views)
                # large: it travels by MPI, and a MARK in the ring keeps its place
                if not r.put(b"", 0, _ring.MARK):
                    self._wait_ring(dest, r, b"", 0, _ring.MARK)
                return self._mpi_send(dest, parts, load)
            n = len(rec)
            if not r.put(rec, 0, _ring.MANY):
                self._wait_ring(dest, r, rec, 0, _ring.MANY)
        self.ring_sent += 1
        if now:
            self._wake_ring(dest, r)
        return 16 + n

    def _wake_ring(self, dest: int, r: _ring.Ring) -> None:
        # the reader flags NAP, then looks at BELL; we stored BELL, now NAP
        lock = _ring._fence_lock  # _ring.fence(), inline (once a frame)
        lock.acquire()
        lock.release()
        bell = r.bell
        if bell[_ring.NAP]:
            bell[_ring.NAP] = 0
            self.wakeups += 1
            self.waker.wake(self.wakes[dest])  # type: ignore[union-attr]

    def _wait_ring(self, dest: int, r: _ring.Ring, data: Any, load: int, kind: int) -> None:
        # The peer's ring is full: it has not read for a while. Take what
        # comes meanwhile (the peer may be waiting for room in ours), as
        # _wait_room does for MPI's window.
        self.blocked_on = dest
        self.ring_waits += 1
        try:
            while not r.put(data, load, kind):
                if self.died:
                    self._on_died()  # (as _wait_room does)
                if dest in self.gone or self.closed:
                    raise ConnectionError(f"context {dest} has left")
                self._wake_ring(dest, r)
                if not self._progress_aside():
                    self._nap(NAP_MIN)
        finally:
            self.blocked_on = None

    def _rings(self) -> bool:
        """Read the rings, if a peer wrote since we last looked."""
        b = self.host.words[_ring.BELL]  # type: ignore[union-attr]
        if b == self.bell_seen:
            return False
        self.bell_seen = b
        got = False
        reading = self.reading
        for p, r in self.rins:
            if r.words[_ring.TAIL] != r.pos:
                if p in reading:
                    self.bell_seen = -1  # (being read further up the stack: look again)
                    continue
                if self.closing or p in self.inflight:
                    got = self._ring_read(p, r) or got
                    continue
                # _ring_read's commonest pass, inline: frames of one buffer
                # until the ring is empty (anything else: _ring_read goes on)
                reading.add(p)
                try:
                    st = r.drain(self.deliver, p, self.inflight)
                finally:
                    reading.discard(p)
                if st > 15:
                    self.ring_got += st >> 4
                    got = True
                if st & 15 != _ring.EMPTY and r.words is not None:
                    got = self._ring_read(p, r) or got
        return got

    def _ring_read(self, p: int, r: _ring.Ring, final: bool = False) -> bool:
        """Hand on what ``p``'s ring holds, and the frames by MPI its MARKs
        stand for; stops at a MARK whose frame has not come yet (``final``:
        ``p`` has left, every frame it sent has come: deliver them all)."""
        got = False
        self.reading.add(p)
        try:
            while True:
                if not self.closing and p not in self.inflight:
                    # the frames of one buffer, the commonest, in the ring's
                    # core, up to an entry of another kind (or until p has a
                    # frame by MPI in flight: what follows queues behind it)
                    st = r.drain(self.deliver, p, self.inflight)
                    if st > 15:
                        self.ring_got += st >> 4
                        got = True
                    kind = st & 15
                    if kind == _ring.EMPTY:
                        break
                    if r.words is None:
                        break  # (closed by what it delivered)
                    if kind == _ring.HELD:
                        continue
                mm, words = r.mm, r.words
                head = r.pos
                if words[_ring.TAIL] == head:
                    words[_ring.HEAD] = head
                    break
                base = _ring.DATA + (head & r.mask)
                n, load = _ring.ENTRY.unpack_from(mm, base)
                if n >= 0:
                    data = mm[base + 8:base + 8 + n]
                    r.pos = head + 8 + ((n + 7) & -8)
                    self.ring_got += 1
                    got = self._hand(p, [data], load) or got
                elif n == _ring.WRAP:
                    r.pos = head + r.cap - (head & r.mask)
                elif n == _ring.MARK:
                    q = self.held.get(p)
                    if not q:
                        words[_ring.HEAD] = head
                        if not final:
                            # still on its way: read again when it comes
                            # (its POKE, behind the MARK, is not read yet)
                            self.marked.add(p)
                            return got
                        r.pos = head + 8
                        continue
                    f = q.popleft()
                    self.marked.discard(p)
                    r.pos = head + 8
                    got = self._hand_frame(p, f) or got
                elif n == _ring.BULK:
                    bufs, fload = r.read_bulk(base, self.landing, p)
                    self.bulk_got += 1
                    r.pos = head + 8 + ((load + 7) & -8)  # load: the entry's length here
                    self.ring_got += 1
                    got = self._hand(p, bufs, fload) or got
                elif n == _ring.POKE:  # p sent us a message by MPI: see _requiet
                    r.pos = head + 8
                    o = self.owed[p] = self.owed.get(p, 0) + 1
                    if o > 0:
                        self.owing.add(p)
                elif n == _ring.MANY:  # a frame of several buffers, as one MPI record
                    bufs, fload = r.read_many(base)  # (the payloads writable, as MPI's are)
                    r.pos = head + 8 + ((load + 7) & -8)  # load: the entry's length here
                    self.ring_got += 1
                    got = self._hand(p, bufs, fload) or got
                else:
                    raise ValueError(f"entry of kind {n} in the ring from rank {p}")
                if r.words is None:
                    break
                # (HEAD is stored when the ring is found empty, or at a MARK)
            if final:
                q = self.held.pop(p, None)
                while q:  # no MARK is left for these: deliver them all the same
                    got = self._hand_frame(p, q.popleft()) or got
        finally:
            self.reading.discard(p)
        return got

    def _hand(self, p: int, parts: List[Any], load: int) -> bool:
        """Deliver a frame of ``p``'s, or queue it behind one whose large
        buffers are still on their way."""
        if self.closing:
            return False
        q = self.inflight.get(p)
        if q is not None:
            q.append(_Frame(parts, load, []))
            return False
        self.deliver(p, parts, load)  # type: ignore[misc]
        return True

    def _hand_frame(self, p: int, f: _Frame) -> bool:
        if f.reqs or p in self.inflight:
            self.inflight.setdefault(p, deque()).append(f)
            return False
        return self._hand(p, f.parts, f.load)

    def nap(self, on: bool) -> bool:
        """While ``on``, this rank may not look at its rings for a while (it
        sleeps on :meth:`fileno`, or user code runs): a peer that writes to
        one then also wakes it (see :class:`Waker`). True if a ring already
        holds frames (poll rather than wait).

        Example (no ring, on ``COMM_SELF``, where mpi4py is installed):
            >>> if available() is None:
            ...     t = MpiTransport(mpi().COMM_SELF.Dup())
            ...     flags = t.nap(True), t.nap(False)
            ...     t.close()
            ... else:
            ...     flags = (False, False)
            >>> flags
            (False, False)
        """
        host = self.host
        if host is not None:
            host.words[_ring.NAP] = 1 if on else 0
        if not on:
            return False
        if self._aside:
            return True  # delivered while a send waited: see poll
        if host is None or not (self.rins or self.offers):
            return False
        _ring.fence()  # our flag before their BELL (see _wake_ring)
        return host.words[_ring.BELL] != self.bell_seen

    def _bury(self) -> None:
        """Unmap the rings of peers that left (poll calls it first thing: no
        transport code runs further up the stack then), giving the pages of
        ours back."""
        dead, self.dead = self.dead, []
        for r in dead:
            if r.host is self.host:
                self.host.drop(r)  # type: ignore[union-attr]
            else:
                r.close()
                if r in self.mapped:
                    self.mapped.remove(r)

    def _forget_rings(self, p: int) -> None:
        """``p`` has left and what its ring held is delivered: its rings go
        at the next poll."""
        for d in (self.offers, self.rin, self.rout_next, self.rout):
            r = d.pop(p, None)
            if r is not None:
                self.dead.append(r)
        self.rins = list(self.rin.items())
        self.pokes.discard(p)
        self.owed.pop(p, None)
        self.owing.discard(p)
        self.marked.discard(p)
        self._requiet()

    def _requiet(self) -> None:
        """Whether MPI is probed only when told (``quiet``): when every peer
        that may send us a message writes to us by ring. Such a peer POKEs
        its ring after each message it sends us by MPI (see :meth:`_post`),
        after its SWITCH, so the reader knows when MPI holds something (a
        large frame behind its MARK, a credit, a goodbye). Then a null call
        makes no MPI call at all; before, a probe (0.75 us here) every 8th
        look of a spin, every 16th pass and every 3rd send made the null
        call on ``mpi`` 4 to 8% slower than on ``local``. A pass probes
        unasked every :data:`_QUIET_LOOK` all the same, and every pass while
        this rank has memory attached to the job's window (MPICH serves
        another rank's read of it only in this rank's MPI calls)."""
        rin, gone = self.rin, self.gone
        self.quiet = bool(rin) and all(p in rin or p in gone
                                       for p in range(self.size) if p != self.ctx)

    def _close_rings(self) -> None:
        self.rin, self.rins, self.offers, self.rout, self.rout_next = {}, [], {}, {}, {}
        self.dead = []  # (every one is in mapped or in the host)
        for r in self.mapped:
            r.close()
        self.mapped = []
        if self.host is not None:
            self.host.close()  # and every ring in it
            self.host = None

    # -- receiving -----------------------------------------------------------
    _moved = False  # the last _progress completed sends or receives of large buffers
    # frames were delivered outside poll (while a send waited, or looked for
    # peers that left): the next poll returns True at once, since what came
    # may be what its caller waits for (a value taken as it was read)
    _aside = False

    def _mpi_waiting(self) -> bool:
        """Whether MPI holds a frame for us, or a large buffer is on its way
        (one probe: what a send that goes by a ring asks before a whole pass)."""
        if self.inflight or self.pushing:
            return True
        if self.quiet and not self.closing:
            # what MPI holds for us was announced by a POKE: read already,
            # or in a ring not read yet (which a peer wrote since we looked)
            return bool(self.owing or self.marked) \
                or self.host.words[_ring.BELL] != self.bell_seen  # type: ignore[union-attr]
        status, anyone = self.status, self.any_source
        for comm, _ in self.rx:
            if comm.Iprobe(anyone, FRAME, status):
                return True
        return False

    def _progress_aside(self) -> bool:
        """_progress, from a send: what it delivers, the next poll reports."""
        got = self._progress()
        if got:
            self._aside = True
        return got

    def poll(self, timeout: Optional[float]) -> bool:
        if self.dead:
            self._bury()
        if self.died:
            self._on_died()
            return True
        if self.rout_next and not self.closing:
            # a peer that offered us its ring is written to there from now
            # on, not from our first frame for it: until every peer writes
            # to it by ring, a rank probes MPI unasked (see _requiet)
            for dest in list(self.rout_next):
                if dest not in self.gone:
                    self._switch(dest)
        if self.signalling and self.rins and not self.host.words[_ring.NAP]:  # type: ignore[union-attr]
            # a writer that woke us cleared NAP: flag it again before this
            # look, or its next frame would raise no signal
            self.nap(True)
        woke = 0
        if timeout == 0 and self.signalling and self.waker is not None:
            # served from a signal: its wake-ups are read whatever brings the
            # frames (the socket holds 10; with them unread, a peer's next
            # wake-up, and so its signal, was dropped: requests to a rank
            # whose method slept waited for the service's 50 ms round)
            woke = self.waker.drain()
        if self._progress() or self._aside:
            self._aside = False
            return True
        if timeout == 0:
            if woke:
                # served from a signal while user code runs: a peer woke us
                # for a frame MPI does not show yet (between ranks without a
                # ring it may take a while): look for it now, as a woken
                # rank's poll does, or it waits for the service's next round
                return self._spin(None, woken=True)
            return False
        deadline = None if timeout is None else time.monotonic() + timeout
        own = self.waker.state if self.waker is not None else None
        seen = own[SENT] if own is not None else 0  # frames sent after this are not here yet
        if self.spin_s > 0.0 and not self.inflight:
            start = time.perf_counter()
            if self._spin(deadline):
                return True
            got = self._wait(deadline, own, seen)
            if self.rins:  # as on local: where frames are seen in shared memory
                self._adapt(time.perf_counter() - start, got)
            return got
        return self._wait(deadline, own, seen)

    glance = _ring.glance

    def _adapt(self, waited: float, came: bool) -> None:
        # as the local transport does: a frame that came soon after the spin
        # gave up cost a sleep and a wake-up that a longer spin would have
        # saved, so spin that long next time (up to spin_max); a long wait,
        # or one that ended with nothing, brings the spin back down
        if came and waited <= self.spin_max:
            self.spin_cur = min(self.spin_max, max(self.spin_cur, 1.5 * waited))
        elif self.spin_cur > self.spin_s:
            self.spin_cur = max(self.spin_s, 0.5 * self.spin_cur)

    def _wait(self, deadline: Optional[float], own: Any, seen: int) -> bool:
        """Wait for a frame, after the spin (see poll): True if one came."""
        waker = self.waker
        while True:
            if self.died:  # (its watcher woke us)
                self._on_died()
                return True
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
            else:
                left = SLEEP_MAX
            if self.inflight:
                # a large buffer is on its way: MPI moves it as we poll
                self._nap(min(NAP_MIN, left))
            elif self.pushing:
                # a large message MPI has not sent yet needs our progress to leave
                self._nap(min(NAP_MAX, left))
            elif waker is not None and self.wakes:
                # Peers on this host wake us; others (if any) are polled for
                # every NAP_MAX. A wake-up comes right after its frame was
                # handed to MPI, which may take a while to show it here: so
                # one read now means a frame is on its way, and we poll for
                # it (SPIN_WOKEN) rather than sleep past it.
                if waker.drain():
                    if self._progress() or self._spin(deadline, woken=True):
                        return True
                    self.empty_wakes += 1
                    self.expect = True  # it is late: sleep briefly until it shows
                    continue
                if self._progress():
                    return True
                if own is not None and own[SENT] != seen:
                    # a peer sent a frame since we began, maybe while we
                    # polled (so it did not wake us): it is on its way
                    seen = own[SENT]
                    if self._spin(deadline, woken=True):
                        return True
                    continue
                # (a ring offered and not yet taken counts: its peer may
                # switch to it and write there while we sleep, and wakes us
                # only if NAP is flagged; it was not, and the first calls of
                # a job waited SLEEP_MAX each)
                rings = self.rins or self.offers
                if rings and self.nap(True):
                    # a ring frame came since we last looked: NAP is flagged
                    # (a writer from here on wakes us), look once more
                    if not self.signalling:
                        self.nap(False)
                    if self._progress():
                        return True
                    continue
                self._reap()
                self.sleeps += 1
                longest = SLEEP_MAX if self.woken_by_all and not self.expect else NAP_MAX
                try:
                    waker.sleep(min(left, longest))
                finally:
                    if rings and not self.signalling:
                        self.nap(False)
                continue
            else:
                self._nap(min(NAP_MAX, left))
            if self._progress():
                return True

    def _nap(self, most: float = NAP_MAX) -> None:
        """Sleep NAP_MIN if this rank was active in the last HOT seconds, else
        twice as long as last time (up to NAP_MAX); ``most`` at most."""
        if time.monotonic() - self.active_at < HOT:
            d = NAP_MIN
        else:
            d = self.nap_len = min(max(self.nap_len * 2, NAP_MIN), NAP_MAX)
        self.naps += 1
        time.sleep(min(d, most))

    def _spin(self, deadline: Optional[float], woken: bool = False) -> bool:
        # As local does: poll for spin_s before sleeping, but only while this
        # rank has a core to itself (a gap between two polls means another
        # process had it; then sleep at once for a while). Woken for a frame,
        # poll for it a few times before giving the core away: it is on its
        # way, and usually shows at the second look.
        now = time.perf_counter()
        if now < self.calm_until and not woken:
            return False
        end = now + (SPIN_WOKEN if woken else self.spin_cur)
        if deadline is not None:
            end = min(end, now + max(0.0, deadline - time.monotonic()))
        clock = time.perf_counter
        yield_ = os.sched_yield
        progress = self._progress
        last = now
        looks = 0 if woken else _EAGER_LOOKS
        own = self.waker.state if self.waker is not None else None
        if own is not None:
            own[POLLING] = 1  # peers need not wake us meanwhile
        # with rings, MPI only at every _MPI_LOOK-th look: frames come by the
        # rings (a large one's MARK too), and a probe costs more than a look
        rings = self._rings if self.rins and not woken else None
        try:
            while True:
                if rings is not None and looks % _MPI_LOOK:
                    if rings():
                        self.active_at = time.monotonic()
                        self.expect = False
                        return True
                elif progress():
                    return True
                t = clock()
                if t - last > _PREEMPTED:
                    self.calm_until = t + _CALM
                    self.spins_preempted += 1
                    return False
                if t > end:
                    return False
                last = t
                looks += 1
                if looks > _EAGER_LOOKS:
                    yield_()  # lets a process waiting for this core run first
        finally:
            if own is not None:
                own[POLLING] = 0

    def _progress(self) -> bool:
        """One pass: finish large receives, take the messages that came; True if
        a frame was delivered."""
        got = False
        self._moved = False
        natives = self._natives
        if natives is not None and natives.pending:
            # MPI's own collectives progress in every wait, not only in the
            # engine's pollers: one that a rank joined late (as its function
            # ended) must end while this context waits to close
            natives.drive()
        if self.rins:
            got = self._rings()
            if got:
                # MPI too, now and then (a goodbye, a credit, a large
                # buffer): while rings deliver, a probe would double a pass
                self.ring_passes += 1
                if self.ring_passes % _RING_LOOK:
                    self.active_at = time.monotonic()
                    self.expect = False
                    return True
        if self.inflight:
            got = self._advance() or got
        if self.pushing or len(self.unfinished) > 16:
            self._reap()
        if self.quiet and not self.owing and not self.marked and not self.closing \
                and self.quiet_passes < _QUIET_LOOK \
                and (self._window is None or not self._window.attached):
            self.quiet_passes += 1  # nothing was announced: no probe (see _requiet)
        else:
            self.quiet_passes = 0
            self.probe_passes += 1
            status, anyone, byte = self.status, self.any_source, self.byte
            rin, owed, owing = self.rin, self.owed, self.owing
            for comm, members in self.rx:
                for _ in range(_PROBES):
                    msg = comm.Improbe(anyone, FRAME, status)
                    if msg is None:
                        break
                    src = status.Get_source()
                    if members is not None:
                        src = members[src]
                    if src in rin:  # one its ring announced (or will: see _requiet)
                        o = owed[src] = owed.get(src, 0) - 1
                        if o <= 0:
                            owing.discard(src)
                    buf = bytearray(status.Get_count(byte))
                    msg.Recv([buf, byte])
                    got = self._parse(src, buf) or got
        if self.bell_seen == -1 and self.rins:
            # a SWITCH that came, a frame a MARK waits for: look again
            got = self._rings() or got
        if self.grows and not self.closing:
            self.grow(self.grows.pop(0))
        if self.heard_loss:
            # a peer left: the engine hears of it now, not when its wait ends
            # (a goodbye is no frame, and the wait went back to sleep)
            self.heard_loss = False
            got = True
        if got or self._moved:
            self.active_at = time.monotonic()
            self.expect = False
        return got

    def _advance(self) -> bool:
        got = False
        Testall = self.MPI.Request.Testall
        for src in list(self.inflight):
            q = self.inflight[src]
            while q and Testall(q[0].reqs):
                f = q.popleft()
                self._moved = True
                if not self.closing:
                    self.deliver(src, f.parts, f.load)  # type: ignore[misc]
                    got = True
            if not q:
                del self.inflight[src]
                how = self.lost_later.pop(src, None)
                if how is not None and not self.closing and self.lost is not None:
                    self.lost(src, how)
                    self.heard_loss = True
        return got

    def _parse(self, src: int, buf: bytearray) -> bool:
        got = False
        mv = memoryview(buf)
        pos, end = 0, len(buf)
        counted = False
        copied = 0
        deliver = self.deliver
        # after its SWITCH, a peer's frames by MPI wait for their MARK in its ring
        hq = self.held.setdefault(src, deque()) if src in self.rin else None
        while pos < end:
            nb, load = _REC.unpack_from(buf, pos)
            if nb == CONTROL:
                a, b = _CREDIT.unpack_from(buf, pos + 8)
                pos += 8 + _CREDIT.size
                if load == CREDIT:
                    self.acked_msgs[src] = max(self.acked_msgs[src], a)
                    self.acked_bytes[src] = max(self.acked_bytes[src], b)
                elif load == BYE:
                    self._bye(src)
                elif load == ACK:
                    self.acked.add(src)
                elif load == GROW:  # a plan to add ranks, a bytes long
                    self.grows.append(pickle.loads(buf[pos:pos + a]))
                    pos += a
                elif load == OFFER:
                    self._offered(src, buf[pos:pos + a])
                    pos += a
                elif load == SWITCH:
                    self._switched(src)
                    if src in self.rin:
                        hq = self.held.setdefault(src, deque())
                continue
            counted = True
            if nb == 1:
                n0 = _LEN1.unpack_from(buf, pos)[2]
                if n0 <= INLINE:
                    pos += 16
                    parts = [mv[pos:pos + n0]]
                    pos += n0
                    if hq is not None:
                        hq.append(_Frame(parts, load, []))
                        self.bell_seen = -1  # its MARK may be waiting for it
                    elif src in self.inflight:
                        self.inflight[src].append(_Frame(parts, load, []))
                    elif not self.closing:
                        deliver(src, parts, load)  # type: ignore[misc]
                        got = True
                    continue
            lens = struct.unpack_from(f"<{nb}Q", buf, pos + 8)
            pos += 8 + 8 * nb
            parts = []
            reqs = []
            for n in lens:
                if n <= INLINE:
                    parts.append(mv[pos:pos + n])
                    pos += n
                else:
                    if n <= COPY_MAX:
                        copied += n  # in the sender's window
                    # received in place: the array the user gets is this memory,
                    # or the buffer the receiver posted for it (a get's array)
                    big = None
                    if parts and self.landing is not None:
                        big = self.landing(src, parts[0], n)
                    if big is None:
                        big = self.pool.get(n)
                    reqs.append(self.dcomm[src].Irecv([big, self.byte], self.drank[src], DATA))
                    parts.append(big)
            if hq is not None:
                hq.append(_Frame(parts, load, reqs))
                self.bell_seen = -1  # its MARK may be waiting for it
            elif reqs or src in self.inflight:
                self.inflight.setdefault(src, deque()).append(_Frame(parts, load, reqs))
            elif not self.closing:
                deliver(src, parts, load)  # type: ignore[misc]
                got = True
        if counted:
            self.got_msgs[src] += 1
            self.got_bytes[src] += end + copied
            if src not in self.gone and (
                    self.got_msgs[src] - self.credited_msgs[src] >= WINDOW_MESSAGES // CREDIT_EVERY
                    or self.got_bytes[src] - self.credited_bytes[src] >= WINDOW_BYTES // CREDIT_EVERY):
                self._credit(src)
        return got

    def peer_died(self, peer: int, how: str) -> None:
        """Context ``peer``'s process died (called from any thread): it is
        reported lost at this rank's next poll, which this wakes."""
        self.died.append((peer, how))
        if self.waker is not None and self.wake_name is not None:
            self.waker.wake(Waker.address(self.wake_name, self.ctx))

    def _on_died(self) -> None:
        self.broken = True
        while self.died:  # (pop: the watcher's thread may append meanwhile)
            peer, how = self.died.pop(0)
            if peer in self.gone:
                continue  # it said goodbye before it died
            self.gone.add(peer)
            self.wbuf.pop(peer, None)
            self.inflight.pop(peer, None)
            self._forget_rings(peer)  # (and _requiet)
            if not self.closing and self.lost is not None:
                self.lost(peer, how)

    def _bye(self, src: int) -> None:
        """``src`` is leaving: everything it sent has come (order per pair)."""
        r = self.rin.get(src)
        if r is not None and src not in self.reading:
            # what it wrote in its ring before it left comes first
            self._ring_read(src, r, final=True)
        self._forget_rings(src)
        if src in self.gone:
            self.acked.add(src)  # we said goodbye too: its goodbye answers ours
            return
        self.gone.add(src)
        self._requiet()
        self.wbuf.pop(src, None)
        try:
            self._control(src, ACK)  # after everything we sent it: it can go
        except Exception:
            pass
        how = "its context left (it said goodbye on MPI)"
        if src in self.inflight:
            self.lost_later[src] = how  # once its last frames' large buffers are in
        elif not self.closing and self.lost is not None:
            self.lost(src, how)
            self.heard_loss = True

    # -- adding ranks ----------------------------------------------------------
    def tell_grow(self, dest: int, plan: Dict[str, Any]) -> None:
        """Context 0: ask context ``dest`` to take part in adding ranks (it does
        as soon as it next takes messages; see :meth:`grow`)."""
        self._check(dest)
        data = pickle.dumps(plan)
        self._flush_one(dest)  # after what was queued for it
        self._post(dest, _REC.pack(CONTROL, GROW) + _CREDIT.pack(len(data), 0) + data,
                   counted=False, wake=True)

    def grow(self, plan: Dict[str, Any]) -> None:
        """Join the ranks that context 0 spawned, together with every live context.

        ``plan``: "live", the live contexts (context 0 first), every one of
        which calls this; "ids", the contexts of the new ranks, in their
        order; "hosts", context -> host. The live contexts make one
        communicator (the last one every live context shares, or a part of it
        without the contexts that left), make an intercommunicator with the
        new ranks' world (context 0 leads; its communicator with the new ranks,
        ``peer_comm``, is the bridge) and merge it: from then on each new
        rank is reached through it, and every older pair as before. These
        calls block, but briefly: the new ranks have started already and
        wait in the same calls."""
        live, ids = list(plan["live"]), list(plan["ids"])
        latest, members = self.links[-1], self.members[-1]
        rank_of = {c: r for r, c in enumerate(members) if c >= 0}
        ranks = [rank_of[c] for c in live]
        local, temp = latest, None
        if ranks != list(range(latest.Get_size())):
            group = latest.Get_group()
            part = group.Incl(ranks)
            local = temp = latest.Create_group(part, GROW_TAG)
            part.Free()
            group.Free()
        leader = self.ctx == live[0]
        inter = local.Create_intercomm(0, self.peer_comm if leader else local, 1 if leader else 0,
                                       GROW_TAG)
        merged = inter.Merge(high=False)
        inter.Free()
        if temp is not None:
            temp.Free()
        if plan.get("main_by_value"):
            # the new ranks did not run the program: what its __main__
            # defines travels by value from every context from now on
            from ..core import marshal
            marshal.main_by_value()
        self._link(merged, live + ids)
        self._learn_hosts(plan["hosts"])
        self._offer_rings()

    # -- closing -------------------------------------------------------------
    def close(self, linger: float = LINGER) -> None:
        """Say goodbye to every peer, take what they still send until each one
        answers (or ``linger`` seconds pass), then let MPI forget the rest."""
        if not self.closed:
            self.goodbye()
            self.linger(linger)

    def goodbye(self) -> None:
        """The first half of :meth:`close`: flush, and tell every peer we leave."""
        if self.closing:
            return
        if self.died:
            self._on_died()  # (no goodbye to those, nor an answer to wait for)
        try:
            self.flush()
        except Exception:
            pass
        self.closing = True
        self.leaving = self.peers()
        for p in self.leaving:
            try:
                # woken: a peer asleep in a wait hears at once that we left
                # (one whose engine failed leaves while the others wait for it)
                self._control(p, BYE, wake=True)
                self.gone.add(p)
            except Exception:
                self.acked.add(p)

    def linger(self, linger: float = LINGER) -> None:
        """The second half of :meth:`close`: take what the peers still send
        (their large buffers included) until each has answered our goodbye, or
        ``linger`` seconds; then cancel what is left and release the
        communicators."""
        deadline = time.monotonic() + linger
        self.lingered_out = True
        try:
            while time.monotonic() < deadline:
                self._reap()
                while self.died:  # (MPI ended it: it will not answer)
                    self.broken = True
                    self.acked.add(self.died.pop(0)[0])
                # MPI's own collectives still pending (one a rank joined late,
                # as its function ended) are driven to their end (by
                # _progress, below): a rank that left one half done would
                # hold every rank's disconnection
                natives = self._natives is not None and bool(self._natives.pending)
                if not (any(p not in self.acked for p in self.leaving) or self.inflight
                        or self.unfinished or natives):
                    self.lingered_out = False
                    break
                if not self._progress() and not self._moved:
                    self._nap(NAP_MIN)
        except Exception:
            pass
        self.abandon()
        self.closed = True
        self._close_rings()
        if self.waker is not None:
            self.waker.close()
        # A collective of MPI's still pending now is one that some rank never
        # joined (it was stopped inside its function, at a Ctrl-C, while
        # this one waited): no disconnection can end while it is pending, so
        # none is waited for (the 10 s of DISCONNECT_WAIT, each time)
        stranded = self._natives is not None and bool(self._natives.pending)
        if self._natives is not None:
            self._natives.close()
        if self._window is not None:
            self._window.close()
        if stranded and self.release and not self.broken:
            print(f"macroflow: context {self.ctx}: an MPI collective that another context "
                  f"never joined is still pending; this process ends without MPI_Finalize",
                  file=sys.stderr)
            self.broken = True
            _disconnect_given_up()
        for c in self.release:
            try:
                if self.broken:
                    # (a disconnection waits for every process of the
                    # communicator: with one dead, forever)
                    c.Free()
                elif not disconnect(c, self.ctx):
                    self.broken = True  # the others would wait as long
            except Exception:
                pass

    def abandon(self) -> None:
        """Cancel every receive still pending (a rank leaving in a hurry);
        the sends still pending are left to MPI, their buffers kept. MPICH
        crashed cancelling a large send in flight (a segmentation fault of
        the ranks stopped by a Ctrl-C during a flood of large values, 3 of
        4 jobs of three ranks), and MPI 4 deprecates cancelling sends."""
        if self.unfinished:
            self.abandoned.append(([r for r, _ in self.unfinished],
                                   [b for _, b in self.unfinished]))
        reqs: List[Any] = []
        bufs: List[Any] = []
        for q in self.inflight.values():
            for f in q:
                reqs.extend(f.reqs)
                bufs.append(f.parts)
        self.unfinished.clear()
        self.pushing = 0
        self.inflight.clear()
        if reqs:
            self._abandon(reqs, bufs)


def _fine_timer_slack() -> None:
    """Let this thread's short sleeps last what they ask (Linux adds up to 50 us
    by default, which would more than double a nap of NAP_MIN)."""
    try:
        ctypes.CDLL(None).prctl(29, 1000, 0, 0, 0)  # PR_SET_TIMERSLACK, in ns
    except (OSError, AttributeError):
        pass


def _view(p: object) -> memoryview:
    if type(p) is PickleBuffer:
        return p.raw()
    m = memoryview(p)  # type: ignore[arg-type]
    return m if m.format == "B" and m.ndim == 1 and m.c_contiguous else m.cast("B")


def _record(parts: Sequence[object], load: int) -> Optional[bytes]:
    """The frame as one record if every buffer travels inline, else None."""
    if len(parts) == 1:
        d = parts[0]
        if isinstance(d, (bytes, bytearray)) and len(d) <= INLINE:
            return _LEN1.pack(1, load, len(d)) + d
    views = [_view(p) for p in parts]
    lens = [v.nbytes for v in views]
    if any(n > INLINE for n in lens):
        return None
    return b"".join([_REC.pack(len(views), load), struct.pack(f"<{len(views)}Q", *lens), *views])


# -- starting ranks ------------------------------------------------------------

def _poll_messages(comm: Any, tag: int, count: int, what: str, timeout: Optional[float],
                   waiting_for: Callable[[Set[int]], str],
                   into: Optional[Dict[int, Any]] = None) -> Dict[int, Any]:
    """Receive one pickled message of ``tag`` from each of ``count`` ranks,
    sleeping between polls (a blocking receive would spin a core), into
    ``into`` (a new dict by default), which it returns."""
    MPI = mpi()
    got: Dict[int, Any] = {} if into is None else into
    status = MPI.Status()
    start = time.monotonic()
    told = False
    nap = 0.0
    while len(got) < count:
        if comm.Iprobe(MPI.ANY_SOURCE, tag, status):
            src = status.Get_source()
            got[src] = comm.recv(source=src, tag=tag)
            nap = 0.0
            continue
        waited = time.monotonic() - start
        if timeout is not None and waited > timeout:
            raise RuntimeError(f"{what}: no answer within {timeout:g} s from "
                               f"{waiting_for(set(got))}")
        if not told and waited > 10.0:
            print(f"macroflow: {what}: still waiting for {waiting_for(set(got))}",
                  file=sys.stderr, flush=True)
            told = True
        nap = min(max(nap * 2, NAP_MIN), 0.01)
        time.sleep(nap)
    return got


def spawn(count: int, entry: str, timeout: float = 120.0) -> Tuple[Any, Any, Dict[int, Tuple[str, int]]]:
    """Start ``count`` fresh ranks that run ``entry`` ("module:function").

    Each is ``sys.executable`` started by ``MPI_Comm_spawn`` with this
    process's ``sys.path`` and working directory; it merges with this process
    into one communicator (this process is rank 0) and calls
    ``function(comm)``. Returns (intercommunicator, merged communicator,
    {rank: (host, pid)}). A rank that cannot import ``entry`` says why, and
    this raises RuntimeError with its traceback.

    Example:
        >>> if available() is None:
        ...     inter, comm, hosts = spawn(1, "macroflow.transport.mpi:_hello_only")
        ...     size = comm.Get_size()
        ...     comm.Disconnect(); inter.Disconnect()
        ... else:
        ...     size = 2
        >>> size
        2
    """
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        # (MPICH's process manager ends the spawning process when asked for none)
        raise ValueError(f"spawn: count must be a positive int; got {count!r}")
    if _broken is not None:
        raise RuntimeError(f"the mpi transport cannot start ranks in this process any more: "
                           f"{_broken}. Run the next computation on mpi in a new process "
                           f"(or on another transport)")
    MPI = mpi()
    code = _rank_code(entry, DeathWatch.here())
    sys.stdout.flush()
    sys.stderr.flush()
    sweep_segments()
    before = mpich_shm_files()
    inter = comm = None
    hellos: Dict[int, Any] = {}
    try:
        # A Ctrl-C in MPI's spawn or merge was raised as it returned, and its
        # communicator lost with it (the ranks could not be sent away): its
        # handler runs once both have returned (neither could be interrupted)
        with _sigint_later():
            with _own_process_group():
                inter = MPI.COMM_SELF.Spawn(sys.executable, args=["-c", code], maxprocs=count)
            comm = inter.Merge(high=False)
        _spawn_segments.update(mpich_shm_files() - before)
        _poll_messages(comm, HELLO, count, f"starting {count} MPI ranks", timeout,
                       lambda have: "ranks " + ", ".join(
                           str(r) for r in range(1, count + 1) if r not in have), into=hellos)
    except KeyboardInterrupt:
        if inter is not None and entry.endswith((":_serve_spawned", ":_serve_added")):
            _send_away(inter, comm, count, hellos)
        raise
    errors = {r: h[1] for r, h in hellos.items() if h[0] == "error"}
    if errors:
        try:
            comm.Disconnect()
            inter.Disconnect()
        except Exception:
            pass
        r, text = sorted(errors.items())[0]
        raise RuntimeError(f"spawned rank {r} could not start ({entry}):\n{text}")
    return inter, comm, {r: (h[1], h[2]) for r, h in hellos.items()}


@contextlib.contextmanager
def _sigint_later() -> Any:
    """Run SIGINT's handler (Ctrl-C's KeyboardInterrupt) when the block
    ends, not in it (in the main thread; elsewhere Python runs no handler).

    Example:
        >>> try:
        ...     with _sigint_later():
        ...         os.kill(os.getpid(), signal.SIGINT)
        ...         said = "the block ran to its end"
        ... except KeyboardInterrupt:
        ...     print(said, "then Ctrl-C")
        the block ran to its end then Ctrl-C
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: List[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if caught:
            if callable(previous):
                previous(signal.SIGINT, None)
            elif previous == signal.SIG_DFL:
                os.kill(os.getpid(), signal.SIGINT)


def _send_away(inter: Any, comm: Any, count: int, hellos: Dict[int, Any]) -> None:
    """Ctrl-C while ``count`` ranks start: tell them the computation will
    not start (a setup of None), so that they leave MPI in order, and
    disconnect from them. Left waiting, they lived as long as this process
    (an interactive one: for ever), and MPI's process manager killed them
    at its end, which left their shared-memory files in /dev/shm (2 MB
    each, every time)."""
    from ..launch import _sigint_ignored
    with _sigint_ignored():  # (a second Ctrl-C: not in the middle)
        try:
            if comm is None:
                comm = inter.Merge(high=False)
            # their hellos first: one left unreceived stayed in MPI's queue, where
            # the next computation's first receive took it (MPI reuses the
            # communicator's context id): "Invalid rank 2" from a job of 2 ranks
            _poll_messages(comm, HELLO, count, f"sending {count} starting MPI ranks away",
                           DISCONNECT_WAIT, lambda have: "ranks", into=hellos)
            reqs = [comm.isend(None, dest=r, tag=SETUP) for r in range(1, count + 1)]
            deadline = time.monotonic() + DISCONNECT_WAIT
            while not all(r.Test() for r in reqs) and time.monotonic() < deadline:
                time.sleep(0.001)
            for c in (comm, inter):
                if not disconnect(c, 0):
                    break
        except Exception:
            pass  # (MPI refused: they end with this process, as before)


@contextlib.contextmanager
def _own_process_group() -> Any:
    """While MPICH starts its process manager for this process (at its first
    spawn), put this process in a process group other than its own, so that
    the manager is not in the caller's group: a Ctrl-C at the terminal
    (SIGINT to the foreground group) then reaches this process alone, which
    ends the ranks in order, instead of the manager, which kills the job
    with SIGKILL; and the manager, which ends a job (when a spawned rank
    dies, say) by killing its process group, kills neither this process nor
    a shell that started it. A process that leads its group (as a shell with
    job control starts each command) joins the group of a short-lived
    placeholder process for the while; one in a group of another joins a
    new group of its own. A session leader cannot move (nor is anything
    changed where moving fails): there, a rank that dies ends this process
    too.

    Example:
        >>> before = os.getpgrp()
        >>> with _own_process_group():
        ...     inside = os.getpgrp()
        >>> os.getpgrp() == before and (inside != before or os.getsid(0) == os.getpid())
        True
    """
    before = os.getpgrp()
    me = os.getpid()
    moved = False
    holder = None
    if os.getsid(0) != me:
        try:
            if before != me:
                os.setpgid(0, 0)
            else:
                import subprocess
                # a group to join, with an id that is not this process's
                group: Dict[str, Any] = ({"process_group": 0} if sys.version_info >= (3, 11)
                                         else {"preexec_fn": os.setpgrp})
                holder = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                                          stdin=subprocess.PIPE, **group)
                os.setpgid(0, holder.pid)
            moved = True
        except OSError:
            pass
    try:
        yield
    finally:
        if moved:
            try:
                os.setpgid(0, before if before != me else 0)
            except OSError:
                pass
        if holder is not None:
            holder.stdin.close()  # type: ignore[union-attr]
            holder.wait()


def _hello(comm: Any) -> None:
    comm.send(("ok", socket.gethostname(), os.getpid()), dest=0, tag=HELLO)


def _rank_code(entry: str, watch: Optional["DeathWatch"]) -> str:
    """The program (``python -c``) of a rank spawned to run ``entry``: it
    starts MPI and merges first, by :mod:`rank_start` (loaded by its path),
    then imports macroflow and runs :func:`_spawned`. It is one line, and
    ends with this process's pid: ``_spawned(..., pid)`` (how a process
    tells the ranks it spawned).

    Example:
        >>> code = _rank_code("m:f", None)
        >>> "\\n" not in code and code.endswith(f"_spawned('m:f', _c, _w, {os.getpid()})")
        True
    """
    from ..core.threads import HANDLED_SIGNALS
    start = rank_start.__file__
    watches = [watch.name] if watch is not None else []
    if os.environ.get(WATCH_ENV):
        # under `macroflow run`, a rank added to the job: should it die, the
        # command names it (see note_added)
        watches.append(os.environ[WATCH_ENV])
    pid = os.getpid()
    # (one line: MPICH's process manager cannot pass an argument of several)
    return "; ".join([
        f"import os, sys; os.chdir({os.getcwd()!r}); sys.path[:] = {list(sys.path)!r}",
        f"_r = {{}}; exec(compile(open({start!r}).read(), {start!r}, 'exec'), _r)",
        f"_c, _w = _r['start']({watches!r}, {pid}, {sorted(int(s) for s in HANDLED_SIGNALS)!r})",
        f"_spawned = _r['load'](_c, _w, {HELLO})",
        f"_spawned({entry!r}, _c, _w, {pid})",
    ])


def _spawned(entry: str, comm: Any, reporting: List[socket.socket],
             spawner: int) -> None:  # pragma: no cover - runs in a spawned rank
    """What a spawned rank runs once it has merged with its spawner (pid
    ``spawner``) into ``comm``: say hello, run ``entry``, leave.
    ``reporting``: its connections to death watches (see :mod:`rank_start`)."""
    global _MPI
    if _MPI is None:  # (started by rank_start)
        from mpi4py import MPI
        _MPI = MPI
    DeathWatch._reporting = [*DeathWatch._reporting, *reporting]
    from ..core.threads import start_thread
    start_thread(rank_start.watch_spawner, "macroflow-spawned-watch", (spawner, _settled))
    if not entry.endswith((":_serve_added", ":_serve_spawned")):
        _settled.set()  # (a served rank waits for its setup first: see _serve)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is context 0's to handle
    try:
        import importlib
        mod, _, fn = entry.partition(":")
        target = getattr(importlib.import_module(mod), fn)
    except BaseException:
        comm.send(("error", traceback.format_exc()), dest=0, tag=HELLO)
        _leave(0)
    try:
        target(comm)
    except BaseException:
        traceback.print_exc()
    _leave(0)


#: set once a spawned rank no longer needs its spawner watched (see rank_start.watch_spawner)
_settled = threading.Event()


def _leave_orphaned() -> None:  # pragma: no cover - in a rank
    try:  # MPICH's files that only this rank still maps go with it
        with open("/proc/self/maps") as f:
            mine = {line.split()[-1] for line in f if "/dev/shm/mpich_shm_" in line}
        remove_unused(sorted(mine), besides=os.getpid())
    finally:
        os._exit(1)


def _hello_only(comm: Any) -> None:  # pragma: no cover - runs in a spawned rank
    _hello(comm)


def _hear_hellos(comm: Any) -> Dict[int, Tuple[str, int]]:
    """Context 0 under mpiexec: wait until every other rank has called mf.run
    or mf.init; returns {rank: (host, pid)}."""
    n = comm.Get_size()
    hellos = _poll_messages(comm, HELLO, n - 1, "starting the computation", None,
                            lambda have: "ranks " + ", ".join(
                                str(r) for r in range(1, n) if r not in have)
                            + " to call mf.run or mf.init")
    return {r: (h[1], h[2]) for r, h in hellos.items()}


def _handshake(comm: Any, setup: Dict[str, Any]) -> None:
    """Context 0's side of starting a computation: send every rank ``setup``."""
    reqs = [comm.isend(setup, dest=r, tag=SETUP) for r in range(1, comm.Get_size())]
    for r in reqs:
        r.wait()


def _serve(comm: Any, spawned: bool) -> None:  # pragma: no cover - runs in ranks 1..N-1
    """A rank other than 0: say hello, get the setup, serve until the computation ends."""
    from ..core import marshal
    if not spawned:
        _hello(comm)
    setup = _poll_messages(comm, SETUP, 1, "waiting for context 0", None,
                           lambda have: "context 0")[0]
    _settled.set()  # (its spawner's end is heard as any context's from here)
    if setup is None:
        return  # context 0 was interrupted as this rank started (see _send_away)
    if spawned:
        # this process ran none of the program's script: what its __main__
        # defined comes by value, and goes on by value (to a third context)
        marshal.main_by_value()
    else:
        marshal.snapshot_main()  # the same script runs everywhere: what it defined exists here
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _serve_on(MpiTransport(comm, setup["spin_us"], wake=(setup["computation"], setup["hosts"]),
                           window=setup.get("window", False), rings=setup.get("rings", False)),
              setup)


def _serve_on(transport: "MpiTransport", setup: Dict[str, Any],
              init_blob: Optional[bytes] = None) -> None:  # pragma: no cover - in ranks 1..
    """Be context ``transport.ctx`` until the computation ends; a context added
    while running runs its ``init`` first and reports in (launch.joined)."""
    from ..core import context as _ctx
    from ..core import marshal
    from ..core.context import Engine

    def terminate(signum, frame):
        # asked to stop while computing: leave in order, or the process
        # manager takes this rank for crashed and ends the whole job
        transport.goodbye()
        transport.linger(0.1)
        _leave(0)

    signal.signal(signal.SIGTERM, terminate)
    eng = None
    try:
        from ..core.future import forget_learned
        forget_learned()  # a rank serves one computation after another
        eng = Engine(transport.ctx, transport.size, transport, setup["placement"],
                     computation=setup["computation"])
        eng.describe_lost = lambda peer: ""  # the transport's words say it best here
        _ctx._state.default = eng
        if init_blob is not None:
            from ..launch import joined
            if not joined(eng, lambda: marshal.loads(init_blob)):
                eng = None  # its init failed: it has said so, and leaves
        if eng is not None:
            eng.serve_forever()
    except BaseException as e:
        from ..core.context import fatal_text
        text = fatal_text(e)
        sys.stderr.write(text)
        try:
            if eng is not None:
                eng.report_fatal(text)
        except Exception:
            _abort(transport.comm)  # nobody can be told: end the job rather than leave it hanging
    try:
        transport.close()
    except Exception:
        traceback.print_exc()


def _serve_added(parent: Any) -> None:  # pragma: no cover - runs in a rank added while running
    """A rank spawned by context 0 while the computation runs (``parent``:
    context 0 and the ranks spawned with this one): say hello, get the plan,
    join the live contexts (:meth:`MpiTransport.grow` is their side), serve."""
    from ..core import marshal
    MPI = mpi()
    _hello(parent)
    go = _poll_messages(parent, SETUP, 1, "waiting for context 0", None,
                        lambda have: "context 0")[0]
    if go is None:
        return  # context 0 gave up on adding contexts
    marshal.main_by_value()  # it ran none of the program's script (see _serve)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    inter = MPI.COMM_WORLD.Create_intercomm(0, parent, 0, GROW_TAG)
    comm = inter.Merge(high=True)
    _settled.set()  # (joined: context 0's end is heard as any context's from here)
    inter.Free()
    transport = MpiTransport(comm, go["spin_us"], wake=(go["computation"], go["hosts"]),
                             members=list(go["live"]) + list(go["ids"]),
                             rings=go.get("rings", False))
    _serve_on(transport, go, go["init"])


def _serve_spawned(comm: Any) -> None:  # pragma: no cover - runs in a spawned rank
    _hello(comm)
    _serve(comm, spawned=True)


def _serve_world(comm: Any) -> None:  # pragma: no cover - runs in ranks 1..N-1 under mpiexec
    """Serve as one of ranks 1..N-1 of an mpiexec job, then end the process."""
    try:
        _serve(comm, spawned=False)
    finally:
        _leave(0)


# -- errors under mpiexec ------------------------------------------------------

#: Under mpiexec, how long a rank other than 0 waits before it prints its
#: uncaught error: if rank 0 fails too, it prints first and ends the job.
SECOND_VOICE_DELAY = 1.0


def excepthook(etype, value, tb, previous=None, rank: Optional[int] = None) -> None:
    r"""``sys.excepthook`` of the ranks of an mpiexec job (installed on import).

    An uncaught error ends every rank, printed once: rank 0 prints at once;
    another rank waits :data:`SECOND_VOICE_DELAY` seconds first (when every
    rank fails alike, rank 0's report ends the job before the others speak).
    Then ``MPI_Abort`` ends the job: the other ranks may be waiting for this
    one (a rank that ends before MPI started in it leaves the others waiting
    in MPI's start forever), and MPI's own ending would wait for them. MPI is
    started for that if it is not running yet (for 10 s at most, or the
    process just ends with code 1).

    Example (what rank 0 does, without MPI running):
        >>> import io, contextlib
        >>> err = io.StringIO()
        >>> with contextlib.redirect_stderr(err):
        ...     excepthook(ValueError, ValueError("bad"), None,
        ...                previous=lambda t, v, tb: print(f"{t.__name__}: {v}", file=sys.stderr),
        ...                rank=0)
        >>> err.getvalue()
        'ValueError: bad\n'
    """
    if previous is None:
        from ..core.errors import excepthook as previous  # (without the runtime's frames)
    world = world_from_environment()
    if rank is None:
        rank = world[0] if world is not None else 0
    started = world is not None and _start_mpi_for_abort()
    if rank != 0 and not issubclass(etype, KeyboardInterrupt):
        time.sleep(SECOND_VOICE_DELAY)
    previous(etype, value, tb)
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except Exception:
        pass
    if started:
        note_job_error(rank)
        # mpiexec forwards our output through a pipe it stops reading when the
        # job is aborted: give it a moment to pass the report on whole
        time.sleep(0.2)
        _abort(_MPI.COMM_WORLD)


def note_job_error(rank: int) -> None:
    """Under ``macroflow run --transport mpi``, note that rank ``rank``'s
    uncaught error (printed already) is what ends the job, so that the
    command does not blame the ranks MPI ends after it; nothing elsewhere.

    Example:
        >>> note_job_error(0)  # not under macroflow run: nothing to note
    """
    table = os.environ.get(CONTEXTS_FILE)
    if table:
        try:
            with open(table + ".error", "a") as f:
                f.write(f"{rank}\n")
        except OSError:
            pass


def note_added(hosts: Dict[int, Tuple[str, int]]) -> None:
    """Under ``macroflow run --transport mpi``, note the contexts just added
    (context -> (host, pid)) beside the job's table, so that the command can
    name one that dies; nothing elsewhere.

    Example:
        >>> note_added({2: ("h", 123)})  # not under macroflow run: nothing to note
    """
    table = os.environ.get(CONTEXTS_FILE)
    if table:
        try:
            with open(table + ".added", "a") as f:
                for c, (h, pid) in sorted(hosts.items()):
                    f.write(f"{c} {h} {pid}\n")
        except OSError:
            pass


def _start_mpi_for_abort(wait: float = 10.0) -> bool:
    """Have MPI running here (so that MPI_Abort can end the job); False if it
    has ended already, or does not start within ``wait`` seconds (the other
    ranks never start it)."""
    if _MPI is not None:
        return _MPI.Is_initialized() and not _MPI.Is_finalized()
    from ..core.threads import start_thread
    t = start_thread(lambda: _try(mpi), "macroflow-mpi-start")
    t.join(wait)
    return _MPI is not None and _MPI.Is_initialized()


def _try(fn: Callable[[], Any]) -> None:
    try:
        fn()
    except Exception:
        pass


def install_excepthook() -> bool:
    """Install :func:`excepthook` if this process is one of several mpiexec
    ranks and nobody replaced Python's own hook; True if installed.

    Example:
        >>> install_excepthook() == (world_from_environment() is not None and
        ...                          world_from_environment()[1] > 1)
        True
    """
    from ..core import errors
    world = world_from_environment()
    if world is None or world[1] < 2 or \
            sys.excepthook not in (sys.__excepthook__, errors.excepthook):
        return False
    sys.excepthook = excepthook
    return True


# -- the launcher --------------------------------------------------------------

_world_done = False  # under mpiexec: the other ranks left with the first computation
#: Set by ``macroflow run --transport mpi``: the file where context 0 writes
#: "rank host pid" per context before the computation starts (and waits for
#: the file "<it>.watched"), so that a rank that dies can be named.
CONTEXTS_FILE = "MACROFLOW_MPI_CONTEXTS"
#: Set by ``macroflow run --transport mpi``: the name of its
#: :class:`DeathWatch`, which every rank of this host reports to, so that the
#: rank that died first is known (MPI's process manager ends the others then).
WATCH_ENV = "MACROFLOW_MPI_WATCH"


def check_room(contexts: int, adding: bool = False) -> None:
    """Raise LimitError if ``contexts`` contexts cannot be started here.

    Under mpiexec the ranks exist already; otherwise the ``contexts - 1``
    spawned interpreters must fit in memory (:data:`CONTEXT_MEMORY` each).
    Contexts added while running (``adding``) are spawned under mpiexec too,
    so they are checked there as well.

    Example:
        >>> check_room(2)
    """
    if world_from_environment() is not None and not adding:
        return
    from ..core.errors import LimitError
    from .local import _mem_available, room_advice
    avail = _mem_available()
    need = (contexts - 1) * CONTEXT_MEMORY
    if avail is not None and need > avail:
        raise LimitError("memory", (
            f"{contexts} contexts do not fit in this host's memory: the {contexts - 1} ranks "
            f"to spawn need about {need >> 20} MB ({CONTEXT_MEMORY >> 20} MB each on the mpi "
            f"transport) and {avail >> 20} MB is available (MemAvailable in /proc/meminfo); "
            f"{room_advice(avail // CONTEXT_MEMORY + 1, adding)}, or free memory"))


def launcher(session):
    """The launcher of this transport: ranks of this mpiexec job, or spawned ones.

    Example:
        >>> import macroflow as mf
        >>> if available() is None:
        ...     with mf.init(contexts=2, transport="mpi") as s:
        ...         name = type(launcher(s)).__name__
        ... else:
        ...     name = "MpiLauncher"
        >>> name
        'MpiLauncher'
    """
    return MpiLauncher(session)


def _launcher_base():
    from ..launch import Launcher
    return Launcher


class MpiLauncher(_launcher_base()):  # type: ignore[misc]
    """Contexts 1..N-1 as MPI ranks: those of this mpiexec job, or spawned ones.

    Example:
        >>> MpiLauncher.remote
        True
    """

    def __init__(self, session) -> None:
        super().__init__(session)
        self.hosts: Dict[int, Tuple[str, int]] = {}
        self.spawned = False
        self.added: Set[int] = set()  # contexts added while running (spawned ranks)
        self.terminated: Set[int] = set()
        self.placement: Any = None
        self.spin_us = 0.0
        # SIGTERM while spawned ranks start is put off until the session is up
        self._sigterm: Optional[Callable[[int, Any], None]] = None
        self._starting = False
        self._term_pending = 0
        self.deaths: Dict[int, str] = {}  # spawned ranks that died, in that order: how

    def _watch_deaths(self) -> None:
        """Hear of spawned ranks that die (see :class:`DeathWatch`)."""
        if self._on_death not in _death_listeners:
            _death_listeners.append(self._on_death)

    def _on_death(self, pid: int, status: Optional[int]) -> None:
        # (the watcher's thread)
        from .base import process_fate
        eng = self.engine
        ctx = next((c for c, (h, p) in self.hosts.items() if p == pid and _local(h)), None)
        if eng is None or ctx is None:
            return
        global _broken
        first = next(iter(self.deaths), None)
        watch = DeathWatch._mine
        together = sorted(c for c, (h, p) in self.hosts.items()
                          if watch is not None and p in watch.together and _local(h)
                          and c != ctx)
        if first is None or together:
            if status is None:
                how = f"its process (pid {pid}) ended while the computation ran (killed, or " \
                      f"os._exit)"
            else:
                how = process_fate(pid, status)
            if together:
                others = ", ".join(str(c) for c in together)
                whose = f"context {others}" if len(together) == 1 else f"contexts {others}"
                how += (f"; {whose} ended at the same moment: one died first, and MPI's process "
                        f"manager ended the others (it ends every spawned rank when one "
                        f"dies); which one died first is not known")
            if first is None:
                if together:  # (which is not known: see DeathWatch._tell)
                    both = ", ".join(str(c) for c in sorted([ctx, *together]))
                    _broken = (f"contexts {both}, ranks this process spawned, died at the same "
                               f"moment ({how}); MPI here cannot spawn ranks again")
                else:
                    _broken = (f"context {ctx}, a rank this process spawned, died ({how}); MPI "
                               f"here cannot spawn ranks again")
                _end_without_finalize()
        else:
            how = (f"its process (pid {pid}) was ended by MPI after context "
                   f"{first}'s died (MPI's process manager ends every spawned "
                   f"rank when one dies)")
        self.deaths[ctx] = how
        eng.transport.peer_died(ctx, how)

    def start(self, placement, spin_us: float):
        global _world_done
        from ..core import marshal
        from ..core.context import Engine
        from ..launch import rings_setting
        s = self.session
        rings = rings_setting()  # (a bad setting is an error before any rank waits for us)
        MPI = mpi()
        self.placement, self.spin_us = placement, spin_us
        world = world_from_environment()
        hosts = None
        if world is not None and world[1] > 1:
            if _world_done:
                raise RuntimeError(
                    "this mpiexec job's other ranks ended with its first computation: under "
                    "mpiexec, run one computation per job (one mf.run, or one mf.init ... "
                    "mf.shutdown); a script that `macroflow run` starts runs its main (or, "
                    "with --spmd, its SPMD function) as that one computation, so its top "
                    "level must start none: put a top-level mf.run or mf.spmd under "
                    "`if __name__ == \"__main__\":`")
            if os.environ.get(WATCH_ENV):
                DeathWatch.report_to(os.environ[WATCH_ENV])
            comm = MPI.COMM_WORLD.Dup()
            if comm.Get_rank() != 0:
                _serve_world(comm)  # never returns
            _world_done = True
            marshal.snapshot_main()  # every rank ran the script up to here
            release: List[Any] = []
        else:
            self.spawned = True
            self._take_sigterm()
            # spawned ranks are fresh interpreters: what this process's
            # __main__ defines travels by value
            marshal._main_snapshot = {}
            if s.size == 1:
                # nothing to spawn (MPICH's process manager ends this process
                # when asked to spawn no rank); add_contexts spawns later
                comm, hosts, release = MPI.COMM_SELF.Dup(), {}, []
            else:
                self._watch_deaths()
                inter, comm, hosts = spawn(s.size - 1, "macroflow.transport.mpi:_serve_spawned")
                release = [comm, inter]
        try:
            if hosts is None:
                hosts = _hear_hellos(comm)
            self.hosts = hosts
            names = {0: socket.gethostname(), **{r: h for r, (h, _) in hosts.items()}}
            table = os.environ.get(CONTEXTS_FILE)
            if table and not self.spawned:
                with open(table + ".new", "w") as f:
                    for r, (h, pid) in sorted({0: (names[0], os.getpid()), **hosts}.items()):
                        f.write(f"{r} {h} {pid}\n")
                os.replace(table + ".new", table)  # whole, for whoever watches for it
                # it watches the ranks' processes before any user code runs
                # (a rank that died unwatched could not be named)
                deadline = time.monotonic() + 5.0
                while not os.path.exists(table + ".watched") and time.monotonic() < deadline:
                    time.sleep(0.001)
            # a window only under mpiexec: spawned ranks disconnect as they
            # end, and a window that cannot be freed would bind them
            window = not self.spawned and os.environ.get("MACROFLOW_MPI_WINDOW", "1") != "0"
            # Rings only under mpiexec: with spawned ranks, a rank that left a
            # collective unjoined (see ENDED) made the disconnection at close
            # hang about 3 runs in 10 beside a busy process, 0 in 10 without
            # rings, in the tests of mf.spmd's unjoined collectives
            rings = rings and not self.spawned
            _handshake(comm, {"computation": s.computation, "placement": placement,
                             "spin_us": spin_us, "hosts": names, "window": window,
                             "rings": rings})
            transport = MpiTransport(comm, spin_us, release=release,
                                     wake=(s.computation, names), window=window, rings=rings)
        except BaseException:
            if not self.spawned:
                _abort(comm)  # the other ranks wait for a setup that will never come
            raise
        eng = Engine(0, s.size, transport, placement, computation=s.computation)
        self.engine = eng
        eng.describe_lost = self.describe_lost
        return eng

    def describe_lost(self, peer: int) -> str:
        if peer in self.deaths:
            return self.deaths[peer]
        host, pid = self.hosts.get(peer, ("?", 0))
        return f"its rank left the computation (pid {pid} on {host})"

    def pid(self, ctx: int) -> Optional[int]:
        return os.getpid() if ctx == 0 else self.hosts.get(ctx, ("", None))[1]

    def protocols(self, ctx: int) -> Optional[Tuple[Tuple[str, str], ...]]:
        host, pid = (socket.gethostname(), os.getpid()) if ctx == 0 else \
            self.hosts.get(ctx, ("?", 0))
        return (("mpi", f"{host}:{pid}:rank{ctx}"),)

    def _spawned_here(self, ctx: int) -> bool:
        # its process is one this computation spawned (not a rank of mpiexec's job)
        return self.spawned or ctx in self.added

    def add(self, ids: List[int], init: Any) -> None:
        """Spawn one rank per id (MPI_Comm_spawn from context 0 alone, so the
        other contexts serve on while the new interpreters start), then join
        them with every live context (:meth:`MpiTransport.grow`)."""
        from ..core import marshal
        eng = self.engine
        assert eng is not None
        t = eng.transport
        MPI = mpi()
        if not self.spawned:
            # under mpiexec the new ranks run none of the script: what its
            # __main__ defines goes by value from here on, the init first
            # (pickled by name, it could not be found there)
            marshal.main_by_value()
        blob = marshal.dumps_inband(init)  # (an array it holds too: a partial's, say)
        self._watch_deaths()
        try:
            inter, parent, hellos = spawn(len(ids), "macroflow.transport.mpi:_serve_added")
        except MPI.Exception as e:
            raise RuntimeError(
                f"the mpi transport cannot add contexts here: MPI_Comm_spawn failed "
                f"({e.Get_error_string().strip()}). Adding contexts needs an MPI process manager "
                f"that starts processes while a job runs (MPICH's mpiexec, or the one MPICH "
                f"starts for a program run without mpiexec, does; some batch systems' launchers "
                f"do not)") from e
        t.release += [parent, inter]
        for i, c in enumerate(ids):
            self.hosts[c] = hellos[i + 1]
        note_added({c: self.hosts[c] for c in ids})
        self.added.update(ids)
        live = [0] + [c for c in t.peers() if c not in eng.lost]
        names = {0: socket.gethostname(), **{c: h for c, (h, _) in self.hosts.items()}}
        plan = {"live": live, "ids": list(ids), "hosts": names,
                # under mpiexec, the ranks that ran the program found its
                # __main__'s classes by name; the new ones cannot
                "main_by_value": not self.spawned}
        go = dict(plan, computation=self.session.computation, placement=self.placement,
                  spin_us=self.spin_us, init=bytes(blob), rings=t.rings)
        reqs = [parent.isend(go, dest=r, tag=SETUP) for r in range(1, len(ids) + 1)]
        for c in live[1:]:
            t.tell_grow(c, plan)
        t.peer_comm = parent
        try:
            t.grow(plan)
        finally:
            t.peer_comm = None
        for r in reqs:
            r.wait()

    def wait(self, grace: float) -> None:
        eng = self.engine
        if eng is None:
            return
        t = eng.transport
        deadline = time.monotonic() + grace
        while any(p not in t.gone for p in range(1, t.size)) and time.monotonic() < deadline:
            if t.died:
                t._on_died()  # (ranks MPI ended say no goodbye)
            if not t._progress():
                t._nap(NAP_MIN)
        # then the processes of spawned ranks end (those of mpiexec's ranks
        # end with the job: MPI ends in all of them together)
        while (self.spawned or self.added) and time.monotonic() < deadline:
            if not any(_alive(*self.hosts.get(p, ("", 0))) for p in range(1, t.size)
                       if p in t.gone and self._spawned_here(p)
                       and _local(self.hosts.get(p, ("", 0))[0])):
                break
            t._progress()
            time.sleep(0.001)

    def _take_sigterm(self) -> None:
        """Make SIGTERM end this process in order (mf.Terminated(143), a
        SystemExit, in the main thread: the computation closes, MPI
        finalizes), unless the program
        handles SIGTERM itself. Killed outright, a process that spawned ranks
        leaves MPICH's process manager to end the job by killing its process
        group: the shell that started the program, when it shares the group."""
        if threading.current_thread() is not threading.main_thread() or \
                signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return

        def terminated(signum: int, frame: Any) -> None:
            if self._starting:
                # spawning, or the ranks waiting for their setup: ending now
                # would leave them behind; the session ends once it is up
                self._term_pending = 128 + signum
                return
            from ..core.errors import Terminated
            raise Terminated(128 + signum)

        self._starting = True
        signal.signal(signal.SIGTERM, terminated)
        self._sigterm = terminated

    def started(self) -> None:
        self._starting = False
        code = self._term_pending
        if code:
            self._term_pending = 0
            from ..core.errors import Terminated
            raise Terminated(code)

    def stop(self) -> None:
        try:
            self._stop()
        finally:
            DeathWatch.bye()  # (under macroflow run: context 0's computation ended in order)
            if self._sigterm is not None:
                if signal.getsignal(signal.SIGTERM) is self._sigterm:
                    signal.signal(signal.SIGTERM, signal.SIG_DFL)
                self._sigterm = None
            if self.deaths:
                # MPICH's segments, which its ranks remove only when they end in order
                _spawn_segments.difference_update(
                    remove_unused(sorted(_spawn_segments), besides=os.getpid()))
            # the shared pages of ranks that did not close their transport
            # (killed, or ended by MPI_Abort): nobody else would remove them
            import glob
            for path in glob.glob(Waker.state_path(self.session.computation, 0)[:-1] + "*"):
                if not path.endswith("-0"):
                    try:
                        os.unlink(path)
                    except OSError:
                        pass

    def _stop(self) -> None:
        eng = self.engine
        if eng is None:
            return
        t = eng.transport

        def left(p):
            # a rank has left when it said goodbye (or died); a spawned one
            # when its process ended too
            return (p in t.gone or p in self.deaths) and not (
                self._spawned_here(p) and _alive(*self.hosts.get(p, ("", 0))))

        stuck = [p for p in range(1, t.size) if p not in self.terminated and not left(p)]
        if not stuck:
            return
        for p in stuck:
            host, pid = self.hosts.get(p, ("", 0))
            if _local(host) and pid:
                try:
                    os.kill(pid, signal.SIGTERM)  # its handler leaves MPI in order
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            # their goodbyes, behind what they had sent us: a rank stopped in
            # a flood of large values leaves its sends to MPI (see abandon),
            # hundreds of frames to take before its goodbye (one per 5 ms
            # nap took longer than the 5 s it is given)
            try:
                got = t._progress()
            except Exception:  # (MPI's error for a request of a rank that died meanwhile)
                got = False
            still = [p for p in stuck if not left(p)]
            if not still:
                self.terminated.update(stuck)
                return
            if not (got or t._moved or t.inflight):
                time.sleep(0.005)
        names = ", ".join(f"{p} (pid {self.hosts.get(p, ('?', 0))[1]})" for p in still)
        print(f"macroflow: contexts {names} did not stop; ending the MPI job (MPI_Abort), "
              f"this process included", file=sys.stderr, flush=True)
        _abort(t.comm)


def _local(host: str) -> bool:
    return host == socket.gethostname()


def _alive(host: str, pid: int) -> bool:
    """Whether the process ``pid`` of ``host`` still runs (True if it cannot be known)."""
    if not _local(host) or not pid:
        return True
    fields = _stat(pid)
    return fields is not None and fields[0] not in (b"Z", b"X")


class MpiWindow:
    """A dynamic MPI window over a communicator (``MPI_Win_create_dynamic``),
    in a passive-target epoch to every rank from the start: a rank attaches
    the memory it registers, and any rank reads it with ``MPI_Rget``, polled
    by its engine, while the owner's CPU does something else.

    Making it is collective (every rank of the communicator, at the same
    point): the transport makes it as it starts, under mpiexec only. It is
    never freed (``MPI_Win_free`` is collective too, and ranks end one by
    one); under mpiexec every rank is bound to the others until the job
    ends anyway.

    Example (one rank reading its own memory, where mpi4py is installed):
        >>> import numpy as np
        >>> if available() is None:
        ...     w = MpiWindow(mpi(), mpi().COMM_SELF, [0])
        ...     src, out = np.arange(4, dtype=np.uint8), np.zeros(4, np.uint8)
        ...     attached = w.attach(src)
        ...     req = w.get(out, 0, src.ctypes.data, 4)
        ...     while not req.Test():
        ...         pass
        ...     w.detach(src)
        ...     print(out.tolist())
        ... else:
        ...     print([0, 1, 2, 3])
        [0, 1, 2, 3]
    """

    def __init__(self, MPI: Any, comm: Any, members: Sequence[int]):
        self.MPI = MPI
        self.win = MPI.Win.Create_dynamic(comm=comm)
        self.win.Lock_all()
        self.rank_of = {c: r for r, c in enumerate(members) if c >= 0}
        self.byte = MPI.BYTE
        self.closed = False
        # buffers attached now: while there are any, the owner's engine
        # calls MPI at every pass (see _progress), or MPICH would not serve
        # other ranks' reads of them until it next did
        self.attached = 0

    def reaches(self, ctx: int) -> bool:
        """Whether context ``ctx`` is a rank of this window."""
        return ctx in self.rank_of and not self.closed

    def attach(self, buf: Any) -> bool:
        """Let the other ranks read ``buf`` (C-contiguous); False if MPI refuses."""
        try:
            self.win.Attach(buf)
        except Exception:
            return False
        self.attached += 1
        return True

    def detach(self, buf: Any) -> None:
        try:
            self.win.Detach(buf)
        except Exception:
            return
        self.attached -= 1

    def get(self, out: Any, ctx: int, address: int, nbytes: int) -> Any:
        """Start reading ``nbytes`` at ``address`` in context ``ctx`` into
        ``out``; returns the MPI request (test it to make progress)."""
        return self.win.Rget([out, nbytes, self.byte], self.rank_of[ctx],
                             (address, nbytes, self.byte))

    def flush(self, ctx: int) -> None:
        """Wait until every read started from context ``ctx``'s memory is done."""
        self.win.Flush(self.rank_of[ctx])

    def close(self) -> None:
        # no Unlock_all: it waits for every rank, and ranks end one by one
        # (the reads of this rank were waited for by their handles)
        self.closed = True


class MpiCollectives:
    """MPI's non-blocking collectives (``Ibarrier``, ``Iallreduce``) on a
    duplicate of a communicator, polled by the engine: never a blocking
    collective, which could not serve requests while it waits (Tulip's point).
    The duplicate is made with ``Idup`` at first use, so that no rank blocks
    there either; every rank makes it at the same point (its first native
    collective), as MPI requires.

    Example:
        >>> from macroflow.transport.mpi import available, mpi
        >>> if available() is None:
        ...     natives = MpiCollectives(mpi(), mpi().COMM_SELF)
        ...     op = natives.start("barrier", None, None)
        ...     while not op.test():
        ...         pass
        ...     print(op.result())
        ... else:
        ...     print(None)
        None
    """

    #: the reductions MPI does natively, by macroflow's op name
    OPS = ("sum", "prod", "min", "max")

    def __init__(self, MPI: Any, comm: Any):
        self.MPI = MPI
        self.parent = comm
        # duplicated at the first collective started (every rank starts its
        # first at the same point): a run that never uses one leaves nothing
        # pending that would hold the communicator's disconnection
        self.comm: Any = None
        self.dup: Any = None
        self.started = 0  # collectives started on it: each rank's count, matched in order
        self.pending: List["NativeCollective"] = []  # started, not yet seen complete
        # started, with MPI calls still to make: made in this order (see advance)
        self.unissued: List["NativeCollective"] = []
        self.busy = False  # in advance() or a test's MPI call

    def unfinished(self) -> Tuple[int, List[Tuple[int, tuple]]]:
        """How many collectives this rank started, and (index, spec) of those
        not complete: what another rank needs to join them (see catch_up)."""
        self.pending = [c for c in self.pending if not c.done]
        return self.started, [(c.index, c.spec()) for c in self.pending]

    def catch_up(self, started: int, specs: Sequence[Tuple[int, tuple]]) -> List["NativeCollective"]:
        """Join the collectives another rank started and this one never did
        (its run's function ended without them): a collective that some rank
        never joins would hold every rank's disconnection from MPI. Returns
        the ones started, for the caller to drive to completion."""
        import numpy as np
        joined = []
        for index, (kind, dtype, shape, op) in specs:
            if index >= self.started and index < started:
                value = None if dtype is None else np.zeros(shape, dtype)
                joined.append(self.start(kind, value, op))
        return joined

    def drive(self) -> bool:
        """Make progress on the collectives started here; True while some
        have not ended."""
        self.pending = [c for c in self.pending if not c.test()]
        return bool(self.pending)

    def close(self) -> None:
        """Free the duplicate communicator: MPI frees it once what is pending
        on it ends, and a collective a rank never joined must not hold the
        disconnection of the others."""
        if self.comm is not None and self.dup is None:
            try:
                self.comm.Free()
            except Exception:
                pass

    def can(self, kind: str, value: Any, op: Any) -> bool:
        """Whether :meth:`start` takes this collective: a barrier, or an
        allreduce with a named op, whatever its value. Only what every rank
        knows alike may decide it: a rank going by the tree while another
        waits in MPI would wait for ever. An allreduce whose values MPI cannot
        reduce alike on every rank ends with :attr:`NativeCollective.fallback`
        set, on every rank at once: the run's tree does it then."""
        return kind == "barrier" or (kind == "allreduce" and op in self.OPS)

    def start(self, kind: str, value: Any, op: Any) -> "NativeCollective":
        c = NativeCollective(self, kind, value, op, self.started)
        self.started += 1
        self.pending.append(c)
        self.unissued.append(c)
        return c

    def advance(self) -> None:
        """Make the MPI calls the collectives started here can make now, in
        the order they were started: MPI matches a communicator's
        collectives by the order each rank calls them, and an allreduce
        calls MPI twice (its signature, then its values, once the signature
        is known). Issued as each was first tested, a rank with an
        allreduce started behind a barrier it had not waited for called
        ``Iallreduce`` before ``Ibarrier`` (the duplicate communicator was
        not ready at the barrier's first test), or a later collective's
        signature before the earlier one's values: every rank then waited
        for ever (3 ranks on 2 cores, most runs)."""
        if self.busy:
            return  # (called again from a signal, in the middle of it: see NativeCollective.test)
        self.busy = True
        try:
            if self.comm is None:
                self.comm, self.dup = self.parent.Idup()
            if self.dup is not None:
                if not self.dup.Test():
                    return
                self.dup = None
            n = 0
            for c in self.unissued:
                if not c.issue():
                    break  # (the ones behind it wait for it)
                n += 1
            if n:
                del self.unissued[:n]
        finally:
            self.busy = False


class NativeCollective:
    """One collective of :class:`MpiCollectives` in progress: ``test()``
    makes progress and says whether it is done; ``result()`` then."""

    __slots__ = ("owner", "kind", "value", "op", "index", "req", "out", "done", "sig",
                 "fallback", "back", "issued")

    def __init__(self, owner: MpiCollectives, kind: str, value: Any, op: Any, index: int):
        self.owner = owner
        self.kind = kind
        self.value = value
        self.op = op
        self.index = index
        self.req: Any = None
        self.out: Any = None
        self.done = False
        self.sig: Any = None  # an allreduce's check that every rank gave the same array kind
        # they did not (or one had a value MPI does not reduce alike on every
        # rank): the run's tree reduces it instead, on every rank
        self.fallback = False
        self.back: Any = None  # what turns the reduced array into the value's type
        self.issued = False  # every MPI call it makes has been made

    def spec(self) -> tuple:
        """(kind, dtype, shape, op): enough for another rank to join it."""
        a = _reducible(self.value, self.op, self.owner.parent.Get_size())[0]
        return (self.kind, None if a is None else a.dtype.str,
                None if a is None else a.shape, self.op)

    def test(self) -> bool:
        if self.done:
            return True
        owner = self.owner
        if owner.busy:
            # called from a signal handler (the service mechanism) in the
            # middle of a test: between the signature's end and the
            # reduction's start it would take the finished signature for the
            # reduction, and the output (the rank's own input, as MPI had
            # copied it so far) for the result
            return False
        if not self.issued:
            owner.advance()
            if not self.issued:
                return False
        if self.fallback:
            self.done = True
            return True
        owner.busy = True
        try:
            if not self.req.Test():
                return False
            if self.back is not None:
                self.out = self.back(self.out)
            self.done = True
            return True
        finally:
            owner.busy = False

    def issue(self) -> bool:
        """Make its next MPI call if it can (see :meth:`MpiCollectives.advance`);
        True once it has made every one."""
        owner = self.owner
        MPI = owner.MPI
        if self.req is None:
            if self.kind == "barrier":
                self.req = owner.comm.Ibarrier()
                self.issued = True
                return True
            self.req = owner.comm.Iallreduce(*self._signature(), op=MPI.MAX)
        if not self.req.Test():
            return False
        got = self.sig[1]
        self.sig = None
        self.issued = True
        if got[0] != -got[1] or got[2]:
            self.fallback = True
            return True
        import numpy as np
        v = self.value  # (_signature made it an array MPI can reduce)
        if not v.flags.c_contiguous or not v.dtype.isnative:
            v = np.ascontiguousarray(v, v.dtype.newbyteorder("="))
        self.out = np.empty_like(v)
        ops = {"sum": MPI.SUM, "prod": MPI.PROD, "min": MPI.MIN, "max": MPI.MAX}
        self.req = owner.comm.Iallreduce(v, self.out, op=ops[self.op])
        return True

    def _signature(self) -> tuple:
        """First, a reduction of three numbers that tells whether every rank
        gave an array of numbers of the same dtype and shape (and op): MPI
        would reduce mismatched buffers into wrong numbers, or wait for ever
        for bytes that never come. Every rank sees the same answer, so all go
        on in MPI, or all in the tree (which reduces what the ranks gave as
        it does on every transport). A NaN in a min or max goes to the tree
        too: MPI's MAX keeps or drops it by the order each rank combined in,
        so ranks would get different results."""
        import numpy as np
        v, self.back = _reducible(self.value, self.op, self.owner.parent.Get_size())
        if v is not None:
            self.value = v
            # the type is in it too: a float and a 0-d array reduce alike in
            # MPI, but the tree gives each context a numpy float then
            tag = "array" if self.back is None else self.back.__name__
            h = zlib.crc32(f"{tag}{v.dtype.newbyteorder('=').str}{v.shape}{self.op}".encode())
            odd = int(v.dtype.kind == "f" and self.op in ("min", "max")
                      and bool(np.isnan(v).any()))
        else:
            h, odd = 0, 1
        self.sig = (np.array([h, -h, odd], np.int64), np.empty(3, np.int64))
        return self.sig

    def result(self) -> Any:
        """The reduced value (None for a barrier); see :attr:`fallback`."""
        return self.out


def _scalar(a: Any) -> Any:
    return a[()]


def _reducible(value: Any, op: str, ranks: int) -> Tuple[Any, Any]:
    """``(array, back)``: ``value`` as an array MPI can reduce with ``op``
    and what turns the reduced array back into ``value``'s type (None: it is
    an array); ``(None, None)`` where MPI cannot give what the tree gives: a
    value of another type, or a Python int whose sum over ``ranks`` ranks
    could leave int64 (Python's ints do not overflow; MPI's would wrap), or
    floats summed or multiplied over more than two ranks: the tree combines
    them in rank order, MPI in an order of its own, and float addition is
    not associative (1e16, 1.0, -1e16, 1.0, 3.0 over five ranks: 3.0 by the
    tree, 4.0 by MPICH); of two, either order gives the same bits.

    Example:
        >>> _reducible(1.5, "sum", 2)[1], _reducible(1.5, "sum", 3), _reducible(1.5, "max", 3)[1]
        (<class 'float'>, (None, None), <class 'float'>)
    """
    import numpy as np
    t = type(value)
    if ranks > 2 and (op == "sum" or op == "prod"):
        kind = value.dtype.kind if isinstance(value, (np.ndarray, np.generic)) else \
            "f" if t is float else None
        if kind == "f":
            return None, None
    if t is np.ndarray:
        if value.dtype.kind not in "iuf":
            return None, None
        # numpy combines 0-d arrays into a number (np.float64): so does the tree
        return value, (_scalar if value.ndim == 0 else None)
    if t is float:
        return np.array(value), float
    if t is int:
        bound = 2 ** 63 // ranks if op == "sum" else 2 ** 63 if op in ("min", "max") else 0
        return (np.array(value, np.int64), int) if -bound < value < bound else (None, None)
    if isinstance(value, np.generic) and value.dtype.kind in "iuf":
        return np.array(value), _scalar
    return None, None


atexit.register(_at_exit)  # (at import: see _at_exit)
