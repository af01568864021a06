"""N connected ends of one transport, built in this process, for the conformance suite.

A transport is tested only through :class:`macroflow.transport.base.Transport`.
Supporting a new protocol in the suite means adding one builder to
:data:`BUILDERS` (a function ``n -> Ends``), and saying what it can do in the
``Ends`` it returns (``reports_lost``, ``has_fileno``) and how to see that a
sender waits for its reader (``backlog``).
"""

import socket
import threading
import time
from typing import Callable, Dict, List, Optional

from macroflow.launch import new_computation_id
from macroflow.transport.inproc import InprocTransport, World
from macroflow.transport.local import LocalTransport, Mesh


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


#: transport -> builder of n connected ends; the suite runs on every entry
BUILDERS: Dict[str, Callable[[int], Ends]] = {
    "inproc": build_inproc,
    "local": build_local,
    "local-mesh": build_local_mesh,
}


def build(name: str, n: int) -> Ends:
    """``n`` connected ends of transport ``name`` (a key of :data:`BUILDERS`).

    Example:
        >>> build("inproc", 2).name
        'inproc'
        >>> build("smoke-signals", 2)
        Traceback (most recent call last):
        ...
        ValueError: no harness for transport 'smoke-signals'; known: inproc, local, local-mesh
    """
    if name not in BUILDERS:
        raise ValueError(f"no harness for transport {name!r}; known: {', '.join(BUILDERS)}")
    if n < 2:
        raise ValueError(f"need at least 2 ends to connect, got {n}")
    return BUILDERS[name](n)
