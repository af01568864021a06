"""N connected ends of one transport, built in this process, for the conformance suite.

A transport is tested only through :class:`macroflow.transport.base.Transport`.
Supporting a new protocol in the suite means adding one builder to
:data:`BUILDERS` (a function ``n -> Ends``), and saying what it can do in the
``Ends`` it returns (``reports_lost``, ``has_fileno``) and how to see that a
sender waits for its reader (``backlog``).
"""

import atexit
import functools
import os
import pickle
import shutil
import socket
import ssl
import subprocess
import tempfile
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import pytest

from macroflow.launch import new_computation_id
from macroflow.transport.inproc import InprocTransport, World
from macroflow.transport.local import LocalTransport, Mesh
from macroflow.transport.tcp import TcpTransport


class Worker:
    """A function run in a thread, keeping what it returned or raised.

    Example:
        >>> w = Worker(lambda: 6 * 7)
        >>> w.result(timeout=10)
        42
    """

    def __init__(self, fn: Callable[[], object], on_exit: Callable[[], None] = lambda: None):
        self.value: object = None
        self.error: Optional[BaseException] = None
        self._fn, self._on_exit = fn, on_exit
        # a daemon: a transport that hangs fails its test, not the interpreter's exit
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.value = self._fn()
        except BaseException as e:  # handed to whoever asks for the result
            self.error = e
        finally:
            self._on_exit()

    @property
    def done(self) -> bool:
        """True once the function has returned or raised."""
        return not self.thread.is_alive()

    def result(self, timeout: float) -> object:
        """What the function returned; re-raises what it raised; AssertionError
        if it is still running after ``timeout`` seconds."""
        self.thread.join(timeout)
        assert self.done, f"still running after {timeout} s"
        if self.error is not None:
            raise self.error
        return self.value


class Ends:
    """Connected ends of one transport, with what each one received.

    ``got[i]`` lists the frames end ``i`` received, as ``(src, buffers, load)``;
    ``lost[i]`` the peers it was told it lost, as ``(peer, how)``.

    Example:
        >>> e = build("inproc", 2)
        >>> e.ends[0].send(1, [b"hi"], 3) > 0
        True
        >>> e.pump(lambda: e.got[1]); [(s, bytes(b[0]), l) for s, b, l in e.got[1]]
        [(0, b'hi', 3)]
        >>> e.close()
    """

    def __init__(self, name: str, ends: Dict[int, object], *, reports_lost: bool,
                 has_fileno: bool, backlog: Callable[[object, int], bool]):
        self.name = name
        self.ends = ends
        self.ids: List[int] = sorted(ends)
        self.reports_lost = reports_lost
        self.has_fileno = has_fileno
        self._backlog = backlog
        self.got: Dict[int, list] = {i: [] for i in self.ids}
        self.lost: Dict[int, list] = {i: [] for i in self.ids}
        self.closed: set = set()
        self.busy: set = set()  # ends a Worker is using: nobody else may touch them
        self.workers: List[Worker] = []
        for i, t in ends.items():
            t.attach(lambda src, bufs, load, g=self.got[i]: g.append((src, bufs, load)),
                     lambda peer, how, g=self.lost[i]: g.append((peer, how)))

    def pump(self, until: Callable[[], object], timeout: float = 60.0,
             ends: Optional[List[int]] = None) -> None:
        """Poll every end that is open and not busy (or only those of ``ends``;
        ``ends=[]`` polls none and only watches workers) until ``until()`` is
        true; AssertionError if it is not within ``timeout`` seconds.

        Example:
            >>> e = build("inproc", 2)
            >>> e.pump(lambda: True)
            >>> e.close()
        """
        which = self.ids if ends is None else ends
        deadline = time.monotonic() + timeout
        while not until():
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.name}: condition not reached within {timeout} s "
                                     f"(received: {[len(self.got[i]) for i in self.ids]})")
            free = [i for i in which if i not in self.closed and i not in self.busy]
            for i in free:
                # a short wait in the last end's poll: ends share this thread
                self.ends[i].poll(0.002 if i == free[-1] else 0)
            if not free:
                time.sleep(0.001)  # nothing to poll here: only watch what workers do

    def background(self, end: int, fn: Callable[[], object]) -> Worker:
        """Run ``fn`` (which uses end ``end``) in a thread; :meth:`pump` leaves
        that end alone meanwhile.

        Example:
            >>> e = build("inproc", 2)
            >>> w = e.background(0, lambda: e.ends[0].send(1, [b"x"], 0))
            >>> w.result(timeout=10) > 0, len(e.got[1])
            (True, 1)
            >>> e.close()
        """
        assert end not in self.busy, f"end {end} is already used by a worker"
        self.busy.add(end)
        w = Worker(fn, on_exit=lambda: self.busy.discard(end))
        self.workers.append(w)
        return w

    def backlogged(self, end: int, dest: int) -> bool:
        """True if end ``end`` holds bytes for ``dest`` that wait for ``dest`` to read.

        Example:
            >>> e = build("inproc", 2)
            >>> e.backlogged(0, 1)
            False
            >>> e.close()
        """
        return self._backlog(self.ends[end], dest)

    def disappear(self, end: int) -> None:
        """Close end ``end``, as if its context had ended.

        Example:
            >>> e = build("inproc", 2)
            >>> e.disappear(1)
            >>> sorted(e.closed)
            [1]
            >>> e.close()
        """
        self.closed.add(end)
        self.ends[end].close()

    def close(self) -> None:
        """Close every end; workers blocked on a closed peer end with it.

        Example:
            >>> build("inproc", 3).close()
        """
        # ends no worker uses first: a worker waiting on one of them is released
        for i in self.ids:
            if i not in self.closed and i not in self.busy:
                self.disappear(i)
        for w in self.workers:
            w.thread.join(30)
        for i in self.ids:
            if i not in self.closed:
                self.disappear(i)


def _never(_end: object, _dest: int) -> bool:
    return False


def _local_backlog(end: LocalTransport, dest: int) -> bool:
    # bytes of a frame the kernel did not take stay in the connection's outq
    # until the reader makes room; nothing else empties it
    c = end.conns.get(dest)
    return c is not None and bool(c.outq)


def build_inproc(n: int) -> Ends:
    """``n`` ends of the inproc transport, numbered 0..n-1.

    Example:
        >>> build_inproc(2).ids
        [0, 1]
    """
    w = World()
    return Ends("inproc", {i: InprocTransport(w, i) for i in range(n)},
                reports_lost=False, has_fileno=False, backlog=_never)


def build_local(n: int) -> Ends:
    """``n`` ends of the local transport, numbered 0..n-1, one socketpair per pair.

    Example:
        >>> e = build_local(2); e.ids
        [0, 1]
        >>> e.close()
    """
    socks: Dict[int, Dict[int, socket.socket]] = {i: {} for i in range(n)}
    for i in range(n):
        for j in range(i + 1, n):
            socks[i][j], socks[j][i] = socket.socketpair()
    return Ends("local", {i: LocalTransport(i, socks[i]) for i in range(n)},
                reports_lost=True, has_fileno=True, backlog=_local_backlog)


def build_local_mesh(n: int) -> Ends:
    """``n`` ends of the local transport, numbered 1..n, connecting on demand
    through a :class:`Mesh` (as contexts 1.. of a computation do).

    Example:
        >>> e = build_local_mesh(2); e.ids
        [1, 2]
        >>> e.close()
    """
    mesh = Mesh(new_computation_id(), n + 1)
    ends = {c: LocalTransport(c, {}, mesh=mesh, listener=mesh.listen(c)) for c in range(1, n + 1)}
    return Ends("local-mesh", ends, reports_lost=True, has_fileno=True, backlog=_local_backlog)


#: the secret the tcp ends of the harness share
SECRET = "a secret for the transport tests, 16+ bytes"


@functools.lru_cache(maxsize=None)
def certificate() -> Tuple[str, str]:
    """(certificate file, key file) of a self-signed certificate for localhost
    and 127.0.0.1, made once per test run with the openssl command; the test
    is skipped, saying why, where openssl is not installed.

    Example:
        >>> cert, key = certificate()
        >>> open(cert).read().startswith("-----BEGIN CERTIFICATE-----")
        True
    """
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("TLS tests need the openssl command, to make a self-signed certificate")
    where = tempfile.mkdtemp(prefix="macroflow-tls-")
    atexit.register(shutil.rmtree, where, True)
    cert, key = os.path.join(where, "cert.pem"), os.path.join(where, "key.pem")
    subprocess.run([openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
                    "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
                    "-keyout", key, "-out", cert], check=True, capture_output=True, timeout=120)
    return cert, key


def tls_contexts() -> Tuple[ssl.SSLContext, ssl.SSLContext]:
    """(server, client) ssl contexts that trust :func:`certificate` and
    nothing else; the client checks the server's name.

    Example:
        >>> server, client = tls_contexts()
        >>> client.check_hostname, client.verify_mode == ssl.CERT_REQUIRED
        (True, True)
    """
    cert, key = certificate()
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(cert, key)
    client = ssl.create_default_context(cafile=cert)
    return server, client


def tcp_ends(n: int, tls: bool = False, **kw) -> Dict[int, TcpTransport]:
    """``n`` TCP transports numbered 0..n-1 on loopback, each knowing where the
    others listen, not connected yet (``kw``: more TcpTransport arguments).

    Example:
        >>> ends = tcp_ends(2)
        >>> ends[0].directory == {1: ends[1].address()[1]}
        True
        >>> for t in ends.values(): t.close()
    """
    extra = dict(zip(("server_ssl", "client_ssl"), tls_contexts())) if tls else {}
    comp = new_computation_id()
    ends = {i: TcpTransport(i, SECRET, comp, **extra, **kw) for i in range(n)}
    for i, t in ends.items():
        for j, u in ends.items():
            if i != j:
                t.add_peer(j, u.address()[1])
    return ends


def _build_tcp(n: int, tls: bool) -> Ends:
    ends = tcp_ends(n, tls)
    e = Ends("tcp-tls" if tls else "tcp", ends, reports_lost=True, has_fileno=True,
             backlog=_local_backlog)
    # Connections are made on demand, but a handshake needs both ends to poll:
    # the suite's senders may run before their receiver is first polled (that
    # connecting on demand works is checked in test_transport_tcp.py)
    for i in ends:
        for j in ends:
            if i < j:
                ends[i].connect(j, wait=False)
    e.pump(lambda: all(sorted(t.peers()) == [j for j in ends if j != i] for i, t in ends.items()))
    return e


def build_tcp(n: int) -> Ends:
    """``n`` ends of the tcp transport over loopback, numbered 0..n-1, connected.

    Example:
        >>> e = build_tcp(2); e.ends[0].peers()
        [1]
        >>> e.close()
    """
    return _build_tcp(n, tls=False)


def build_tcp_tls(n: int) -> Ends:
    """The same as :func:`build_tcp`, over TLS (skipped where openssl is missing).

    Example:
        >>> e = build_tcp_tls(2); e.ends[1].peers()
        [0]
        >>> e.close()
    """
    return _build_tcp(n, tls=True)
# -- mpi: the ends are spawned ranks, driven from here ------------------------
#
# MPI cannot hold several ranks in one process, so each end is a rank of its
# own (spawned with MPI_Comm_spawn, as mf.init does), running a real
# MpiTransport on a communicator of the ends only; this process drives each one
# through a proxy that forwards every call and brings back what the end
# received (frames, lost peers) with the answer. The frames between ends travel
# on MPI, between processes: order per pair, large out-of-band buffers and flow
# control under a flood are MPI's and the transport's own.

_REQ, _REP, _QRY, _QREP = 11, 12, 13, 14  # tags between this process and the ends


def _mpi_wait(comm, source: int, tag: int) -> Any:
    """Receive one pickled message, polling (a blocking receive would spin a core)."""
    from macroflow.transport.mpi import mpi
    MPI = mpi()
    spin_until = time.monotonic() + 200e-6
    while not comm.Iprobe(source, tag):
        if time.monotonic() > spin_until:
            time.sleep(0.0002)
    return comm.recv(source=source, tag=tag)


class _MpiGroup:
    """The spawned ranks of one build_mpi, and the communicator to drive them."""

    def __init__(self, n: int, entry: str = "transport_harness:_mpi_end"):
        from macroflow.transport import mpi as M
        self.inter, self.comm, self.hosts = M.spawn(n, entry)
        self.comm.Split(M.mpi().UNDEFINED, 0)  # the ends' own communicator, without us
        self.open = n
        self.lock = threading.Lock()

    def call(self, end: int, op: str, *args: Any) -> Any:
        self.comm.send((op, args), dest=end + 1, tag=_REQ)
        return _mpi_wait(self.comm, end + 1, _REP)

    def ended(self) -> None:
        with self.lock:
            self.open -= 1
            last = self.open == 0
        if last:  # every end is closed: the ranks leave, and MPI forgets them
            from macroflow.transport.mpi import _alive
            for r in range(1, self.comm.Get_size()):
                self.call(r - 1, "exit")
            deadline = time.monotonic() + 30
            while any(_alive(*h) for h in self.hosts.values()) and time.monotonic() < deadline:
                time.sleep(0.002)
            self.comm.Disconnect()
            self.inter.Disconnect()


class MpiEnd:
    """Stands here for one MpiTransport living in a spawned rank."""

    def __init__(self, group: _MpiGroup, end: int):
        self.group, self.end = group, end
        self.deliver: Optional[Callable] = None
        self.lost: Optional[Callable] = None
        self.closed = False

    def attach(self, deliver, lost) -> None:
        self.deliver, self.lost = deliver, lost

    def _call(self, op: str, *args: Any) -> Any:
        status, value, events = self.group.call(self.end, op, *args)
        for ev in events:  # what the end received while it served this call
            if ev[0] == "frame":
                self.deliver(ev[1], ev[2], ev[3])  # type: ignore[misc]
            else:
                self.lost(ev[1], ev[2])  # type: ignore[misc]
        if status == "error":
            raise value
        return value

    def send(self, dest: int, parts, load: int) -> int:
        return self._call("send", dest, [bytes(memoryview(p).cast("B")) for p in parts], load)

    def queue(self, dest: int, parts, load: int) -> int:
        return self._call("queue", dest, [bytes(memoryview(p).cast("B")) for p in parts], load)

    def flush(self) -> None:
        self._call("flush")

    def poll(self, timeout: Optional[float]) -> bool:
        return self._call("poll", timeout)

    def peers(self):
        return self._call("peers")

    def ring_counts(self) -> Tuple[int, int, int]:
        """(frames the end wrote to rings, frames it read from rings, times a
        send found a ring full)."""
        return tuple(self._call("counts"))

    def fileno(self) -> None:
        return None  # the end's descriptor is in another process: nothing to watch here

    def backlogged(self, dest: int) -> bool:
        # asked of a thread of the end's rank: its main thread may be inside a send
        self.group.comm.send(dest, dest=self.end + 1, tag=_QRY)
        return _mpi_wait(self.group.comm, self.end + 1, _QREP)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._call("close")  # answered once the goodbyes are sent; the end lingers on
            self.group.ended()


def _mpi_end_rings(comm) -> None:  # pragma: no cover - runs in a spawned rank
    """One end of build_mpi_rings: frames between the ends through shared-memory rings."""
    _mpi_end(comm, rings=True)


def _mpi_end(comm, rings: bool = False) -> None:  # pragma: no cover - runs in a spawned rank
    """One end of build_mpi: serve the proxy's calls on a real MpiTransport."""
    from macroflow.transport import mpi as M
    import faulthandler
    import signal
    faulthandler.register(signal.SIGUSR2, all_threads=True)  # kill -USR2: where a hung end is
    M._hello(comm)
    rank = comm.Get_rank()
    ends = comm.Split(0, rank)
    host = socket.gethostname()
    t = M.MpiTransport(ends, spin_us=50.0, wake=(f"harness-{os.getppid()}-{comm.Get_size()}",
                                                 {i: host for i in range(ends.Get_size())}),
                       rings=rings)
    events: List[tuple] = []
    t.attach(lambda src, bufs, load: events.append(
        ("frame", src, [bytes(memoryview(b).cast("B")) for b in bufs], load)),
        lambda peer, how: events.append(("lost", peer, how)))
    stop = threading.Event()

    def answer_backlog_queries() -> None:
        while not stop.is_set():
            if comm.Iprobe(0, _QRY):
                dest = comm.recv(source=0, tag=_QRY)
                comm.send(t.blocked_on == dest, dest=0, tag=_QREP)
            else:
                time.sleep(0.0005)

    threading.Thread(target=answer_backlog_queries, daemon=True).start()
    while True:
        op, args = _mpi_wait(comm, 0, _REQ)
        try:
            if op == "exit":
                value = None
            elif op == "close":
                t.goodbye()
                value = None
            elif op == "counts":  # frames through rings: sent, received; waits for room
                value = (t.ring_sent, t.ring_got, t.ring_waits)
            else:
                value = getattr(t, op)(*args)
            status = "ok"
        except Exception as e:
            status, value = "error", e
        try:
            pickle.dumps(value)
        except Exception:
            status, value = "error", RuntimeError(repr(value))
        out, events[:] = list(events), []
        comm.send((status, value, out), dest=0, tag=_REP)
        if op == "exit":
            stop.set()
            return
        if op == "close":
            t.linger()  # the proxy has its answer: the others may close meanwhile


def _mpi_backlog(end: MpiEnd, dest: int) -> bool:
    return end.backlogged(dest)


def build_mpi_rings(n: int) -> Ends:
    """As :func:`build_mpi`, the ends (one host) sending frames of up to
    64 KiB through shared-memory rings.

    Example:
        >>> from macroflow.transport.mpi import available
        >>> e = build_mpi_rings(2) if available() is None else None
        >>> e.ids if e is not None else [0, 1]
        [0, 1]
        >>> e is None or e.close()
    """
    group = _MpiGroup(n, "transport_harness:_mpi_end_rings")
    return Ends("mpi-rings", {i: MpiEnd(group, i) for i in range(n)}, reports_lost=True,
                has_fileno=False, backlog=_mpi_backlog)


def build_mpi(n: int) -> Ends:
    """``n`` ends of the mpi transport, numbered 0..n-1, each a spawned rank.

    Example:
        >>> from macroflow.transport.mpi import available
        >>> e = build_mpi(2) if available() is None else None
        >>> e.ids if e is not None else [0, 1]
        [0, 1]
        >>> e is None or e.close()
    """
    group = _MpiGroup(n)
    # reports_lost: an end that closes says goodbye, and its peers report it
    # (what disappear() does here); MPI cannot report a rank that dies, whose
    # process manager ends the whole job instead, so no test kills an end
    return Ends("mpi", {i: MpiEnd(group, i) for i in range(n)}, reports_lost=True,
                has_fileno=False, backlog=_mpi_backlog)


#: transport -> builder of n connected ends; the suite runs on every entry
BUILDERS: Dict[str, Callable[[int], Ends]] = {
    "inproc": build_inproc,
    "local": build_local,
    "local-mesh": build_local_mesh,
    "tcp": build_tcp,
    "tcp-tls": build_tcp_tls,
}
try:
    from macroflow.transport.mpi import available as _mpi_available
    if _mpi_available() is None:
        BUILDERS["mpi"] = build_mpi
        from macroflow.transport.ring import problem as _ring_problem
        if _ring_problem() is None:
            BUILDERS["mpi-rings"] = build_mpi_rings
except ImportError:
    pass


def build(name: str, n: int) -> Ends:
    """``n`` connected ends of transport ``name`` (a key of :data:`BUILDERS`).

    Example:
        >>> build("inproc", 2).name
        'inproc'
        >>> build("smoke-signals", 2)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: no harness for transport 'smoke-signals'; known: inproc, local, local-mesh...
    """
    if name not in BUILDERS:
        raise ValueError(f"no harness for transport {name!r}; known: {', '.join(BUILDERS)}")
    if n < 2:
        raise ValueError(f"need at least 2 ends to connect, got {n}")
    return BUILDERS[name](n)
