"""Bring a computation up and down: :func:`run`, :func:`init`, :func:`shutdown`.

With the ``local`` transport, context 0 is this process (it runs main) and
contexts 1..N-1 are forked from it, each with a socketpair to context 0 and a
listening socket through which the others connect to it when they first need
to (so N contexts cost context 0 about N descriptors, not N squared).
Forking (rather than starting fresh interpreters) makes start-up a few
milliseconds, and classes and functions of the user's ``__main__`` exist in
every context; those defined after the fork travel by value.

Whatever way the computation ends (main returns or raises, Ctrl-C, a
context crashes), every process it started is gone when ``run`` returns:
children are asked to stop, then killed, and they also die with their parent
(PR_SET_PDEATHSIG) or as soon as they see context 0's connection close.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import ctypes
import errno
import math
import numbers
import os
import random
import resource
import secrets
import signal
import socket
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from .core import context as _ctx
from .core import errors
from .core import marshal
from .core.context import JOINED, MEMBERS, SHUTDOWN, Engine
from .core.errors import LimitError
from .core.future import forget_learned
from .core.placement import Placement
from .core.threads import fork
from . import forkserver
from .transport.base import REGISTRY, process_fate

DEFAULT_SPIN_US = 50.0

_sessions: List["Session"] = []


def spin_us_setting(spin_us: Any = None) -> float:
    """The spin time to use: ``spin_us`` if given, else MACROFLOW_SPIN_US, else 50.

    Allowed: a finite number of microseconds >= 0 (0: sleep at once, never
    poll); anything else raises ValueError naming the value and its source.

    Example:
        >>> spin_us_setting(20)
        20.0
        >>> spin_us_setting(-1)
        Traceback (most recent call last):
        ...
        ValueError: spin_us must be a finite number of microseconds >= 0 (0: never poll before sleeping); got -1
    """
    if spin_us is not None:
        return _check_spin(spin_us, spin_us, "spin_us")
    env = os.environ.get("MACROFLOW_SPIN_US")
    if not env:
        return DEFAULT_SPIN_US
    try:
        value = float(env)
    except ValueError:
        value = None
    return _check_spin(value, env, "the MACROFLOW_SPIN_US environment variable")


def _switch(name: str, default: bool, off: str, on: str) -> bool:
    # an environment variable that is 0 or 1 (``off``/``on`` say what each
    # means in the error for anything else), or unset: ``default``
    env = os.environ.get(name, "").strip()
    if env == "":
        return default
    if env in ("0", "1"):
        return env == "1"
    raise ValueError(f"the {name} environment variable must be 0 ({off}) or 1 ({on}); "
                     f"got {env!r}")


def rings_setting() -> bool:
    """Whether contexts on one host send small frames through shared-memory
    rings (the default) rather than their sockets: MACROFLOW_RINGS=0 turns
    them off, 1 (or unset) on; anything else raises ValueError.

    Example:
        >>> import os
        >>> os.environ.pop("MACROFLOW_RINGS", None) and None
        >>> rings_setting()
        True
    """
    return _switch("MACROFLOW_RINGS", True, "sockets only", "shared-memory rings on one host")


def pin_setting() -> bool:
    """Whether each context of a computation on this host is bound to a CPU
    of its own (MACROFLOW_PIN=1; 0 or unset: not). Only when the contexts are
    no more than the CPUs this process may use; context 0's process gets its
    own set of CPUs back when the computation ends.

    Why: two contexts that the kernel put on one CPU answer a null call in
    about 43 us here, against 24 us on two (see docs/benchmarks.md), and the
    kernel puts processes that wake each other together.

    Example:
        >>> import os
        >>> os.environ.pop("MACROFLOW_PIN", None) and None
        >>> pin_setting()
        False
    """
    return _switch("MACROFLOW_PIN", False, "contexts move between CPUs as the kernel likes",
                   "each on a CPU of its own")


def check_settings(module: Any) -> None:
    """Refuse a bad setting in the environment before anything starts, on
    every transport alike (a transport that does not read one would
    otherwise take it, another refuse it only later): the service
    mechanism's, pinning's, the rings', and the transport ``module``'s own
    (its ``check_settings``, if it has one), and MACROFLOW_COMPILED.

    Example:
        >>> import os
        >>> os.environ["MACROFLOW_PIN"] = "maybe"
        >>> try:
        ...     check_settings(load_transport("inproc"))
        ... except ValueError as e:
        ...     print(str(e).split(" must")[0])
        ... finally:
        ...     del os.environ["MACROFLOW_PIN"]
        the MACROFLOW_PIN environment variable
    """
    from .core.threads import service_setting
    service_setting()
    pin_setting()
    rings_setting()
    from .transport import ring
    if ring.SETTING_ERROR is not None:
        raise ValueError(ring.SETTING_ERROR)
    own = getattr(module, "check_settings", None)
    if own is not None:
        own()


def _pin(ctx: int, cpus: Optional[List[int]]) -> None:
    # context ctx on a CPU of its own; one added beyond the CPUs goes anywhere
    if cpus:
        os.sched_setaffinity(0, {cpus[ctx]} if ctx < len(cpus) else set(cpus))


def _check_spin(value: Any, shown: Any, source: str) -> float:
    # (numpy's numbers too: each is a numbers.Real, but for its bool)
    if (isinstance(value, numbers.Real) and not isinstance(value, bool)
            and math.isfinite(value) and value >= 0):
        return float(value)
    raise ValueError(f"{source} must be a finite number of microseconds >= 0 "
                     f"(0: never poll before sleeping); got {shown!r}")


def _set_pdeathsig() -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class Session:
    """A running computation seen from context 0; close it to tear everything down.

    Returned by :func:`init`; usable as a context manager.

    Example:
        >>> import macroflow as mf
        >>> s = mf.init(contexts=2, transport="inproc")
        >>> mf.num_contexts()
        2
        >>> s.close()
    """

    def __init__(self, contexts: int, transport: str, placement: Any, spin_us: float,
                 make_launcher: Optional[Callable[["Session"], "Launcher"]] = None):
        self.size = contexts
        self.transport_name = transport
        self.closed = False
        self.in_run = False  # started by run(): its main may not call shutdown()
        self.engine: Optional[Engine] = None
        self.started = time.perf_counter()
        self.computation = new_computation_id()
        forget_learned()  # what an earlier computation here learned (see CallSite)
        errors.forked_end = None  # (a child forked in a method may start its own)
        self.launcher: Launcher = (make_launcher or load_transport(transport).launcher)(self)
        try:
            self.engine = self.launcher.start(placement, spin_us)
        except KeyboardInterrupt:
            # Ctrl-C while the contexts start: those started so far are stopped
            with _sigint_ignored():
                self.launcher.stop()
            raise
        _ctx._state.default = self.engine
        _sessions.append(self)
        self.launcher.started()  # may raise: the session is closed at exit

    # -- teardown --------------------------------------------------------------
    def close(self, grace: float = 2.0) -> None:
        """Stop every context and wait for their processes; idempotent.

        Contexts get ``grace`` seconds to leave by themselves (one that
        computes cannot), then they are killed.

        Example:
            >>> import macroflow as mf
            >>> session = mf.init(contexts=2, transport="inproc")
            >>> session.close()
            >>> session.close()                  # a second close does nothing
            >>> try:
            ...     mf.context_id()
            ... except RuntimeError:
            ...     print("no computation is running")
            no computation is running
        """
        if self.closed:
            return
        if self.engine is not None and not _exiting:
            # (its engine is that thread's: from another, close() tore the
            # computation down under a wait there, which then failed with an
            # internal error or waited for ever)
            _check_thread(self.engine, "close() of a computation")
        self.closed = True
        eng = self.engine
        interrupted = False
        try:
            if eng is not None and self.launcher.remote:
                eng.stopping = True
                for c in eng.context_ids():
                    if c != eng.id and c not in eng.lost:
                        try:
                            eng.send(c, (SHUTDOWN,))
                        except Exception:
                            pass
                try:
                    self.launcher.wait(grace)
                except KeyboardInterrupt:
                    # Ctrl-C while they finish: stop them at once, and raise it
                    # then (it was dropped: the program went on). A Ctrl-C
                    # that ends a computation closes it with SIGINT ignored.
                    interrupted = True
        finally:
            self.launcher.stop()
            for e in self.launcher.engines():
                e.closed = True
                if e.service is not None:
                    e.service.stop()
                e.pool.close()
            if eng is not None and eng.transport is not None:
                eng.transport.close()
            if _ctx._state.default is eng:
                _ctx._state.default = None
            if self in _sessions:
                _sessions.remove(self)
        if interrupted:
            raise KeyboardInterrupt

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        if exc_type is None:
            try:
                self._drain(2.0)
            except KeyboardInterrupt:
                # Ctrl-C while what main left behind runs: the computation
                # ends as at any other Ctrl-C (it stayed running, said stopped)
                self._interrupted()
                raise
        if exc_type is KeyboardInterrupt:
            self._interrupted()
        else:
            self.close(grace=2.0)

    def _contexts_now(self) -> int:
        """How many contexts the computation has: with those added or
        joined; not those removed or lost before.

        Example:
            >>> import macroflow as mf
            >>> with mf.init(contexts=2, transport="inproc") as s:
            ...     s._contexts_now()
            2
        """
        eng = self.engine
        return self.size if eng is None else len(eng.context_ids())

    def _interrupted(self) -> None:
        """Ctrl-C ended the computation: stop it, and say so in one line
        (:func:`run` says it itself, once the Ctrl-C has reached it)."""
        n = self._contexts_now()
        # after Ctrl-C, waiting long for contexts that compute helps
        # nobody; and a second Ctrl-C (a key pressed twice) is not to cut
        # the teardown short, with a traceback from its middle
        with _sigint_ignored():
            self.close(grace=0.2)
        if not self.in_run:
            print(interrupted_line(n), file=sys.stderr)

    def _drain(self, grace: float) -> None:
        """The program ended in order: what context 0 sent itself (remote
        service requests main did not wait for) runs before the contexts
        stop, and on ``inproc`` what the others were sent too, as a context
        of its own process serves what came before it is told to stop (for
        ``grace`` seconds at most)."""
        eng = self.engine
        if eng is None or eng.closed or eng.stopping:
            return
        deadline = time.monotonic() + grace
        driver = eng.driver
        if driver is eng:
            # what came while main computed (or slept) is read first: the
            # inbox holds only what a wait or a poll read
            for _ in range(3):  # (MPI may show a message only at a second look)
                eng.transport.poll(0)
            eng.run_until(lambda: not (eng.inbox or eng.ready), deadline)
        else:
            driver.run_until(lambda: not driver.pending(), deadline)


@contextlib.contextmanager
def _sigint_ignored() -> Any:
    """SIGINT ignored meanwhile (in the main thread; elsewhere nothing changes).

    Example:
        >>> with _sigint_ignored():
        ...     signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        True
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


class Launcher:
    """How one transport brings the contexts of a :class:`Session` up and down.

    A transport module names its launcher with a function ``launcher(session)``;
    :func:`load_transport` finds the module by scheme. ``start`` returns
    context 0's engine; ``wait`` gives the other contexts ``grace`` seconds
    to leave after they were told to; ``stop`` ends whatever is left.

    Example:
        >>> import macroflow as mf
        >>> with mf.init(contexts=2, transport="inproc") as s:
        ...     type(s.launcher).__name__, s.launcher.remote
        ('InprocLauncher', False)
    """

    #: True where other contexts run elsewhere and must be told to stop
    remote = True
    #: True where a context may leave while the computation runs (remove_context)
    removable = False
    #: True where workers of other hosts may join (mf.init(listen=...)): only
    #: then may mf.wait_contexts wait for more contexts than there are
    joinable = False

    def __init__(self, session: "Session") -> None:
        self.session = session
        self.engine: Optional[Engine] = None

    def start(self, placement: Placement, spin_us: float) -> Engine:
        raise NotImplementedError

    def started(self) -> None:
        """The session is up and will be closed at exit whatever happens: what
        was put off while it started may happen now (a SIGTERM, say)."""

    def wait(self, grace: float) -> None:
        """Wait up to ``grace`` seconds for the other contexts to leave."""

    def stop(self) -> None:
        """End every context still running (after :meth:`wait`); idempotent."""

    def engines(self) -> List[Engine]:
        """The engines that live in this process."""
        return [] if self.engine is None else [self.engine]

    def describe_lost(self, peer: int) -> str:
        """Words for how context ``peer`` went (its process's fate, say)."""
        return "connection closed"

    def add(self, ids: List[int], init: Any) -> None:
        """Start contexts ``ids`` (numbered after every existing one); each runs
        ``init`` and reports in with JOINED (see :func:`add_contexts`)."""
        raise ValueError(f"the {self.session.transport_name} transport cannot add contexts "
                         f"while running")

    def stop_added(self, ctx: int) -> bool:
        """End context ``ctx``, added and not yet reported in (its ``init``
        outlived :func:`add_contexts`'s timeout); False where it cannot be."""
        return False

    def pid(self, ctx: int) -> Optional[int]:
        """The process id of context ``ctx`` (started with the computation)."""
        return os.getpid() if ctx == 0 else None

    def protocols(self, ctx: int) -> Optional[Tuple[Tuple[str, str], ...]]:
        """How context ``ctx`` (started with the computation) can be reached,
        if the launcher knows better than its own transport's address."""
        return None


class InprocLauncher(Launcher):
    """Every context in this process, stepped in turn by one driver (for tests)."""

    remote = False
    removable = True

    def start(self, placement: Placement, spin_us: float) -> Engine:
        from .transport.inproc import InprocTransport, World
        marshal.forget_main_snapshot()
        world = self.world = World()
        s = self.session
        for c in range(s.size):
            eng = Engine(c, s.size, InprocTransport(world, c), placement.copy(),
                         computation=s.computation)
            eng.driver = world
            world.engines.append(eng)
        self.engine = world.engines[0]
        return self.engine

    def engines(self) -> List[Engine]:
        return list(self.world.engines)

    def add(self, ids: List[int], init: Any) -> None:
        from .transport.inproc import InprocTransport
        s = self.session
        for c in ids:
            eng = Engine(c, c + 1, InprocTransport(self.world, c), self.engine.placement.copy(),
                         computation=s.computation)
            eng.driver = self.world
            self.world.engines.append(eng)
            prev, _ctx._state.current = _ctx._state.current, eng
            try:
                joined(eng, lambda: init, in_main=True)
            finally:
                _ctx._state.current = prev

    def pid(self, ctx: int) -> Optional[int]:
        return os.getpid()


class ForkLauncher(Launcher):
    """Contexts 1..N-1 forked from this process, for the ``local`` transport."""

    removable = True

    def __init__(self, session: "Session") -> None:
        super().__init__(session)
        self.pids: Dict[int, int] = {}
        self.reaped: Dict[int, int] = {}
        self.server: Optional[forkserver.ForkServer] = None
        self.cpus: Optional[List[int]] = None  # each context's CPU (see pin_setting)
        self.affinity: Optional[set] = None  # context 0's own, given back at the end

    def start(self, placement: Placement, spin_us: float) -> Engine:
        from .transport.local import Mesh, nofile_error
        s = self.session
        n = s.size
        mesh = Mesh(s.computation, n)
        marshal.snapshot_main()
        if pin_setting() and hasattr(os, "sched_setaffinity"):
            cpus = sorted(os.sched_getaffinity(0))
            if n <= len(cpus):
                self.cpus, self.affinity = cpus, set(cpus)
                _pin(0, cpus)
        cpus = self.cpus
        sys.stdout.flush()
        sys.stderr.flush()
        # Each child gets only its socketpair with context 0 and its listening
        # socket; this process keeps one end per child, nothing more.
        mine: Dict[int, socket.socket] = {}
        spare: List[socket.socket] = []  # the child's sockets, until it has them
        try:
            for c in range(1, n):
                try:
                    a, b = socket.socketpair()
                    spare += (a, b)
                    listener = mesh.listen(c)
                    spare.append(listener)
                except OSError as e:
                    if e.errno in (errno.EMFILE, errno.ENFILE):
                        raise nofile_error(f"make the sockets of context {c} of {n}", e) from e
                    if e.errno == errno.EADDRINUSE:
                        raise RuntimeError(
                            f"another computation already uses the name {s.computation}; "
                            f"start again (names are random)") from e
                    raise
                try:
                    # (a Ctrl-C meanwhile is raised here, the child noted to be stopped)
                    pid = fork(lambda p: self.pids.__setitem__(c, p))
                except OSError as e:
                    err = fork_error(c, n, e)
                    if err is e:
                        raise
                    raise err from e
                if pid == 0:  # pragma: no cover - runs in the child
                    _pin(c, cpus)
                    _child_main(c, n, b, listener, [a, *mine.values()], mesh, placement,
                                spin_us, s.computation, make_transport=self.child_transport)
                self.pids[c] = pid
                mine[c] = a
                spare.clear()
                b.close()
                listener.close()
                self.forked(c)
            # forked now, while this process is single-threaded (see forkserver)
            self.server = forkserver.start(
                lambda ctx, sock, blob: (_pin(ctx, cpus), _child_main(
                    ctx, ctx + 1, sock, mesh.listen(ctx), [], mesh, placement, spin_us,
                    s.computation, blob, make_transport=self.child_transport)),
                list(mine.values()) + self.own_sockets())
            eng = Engine(0, n, self.root_transport(mine, mesh, spin_us), placement,
                         computation=s.computation)
        except BaseException:
            for sk in spare:
                sk.close()
            for sk in mine.values():
                sk.close()
            self.stop()
            raise
        self.engine = eng
        eng.describe_lost = self.describe_lost
        return eng

    def forked(self, ctx: int) -> None:
        """Context ``ctx`` was forked (called in context 0)."""

    def own_sockets(self) -> List[socket.socket]:
        """Context 0's sockets that no other process may keep (beyond its
        socketpairs): a copy elsewhere would hide context 0's end."""
        return []

    def root_transport(self, socks: Dict[int, socket.socket], mesh: Any, spin_us: float) -> Any:
        """Context 0's transport, given its socketpairs with the children."""
        from .transport.local import LocalTransport
        return LocalTransport(0, socks, spin_us, mesh=mesh, rings=rings_setting())

    def child_transport(self, ctx: int, sock: socket.socket, listener: socket.socket,
                        mesh: Any, spin_us: float) -> Any:  # pragma: no cover - in children
        """Context ``ctx``'s transport, made in its process after the fork."""
        from .transport.local import LocalTransport
        return LocalTransport(ctx, {0: sock}, spin_us, mesh=mesh, listener=listener,
                              rings=rings_setting())

    def add(self, ids: List[int], init: Any) -> None:
        from .transport.local import nofile_error
        eng = self.engine
        assert eng is not None
        if self.server is None:
            super().add(ids, init)
        blob = marshal.dumps_inband(init)  # (an array it holds too: a partial's, say)
        for c in ids:
            try:
                a, b = socket.socketpair()
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE):
                    raise nofile_error(f"make the sockets of context {c}", e) from e
                raise
            try:
                self.server.fork(c, b, bytes(blob))
            finally:
                b.close()
            eng.transport.adopt(c, a)
            try:
                self.server.pid_of(c)
            except OSError as e:
                eng.lost[c] = str(e)  # never started: no work may go there
                raise OSError(f"cannot start context {c}: {e}") from e

    def pid(self, ctx: int) -> Optional[int]:
        if ctx == 0:
            return os.getpid()
        if ctx in self.pids:
            return self.pids[ctx]
        return self.server.pids.get(ctx) if self.server is not None else None

    def stop_added(self, ctx: int) -> bool:
        pid = self.server.pids.get(ctx) if self.server is not None else None
        if pid is None:
            return False
        try:
            os.kill(pid, signal.SIGKILL)  # (the fork server reaps it)
        except ProcessLookupError:
            pass
        return True

    def _joined_fate(self, peer: int) -> str:
        # no process of ours (a worker's context): one of this host can be
        # read in /proc, while its worker has not reaped it; else the
        # transport's words ("" here) say what is known
        info = self.engine.joined.get(peer) if self.engine is not None else None
        if info is None or info[0].node != node_name() or not info[0].pid:
            return ""
        from .transport.local import _process_fate
        return _process_fate(info[0].pid) or ""

    def describe_lost(self, peer: int) -> str:
        pid = self.pids.get(peer)
        if pid is None:
            if self.server is not None and peer in self.server.pids:
                status = self.server.exit_status(peer, 1.0)
                pid = self.server.pids[peer]
                if status is None:
                    return f"connection closed (pid {pid} still running)"
                return process_fate(pid, status)
            return self._joined_fate(peer)
        deadline = time.monotonic() + 1.0
        while True:  # the socket closes an instant before the process can be reaped
            try:
                r, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                return "connection closed"
            if r:
                self.reaped[peer] = status
                return process_fate(pid, status)
            if time.monotonic() > deadline:
                return f"connection closed (pid {pid} still running)"
            time.sleep(0.001)

    def wait(self, grace: float) -> None:
        deadline = time.monotonic() + grace
        for c, pid in self.pids.items():
            if c in self.reaped:
                continue
            while True:
                try:
                    r, status = os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    self.reaped[c] = 0
                    break
                if r:
                    self.reaped[c] = status
                    break
                if time.monotonic() > deadline:
                    break  # killed by stop()
                time.sleep(0.0005)
        if self.server is not None:
            for c in list(self.server.pids):
                if self.server.exit_status(c, deadline - time.monotonic()) is None:
                    break  # the server kills what is left

    def stop(self) -> None:
        # only children not yet reaped: a reaped pid may already be someone else's
        for c, pid in self.pids.items():
            if c not in self.reaped:
                _kill(pid)
                self.reaped[c] = -9
        if self.server is not None:
            self.server.close()
        if self.affinity is not None:
            os.sched_setaffinity(0, self.affinity)  # context 0's CPUs, as they were
            self.affinity = None


def load_transport(scheme: str) -> Any:
    """The protocol module registered for ``scheme``, imported on first use.

    Raises ValueError for a scheme nobody registered, and ImportError naming
    what to install when the module's own dependencies are missing.

    Example:
        >>> load_transport("inproc").__name__
        'macroflow.transport.inproc'
        >>> load_transport("carrier-pigeon")
        Traceback (most recent call last):
        ...
        ValueError: unknown transport 'carrier-pigeon'; available: inproc, local, mpi, tcp
    """
    import importlib
    path = REGISTRY.get(scheme) if isinstance(scheme, str) else None
    if path is None:
        raise ValueError(f"unknown transport {scheme!r}; available: {', '.join(sorted(REGISTRY))}")
    return importlib.import_module(path)


@dataclasses.dataclass(frozen=True)
class ContextInfo:
    """One context of the computation, as :func:`contexts` lists it.

    ``node`` is the host it runs on, ``pid`` its process, ``protocols`` the
    (protocol, address) pairs it can be reached by, ``state`` one of
    "running", "lost" (its process or connection is gone), "retiring" and then
    "removed" (by :func:`remove_context`) or "failed" (its ``init`` raised when it
    was added).

    Example:
        >>> import macroflow as mf
        >>> with mf.init(contexts=2, transport="inproc"):
        ...     [(c.id, c.state) for c in mf.contexts()]
        [(0, 'running'), (1, 'running')]
    """

    id: int
    node: str
    pid: Optional[int]
    protocols: tuple
    state: str


def node_name() -> str:
    """The name of the host this process runs on.

    Example:
        >>> node_name() == socket.gethostname()
        True
    """
    return socket.gethostname()


def _positive_seconds(value: Any, what: str) -> float:
    """``value`` as a number of seconds above 0; TypeError or ValueError,
    naming ``what``, for anything else.

    Example:
        >>> _positive_seconds(2, "add_contexts: timeout")
        2.0
        >>> _positive_seconds(0, "add_contexts: timeout")
        Traceback (most recent call last):
        ...
        ValueError: add_contexts: timeout must be a positive number of seconds; got 0
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{what} must be a positive number of seconds; got {value!r}")
    if not value > 0:  # (NaN too)
        raise ValueError(f"{what} must be a positive number of seconds; got {value!r}")
    return float(value)


def _check_thread(eng: Engine, what: str) -> None:
    # one thread runs context 0's engine (and its service thread, for what it
    # serves while a method computes), as current_engine says
    me = threading.get_ident()
    if me != eng.thread and me != eng.serving:
        raise RuntimeError(f"{what} was called from a thread other than the one that "
                           f"started the computation; call it from that thread")


def _inside_user_code() -> Optional[str]:
    """What user code a computation runs this thread is in ("method
    Counter.add on context 1", "SPMD function f on context 0"), or None.

    Example:
        >>> _inside_user_code() is None  # (a program's own code)
        True
    """
    from .core.threads import Worker, getcurrent
    g = getcurrent()
    return g.engine.running(g.call) if isinstance(g, Worker) else None


def _main_session(what: str) -> "Session":
    inside = _inside_user_code()
    if inside is not None:
        raise RuntimeError(f"{what} was called inside {inside}: only the program that started "
                           f"the computation (context 0's main) can do that")
    eng = _ctx._state.default
    cur = _ctx._state.current
    if cur is not None and eng is not None and cur is not eng:
        # (inproc: another context's code, an added context's init, runs in
        # this very thread; elsewhere it runs in a process of its own)
        raise RuntimeError(f"{what} is for the program that started the computation "
                           f"(context 0); this is context {cur.id}")
    for s in _sessions:
        if s.engine is eng and not s.closed:
            _check_thread(eng, what)
            return s
    if eng is not None:
        raise RuntimeError(f"{what} is for the program that started the computation "
                           f"(context 0); this is context {eng.id}")
    raise RuntimeError(f"{what}: no computation is running; start one with mf.init or mf.run")


def contexts() -> List[ContextInfo]:
    """Every context of the computation, with its node, process and protocols.

    Answered by context 0 (the program that started the computation).

    Example:
        >>> import macroflow as mf, socket
        >>> def main():
        ...     here = socket.gethostname()
        ...     return [(c.id, c.node == here, c.protocols[0][0]) for c in mf.contexts()]
        >>> mf.run(main, contexts=2, transport="local")
        [(0, True, 'local'), (1, True, 'local')]
    """
    s = _main_session("mf.contexts()")
    eng = s.engine
    assert eng is not None
    eng.poll()  # what the transport knows (a context lost since it last looked, say)
    out = []
    for c in range(eng.size):
        got = eng.joined.get(c)
        if got is not None:
            info = got[0]
            if c in eng.lost and info.state == "running":
                info = dataclasses.replace(info, state="removed" if c in eng.heirs else "lost")
            elif c in eng.retiring and info.state == "running":
                info = dataclasses.replace(info, state="retiring")
        else:
            pid = s.launcher.pid(c)
            protocols = s.launcher.protocols(c)
            if protocols is None:
                proto, addr = eng.transport.address()
                protocols = ((proto, f"{addr.rsplit(':', 1)[0]}:{pid}"),)
            state = "running"
            if c in eng.heirs:
                state = "removed"
            elif c in eng.lost:
                state = "lost"
            elif c in eng.retiring:
                state = "retiring"
            info = ContextInfo(c, node_name(), pid, tuple(protocols), state)
        out.append(info)
    return out


def wait_contexts(n: int, timeout: Optional[float] = None) -> int:
    """Wait until the computation has at least ``n`` live contexts (workers
    joining over TCP, say), serving meanwhile; returns how many it has.

    Raises:
        TypeError: ``n`` is not an int.
        ValueError: ``n`` is below 1, or more than the computation has while
            it does not listen (no context can join it).
        macroflow.TimeoutError: fewer than ``n`` after ``timeout`` seconds.

    Example:
        >>> import macroflow as mf
        >>> mf.run(lambda: mf.wait_contexts(2, timeout=5), contexts=2, transport="inproc")
        2
    """
    from .core import errors
    from .core.context import check_timeout
    n = _ctx.positive_count(n, "wait_contexts: n")
    timeout = check_timeout(timeout)
    s = _main_session("mf.wait_contexts()")
    eng = s.engine
    assert eng is not None
    deadline = None if timeout is None else time.monotonic() + timeout

    def ready() -> int:
        # a joining context counts once it has reported in (a worker's contexts
        # report one by one, in any order: one with a higher id may be first)
        return sum(1 for c in eng.context_ids() if c < s.size or c in eng.joined)

    eng.step(0)  # a loss already said (a worker killed before this call) counts
    if ready() < n and not s.launcher.joinable:
        # only workers joining over TCP add contexts while main waits here
        raise ValueError(f"wait_contexts({n}): the computation has {ready()} contexts and "
                         f"does not listen, so none can join: start it with "
                         f"mf.init(..., listen='HOST:PORT') for workers to join, or add "
                         f"contexts with mf.add_contexts()")
    if not eng.driver.run_until(lambda: ready() >= n, deadline):
        raise errors.TimeoutError(f"wait_contexts: {ready()} contexts after "
                                  f"{timeout} s, not {n}")
    return ready()


def add_contexts(n: int, init: Optional[Callable[[int], Any]] = None,
                 timeout: float = 60.0) -> List[int]:
    """Create ``n`` new contexts while the program runs and return their ids.

    Each new context runs ``init(context_id)`` (if given) before it serves;
    the call returns once every new context has done so, and placement uses
    them from then on. On ``local`` the new contexts are forked by a server
    started with the computation (so this process may have threads by now),
    as copies of this program as it was at start-up.

    Raises:
        TypeError: ``n`` is not an int, ``init`` is not callable, or
            ``timeout`` is not a number.
        ValueError: ``n`` is below 1, ``timeout`` is not above 0, or the
            transport cannot add contexts.
        RuntimeError: called inside a method, or not on context 0; or (on
            ``local``) the fork server that makes new contexts has ended.
        CallError: ``init`` cannot be pickled (found before any context is
            started).
        MacroflowError: ``init`` raised in a new context (with its traceback;
            that context is not used, the others are). The first failure is
            raised; its message names the others, and its ``added``
            attribute lists the new contexts that are in use.
        ContextLost: a new context died before it reported in (``added``
            as above; its ``how`` says how that context ended, its ``also``
            names the others).
        TimeoutError: a new context did not report in within ``timeout``
            seconds (its ``init`` had not returned): it counts as lost, no
            work is placed on it, and it is stopped (on ``local`` and
            ``tcp``; elsewhere it ends with the computation). Those that
            reported in are used (``added`` lists them). On ``inproc``,
            where ``init`` runs in the program's own thread, nothing can
            stop it: ``add_contexts`` returns once it does, and the timeout
            is not applied.
        LimitError: this host cannot hold ``n`` more contexts (too little
            memory, RLIMIT_NPROC, or on ``local`` and ``tcp`` too few free
            file descriptors, RLIMIT_NOFILE): found before any is started.

    Example:
        >>> import macroflow as mf
        >>> def main():
        ...     new = mf.add_contexts(2)
        ...     return new, mf.num_contexts()
        >>> mf.run(main, contexts=2, transport="inproc")
        ([2, 3], 4)
    """
    from .core import errors
    n = _ctx.positive_count(n, "add_contexts: n")
    if init is not None and not callable(init):
        raise TypeError(f"add_contexts: init must be a function of the context id, or None; "
                        f"got {init!r}")
    timeout = _positive_seconds(timeout, "add_contexts: timeout")
    if init is not None:
        try:  # (it travels to each new context: said here, before any is started)
            marshal.dumps(init)
        except marshal.PICKLE_ERRORS as e:
            raise errors.CallError(f"add_contexts: init {getattr(init, '__qualname__', init)!s} "
                                   f"cannot be sent to the new contexts: {e}") from e
    s = _main_session("mf.add_contexts()")
    eng = s.engine
    assert eng is not None
    check = getattr(load_transport(s.transport_name), "check_room", None)
    if check is not None:
        try:
            check(n + 1, adding=True)  # n more, before any is started (as mf.run checks)
        except errors.LimitError as e:
            raise errors.LimitError(e.limit, f"mf.add_contexts({n}): this host cannot hold "
                                             f"{n} more contexts (checked as for a computation "
                                             f"of {n + 1}): {e}") from None
    ids = list(range(eng.size, eng.size + n))
    s.launcher.add(ids, init)
    eng.grow(ids[-1] + 1)
    deadline = time.monotonic() + timeout
    # a context whose init failed reports in, then ends: what it said is read
    # before its end is seen, and is the better news
    done = eng.driver.run_until(
        lambda: all(c in eng.joined or (c in eng.lost and not eng.inbox) for c in ids), deadline)
    late = [] if done else [c for c in ids if c not in eng.joined and c not in eng.lost]
    reported = [c for c in ids if c not in late]
    stopped = [c for c in late if s.launcher.stop_added(c)]
    for c in late:
        # no work goes to a context whose init has not returned (it would
        # wait behind it, for ever if init never returns): it counts as
        # lost, here and, once it is stopped, wherever it is sought
        eng.peer_lost(c, f"it did not report in within {timeout} s of mf.add_contexts (its "
                         f"init had not returned)" + ("; it was stopped" if c in stopped else ""),
                      describe=False)  # (the launcher would say only that it was killed)
    # every failure is marked before the others hear of the new contexts
    # (MEMBERS carries what is lost): a context whose init raised was
    # otherwise left to their placement, and to this one's, until its end
    # was seen, and served what they sent meanwhile
    failed = [c for c in reported if c not in eng.joined or eng.joined[c][1] is not None]
    for c in failed:
        if c in eng.joined:
            eng.lost.setdefault(c, "its init raised")  # no work goes there
    # every context may place work on the new ones now (those that reported in)
    members = (reported[-1] + 1 if reported else ids[0]) if late else eng.size
    # the new ones first: they learn which contexts left before they came
    # (so sent nothing there) before the others hear of them
    msg = (MEMBERS, members) + eng.members()[2:]
    for c in sorted(eng.context_ids(), key=lambda c: c not in ids):
        if c != eng.id:
            try:
                eng.send(c, msg)
            except Exception:
                pass
    eng.transport.flush()
    used = [c for c in reported if c not in failed]
    in_use = f" (contexts {used} were added and are used)" if used else ""
    err: Exception
    if not done:
        still = [c for c in late if c not in stopped]
        err = errors.TimeoutError(
            f"add_contexts: contexts {late} did not report in within {timeout} s (their init "
            f"had not returned); "
            + ("they were stopped" if not still else
               f"contexts {still} cannot be stopped on {s.transport_name} and end with the "
               f"computation")
            + "; no work is placed on them"
            + (f"; contexts {failed} failed" if failed else "") + in_use)
    elif failed:
        c = failed[0]
        also = (f"; contexts {failed[1:]} failed too" if len(failed) > 1 else "") + in_use
        if c not in eng.joined:
            err = errors.ContextLost(c, eng.lost[c], also=also)
        else:
            err = errors.MacroflowError(f"init of new context {c} raised (the context is not "
                                        f"used){also}:\n{eng.joined[c][1]}")
    else:
        return ids
    err.added = used  # type: ignore[attr-defined]
    raise err


def remove_context(cid: int, timeout: float = 60.0) -> None:
    """Retire context ``cid`` while the program runs, and wait until it has left.

    From the call on, no new work is placed on ``cid``. It finishes the calls
    it has; a stateless call that reaches it later runs elsewhere, and a
    call to one of its objects fails with :class:`ObjectDestroyed`. The
    values it holds (results of finished calls, which futures elsewhere may
    still ask for) are handed over to context 0 first, so no future loses
    its value; then its process ends. Calls to its objects made later fail
    with ``ObjectDestroyed`` too, and :func:`contexts` shows it as
    ``removed``.

    Raises:
        TypeError: ``cid`` is not an int (or a numpy integer).
        ValueError: ``cid`` is not the id of a running context other than 0,
            or the transport cannot remove contexts.
        RuntimeError: called inside a method, or not on context 0.
        TimeoutError: ``cid`` did not finish its calls within ``timeout``
            seconds (it goes on retiring). On ``inproc``, where every context
            shares this thread, only once the method computing there returns.
        ContextLost: ``cid`` was lost before the call (it died, say), or
            died while it retired.

    Example:
        >>> import macroflow as mf
        >>> @mf.persistent
        ... class Square:
        ...     def of(self, x): return x * x
        >>> def main():
        ...     s = Square.create(on=1)
        ...     f = s.of(7)                     # its value is held by context 1
        ...     mf.remove_context(1)
        ...     try:
        ...         s.of(2).result()
        ...     except mf.ObjectDestroyed:
        ...         gone = "ObjectDestroyed"
        ...     return f.result(), gone, [c.state for c in mf.contexts()]
        >>> mf.run(main, contexts=3, transport="local")
        (49, 'ObjectDestroyed', ['running', 'removed', 'running'])
    """
    from .core import errors
    c = _ctx.as_int(cid)  # an int, or a numpy integer
    if c is None:
        # (a TypeError, as on= gives for an id that is not an int)
        raise TypeError(f"remove_context: cid must be a context id (an int); got {cid!r}")
    cid = c
    timeout = _positive_seconds(timeout, "remove_context: timeout")
    s = _main_session("mf.remove_context()")
    eng = s.engine
    assert eng is not None
    if not getattr(s.launcher, "removable", False):
        raise ValueError(f"remove_context: the {s.transport_name} transport cannot remove "
                         f"contexts (local, tcp and inproc can)")
    if cid == 0:
        raise ValueError("remove_context: context 0 runs the program and cannot be removed")
    pending = eng.__dict__.setdefault("_removals_timed_out", set())
    if cid in eng.heirs and cid in pending:
        pending.discard(cid)  # asked before, timed out, and done since
        return
    if not 0 < cid < eng.size or cid in eng.heirs:
        raise ValueError(f"remove_context: no running context {cid} (the computation has "
                         f"contexts 0 to {eng.size - 1}"
                         f"{'; it was removed already' if cid in eng.heirs else ''})")
    if cid in eng.lost:
        raise errors.ContextLost(cid, eng.lost[cid])
    if cid not in eng.retiring:
        eng.remove(cid)
    deadline = time.monotonic() + timeout
    done = eng.driver.run_until(
        lambda: cid in eng.left or (cid in eng.lost and cid not in eng.heirs), deadline)
    if cid in eng.lost and cid not in eng.heirs:
        raise errors.ContextLost(cid, eng.lost[cid])
    if not done:
        pending.add(cid)  # asking again waits for it, or returns once it has left
        raise errors.TimeoutError(f"remove_context: context {cid} did not finish its calls "
                                  f"within {timeout} s; it goes on retiring")
    pending.discard(cid)


def new_computation_id() -> str:
    """A short random name for a new computation, unique for all practical purposes.

    Example:
        >>> a, b = new_computation_id(), new_computation_id()
        >>> len(a), a != b
        (8, True)
    """
    return secrets.token_hex(4)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass


def fork_error(ctx: int, n: int, err: OSError) -> Exception:
    """The clear error for a failed ``fork()`` of context ``ctx`` of ``n``.

    Example:
        >>> e = fork_error(40, 100, OSError(errno.EAGAIN, "Resource temporarily unavailable"))
        >>> e.limit, "RLIMIT_NPROC" in str(e), "ulimit -u" in str(e)
        ('RLIMIT_NPROC', True, True)
    """
    if err.errno == errno.EAGAIN:
        soft, hard = resource.getrlimit(resource.RLIMIT_NPROC)
        inf = resource.RLIM_INFINITY
        shown = ["unlimited" if v == inf else str(v) for v in (soft, hard)]
        return LimitError("RLIMIT_NPROC", (
            f"cannot fork context {ctx} of {n}: the limit on processes is reached "
            f"(RLIMIT_NPROC soft limit {shown[0]}, hard limit {shown[1]}, counting every "
            f"process of this user; or the pids.max of this container's cgroup). "
            f"Raise it with `ulimit -u N` in the shell that starts Python, or "
            f"resource.setrlimit(resource.RLIMIT_NPROC, (N, hard)) before mf.init or "
            f"mf.run; or use fewer contexts"))
    if err.errno == errno.ENOMEM:
        return LimitError("memory", (
            f"cannot fork context {ctx} of {n}: not enough memory (ENOMEM); "
            f"use fewer contexts or free memory"))
    return err


def joined(eng: Engine, get_init: Callable[[], Any], in_main: bool = False) -> bool:
    """Run the ``init`` of a context added while running (``get_init()`` gives
    it, or None), then report in to context 0 with this context's description,
    or with the error init raised. Returns False if init failed. ``in_main``:
    init runs in the program's own thread (inproc), where a Ctrl-C is the
    program's, not init's error."""
    error = None
    try:
        init = get_init()
        if init is not None:
            eng.transport.settle(5.0)  # (tcp: what connects to it now is answered, not timed out)
            init(eng.id)
    except BaseException as e:
        if in_main and isinstance(e, KeyboardInterrupt):
            raise
        error = errors.format_user(e)  # (init's frames, not ours)
    addresses = getattr(eng.transport, "addresses", None)
    protocols = addresses() if addresses is not None else (eng.transport.address(),)
    info = ContextInfo(eng.id, node_name(), os.getpid(), tuple(protocols),
                       "failed" if error else "running")
    eng.send(0, (JOINED, (info, error)))
    eng.transport.flush()
    return error is None


def _child_main(ctx: int, n: int, sock: socket.socket, listener: socket.socket,
                inherited: List[socket.socket], mesh: Any, placement: Placement,
                spin_us: float, computation: str, init_blob: Optional[bytes] = None,
                make_transport: Optional[Callable[..., Any]] = None) -> None:  # pragma: no cover
    code = 0
    eng = None
    try:
        _set_pdeathsig()
        if os.getppid() == 1:
            os._exit(0)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is context 0's to handle
        for s in list(_sessions):
            s.closed = True  # the parent's sessions are not ours to close
        # context 0's ends of its socketpairs: a copy kept here would hide
        # context 0's death from the other contexts
        for s in inherited:
            s.close()
        random.seed()
        # numpy.random seeds itself from the OS when first imported: reseed only
        # a generator copied from context 0 (importing it costs ~10 ms per context)
        np_random = sys.modules.get("numpy.random")
        if np_random is not None:
            np_random.seed()
        assert make_transport is not None
        eng = Engine(ctx, n, make_transport(ctx, sock, listener, mesh, spin_us),
                     placement.copy(), computation=computation)
        eng.describe_lost = lambda peer: ""  # the transport's own words say it best here
        _ctx._state.default = eng
        if init_blob is not None:  # added while running: initialise, then report in
            if not joined(eng, lambda: marshal.loads(init_blob)):
                code = 1
                return
        eng.serve_forever()
    except BaseException as e:
        text = _ctx.fatal_text(e)
        sys.stderr.write(text)
        if eng is not None:
            eng.report_fatal(text)
        code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def choose_transport(transport: Optional[str], contexts: Optional[int],
                     world: Optional[tuple] = None) -> tuple:
    """The (transport, contexts) a computation uses, given what the caller asked.

    Started by an MPI launcher with more than one rank (``world``: (rank,
    size), read from the environment when not given), the transport is
    ``"mpi"`` and there are as many contexts as ranks; elsewhere the default
    transport is ``"local"`` and the default number of contexts the CPU count.

    Raises:
        ValueError: under mpiexec, another transport or another number of
            contexts than the job's ranks.

    Example:
        >>> choose_transport(None, 4, world=None)
        ('local', 4)
        >>> choose_transport(None, None, world=(0, 3))
        ('mpi', 3)
        >>> choose_transport(None, 8, world=(0, 3))
        Traceback (most recent call last):
        ...
        ValueError: contexts=8, but mpiexec started 3 ranks: under mpiexec each rank is a context; pass contexts=3 or leave it out
    """
    if world is None:
        from .transport.mpi import world_from_environment
        world = world_from_environment()
    if world is not None and world[1] > 1:
        rank, size = world
        if transport is None:
            transport = "mpi"
        elif transport != "mpi":
            raise ValueError(
                f"this process is rank {rank} of {size} started by mpiexec, where the transport "
                f"is 'mpi' (each rank a context); got transport={transport!r}: leave it out, or "
                f"start the program without mpiexec")
        if contexts is None:
            contexts = size
        elif contexts != size:
            raise ValueError(f"contexts={contexts}, but mpiexec started {size} ranks: under mpiexec "
                             f"each rank is a context; pass contexts={size} or leave it out")
    if transport is None:
        transport = "local"
    if contexts is None:
        contexts = os.cpu_count() or 1
    return transport, contexts


#: the script `macroflow run` is loading (its top level runs), else None
loading_script: Optional[str] = None


class TopLevelStart(RuntimeError):
    """A script that `macroflow run` loads starts a computation at its top level."""


def init(contexts: Optional[int] = None, transport: Optional[str] = None, placement: Any = None,
         spin_us: Optional[float] = None, *, listen: Any = None, secret: Optional[str] = None,
         tls: Optional[Tuple[str, str]] = None) -> Session:
    """Start a computation of ``contexts`` contexts; this process becomes context 0.

    For scripts and notebooks: use it as a context manager, or call
    :func:`shutdown` (it also runs at exit).

    Under ``mpiexec -n N`` (N > 1), every rank calls it: rank 0 becomes context 0
    and returns, the other ranks serve the computation and end their process
    when it ends (so the code after this call runs on rank 0 only).

    Args:
        contexts: number of contexts, this one included (default: CPU count;
            under mpiexec: the number of ranks, which it must equal).
        transport: "local" (processes on this host), "inproc" (one process),
            "tcp" (processes on this host that talk TCP over loopback) or
            "mpi" (MPI ranks: this mpiexec job's, or spawned ones); default
            "mpi" under mpiexec, "local" elsewhere.
        placement: a policy name ("round-robin", "random",
            "best-most-recently") or a :class:`macroflow.Placement`.
        spin_us: how long, in microseconds, an idle context polls before it
            sleeps: a finite number >= 0, 0 to sleep at once (default 50, or
            the MACROFLOW_SPIN_US environment variable).
        listen: accept workers of other hosts (``macroflow worker --connect``)
            at "HOST:PORT" (":PORT" or a port number: loopback only); the
            contexts started here talk to each other by the local path and
            to workers over TCP (see :mod:`macroflow.join`).
        secret: the computation's secret for workers (at least 16
            characters, surrounding white space dropped, as the workers
            drop it); default MACROFLOW_SECRET or MACROFLOW_SECRET_FILE,
            else a new one, printed on standard error for you to hand on.
        tls: ``(certificate file, key file)`` to speak TLS with workers
            (every host uses the same pair).

    Raises:
        RuntimeError: a computation is already running in this process.
        ValueError: bad number of contexts, transport, placement or spin_us
            (or MACROFLOW_SPIN_US).
        LimitError: the host cannot hold that many contexts: found before
            anything starts for processes (RLIMIT_NPROC) and memory (see
            :func:`macroflow.transport.local.check_room`), while starting
            for file descriptors.

    Example:
        >>> import macroflow as mf
        >>> with mf.init(contexts=2, transport="inproc"):
        ...     mf.num_contexts()
        2
        >>> mf.init(contexts=2, spin_us="fast")
        Traceback (most recent call last):
        ...
        ValueError: spin_us must be a finite number of microseconds >= 0 (0: never poll before sleeping); got 'fast'
    """
    if _ctx._state.default is not None:
        inside = _inside_user_code()
        if inside is not None:
            raise RuntimeError(f"mf.run()/mf.init() was called inside {inside}: code that a "
                               f"computation runs cannot start another; make the calls it "
                               f"needs in this one")
        if threading.get_ident() != _ctx._state.default.thread:
            raise RuntimeError("a macroflow computation is already running in this process, "
                               "started by another thread; one process runs one computation "
                               "at a time: use it from that thread, or start this one after "
                               "it ends")
        if any(s.in_run for s in _sessions):  # (where mf.shutdown() is refused)
            raise RuntimeError("a macroflow computation is already running in this process: "
                               "this is the main function of mf.run(), which runs in it; use "
                               "it, or start the other computation after mf.run returns")
        raise RuntimeError("a macroflow computation is already running in this process; "
                           "shut it down first (mf.shutdown())")
    if loading_script is not None:
        # its top level would start a computation, and then macroflow run its
        # main in another: the program would run twice
        raise TopLevelStart(
            f"{loading_script} starts a computation at its top level (mf.run, mf.init or "
            f"mf.spmd) while `macroflow run` loads it; macroflow run calls its main itself: "
            f"put that call under `if __name__ == \"__main__\":`")
    if contexts is not None:
        contexts = _ctx.positive_count(contexts, "contexts")
    transport, contexts = choose_transport(transport, contexts)
    module = load_transport(transport)
    check_settings(module)  # before anything starts
    check = getattr(module, "check_room", None)
    make_launcher = None
    if listen is not None:
        make_launcher = _listen_launcher(transport, listen, secret, tls)
    elif secret is not None or tls is not None:
        raise ValueError("secret and tls are for a computation that listens for workers: "
                         "give listen= too")
    if check is not None:
        check(contexts)  # before anything is started
    return Session(contexts, transport, Placement.make(placement), spin_us_setting(spin_us),
                   make_launcher)


def _listen_launcher(transport: str, listen: Any, secret: Optional[str],
                     tls: Optional[Tuple[str, str]]) -> Callable[["Session"], "Launcher"]:
    from .join import TcpLauncher, listen_address, tls_contexts
    from .transport.tcp import format_address, load_secret
    if transport != "local":
        raise ValueError(f"listen= works with the local transport (contexts forked here, "
                         f"workers joining over TCP); got transport={transport!r}")
    host, port = listen_address(listen)
    if tls is not None and (not isinstance(tls, (tuple, list)) or len(tls) != 2):
        raise ValueError(f"tls must be (certificate file, key file); got {tls!r}")
    contexts_tls = tls_contexts(*tls) if tls is not None else (None, None)
    told = secret is not None or bool(os.environ.get("MACROFLOW_SECRET")) \
        or bool(os.environ.get("MACROFLOW_SECRET_FILE"))
    if secret is not None:
        from .transport.tcp import _check_secret
        if isinstance(secret, (bytes, bytearray)):
            # (the workers' MACROFLOW_SECRET is text: the same bytes as text)
            try:
                secret = bytes(secret).decode()
            except UnicodeDecodeError:
                raise ValueError("secret= as bytes must be UTF-8 text, as the workers' "
                                 "MACROFLOW_SECRET or --secret-file is") from None
        if not isinstance(secret, str):
            raise TypeError(f"secret= must be a str (or UTF-8 bytes); got "
                            f"{type(secret).__name__}")
        # (surrounding white space goes, as from MACROFLOW_SECRET or a file:
        # the workers read theirs so, and would be refused)
        secret = _check_secret(secret.strip(), "secret=")
    else:
        secret = load_secret()

    def make(session: "Session") -> "Launcher":
        launcher = TcpLauncher(session, f"{format_address(host, port)}", secret, contexts_tls)
        launcher.joinable = True  # (transport="tcp" alone listens with a secret nobody knows)
        if not told:
            launcher.announce_secret = True
        return launcher
    return make


def shutdown() -> None:
    """Tear down the running computation, if any.

    For computations started with :func:`init`, from the program that
    started them: a method cannot end the computation it runs in, and
    ``main`` of :func:`run` ends it by returning.

    Raises:
        RuntimeError: called inside a method of a parallel object, or inside
            the main function of :func:`run`.

    Example:
        >>> import macroflow as mf
        >>> mf.shutdown()   # nothing running: does nothing
    """
    inside = _inside_user_code()
    if inside is not None:
        raise RuntimeError(f"mf.shutdown() was called inside {inside}: code that a computation "
                           f"runs cannot end it; return, and let the program that started it "
                           f"end it")
    for s in list(_sessions):
        if s.engine is not None and not _exiting and not s.closed:
            _check_thread(s.engine, "mf.shutdown()")
        if s.in_run and not _exiting:
            raise RuntimeError("mf.shutdown() was called inside the main function of mf.run(): "
                               "return from main instead; mf.run ends the computation then")
        s.close()


_exiting = False


def _shutdown_at_exit() -> None:
    global _exiting
    _exiting = True
    try:
        shutdown()
    except KeyboardInterrupt:
        pass  # (a Ctrl-C while the program exits: it exits, and they were stopped)


atexit.register(_shutdown_at_exit)


def _forked_child() -> None:
    """In a child made by ``os.fork()`` (multiprocessing's fork too) while a
    computation runs here: the computation is the parent's (its processes,
    sockets, rings and MPI), so the child neither uses it (every ``mf``
    call says why) nor ends it (its exit, or a ``with`` block it leaves,
    would stop the parent's contexts)."""
    engines = []
    for s in _sessions:
        s.closed = True
        every = getattr(s.launcher, "engines", None)  # (inproc: every context's is here)
        engines.extend(every() if every is not None else [s.engine])
    # a context's own process (a method forked it): its engine is the running one
    st = _ctx._state
    engines.extend((st.default, st.current, getattr(_ctx.getcurrent(), "engine", None)))
    engines = list({id(e): e for e in engines if e is not None}.values())
    if not engines:
        return
    _sessions.clear()
    ppid = os.getppid()
    _ctx.fork_away(engines, ppid)
    st.default = st.current = None
    st.forked_from = ppid


os.register_at_fork(after_in_child=_forked_child)


def _under_mpiexec() -> None:
    # Under mpiexec, an uncaught error on any rank ends every rank, printed
    # once (see macroflow.transport.mpi.excepthook); elsewhere nothing happens.
    from .transport.mpi import install_excepthook
    install_excepthook()


def run(main: Callable[..., Any], *args: Any, contexts: Optional[int] = None,
        transport: Optional[str] = None, placement: Any = None, spin_us: Optional[float] = None,
        listen: Any = None, secret: Optional[str] = None, tls: Optional[Tuple[str, str]] = None,
        **kwargs: Any) -> Any:
    """Run ``main(*args, **kwargs)`` on context 0 of a new computation and return its value.

    If main returns a Future, its value is returned; an ``async def`` main
    runs in an event loop of its own (it may await macroflow futures and
    asyncio alike). Everything is torn down
    afterwards, whether main returns or raises. Arguments as for :func:`init`:
    under ``mpiexec -n N python script.py``, the same script that runs
    ``mf.run(main, contexts=N)`` alone runs main on rank 0, and the other
    ranks serve and then end their process.

    Example:
        >>> import macroflow as mf
        >>> @mf.regular
        ... class Math:
        ...     def square(self, x): return x * x
        ...     def add(self, a, b): return a + b
        >>> def main():
        ...     m = Math()
        ...     return m.add(m.square(4), m.square(5)).result()
        >>> mf.run(main, contexts=2, transport="inproc")
        41
        >>> async def amain():
        ...     return await Math().square(6)
        >>> mf.run(amain, contexts=2, transport="inproc")
        36
    """
    from .core.future import CoroutineType, Future
    _check_main(main, args, kwargs)
    try:
        session = init(contexts=contexts, transport=transport, placement=placement,
                       spin_us=spin_us, listen=listen, secret=secret, tls=tls)
    except KeyboardInterrupt:
        print("macroflow: interrupted (Ctrl-C) while the computation started; the contexts "
              "started were stopped", file=sys.stderr)
        raise
    session.in_run = True
    try:
        with session:
            result = main(*args, **kwargs)
            if type(result) is CoroutineType:
                result = _run_async_main(result)
            if isinstance(result, Future):  # main handed its place on: wait here
                result = result.result()
            return result
    except KeyboardInterrupt:
        print(interrupted_line(session._contexts_now()), file=sys.stderr)
        raise


def interrupted_line(n: int) -> str:
    """What a computation of ``n`` contexts that Ctrl-C ended says.

    Example:
        >>> interrupted_line(3)
        'macroflow: interrupted (Ctrl-C); all 3 contexts were stopped'
    """
    return f"macroflow: interrupted (Ctrl-C); all {n} contexts were stopped"


def _run_async_main(coro: Any) -> Any:
    """An ``async def`` main, run to its end in an event loop of its own:
    it may await macroflow futures and asyncio alike.

    Example:
        >>> async def main():
        ...     return 7
        >>> _run_async_main(main())
        7
    """
    import asyncio
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    coro.close()
    raise RuntimeError("mf.run() of an async def main was called inside a running event loop, "
                       "which it cannot block: there, start the computation with "
                       "`with mf.init(...):` and `await main()` yourself")


_RUN_OPTIONS = ("contexts", "transport", "placement", "spin_us", "listen", "secret", "tls")


def _check_main(main: Any, args: tuple, kwargs: Dict[str, Any], who: str = "mf.run()") -> None:
    """Refuse a main that is not callable, or that cannot take the arguments
    given, before any context starts (a misspelt option, ``context=4``, is
    one of those arguments).

    Example:
        >>> def main(n): return n
        >>> _check_main(main, (), {"context": 4})
        Traceback (most recent call last):
        ...
        TypeError: mf.run(): main(n) cannot be called with context=4 (missing a required argument: 'n'); did you mean contexts=?
    """
    import difflib
    import inspect
    if not callable(main):
        raise TypeError(f"{who}: main must be callable (a function); got "
                        f"{type(main).__name__}")
    try:
        # (the wrapper's own: a decorator may supply main's arguments)
        sig = inspect.signature(main, follow_wrapped=False)
    except (TypeError, ValueError):
        return  # (a callable with no signature to read: the call itself will say)
    try:
        sig.bind(*args, **kwargs)
    except TypeError as e:
        given = [repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()]
        hint = ""
        for k in kwargs:
            close = difflib.get_close_matches(k, _RUN_OPTIONS, n=1)
            if close:
                hint = f"; did you mean {close[0]}=?"
                break
        name = getattr(main, "__name__", "main")
        raise TypeError(f"{who}: {name}{sig} cannot be called with "
                        f"{', '.join(given) or 'no arguments'} ({e}){hint}") from None


_under_mpiexec()
