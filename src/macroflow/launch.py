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
import ctypes
import errno
import math
import os
import random
import resource
import secrets
import signal
import socket
import sys
import time
import traceback
from typing import Any, Callable, Dict, List, Optional

from .core import context as _ctx
from .core import marshal
from .core.context import SHUTDOWN, Engine
from .core.errors import LimitError
from .core.placement import Placement
from .transport.base import REGISTRY

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


def _check_spin(value: Any, shown: Any, source: str) -> float:
    if (isinstance(value, (int, float)) and not isinstance(value, bool)
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


def describe_status(status: int) -> str:
    """Say how a process ended, from a ``waitpid`` status.

    Example:
        >>> describe_status(9)
        'killed by signal SIGKILL'
        >>> describe_status(256)
        'exited with code 1'
    """
    if os.WIFSIGNALED(status):
        n = os.WTERMSIG(status)
        try:
            name = signal.Signals(n).name
        except ValueError:
            name = str(n)
        return f"killed by signal {name}"
    if os.WIFEXITED(status):
        return f"exited with code {os.WEXITSTATUS(status)}"
    return f"ended with status {status}"


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

    def __init__(self, contexts: int, transport: str, placement: Any, spin_us: float):
        self.size = contexts
        self.transport_name = transport
        self.closed = False
        self.in_run = False  # started by run(): its main may not call shutdown()
        self.engine: Optional[Engine] = None
        self.started = time.perf_counter()
        self.computation = new_computation_id()
        self.launcher: Launcher = load_transport(transport).launcher(self)
        self.engine = self.launcher.start(placement, spin_us)
        _ctx._state.default = self.engine
        _sessions.append(self)

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
        self.closed = True
        eng = self.engine
        try:
            if eng is not None and self.launcher.remote:
                eng.stopping = True
                for c in eng.context_ids():
                    if c != eng.id and c not in eng.lost:
                        try:
                            eng.send(c, (SHUTDOWN,))
                        except Exception:
                            pass
                self.launcher.wait(grace)
        finally:
            self.launcher.stop()
            for e in self.launcher.engines():
                e.closed = True
                if e.service is not None:
                    e.service.stop()
            if eng is not None and eng.transport is not None:
                eng.transport.close()
            if _ctx._state.default is eng:
                _ctx._state.default = None
            if self in _sessions:
                _sessions.remove(self)

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        # after Ctrl-C, waiting long for contexts that compute helps nobody
        self.close(grace=0.2 if exc_type is KeyboardInterrupt else 2.0)


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

    def __init__(self, session: "Session") -> None:
        self.session = session
        self.engine: Optional[Engine] = None

    def start(self, placement: Placement, spin_us: float) -> Engine:
        raise NotImplementedError

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


class InprocLauncher(Launcher):
    """Every context in this process, stepped in turn by one driver (for tests)."""

    remote = False

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


class ForkLauncher(Launcher):
    """Contexts 1..N-1 forked from this process, for the ``local`` transport."""

    def __init__(self, session: "Session") -> None:
        super().__init__(session)
        self.pids: Dict[int, int] = {}
        self.reaped: Dict[int, int] = {}

    def start(self, placement: Placement, spin_us: float) -> Engine:
        from .transport.local import LocalTransport, Mesh, nofile_error
        s = self.session
        n = s.size
        mesh = Mesh(s.computation, n)
        marshal.snapshot_main()
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
                    pid = os.fork()
                except OSError as e:
                    err = fork_error(c, n, e)
                    if err is e:
                        raise
                    raise err from e
                if pid == 0:  # pragma: no cover - runs in the child
                    _child_main(c, n, b, listener, [a, *mine.values()], mesh, placement,
                                spin_us, s.computation)
                self.pids[c] = pid
                mine[c] = a
                spare.clear()
                b.close()
                listener.close()
            eng = Engine(0, n, LocalTransport(0, mine, spin_us, mesh=mesh), placement,
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

    def describe_lost(self, peer: int) -> str:
        pid = self.pids.get(peer)
        if pid is None:
            return "connection closed"
        deadline = time.monotonic() + 1.0
        while True:  # the socket closes an instant before the process can be reaped
            try:
                r, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                return "connection closed"
            if r:
                self.reaped[peer] = status
                return f"its process (pid {pid}) {describe_status(status)}"
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

    def stop(self) -> None:
        # only children not yet reaped: a reaped pid may already be someone else's
        for c, pid in self.pids.items():
            if c not in self.reaped:
                _kill(pid)
                self.reaped[c] = -9


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
        ValueError: unknown transport 'carrier-pigeon'; available: inproc, local
    """
    import importlib
    path = REGISTRY.get(scheme) if isinstance(scheme, str) else None
    if path is None:
        raise ValueError(f"unknown transport {scheme!r}; available: {', '.join(sorted(REGISTRY))}")
    return importlib.import_module(path)


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


def _child_main(ctx: int, n: int, sock: socket.socket, listener: socket.socket,
                inherited: List[socket.socket], mesh: Any, placement: Placement,
                spin_us: float, computation: str) -> None:  # pragma: no cover
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
        from .transport.local import LocalTransport
        eng = Engine(ctx, n, LocalTransport(ctx, {0: sock}, spin_us, mesh=mesh, listener=listener),
                     placement.copy(), computation=computation)
        eng.describe_lost = lambda peer: ""  # the transport's own words say it best here
        _ctx._state.default = eng
        eng.serve_forever()
    except BaseException:
        text = traceback.format_exc()
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


def init(contexts: Optional[int] = None, transport: str = "local", placement: Any = None,
         spin_us: Optional[float] = None) -> Session:
    """Start a computation of ``contexts`` contexts; this process becomes context 0.

    For scripts and notebooks: use it as a context manager, or call
    :func:`shutdown` (it also runs at exit).

    Args:
        contexts: number of contexts, this one included (default: CPU count).
        transport: "local" (processes on this host) or "inproc" (one process).
        placement: a policy name ("round-robin", "random",
            "best-most-recently") or a :class:`macroflow.Placement`.
        spin_us: how long, in microseconds, an idle context polls before it
            sleeps: a finite number >= 0, 0 to sleep at once (default 50, or
            the MACROFLOW_SPIN_US environment variable).

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
        raise RuntimeError("a macroflow computation is already running in this process; "
                           "shut it down first (mf.shutdown())")
    if contexts is None:
        contexts = os.cpu_count() or 1
    if isinstance(contexts, bool) or not isinstance(contexts, int) or contexts < 1:
        raise ValueError(f"contexts must be a positive int; got {contexts!r}")
    module = load_transport(transport)
    from .core.threads import service_setting
    service_setting()  # a bad MACROFLOW_SERVICE is refused before anything starts
    check = getattr(module, "check_room", None)
    if check is not None:
        check(contexts)  # before anything is started
    return Session(contexts, transport, Placement.make(placement), spin_us_setting(spin_us))


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
    from .core.threads import Worker, getcurrent
    if isinstance(getcurrent(), Worker):
        raise RuntimeError("mf.shutdown() was called inside a method: a method cannot end the "
                           "computation it runs in; return, and let the program that started "
                           "it end it")
    for s in list(_sessions):
        if s.in_run and not _exiting:
            raise RuntimeError("mf.shutdown() was called inside the main function of mf.run(): "
                               "return from main instead; mf.run ends the computation then")
        s.close()


_exiting = False


def _shutdown_at_exit() -> None:
    global _exiting
    _exiting = True
    shutdown()


atexit.register(_shutdown_at_exit)


def run(main: Callable[..., Any], *args: Any, contexts: Optional[int] = None, transport: str = "local",
        placement: Any = None, spin_us: Optional[float] = None, **kwargs: Any) -> Any:
    """Run ``main(*args, **kwargs)`` on context 0 of a new computation and return its value.

    If main returns a Future, its value is returned. Everything is torn down
    afterwards, whether main returns or raises.

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
    """
    from .core.future import Future
    session = init(contexts=contexts, transport=transport, placement=placement, spin_us=spin_us)
    session.in_run = True
    try:
        with session:
            result = main(*args, **kwargs)
            if isinstance(result, Future):  # main handed its place on: wait here
                result = result.result()
            return result
    except KeyboardInterrupt:
        print(f"macroflow: interrupted (Ctrl-C); all {session.size} contexts were stopped",
              file=sys.stderr)
        raise
