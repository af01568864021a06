"""The ``local`` protocol module: contexts are processes on this host.

Context 0 shares one AF_UNIX socketpair with every other context, made as
that context is forked. Contexts 1..N-1 connect to each other only when they
first have something to send: each listens on a socket in Linux's abstract
namespace named after the computation and its context id (see :class:`Mesh`),
so a computation holds O(N) descriptors in context 0 and in each context
O(peers it talks to), not the N(N-1) of a full mesh. Either way a frame costs
one ``sendmsg`` on the sender and one or two ``recv_into`` on the receiver.

Wire format of a frame: ``<II`` (number of buffers, sender's load), one ``<Q``
length per buffer, then the buffers back to back. Large buffers are received
straight into their own ``bytearray`` (no copy through the read buffer), so a
numpy array comes out of the pickle on top of the bytes the kernel wrote.
Smaller ones are parsed out of the connection's read buffer, which starts at
16 KiB and grows (to 256 KiB at most, and never shrinks) the first time a
frame holds a buffer that does not fit: a context that talks to hundreds of
peers in small messages pays 16 KiB per connection, not 256.
A connection made on demand starts with a hello (magic, the connector's
context id, the computation's secret) before its first frame.

Order: a sender sends every frame to one peer on the first connection it has
to that peer (one it made or one the peer made), so frames from one sender to
one receiver arrive in order even when both ends connect at the same moment.

Waiting: a context that just did something polls for ``spin_us`` before it
sleeps in epoll, because waking a sleeping process on the other core costs
~30 us here, more than all the Python work of a call (see docs/benchmarks.md).
With rings, a wait that a longer poll would have caught makes the next poll
longer (see ``_adapt``), and the poll looks at the rings every time and at
the sockets (a system call) every ``_SOCKET_LOOK``-th time.

Rings (``rings=True``, as the launcher makes contexts unless MACROFLOW_RINGS=0):
each side of a connection offers the peer a shared-memory ring to write to it
(:mod:`macroflow.transport.ring`: every ring a process reads is in one memfd).
The peer maps it, sends SWITCH on the socket and from then on writes every
frame of up to ``RING_FRAME_MAX`` bytes (half the ring, if less) there: its
buffers copied in and three stores, no system call, and the reader finds it at its next poll by
a single load (the host's BELL). A larger frame still travels on the socket, behind a MARK in the
ring; the reader holds socket frames until it reaches their MARKs, so the
order per direction is the order sent. A reader about to sleep flags NAP, and
a writer that sees the flag pokes the socket with a frame of no buffers, which
wakes the reader's epoll. A writer whose ring is full waits as it does for a
full socket, reading meanwhile. The socket also tells that the peer ended:
what its ring still holds is delivered before the peer is reported lost, and
at the next poll the rings of that connection are unmapped, the pages of ours
given back.
"""

from __future__ import annotations

import errno
import fcntl
import hmac
import mmap
import os
import resource
import select
import socket
import struct
import sys
import time
from collections import deque
from pickle import PickleBuffer
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

from ..core.errors import LimitError
from ..core.threads import numpy
from . import ring as _ring
from .base import Transport

_HDR = struct.Struct("<II")
_HDR1 = struct.Struct("<IIQ")  # the common frame: one buffer
_RBUF_MIN = 16 * 1024  # a connection's read buffer when it is made
_RBUF = 256 * 1024  # the most it grows to (for frames of buffers up to _BIG)
_BIG = _RBUF // 2  # buffers larger than this are received in place
_SOCKBUF = 4 * 1024 * 1024
_IOV_MAX = 512
_SMALL = 64 * 1024  # frames up to this size are joined and sent with one send()
_POOL_MIN = 1 << 20  # buffers from this size on are pooled
_STALL = 2.0  # seconds a peer may pause in the middle of a large buffer
_PREEMPTED = 1e-3  # a gap this long between two polls: someone else had our core
_CALM = 0.01  # then sleep instead of spinning for this long
_SOCKET_LOOK = 8  # a spin with rings looks at the sockets this seldom (see _spin)
SPIN_GROWTH = 20  # the spin grows to at most this many times spin_us (see _adapt)
_HELLO = struct.Struct("<4sI16s")  # magic, the connector's context id, the secret
_MAGIC = b"MFh1"
_UCRED = struct.Struct("3i")  # SO_PEERCRED: pid, uid, gid
_START_WAIT = 120.0  # seconds to wait for a peer's listening socket to appear
NOT_STARTED, LISTENING, GONE = 0, 1, 2  # a context's state in Mesh.states
RING_BYTES = 1 << 20  # a shared-memory ring, one direction of one connection
# larger frames travel on the socket (a MARK in the ring). Up to _BIG the
# socket copies a payload out of its read buffer, so the ring (a copy in, a
# copy out) is never worse; a 64 KiB array there and back took 76 us by the
# socket and 39 us by the ring.
RING_FRAME_MAX = _BIG
# each ring has a bulk area of this many bytes (pages taken only once
# written) for the buffers of BULK_MIN bytes or more of a frame: one copy
# in, and the receiver's array is made on the area itself (see ring.py)
BULK_BYTES = 64 << 20
BULK_MIN = 32 * 1024
# transport control frames on a socket (never a frame of the engine's, whose
# first byte is an opcode or a pickle's): the ring hand-shake
_CTL = b"\x00MFring"
_OFFER = struct.Struct("<iiqi")  # the reader's pid, its RingHost's fd, the ring's offset, bytes
_WAKE = _HDR.pack(0, 0)  # a frame of no buffers: "look at the ring"
_RING_LOOK = 16  # while rings deliver, look at the sockets every this many polls


def nofile_error(what: str, err: OSError) -> LimitError:
    """The clear error for running out of file descriptors while doing ``what``.

    Example:
        >>> e = nofile_error("make a socket", OSError(errno.EMFILE, "Too many open files"))
        >>> e.limit, "RLIMIT_NOFILE" in str(e), "ulimit -n" in str(e)
        ('RLIMIT_NOFILE', True, True)
    """
    if err.errno == errno.ENFILE:
        return LimitError("file-max", (
            f"cannot {what}: the system-wide table of open files is full (ENFILE); "
            f"close other programs' files or raise /proc/sys/fs/file-max (as root)"))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    inf = resource.RLIM_INFINITY
    if hard == inf or hard > soft:
        target = str(hard) if hard != inf else str(max(4 * soft, 65536))
        how = (f"raise the soft limit (each context needs a descriptor in context 0, and "
               f"one per peer it talks to), e.g. `ulimit -n {target}` in the shell that "
               f"starts Python, or resource.setrlimit(resource.RLIMIT_NOFILE, "
               f"({target}, {'resource.RLIM_INFINITY' if hard == inf else hard})) "
               f"before mf.init or mf.run")
    else:
        how = (f"the soft limit is already the hard limit, which only root can raise "
               f"(`ulimit -n {4 * hard}` in a root shell, resource.setrlimit as root, "
               f"/etc/security/limits.conf, LimitNOFILE= for a service); or use fewer contexts")
    shown = "unlimited" if hard == inf else str(hard)
    return LimitError("RLIMIT_NOFILE", (
        f"cannot {what}: too many open files (RLIMIT_NOFILE soft limit {soft}, "
        f"hard limit {shown}); {how}"))


#: Memory counted per context when checking that a computation fits (see
#: check_room). A context forked from a small program holds ~2 MB of its own
#: (USS) while idle, ~9 MB once a full garbage collection has copied the pages
#: of the heap it shares with context 0; more for a larger program.
CONTEXT_MEMORY = 10 << 20
#: The same for a context of the inproc transport: its engine (~22 KB).
INPROC_CONTEXT_MEMORY = 64 << 10


def _mem_available() -> Optional[int]:
    """Bytes of memory available for new work (MemAvailable), or None if unknown."""
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _nproc_limit() -> Optional[int]:
    """RLIMIT_NPROC's soft limit where the kernel holds this process to it, else None."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NPROC)
    if soft == resource.RLIM_INFINITY or os.getuid() == 0:  # root is not held to it
        return None
    return soft


def _tasks_total() -> Optional[int]:
    """Processes and threads of every user on this host (from /proc/loadavg)."""
    try:
        with open("/proc/loadavg", "rb") as f:
            return int(f.read().split()[3].split(b"/")[1])
    except (OSError, ValueError, IndexError):
        return None


def _user_tasks() -> int:
    """Processes and threads of this user: what RLIMIT_NPROC counts."""
    uid = os.getuid()
    n = 0
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.stat(f"/proc/{name}").st_uid == uid:
                    n += os.stat(f"/proc/{name}/task").st_nlink - 2  # one entry per thread
            except OSError:
                pass  # it ended meanwhile
    return n


def _size(n: int) -> str:
    return f"{n >> 20} MB" if n >= 1 << 20 else f"{n >> 10} KB"


def room_advice(fit: int, adding: bool) -> str:
    """What a LimitError of :func:`check_room` advises, for a computation
    that ``fit`` contexts in all would fit: how many to use, or, for
    contexts ``adding`` to a running one (context 0 is there already), how
    many to add.

    Example:
        >>> room_advice(5, False), room_advice(5, True), room_advice(0, True)
        ('use at most 5 contexts', 'add at most 4 contexts', 'add at most 0 contexts')
    """
    return f"add at most {max(fit - 1, 0)} contexts" if adding else f"use at most {fit} contexts"


FDS_PER_ADDED = 2  # descriptors context 0 needs for a context it adds, while it makes it
FDS_SPARE = 8  # and these left over, for what the program opens meanwhile


def _check_nofile(new: int) -> None:
    # Before anything is started: failing for want of descriptors part-way
    # left the contexts made so far half added (in mf.stats(), not in
    # mf.contexts()) and their descriptors taken, so every later add failed.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return
    try:
        used = len(os.listdir("/proc/self/fd"))
    except OSError:
        return
    room = (soft - used - FDS_SPARE) // FDS_PER_ADDED
    if new > room:
        raise LimitError("RLIMIT_NOFILE", (
            f"{new} more contexts need about {new * FDS_PER_ADDED} file descriptors here while "
            f"they are made, and {max(soft - used, 0)} are free (RLIMIT_NOFILE soft limit {soft}, "
            f"hard limit {'unlimited' if hard == resource.RLIM_INFINITY else hard}; {used} open); "
            f"{room_advice(max(room, 0) + 1, True)}, or raise the limit with `ulimit -n N` in "
            f"the shell that starts Python"))


def check_room(contexts: int, transport: str = "local", adding: bool = False) -> None:
    """Raise :class:`LimitError` if this host cannot hold ``contexts`` contexts
    (``adding``: all but one of them are to be added to a running computation;
    the advice then says how many to add).

    Checked before anything is started: on the ``local`` transport, the
    ``contexts - 1`` processes to fork must fit under RLIMIT_NPROC (its soft
    limit, less the processes and threads this user already runs; root is
    not held to it) and in the memory available (MemAvailable in
    /proc/meminfo, counting :data:`CONTEXT_MEMORY` per context); on
    ``inproc``, the contexts must fit in memory (:data:`INPROC_CONTEXT_MEMORY`
    each); contexts added to a running computation on ``local`` must find
    :data:`FDS_PER_ADDED` free file descriptors each under RLIMIT_NOFILE. A
    limit that cannot be read is not checked.

    Example:
        >>> check_room(2)
        >>> try:
        ...     check_room(10**9)
        ... except LimitError as e:
        ...     print(e.limit)
        memory
    """
    per = CONTEXT_MEMORY if transport == "local" else INPROC_CONTEXT_MEMORY
    new = contexts - 1 if transport == "local" else contexts  # context 0 exists already
    # (adding: ``contexts`` counts context 0, which is there already)
    who = f"{new} more contexts" if adding else f"{contexts} contexts"
    avail = _mem_available()
    if avail is not None and new * per > avail:
        fit = avail // per + (1 if transport == "local" else 0)
        raise LimitError("memory", (
            f"{who} do not fit in this host's memory: they need about "
            f"{new * per >> 20} MB ({_size(per)} per context on the {transport} transport) "
            f"and {avail >> 20} MB is available (MemAvailable in /proc/meminfo); "
            f"{room_advice(fit, adding)}, or free memory"))
    if transport != "local":
        return
    if adding:
        _check_nofile(new)
    soft = _nproc_limit()
    if soft is None:
        return
    total = _tasks_total()
    if total is not None and new <= soft - total:
        return  # fits even if every task on the host were this user's
    running = _user_tasks()
    room = max(soft - running, 0)
    if new > room:
        _soft, hard = resource.getrlimit(resource.RLIMIT_NPROC)
        shown = "unlimited" if hard == resource.RLIM_INFINITY else str(hard)
        raise LimitError("RLIMIT_NPROC", (
            f"{who} need {new} new processes, but this user may start only "
            f"{room} more (RLIMIT_NPROC soft limit {soft}, hard limit {shown}; "
            f"{running} processes and threads of this user are running); "
            f"{room_advice(room + 1, adding)}, or raise the limit with `ulimit -u N` in the shell that "
            f"starts Python (or resource.setrlimit(resource.RLIMIT_NPROC, (N, hard)) "
            f"before mf.init or mf.run)"))


def _process_fate(pid: int, wait: float = 0.1) -> Optional[str]:
    """How process ``pid`` ended, read from /proc while it is a zombie (its
    parent, context 0 say, has not reaped it yet); None if it still runs
    after ``wait`` seconds.

    Example:
        >>> import subprocess, sys
        >>> p = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
        >>> while _process_fate(p.pid, wait=0) is None: pass
        >>> _process_fate(p.pid) == f"its process (pid {p.pid}) exited with code 3", p.wait()
        (True, 3)
        >>> _process_fate(p.pid) == f"its process (pid {p.pid}) has ended"
        True
    """
    from .base import process_fate
    deadline = time.monotonic() + wait
    while True:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            return f"its process (pid {pid}) has ended"
        if fields[0] == b"Z" and len(fields) >= 50:
            return process_fate(pid, int(fields[49]))  # exit_code
        # a process closes its files before it is a zombie: its connection
        # may read as closed a moment before /proc says how it ended
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.001)


def node_key() -> str:
    """What makes two processes able to use the local path to each other: the
    same host and the same network namespace (abstract sockets are per namespace).

    Example:
        >>> import socket
        >>> node_key().startswith(socket.gethostname())
        True
    """
    global _node
    pid = os.getpid()
    if _node[0] != pid:  # asked for every global pointer made: once per process
        try:
            ns = os.stat("/proc/self/ns/net").st_ino
        except OSError:
            ns = 0
        _node = (pid, f"{socket.gethostname()}~{ns}")
    return _node[1]


_node = (0, "")  # (the process it was computed in, node_key())


#: the most contexts (started and added while running) one local computation can have
MESH_CAPACITY = 1 << 16


class Mesh:
    """Where the contexts of one computation listen for connections, and which do.

    Context ``c`` (c >= 1) listens on ``address(c)``, a socket in Linux's
    abstract namespace (nothing on disk, gone when its process is). ``states``
    holds one byte per context (NOT_STARTED, LISTENING, GONE) in memory that
    every process of the computation shares (an anonymous shared mapping,
    inherited by fork, no descriptor): a peer whose connection is refused is
    either not forked yet (wait for it) or gone (it is lost). Every connection
    must start with the computation's ``secret``: other processes of this
    host can see the address, but cannot talk to a context.

    Example:
        >>> m = Mesh("c0ffee00", 3)
        >>> m.address(2)
        b'\\x00macroflow-c0ffee00-2'
        >>> s = m.listen(2)
        >>> [m.states[c] for c in range(3)] == [NOT_STARTED, NOT_STARTED, LISTENING]
        True
        >>> s.close()
    """

    def __init__(self, computation: str, size: int, secret: Optional[bytes] = None):
        self.computation = computation
        self.size = size
        self.secret = secret if secret is not None else os.urandom(16)
        # room for contexts added while running; pages never touched cost nothing
        self.states = mmap.mmap(-1, max(size, MESH_CAPACITY))
        # each context's process id, written as it starts listening: how a
        # context that ended went can be told by the others from /proc
        self.pids = mmap.mmap(-1, 4 * max(size, MESH_CAPACITY))

    def address(self, ctx: int) -> bytes:
        return f"\0macroflow-{self.computation}-{ctx}".encode()

    def listen(self, ctx: int) -> socket.socket:
        """A listening socket for context ``ctx``; its state becomes LISTENING."""
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.bind(self.address(ctx))
            s.listen(max(self.size, 16))  # every peer may connect before ctx accepts
        except BaseException:
            s.close()
            raise
        s.setblocking(False)
        self.states[ctx] = LISTENING
        return s

    def note_pid(self, ctx: int) -> None:
        """This process is context ``ctx``'s (its listener is made before
        the fork, by its parent: the context says so itself)."""
        if 0 <= ctx < len(self.pids) // 4:
            struct.pack_into("<i", self.pids, 4 * ctx, os.getpid())

    def pid(self, ctx: int) -> Optional[int]:
        """Context ``ctx``'s process id, once it has noted it; else None.

        Example:
            >>> m = Mesh("c0ffee01", 2)
            >>> m.pid(1) is None
            True
            >>> m.note_pid(1)
            >>> m.pid(1) == os.getpid()
            True
        """
        if not 0 <= ctx < len(self.pids) // 4:
            return None
        return struct.unpack_from("<i", self.pids, 4 * ctx)[0] or None

    def hello(self, ctx: int) -> bytes:
        return _HELLO.pack(_MAGIC, ctx, self.secret)


def tune(sock: socket.socket) -> None:
    """Make a socket non-blocking with large kernel buffers (best effort)."""
    sock.setblocking(False)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, _SOCKBUF)
        except OSError:
            pass


class BufferPool:
    """Large receive buffers, reused once nothing refers to them any more.

    Fresh memory costs the kernel a page fault and a zeroing per page (about
    1 ms per 16 MB here); a buffer whose arrays the user has dropped costs
    nothing. A buffer is free when the pool holds the only reference to it.

    Example:
        >>> pool = BufferPool(limit=64 << 20)
        >>> a = pool.get(3 << 20); a.nbytes
        3145728
        >>> del a
        >>> pool.get(3 << 20).base is pool.bufs[0]
        True
    """

    def __init__(self, limit: int = 256 << 20):
        self.limit = limit
        self.bufs: List[Any] = []  # numpy arrays
        self.held = 0
        self.reused = 0

    def get(self, n: int) -> Any:
        if n >= _POOL_MIN:
            for b in self.bufs:
                # references: the list, the loop variable, getrefcount's argument
                if n <= b.nbytes <= 2 * n and sys.getrefcount(b) <= 3:
                    self.reused += 1
                    return b[:n]
            size = -(-n // _POOL_MIN) * _POOL_MIN
            if self.held + size <= self.limit:
                b = numpy().empty(size, "u1")
                self.bufs.append(b)
                self.held += size
                return b[:n]
        # numpy does not zero what it allocates, and asks for huge pages
        return numpy().empty(n, "u1")


def _small_frame(parts: Sequence[object], load: int) -> Optional[bytes]:
    """The whole frame as one bytes object, if it is small enough to copy."""
    if len(parts) == 1:
        d = parts[0]
        if len(d) > _SMALL:  # type: ignore[arg-type]
            return None
        return _HDR1.pack(1, load, len(d)) + d  # type: ignore[arg-type, operator]
    views = [_view(p) for p in parts]
    lens = [v.nbytes for v in views]
    if sum(lens) > _SMALL:
        return None
    return b"".join([_frame_head(lens, load), *views])


def _frame_head(lens: Sequence[int], load: int) -> bytes:
    """The head of a frame of buffers of ``lens`` bytes (before the buffers),
    on a socket or in a ring's MANY entry.

    Example:
        >>> len(_frame_head([3, 5], 0))
        24
    """
    return _HDR.pack(len(lens), load) + struct.pack(f"<{len(lens)}Q", *lens)


def _view(p: object) -> memoryview:
    if type(p) is PickleBuffer:
        return p.raw()
    m = memoryview(p)  # type: ignore[arg-type]
    return m if m.format == "B" and m.ndim == 1 else m.cast("B")


def _set_async(fd: int, on: bool) -> None:
    try:
        if on:
            fcntl.fcntl(fd, fcntl.F_SETOWN, os.getpid())
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_ASYNC if on else flags & ~os.O_ASYNC)
    except OSError:
        pass  # closed meanwhile


class _Conn:
    __slots__ = ("peer", "sock", "fd", "rbuf", "rmv", "rs", "re", "state", "nbufs",
                 "load", "lens", "idx", "bufs", "big", "bigmv", "bigpos", "outq", "closed", "wbuf",
                 "rin", "offered", "rout", "rout_next", "held", "reading", "poke", "rmax", "pid")

    def __init__(self, peer: int, sock: socket.socket):
        self.peer = peer
        self.sock = sock
        self.fd = sock.fileno()
        self.rbuf = bytearray(_RBUF_MIN)  # grows when a frame needs it: see _grow
        self.rmv = memoryview(self.rbuf)
        self.rs = self.re = 0
        self.state = 0
        self.nbufs = self.load = self.idx = 0
        self.lens: Sequence[int] = ()
        self.bufs: List[object] = []
        self.big: Optional[Any] = None  # a numpy array
        self.bigmv: Optional[memoryview] = None
        self.bigpos = 0
        self.outq: deque = deque()
        self.closed = False
        self.wbuf = bytearray()  # small frames queued for one write at flush()
        # shared-memory rings (see LocalTransport's notes): the one the peer
        # writes to us (offered: made, not yet switched to by the peer), the
        # one we write to (rout_next: mapped, switched to at our next send)
        self.rin: Optional[_ring.Ring] = None
        self.offered: Optional[_ring.Ring] = None
        self.rout: Optional[_ring.Ring] = None
        self.rout_next: Optional[_ring.Ring] = None
        self.held: deque = deque()  # socket frames waiting for their MARK in rin
        self.reading = False  # in _ring_read
        self.pid: Optional[int] = None  # the peer's process, once it offered a ring
        self.poke = False  # frames queued in rout: see if the reader naps at flush()
        self.rmax = 0  # the largest frame that goes in rout (see _switch)


class LocalTransport(Transport):
    """Frames over AF_UNIX stream sockets between forked processes.

    ``socks`` are the connections made before the fork (peer -> socket);
    with a ``mesh``, connections to other peers (ids 1..size-1) are made when
    first needed, and ``listener`` (from :meth:`Mesh.listen`) accepts the
    connections peers make to this context.

    Example (two ends in one process, for illustration):
        >>> import socket
        >>> a, b = socket.socketpair()
        >>> ta, tb = LocalTransport(0, {1: a}), LocalTransport(1, {0: b})
        >>> got = []
        >>> tb.attach(lambda src, bufs, load: got.append((src, bytes(bufs[0]))), None)
        >>> ta.send(1, [b"hello"], 0) > 5
        True
        >>> tb.poll(1.0); got
        True
        [(0, b'hello')]
        >>> ta.close(); tb.close()
    """

    name = "local"
    #: errors of a receive that mean the connection is gone (others are bugs)
    closed_errnos: Tuple[int, ...] = (errno.ECONNRESET, errno.EPIPE)

    def __init__(self, ctx: int, socks: Dict[int, socket.socket], spin_us: float = 0.0,
                 mesh: Optional[Mesh] = None, listener: Optional[socket.socket] = None,
                 rings: bool = False, ring_bytes: int = RING_BYTES, bulk_bytes: int = BULK_BYTES):
        super().__init__()
        self.ctx = ctx
        # shared-memory rings where this CPU orders stores (see the module's notes)
        self.rings = bool(rings) and _ring.problem() is None and hasattr(os, "memfd_create")
        self.ring_bytes = ring_bytes
        self.bulk_bytes = bulk_bytes
        self.rins: List[_Conn] = []  # connections whose peer writes to us in a ring
        self.host: Optional[_ring.RingHost] = None  # where those rings are (made at the first)
        self.bell_seen = 0  # the host's BELL when we last looked at the rings
        self.mapped: List[_ring.Ring] = []  # peers' rings we write to, unmapped at close()
        self.dead: List[_ring.Ring] = []  # rings of closed connections: see _close
        self.ring_polls = 0
        self.pokes = 0  # wake-ups sent: a ring's reader had flagged NAP
        self.bulk_sent = self.bulk_got = 0  # frames with buffers in a bulk area
        self.spin_s = spin_us / 1e6
        self.spin_cur = self.spin_s  # the spin now (see _adapt)
        self.spin_max = SPIN_GROWTH * self.spin_s
        self.conns: Dict[int, _Conn] = {}  # peer -> the connection frames to it go on
        self.links: Dict[int, List[_Conn]] = {}  # peer -> all its connections (at most 2)
        self.byfd: Dict[int, _Conn] = {}
        self.gone: Set[int] = set()  # peers reported lost
        # peers lost before the engine attached (one that died as the
        # contexts started): reported at the first poll (see poll)
        self.early_lost: List[Tuple[int, str, Optional[int]]] = []
        self.pending: List[_Conn] = []  # connections with queued frames
        self.pool = BufferPool()
        self.calm_until = 0.0  # no spinning before this time (we were preempted)
        self.spins_preempted = 0
        self.draining = False  # in _drain: finishing a frame of our own
        self.mesh = mesh
        self.listener = listener
        if mesh is not None and ctx > 0:
            mesh.note_pid(ctx)
        self.lfd = -1
        self.signalling = False  # SIGIO on arrivals: see signal_arrivals
        try:
            self.ep = select.epoll()
        except OSError as e:
            if e.errno in (errno.EMFILE, errno.ENFILE):
                raise nofile_error(f"start context {ctx}'s transport", e) from e
            raise
        for peer, s in socks.items():
            self._offer(self._add(peer, s))
        if listener is not None:
            listener.setblocking(False)
            self.lfd = listener.fileno()
            self.ep.register(self.lfd, select.EPOLLIN)

    def _add(self, peer: int, sock: socket.socket) -> _Conn:
        """Take a connection into use; peer -1: accepted, its hello not read yet."""
        tune(sock)
        c = _Conn(peer, sock)
        self.byfd[c.fd] = c
        self.ep.register(c.fd, select.EPOLLIN)
        if self.signalling:
            _set_async(c.fd, True)
        if peer >= 0:
            self._know(c)
        return c

    def _know(self, c: _Conn) -> None:
        self.links.setdefault(c.peer, []).append(c)
        # the first connection to a peer carries every frame to it: order per pair
        self.conns.setdefault(c.peer, c)

    def fileno(self) -> int:
        return self.ep.fileno()

    def adopt(self, peer: int, sock: socket.socket) -> None:
        """Take ``sock``, connected to context ``peer`` (one added while
        running), as the connection frames to ``peer`` go on."""
        self._offer(self._add(peer, sock))
    def signal_arrivals(self, on: bool, again: bool = False) -> bool:
        """While ``on``, the kernel sends this process SIGIO whenever bytes or a
        connection arrive (O_ASYNC on every socket, new ones included), so a
        context whose thread runs user code can be interrupted to serve. The
        caller installs a SIGIO handler first: SIGIO's default ends the process.
        ``again`` sets every socket even if the state does not change (a
        connection made while it changed may have missed it).

        Example:
            >>> import signal, socket
            >>> got = []
            >>> old = signal.signal(signal.SIGIO, lambda *a: got.append("SIGIO"))
            >>> a, b = socket.socketpair()
            >>> t = LocalTransport(1, {0: b})
            >>> t.signal_arrivals(True)
            True
            >>> _ = a.send(b"x"); time.sleep(0.01)
            >>> t.signal_arrivals(False); got[:1]
            True
            ['SIGIO']
            >>> _ = signal.signal(signal.SIGIO, old); t.close(); a.close()
        """
        if on:
            # frames in rings poke the sockets while signals are on. Never
            # cleared here: this runs in the service's thread, perhaps while
            # the engine's sleeps relying on the flag; its next wake clears it
            self.nap(True)
        if on != self.signalling or again:
            self.signalling = on
            fds = list(self.byfd)
            if self.lfd >= 0:
                fds.append(self.lfd)
            for fd in fds:
                _set_async(fd, on)
        return True

    def peers(self) -> List[int]:
        return [p for p, cs in self.links.items() if any(not c.closed for c in cs)]

    # -- connecting on demand ----------------------------------------------
    def _connect(self, dest: int) -> _Conn:
        """The connection to ``dest``, made now; ConnectionError if it cannot be
        (the peer is then reported lost, once)."""
        mesh = self.mesh
        if mesh is None or dest in self.gone or not 0 < dest < len(mesh.states) or dest == self.ctx:
            raise ConnectionError(f"no connection to context {dest}")
        deadline = 0.0
        pause = 0.0002
        while True:
            # read before connecting: LISTENING is set only once the socket listens
            state = mesh.states[dest]
            if state == GONE:
                self._report(dest, "its process has ended")
            try:
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE):
                    raise nofile_error(f"connect context {self.ctx} to context {dest}", e) from e
                raise
            try:
                s.setblocking(False)
                s.connect(mesh.address(dest))
            except (BlockingIOError, InterruptedError):
                s.close()  # its backlog is full: it has not accepted for a while
            except (ConnectionRefusedError, FileNotFoundError):
                s.close()
                if state != NOT_STARTED:
                    self._report(dest, "its listening socket is gone (connection refused)")
                # else: not forked yet, wait for it
            except OSError as e:
                s.close()
                self._report(dest, f"connect failed: {e}")
            else:
                # the name is free again once its context has ended: whoever listens
                # there now must at least be us (frames are pickles)
                _pid, uid, _gid = _UCRED.unpack(
                    s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
                if uid != os.geteuid():
                    s.close()
                    self._report(dest, f"its address is held by another user (uid {uid})")
                c = self._add(dest, s)
                if not self._send_whole(c, mesh.hello(self.ctx)):
                    raise ConnectionError(f"context {dest}: sending the hello failed")
                self._offer(c)
                return self.conns[dest]  # ours, unless one came in meanwhile
            now = time.monotonic()
            if not deadline:
                deadline = now + _START_WAIT
            elif now > deadline:
                self._report(dest, f"it did not start listening within {_START_WAIT:g} s")
            # serve what arrives meanwhile: the peer may be connecting to us
            for fd, _ev in self.ep.poll(pause):
                self._event(fd)
            pause = min(2 * pause, 0.01)
            c = self.conns.get(dest)
            if c is not None:
                if c.closed:
                    raise ConnectionError(f"no connection to context {dest}")
                return c

    def _report(self, dest: int, how: str) -> None:
        """A peer we could not connect to is lost: say so once, then give up."""
        if dest not in self.gone:
            self.gone.add(dest)
            if self.lost is not None:
                self.lost(dest, how)
        raise ConnectionError(f"context {dest}: {how}")

    def _accept(self) -> bool:
        got = False
        while True:
            try:
                s, _ = self.listener.accept()  # type: ignore[union-attr]
            except (BlockingIOError, InterruptedError):
                return got
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE):
                    raise nofile_error(f"accept a connection to context {self.ctx}", e) from e
                if e.errno in (errno.ECONNABORTED, errno.EPROTO):
                    continue
                raise
            got = self._read(self._add(-1, s)) or got

    def _hello(self, c: _Conn) -> bool:
        """Read an accepted connection's hello; False if it is not there yet or
        not valid (then the connection is dropped, and nobody is reported lost)."""
        if c.re - c.rs < _HELLO.size:
            return False
        magic, peer, secret = _HELLO.unpack_from(c.rbuf, c.rs)
        mesh = self.mesh
        if (mesh is None or magic != _MAGIC or not hmac.compare_digest(secret, mesh.secret)
                or not 0 < peer < len(mesh.states) or peer == self.ctx or peer in self.gone):
            self._close(c, "bad hello")
            return False
        c.rs += _HELLO.size
        c.peer = peer
        self._know(c)
        self._offer(c)
        return True

    def _event(self, fd: int) -> bool:
        c = self.byfd.get(fd)
        if c is not None:
            return self._read(c)
        if fd == self.lfd:
            return self._accept()
        return False

    def address(self):
        """("local", "NODE/MESH:PID"): the host (and network namespace), the
        computation's mesh, and this process."""
        mesh = self.mesh.computation if self.mesh is not None else "-"
        return ("local", f"{node_key()}/{mesh}:{os.getpid()}")

    def reaches(self, address: str) -> bool:
        """True if a context at local ``address`` is in this context's mesh on this host."""
        return self.mesh is not None and address.rsplit(":", 1)[0] == \
            f"{node_key()}/{self.mesh.computation}"

    # -- sending ---------------------------------------------------------
    def queue(self, dest: int, parts: Sequence[object], load: int) -> int:
        c = self.conns.get(dest)
        if c is None:
            c = self._connect(dest)
        if c.closed:
            raise ConnectionError(f"no connection to context {dest}")
        r = c.rout
        if r is None and c.rout_next is not None and not c.outq:
            r = self._switch(c)
        if r is not None:
            if not c.poke:
                c.poke = True
                self.pending.append(c)
            return self._ring_send(c, r, parts, load, False)
        frame = _small_frame(parts, load)
        if frame is None:
            return self.send(dest, parts, load)
        if not c.wbuf:
            self.pending.append(c)
        c.wbuf += frame
        return len(frame)

    def flush(self) -> None:
        pending, self.pending = self.pending, []
        for c in pending:
            self._flush_conn(c)

    def _flush_conn(self, c: _Conn) -> None:
        if c.poke:
            c.poke = False
            if c.rout is not None and not c.closed:
                self._wake(c, c.rout)
        if not c.wbuf or c.closed:
            return
        data, c.wbuf = c.wbuf, bytearray()
        self._send_whole(c, data)

    def _send_whole(self, c: _Conn, data) -> bool:
        """Send one buffer, finishing it in _drain if the kernel takes part of it;
        False if the connection failed (it is closed and reported)."""
        try:
            n = c.sock.send(data)
        except BlockingIOError:
            n = 0
        except OSError as e:
            self._close(c, f"send failed: {e}")
            return False
        if n < len(data):
            c.outq.append(memoryview(data)[n:])
            self._drain(c)
        return True

    def send(self, dest: int, parts: Sequence[object], load: int) -> int:
        c = self.conns.get(dest)
        if c is None:
            c = self._connect(dest)
        if c.closed:
            raise ConnectionError(f"no connection to context {dest}")
        r = c.rout
        if r is None and c.rout_next is not None and not c.outq:
            r = self._switch(c)
        if r is not None:
            if len(parts) == 1:
                # the commonest frame, _ring_send's first case inline
                d = parts[0]
                if (type(d) is bytes or type(d) is bytearray) and len(d) <= c.rmax:
                    k = r.send1(d, load)  # written, and the reader's NAP looked at
                    if k != 1:
                        if k == 0:
                            self._wait_room(c, r, d, load, 0)
                        self._wake(c, r)
                    return 16 + len(d)
            return self._ring_send(c, r, parts, load, True)
        return self._sock_send(c, dest, parts, load)

    def _sock_send(self, c: _Conn, dest: int, parts: Sequence[object], load: int) -> int:
        if c.wbuf:
            self._flush_conn(c)  # keep the order of queued frames
        if not c.outq:
            # fast path: a small frame goes out as one bytes object in one send
            frame = _small_frame(parts, load)
            if frame is not None:
                if not self._send_whole(c, frame):
                    raise ConnectionError(f"context {dest}: send failed")
                return len(frame)
        views = [_view(p) for p in parts]
        head = _frame_head([v.nbytes for v in views], load)
        total = len(head) + sum(v.nbytes for v in views)
        if c.outq:
            c.outq.append(memoryview(head))
            c.outq.extend(views)
            self._drain(c)
            return total
        vec = [head, *views]
        try:
            n = c.sock.sendmsg(vec) if len(vec) <= _IOV_MAX else 0
        except BlockingIOError:
            n = 0
        except OSError as e:
            self._close(c, f"send failed: {e}")
            raise ConnectionError(f"context {dest}: {e}") from None
        if n < total:
            for v in vec:
                v = memoryview(v) if not isinstance(v, memoryview) else v
                if n >= v.nbytes:
                    n -= v.nbytes
                    continue
                c.outq.append(v[n:])
                n = 0
            self._drain(c)
        return total

    def _drain(self, c: _Conn) -> None:
        # The frame did not fit in the kernel buffer. Finish it now, reading
        # everything that arrives meanwhile, so that two contexts sending large
        # frames to each other cannot deadlock.
        self.ep.modify(c.fd, select.EPOLLIN | select.EPOLLOUT)
        draining, self.draining = self.draining, True
        try:
            while c.outq and not c.closed:
                for fd, ev in self.ep.poll(1.0):
                    d = self.byfd.get(fd)
                    if d is None:
                        if fd == self.lfd:
                            self._accept()  # a peer that sends to us may be new
                        continue
                    if ev & (select.EPOLLIN | select.EPOLLHUP | select.EPOLLERR):
                        self._read(d)
                    if d is c and ev & select.EPOLLOUT:
                        self._write(c)
        finally:
            self.draining = draining
            if not c.closed:
                self.ep.modify(c.fd, select.EPOLLIN)

    def _write(self, c: _Conn) -> None:
        while c.outq:
            batch = list(c.outq)[:_IOV_MAX]
            try:
                n = c.sock.sendmsg(batch)
            except BlockingIOError:
                return
            except OSError as e:
                self._close(c, f"send failed: {e}")
                return
            while n and c.outq:
                v = c.outq[0]
                if n >= v.nbytes:
                    n -= v.nbytes
                    c.outq.popleft()
                else:
                    c.outq[0] = v[n:]
                    n = 0

    # -- shared-memory rings ----------------------------------------------
    def _offer(self, c: _Conn) -> None:
        """Make the ring ``c``'s peer is to write to us, and offer it."""
        if not self.rings or c.offered is not None or c.rin is not None or c.closed:
            return
        try:
            if self.host is None:
                self.host = _ring.RingHost()
            r = self.host.ring(self.ring_bytes, bulk=self.bulk_bytes)
        except OSError:
            return  # no memfd here (or no memory): the socket alone
        c.offered = r
        body = _CTL + b"O" + _OFFER.pack(os.getpid(), self.host.fd, r.offset, r.cap)
        self._send_whole(c, _HDR1.pack(1, 0, len(body)) + body)

    def _control(self, c: _Conn, b0: Any) -> None:
        op = b0[len(_CTL)]
        if op == ord("O"):  # the peer offers its ring: we write there from our next send
            pid, fd, offset, cap = _OFFER.unpack_from(b0, len(_CTL) + 1)
            if not self.rings or c.rout is not None:
                return
            try:
                c.rout_next = _ring.Ring.open(pid, fd, offset, cap, self.ctx + 1)
                c.pid = pid  # (how it ended can be told from it, when the connection closes)
                self.mapped.append(c.rout_next)
            except (OSError, ValueError):
                pass  # not ours to open (another user, no /proc): the socket alone
        elif op == ord("S"):  # the peer writes to us in the ring from here on
            r, c.offered = c.offered, None
            if r is None:
                return
            c.rin = r
            self.rins.append(c)
            self.bell_seen = -1  # look at every ring at the next poll

    def _switch(self, c: _Conn) -> _ring.Ring:
        """Write to the peer's ring from now on: the frames queued for the
        socket go first, then SWITCH, which tells the peer where to look."""
        self._flush_conn(c)
        body = _CTL + b"S"
        if not self._send_whole(c, _HDR1.pack(1, 0, len(body)) + body):
            raise ConnectionError(f"context {c.peer}: send failed")
        r, c.rout_next = c.rout_next, None
        # an entry of up to half the ring fits once the reader has caught up,
        # wherever the ring's end falls; a larger one might never fit
        c.rmax = min(RING_FRAME_MAX, (r.cap >> 1) - 16)  # type: ignore[union-attr]
        c.rout = r
        return r  # type: ignore[return-value]

    def _ring_send(self, c: _Conn, r: _ring.Ring, parts: Sequence[object], load: int,
                   now: bool) -> int:
        if len(parts) == 1:
            d = parts[0]
            if type(d) is bytes or type(d) is bytearray:
                n = len(d)
                if n <= c.rmax:
                    if not r.put(d, load):
                        self._wait_room(c, r, d, load, 0)
                    if now:
                        self._wake(c, r)
                    return 16 + n
        views = [_view(p) for p in parts]
        lens = [v.nbytes for v in views]
        total = 8 + 8 * len(views) + sum(lens)
        if total > c.rmax and r.bulk is not None and max(lens) >= BULK_MIN:
            body = r.bulk_body(views, load, BULK_MIN, c.rmax)
            if body is not None:  # its large buffers are in the bulk area
                self.bulk_sent += 1
                if not r.put(body, 0, _ring.BULK):
                    self._wait_room(c, r, body, 0, _ring.BULK)
                if now:
                    self._wake(c, r)
                return total
        if total <= c.rmax:
            # framed as on a socket, each buffer copied straight into the ring
            head = _frame_head(lens, load)
            if not r.put_parts([head, *views], total):
                self._wait_room(c, r, b"".join([head, *views]), 0, _ring.MANY)
            if now:
                self._wake(c, r)
            return total
        # large: it travels on the socket, and a MARK in the ring keeps the order
        if not r.put(b"", 0, _ring.MARK):
            self._wait_room(c, r, b"", 0, _ring.MARK)
        self._wake(c, r)
        return self._sock_send(c, c.peer, parts, load)

    def _wake(self, c: _Conn, r: _ring.Ring) -> None:
        # the reader flags NAP, then looks at TAIL; we stored TAIL, now NAP
        lock = _ring._fence_lock  # _ring.fence(), inline (once a frame)
        lock.acquire()
        lock.release()
        bell = r.bell
        if bell[_ring.NAP] and not c.outq:  # (the bytes in flight will wake it)
            bell[_ring.NAP] = 0
            self.pokes += 1
            self._send_whole(c, _WAKE)

    def _wait_room(self, c: _Conn, r: _ring.Ring, data: Any, load: int, kind: int) -> None:
        # The peer's ring is full: it has not read for a while. Read what
        # comes meanwhile (the peer may be waiting for room in ours), as
        # _drain does for a socket.
        while not r.put(data, load, kind):
            if c.closed:
                raise ConnectionError(f"context {c.peer}: connection closed")
            if r.bell[_ring.NAP] and not c.outq:
                r.bell[_ring.NAP] = 0
                self.pokes += 1
                self._send_whole(c, _WAKE)
            draining, self.draining = self.draining, True
            try:
                self._rings()
                for fd, _ev in self.ep.poll(0.0002):
                    self._event(fd)
            finally:
                self.draining = draining

    def _rings(self) -> bool:
        b = self.host.words[_ring.BELL]  # type: ignore[union-attr]
        if b == self.bell_seen:
            return False  # no peer wrote since we last looked
        self.bell_seen = b
        got = False
        for c in self.rins:
            r = c.rin
            if r.words[_ring.TAIL] != r.pos:  # type: ignore[union-attr]
                if c.reading:
                    self.bell_seen = -1  # (being read further up the stack: look again)
                    continue
                # _ring_read's commonest pass, inline: frames of one buffer
                # until the ring is empty (anything else: _ring_read goes on)
                c.reading = True
                try:
                    st = r.drain(self.deliver, c.peer)  # type: ignore[union-attr]
                finally:
                    c.reading = False
                if st > 15:
                    got = True
                if st & 15 != _ring.EMPTY and r.words is not None:  # type: ignore[union-attr]
                    got = self._ring_read(c) or got
        return got

    def _ring_read(self, c: _Conn, final: bool = False, parsing: bool = False) -> bool:
        """Deliver what ``c``'s ring holds, and the socket frames its MARKs
        stand for (read from the socket if they have not been); stops at a
        MARK whose frame has not come yet. ``parsing``: called from the parse
        of ``c``'s socket, which is not to be entered again (a read in its
        middle may start a large buffer that parse knows nothing of); it
        goes on, and brings the frame when it comes."""
        r = c.rin
        if r is None or c.reading:
            return False
        c.reading = True
        got = False
        try:
            deliver, peer = self.deliver, c.peer
            while True:
                # the frames of one buffer, the commonest, in the ring's core;
                # the other entries here
                st = r.drain(deliver, peer)
                if st > 15:
                    got = True
                kind = st & 15
                if kind == _ring.EMPTY:
                    break
                if kind == _ring.HELD:  # (closed by what it delivered)
                    return got
                head = r.pos
                base = _ring.DATA + (head & r.mask)
                n, load = _ring.ENTRY.unpack_from(r.mm, base)
                if n == _ring.MARK:
                    if not c.held and not final and not c.closed and not parsing:
                        self._read(c)  # its bytes were sent before we looked
                    if not c.held:
                        return got  # still on its way: read again when it comes
                    bufs, load = c.held.popleft()
                    r.pos = head + 8
                    deliver(peer, bufs, load)  # type: ignore[misc]
                elif n == _ring.BULK:
                    bufs, fload = r.read_bulk(base, self.landing, peer)
                    self.bulk_got += 1
                    r.pos = head + 8 + ((load + 7) & -8)  # load: the entry's length here
                    deliver(peer, bufs, fload)  # type: ignore[misc]
                elif n == _ring.MANY:  # a frame of several buffers, framed as on a socket
                    bufs, fload = r.read_many(base)
                    r.pos = head + 8 + ((load + 7) & -8)  # load: the frame's length here
                    deliver(peer, bufs, fload)  # type: ignore[misc]
                else:
                    raise ValueError(f"entry of kind {n} in the ring from context {peer}")
                got = True
                if r.words is None:
                    return got
            if final:
                while c.held:  # no MARK is left for these: deliver them all the same
                    bufs, load = c.held.popleft()
                    deliver(peer, bufs, load)  # type: ignore[misc]
                    got = True
        finally:
            c.reading = False
        return got

    def bulk_counts(self) -> Dict[str, int]:
        """Frames sent and received with buffers in a ring's bulk area, and
        the buffers received so that are still in use here.

        Example:
            >>> t = LocalTransport(0, {}); t.bulk_counts()
            {'bulk_sent': 0, 'bulk_received': 0, 'bulk_buffers_held': 0}
            >>> t.close()
        """
        return _ring.bulk_counts(self.bulk_sent, self.bulk_got, (c.rin for c in self.rins))

    def nap(self, on: bool) -> bool:
        """While ``on``, this context may not look at its rings for a while
        (it sleeps on :meth:`fileno`, or user code runs): a peer that writes
        to one then also pokes the socket beside it, so that the descriptor
        is readable. True if a ring already holds frames (poll rather than
        wait).

        Example:
            >>> t = LocalTransport(0, {})
            >>> t.nap(True), t.nap(False)
            (False, False)
            >>> t.close()
        """
        host = self.host
        if host is None:
            return False
        host.words[_ring.NAP] = 1 if on else 0
        if not (on and self.rins):
            return False
        _ring.fence()  # our flag before their BELL (see _sleep)
        return host.words[_ring.BELL] != self.bell_seen

    def _from_socket(self, c: _Conn, bufs: List[Any], load: int) -> None:
        """A frame from ``c``'s socket, on a transport with rings."""
        if c.rin is not None:
            if bufs:  # (no buffers: a poke, to wake us; poll then looks at the rings)
                c.held.append((bufs, load))
                if not c.reading:
                    self._ring_read(c, parsing=True)
            return
        if not bufs:
            return
        b0 = bufs[0]
        if len(bufs) == 1 and len(b0) > len(_CTL) and b0[0] == 0 and b0[:len(_CTL)] == _CTL:
            self._control(c, b0)
            return
        self.deliver(c.peer, bufs, load)  # type: ignore[misc]

    # -- receiving -------------------------------------------------------
    def poll(self, timeout: Optional[float]) -> bool:
        got = False
        if self.dead:
            self._bury()
        if self.early_lost and self.lost is not None:
            return self._tell_early_lost()
        if self.rins:
            if self.signalling and not self.host.words[_ring.NAP]:  # type: ignore[union-attr]
                # a writer that poked us cleared NAP: flag it again before
                # this look, or the next frame would raise no signal
                self.nap(True)
            got = self._rings()
            if got:
                # the sockets too, now and then: a peer lost, a connection made
                self.ring_polls += 1
                if self.ring_polls % _RING_LOOK:
                    return True
                timeout = 0
        events = self.ep.poll(0)
        if not events and timeout != 0:
            start = 0.0
            if self.spin_s > 0.0:
                start = time.perf_counter()
                events = self._spin()
                if events is None:
                    return True  # a ring delivered
            if not events:
                events = self._sleep(timeout)
                if start and self.rins:
                    # (rings only: a socket's spin pays a system call per look,
                    # and on tcp a longer one measured slower: 64 KiB there and
                    # back 128-150 us against 106-128 us)
                    self._adapt(time.perf_counter() - start, events is None or bool(events))
                if events is None:
                    return True
        for fd, _ev in events:
            c = self.byfd.get(fd)
            if c is not None:
                got = self._read(c) or got
            elif fd == self.lfd:
                got = self._accept() or got
        if self.rins:
            got = self._rings() or got  # (what woke us may be a poke)
        return got

    def _bury(self) -> None:
        """Unmap the rings of closed connections (poll calls it first thing:
        no transport code is running further up the stack then), and give
        the pages of ours back: a context that talks with contexts added and
        removed while it runs would keep a ring for each otherwise."""
        dead, self.dead = self.dead, []
        for r in dead:
            if r.host is self.host:
                self.host.drop(r)  # type: ignore[union-attr]
            else:
                r.close()
                if r in self.mapped:
                    self.mapped.remove(r)

    def _adapt(self, waited: float, came: bool) -> None:
        # A frame that came soon after the spin gave up cost a sleep and a
        # wake-up (tens of us here) that a longer spin would have saved:
        # spin that long next time, up to spin_max. A long wait, or none
        # that ended with a frame, brings the spin back down.
        if came and waited <= self.spin_max:
            self.spin_cur = min(self.spin_max, max(self.spin_cur, 1.5 * waited))
        elif self.spin_cur > self.spin_s:
            self.spin_cur = max(self.spin_s, 0.5 * self.spin_cur)

    def _spin(self) -> Optional[list]:
        # Poll for spin_s before sleeping: waking a sleeping process costs more
        # than a call. But spinning is only a win while this context has a core
        # to itself: a gap between two polls means we were preempted (more
        # runnable processes than cores), and then we stop spinning for a while.
        now = time.perf_counter()
        if now < self.calm_until:
            return []
        deadline = now + self.spin_cur
        poll = self.ep.poll
        clock = time.perf_counter
        yield_ = os.sched_yield
        events: list = []
        last = now
        rings = self._rings if self.rins else None
        looks = 0
        while not events:
            yield_()  # lets a process waiting for this core run first
            if rings is not None:
                if rings():
                    return None
                # the socket at every _SOCKET_LOOK-th look only: frames come
                # by the rings (a large one's MARK too), the socket brings
                # news of peers, and its look is a system call
                looks += 1
                if looks % _SOCKET_LOOK == 0:
                    events = poll(0)
            else:
                events = poll(0)
            t = clock()
            if t - last > _PREEMPTED:
                self.calm_until = t + _CALM
                self.spins_preempted += 1
                break
            if t > deadline:
                break
            last = t
        return events

    glance = _ring.glance

    def _sleep(self, timeout: Optional[float]) -> Optional[list]:
        """Sleep in epoll until something arrives (None: a ring delivered)."""
        rins = self.rins
        # flag NAP, then look once more: a writer that stored its TAIL
        # before our flag sees it and pokes the socket, or we see its TAIL
        if rins and self.nap(True):
            if not self.signalling:
                self.nap(False)
            self._rings()
            return None
        try:
            return self.ep.poll(-1 if timeout is None else timeout)
        except InterruptedError:
            return []
        finally:
            if rins and not self.signalling:
                self.nap(False)

    def _read(self, c: _Conn) -> bool:
        got = False
        sock = c.sock
        while True:
            try:
                if c.big is not None:
                    n = self._recv_rest(c)
                    if n:
                        if c.bigpos == c.big.nbytes:
                            c.bufs.append(c.big)
                            c.big = c.bigmv = None
                            c.idx += 1
                            got = self._parse(c) or got
                        continue
                else:
                    size = len(c.rbuf)
                    if c.re == size:
                        self._compact(c)
                    want = size - c.re
                    n = sock.recv_into(c.rmv[c.re:])
                    if n:
                        c.re += n
                        got = self._parse(c) or got
                        if c.closed:
                            return got
                        if n < want:
                            return got
                        continue
            except BlockingIOError:
                return got
            except InterruptedError:
                continue
            except OSError as e:
                if e.errno in self.closed_errnos:
                    n = 0
                else:
                    raise
            # n == 0: the peer closed its end
            self._close(c, "connection closed")
            return got

    def _recv_rest(self, c: _Conn) -> int:
        """Receive into the large buffer in progress; returns the bytes received
        (0: the peer closed), or raises BlockingIOError when none came."""
        # The rest of a large buffer is on its way: its sender does not return
        # from send() before the whole frame is written, whatever else happens,
        # so waiting for it in the kernel is safe and streams the bytes with far
        # fewer wake-ups than polling. A peer that stalls for _STALL seconds
        # sends us back to polling. Not while we drain a frame of our own: the
        # peer may be draining too, waiting for our bytes before it sends more.
        sock = c.sock
        big, mv = c.big, c.bigmv
        sock.settimeout(0.0 if self.draining else _STALL)
        got = 0
        try:
            while c.bigpos < big.nbytes:  # type: ignore[union-attr]
                n = sock.recv_into(mv[c.bigpos:])  # type: ignore[index]
                if n == 0:
                    return got  # the peer closed: 0 if nothing came before
                c.bigpos += n
                got += n
        except (socket.timeout, BlockingIOError):
            if got == 0:
                raise BlockingIOError from None
        finally:
            sock.setblocking(False)
        return got

    def _compact(self, c: _Conn) -> None:
        live = c.re - c.rs
        if c.rs:
            c.rbuf[:live] = c.rbuf[c.rs:c.re]
        c.rs, c.re = 0, live

    def _grow(self, c: _Conn, need: int) -> None:
        """Give ``c`` a read buffer that holds ``need`` bytes from its start,
        with room to spare, keeping the bytes not parsed yet."""
        size = len(c.rbuf)
        while size < 2 * need and size < _RBUF:
            size *= 2
        buf = bytearray(max(size, need))
        live = c.re - c.rs
        buf[:live] = c.rmv[c.rs:c.re]
        c.rbuf, c.rmv = buf, memoryview(buf)
        c.rs, c.re = 0, live

    def _parse(self, c: _Conn) -> bool:
        if c.peer < 0 and not self._hello(c):
            return False
        got = False
        if self.rings:
            def deliver(peer: int, bufs: List[Any], load: int, c: _Conn = c) -> None:
                self._from_socket(c, bufs, load)
        else:
            deliver = self.deliver  # type: ignore[assignment]
        need = 0  # bytes from c.rs the step we stopped at waits for
        while True:
            # again after every delivery: handling a frame may read (and grow) c
            rbuf = c.rbuf
            avail = c.re - c.rs
            if c.state == 0 and avail >= 16:
                nb, load, n0 = _HDR1.unpack_from(rbuf, c.rs)
                if nb == 1:
                    if avail >= 16 + n0:  # fast path: a whole one-buffer frame
                        rs = c.rs + 16
                        c.rs = rs + n0
                        deliver(c.peer, [rbuf[rs:rs + n0]], load)  # type: ignore[misc]
                        got = True
                        continue
                elif nb <= 8 and avail >= 8 + 8 * nb:
                    lens = struct.unpack_from(f"<{nb}Q", rbuf, c.rs + 8)
                    pos = c.rs + 8 + 8 * nb
                    total = sum(lens)
                    if avail >= pos - c.rs + total and (
                            total <= _BIG or self.landing is None):  # a whole small frame
                        bufs = []
                        for n in lens:
                            bufs.append(rbuf[pos:pos + n])
                            pos += n
                        c.rs = pos
                        deliver(c.peer, bufs, load)  # type: ignore[misc]
                        got = True
                        continue
            if c.state == 0:
                if avail < 8:
                    need = 8
                    break
                c.nbufs, c.load = _HDR.unpack_from(rbuf, c.rs)
                c.rs += 8
                c.state = 1
            elif c.state == 1:
                need = 8 * c.nbufs
                if avail < need:
                    break
                c.lens = struct.unpack_from(f"<{c.nbufs}Q", rbuf, c.rs)
                c.rs += need
                need = 0
                c.idx = 0
                c.bufs = []
                c.state = 2
            else:
                if c.idx == c.nbufs:
                    bufs, c.bufs = c.bufs, []
                    c.state = 0
                    deliver(c.peer, bufs, c.load)  # type: ignore[misc]
                    got = True
                    continue
                n = c.lens[c.idx]
                posted = None
                if n > _BIG and c.idx and self.landing is not None:
                    posted = self.landing(c.peer, c.bufs[0], n)
                if n <= avail:
                    piece = c.rmv[c.rs:c.rs + n]
                    if posted is not None:
                        posted[:] = piece
                        c.bufs.append(posted)
                    else:
                        c.bufs.append(bytes(piece) if c.idx == 0 else bytearray(piece))
                    c.rs += n
                    c.idx += 1
                elif n > _BIG:
                    # the array the user gets is built on this very buffer, or
                    # it is the buffer the receiver posted (a get's array)
                    big = self.pool.get(n) if posted is None else posted
                    big[:avail] = c.rmv[c.rs:c.re]
                    c.rs = c.re = 0
                    c.big, c.bigmv, c.bigpos = big, memoryview(big), avail
                    need = 0
                    break
                else:
                    need = n
                    break
        if c.rs == c.re:
            c.rs = c.re = 0
        size = len(c.rbuf)
        if need > size:
            # a buffer of this frame is received here but larger than the
            # buffer: only connections that carry such frames pay for more
            self._grow(c, need)
        elif c.rs and (c.rs + need > size or size - c.re < size // 2):
            self._compact(c)
        return got

    def _close(self, c: _Conn, how: str) -> None:
        if c.closed:
            return
        if how.startswith("send failed") and c.peer >= 0:
            # what the peer sent before it went (its last words: a FATAL) is
            # still ours to read, and must arrive before it is reported lost
            self._read(c)
            if c.closed:
                return
        if c.rin is not None and not c.reading:
            self._ring_read(c, final=True)  # what the peer wrote before it went comes first
        elif c.held and not c.reading:
            while c.held:
                bufs, load = c.held.popleft()
                self.deliver(c.peer, bufs, load)  # type: ignore[misc]
        c.closed = True
        c.outq.clear()
        if c in self.rins:
            self.rins.remove(c)
            # _rings may be going through the list (this close came from a
            # MARK's read): the ring after this one is skipped, so look again
            self.bell_seen = -1
        # unmapped (and our own rings' pages given back) at the next poll,
        # not now: a read or a send in progress further up the stack may
        # still use them
        for r in (c.rin, c.offered, c.rout, c.rout_next):
            if r is not None:
                self.dead.append(r)
        c.rin = c.offered = c.rout = c.rout_next = None
        try:
            self.ep.unregister(c.fd)
        except (OSError, ValueError):
            pass
        self.byfd.pop(c.fd, None)
        pid = None
        if how == "connection closed":
            pid = c.pid or (self.mesh.pid(c.peer) if self.mesh is not None and c.peer > 0
                            else None)
        try:
            c.sock.close()
        except OSError:
            pass
        peer = c.peer
        if peer < 0:
            return
        if self.listener is not None and peer not in self.gone:
            self._accept()  # a connection the peer made may still wait in our backlog
        links = self.links.get(peer, ())
        for d in links:
            if not d.closed:
                # what the peer sent on its other connection before it closed comes first
                self._read(d)
        if peer in self.gone or any(not d.closed for d in links):
            return  # reported already, or when its last connection closes
        self.gone.add(peer)
        if self.ctx == 0 and self.mesh is not None:
            # context 0's socketpair closes only when the peer ends: tell everyone,
            # so nobody waits for it to start listening
            self.mesh.states[peer] = GONE
        if self.lost is not None:
            if pid is not None:
                how = _process_fate(pid) or how
            self.lost(peer, how)
        else:  # (nobody to tell yet: calls to it would wait for ever)
            self.early_lost.append((peer, how, pid))

    def _tell_early_lost(self) -> bool:
        early, self.early_lost = self.early_lost, []
        for peer, how, pid in early:
            if pid is not None:
                how = _process_fate(pid) or how
            self.lost(peer, how)  # type: ignore[misc]
        return bool(early)

    def close(self) -> None:
        try:
            self.flush()
        except Exception:
            pass
        if self.listener is not None:
            if self.mesh is not None:
                self.mesh.states[self.ctx] = GONE
            try:
                self.ep.unregister(self.lfd)
            except (OSError, ValueError):
                pass
            self.listener.close()
        for c in [*self.conns.values(), *self.byfd.values()]:
            c.closed = True
            try:
                c.sock.close()
            except OSError:
                pass
            c.rin = c.offered = c.rout = c.rout_next = None
        self.rins = []
        self.dead = []  # (every one is in mapped or in the host)
        for r in self.mapped:
            r.close()
        self.mapped = []
        if self.host is not None:
            self.host.close()  # and every ring in it
            self.host = None
        self.byfd.clear()
        try:
            self.ep.close()
        except OSError:
            pass


def launcher(session):
    """The launcher of this transport: contexts forked from this process.

    Example:
        >>> import macroflow as mf
        >>> with mf.init(contexts=2, transport="local") as s:
        ...     type(launcher(s)).__name__
        'ForkLauncher'
    """
    from ..launch import ForkLauncher
    return ForkLauncher(session)
