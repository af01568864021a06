"""Lightweight threads: greenlets that run handlers and park when they wait.

A context runs one OS thread. Its *root* greenlet drives the progress engine;
each method call runs in a :class:`Worker` greenlet taken from a pool, so a
method that waits on a future parks (two stack switches, ~0.6 us) and the
engine goes on serving the context's other objects. A worker that finishes
goes back to the pool, so no call pays for creating a thread.

While a method computes without waiting, a *service mechanism* serves the
requests that need no user code (see ``SERVED_WHILE_BUSY`` in
:mod:`macroflow.core.context`): :class:`ServiceTimer` (a timer signal that
serves between two bytecodes of the method), :class:`ServiceThread` (a
thread that serves when the interpreter lets it), or none but :func:`poll`.
"""

from __future__ import annotations

import os
import select
import signal
import sys
import threading
import time
import weakref
from typing import Any, Callable, List, Optional

import greenlet

getcurrent = greenlet.getcurrent

# What error handling around user code must let through: the end of a
# thread (GreenletExit), and Ctrl-C, which ends the program, not one call.
INTERRUPTS = (greenlet.GreenletExit, KeyboardInterrupt)

DONE = object()  # a worker finished its task and may be reused
PARKED = object()  # a worker is waiting and will be resumed by a Waiter


class Worker(greenlet.greenlet):
    """A pooled greenlet bound to one engine (context).

    Switching to it with a task ``[fn, args]`` (or a tuple) runs ``fn(*args)``; when the
    task ends the worker switches back to its root with :data:`DONE` and
    waits there for its next task, so one greenlet serves many calls. The
    engine does this in ``Engine.spawn``.

    Example:
        >>> from greenlet import getcurrent
        >>> w = Worker(engine=None, root=getcurrent())
        >>> w.switch((print, ("first task",))) is DONE
        first task
        True
        >>> w.switch((print, ("second task, same greenlet",))) is DONE
        second task, same greenlet
        True
    """

    engine: Any = None
    call: Any = None  # the invocation it is running, for rtf and deadlock checks

    def __init__(self, engine: Any, root: greenlet.greenlet):
        super().__init__(run=self._loop, parent=root)
        self.engine = engine

    def _loop(self, task: Any) -> None:
        root = self.parent
        while True:
            fn, args = task
            if type(task) is list:
                # the first task reached _loop as greenlet's argument, which
                # stays referenced for as long as the worker lives: empty it,
                # or its arguments (a large array) would never be freed
                task.clear()
            try:
                fn(*args)
            except INTERRUPTS:
                # the engine's root gets it; in one process (inproc) the
                # program may go on, and the call is failed there (see
                # Engine.interrupted)
                self.engine.interrupted_call = self.call
                raise
            except BaseException as e:  # the engine's own bug: report, keep serving
                self.engine.internal_error(self.call, e)
            self.call = None
            # a parked worker must not keep its last task's arguments alive
            # (a large array received in a pooled buffer or a bulk slot would
            # stay taken until the worker's next task)
            task = fn = args = None
            task = root.switch(DONE)


class Waiter:
    """One parked worker waiting for one event; wakes at most once.

    A worker that must wait makes a Waiter, hands it to whatever it waits
    for (a future, a timer) and parks; ``wake(value)`` queues it on the
    engine, which resumes the worker with ``value`` at its next step.

    Example:
        >>> import macroflow as mf
        >>> from macroflow.core.context import current_engine
        >>> with mf.init(contexts=1, transport="inproc"):
        ...     eng, box = current_engine(), {}
        ...     def task():
        ...         box["waiter"] = Waiter(eng, getcurrent())
        ...         box["got"] = eng.park()      # back to the engine until woken
        ...     eng.spawn(task)
        ...     "got" in box                     # parked
        ...     box["waiter"].wake("hello")
        ...     box["waiter"].wake("ignored")    # a waiter wakes at most once
        ...     eng.process()                    # the engine resumes the worker
        ...     box["got"]
        False
        'hello'
    """

    __slots__ = ("engine", "g", "fired", "value")

    def __init__(self, engine: Any, g: greenlet.greenlet):
        self.engine = engine
        self.g = g
        self.fired = False
        self.value: Any = None

    def wake(self, value: Any) -> None:
        if not self.fired:
            self.fired = True
            self.value = value
            self.engine.ready.append(self)


class Pool:
    """Reusable workers of one engine.

    ``get()`` returns an idle worker, or a new one; ``put(worker)`` takes a
    worker back once its task reported :data:`DONE` (at most ``keep`` are
    kept). ``created`` counts the workers ever made.

    Example:
        >>> from greenlet import getcurrent
        >>> pool = Pool(engine=None, root=getcurrent())
        >>> w = pool.get()
        >>> w.switch((len, ("abc",))) is DONE
        True
        >>> pool.put(w)
        >>> pool.get() is w, pool.created
        (True, 1)
    """

    def __init__(self, engine: Any, root: greenlet.greenlet, keep: int = 64):
        self.engine = engine
        self.root = root
        self.keep = keep
        self.free: List[Worker] = []
        self.created = 0

    def get(self) -> Worker:
        if self.free:
            return self.free.pop()
        self.created += 1
        return Worker(self.engine, self.root)

    def put(self, w: Worker) -> None:
        if len(self.free) < self.keep:
            self.free.append(w)

    def close(self) -> None:
        """End the idle workers. A parked greenlet is never collected (its
        frame would have to run): each would keep its engine, and all the
        engine holds (values kept, its objects), as long as the process
        lives, one engine more for every computation run here.

        Example:
            >>> pool = Pool(engine=None, root=getcurrent())
            >>> w = pool.get()
            >>> w.switch((len, ("abc",))) is DONE
            True
            >>> pool.put(w)
            >>> pool.close()
            >>> w.dead, pool.free
            (True, [])
        """
        free, self.free = self.free, []
        me = getcurrent()
        for w in free:
            if w.dead:
                continue
            try:
                w.parent = me  # (it ends back here, whoever closes)
                w.throw(greenlet.GreenletExit)
            except greenlet.error:
                pass  # another thread's: it goes with that thread


# -------------------------------------------------------------------- service
SERVICES = ("signal", "thread", "timer", "poll")
DEFAULT_SERVICE = "signal"


def service_setting(value: Optional[str] = None) -> str:
    """The service mechanism to use: ``value`` if given, else the
    MACROFLOW_SERVICE environment variable, else :data:`DEFAULT_SERVICE`.

    Example:
        >>> service_setting("thread")
        'thread'
        >>> service_setting("pigeon")
        Traceback (most recent call last):
        ...
        ValueError: the service mechanism must be one of signal, thread, timer, poll; got 'pigeon'
    """
    source = "the service mechanism"
    if value is None:
        env = os.environ.get("MACROFLOW_SERVICE")
        value = env or DEFAULT_SERVICE
        if env:
            source = "the MACROFLOW_SERVICE environment variable"
    if value not in SERVICES:
        raise ValueError(f"{source} must be one of {', '.join(SERVICES)}; got {value!r}")
    return value


class Service:
    """Serves a context while user code runs there: this base serves only
    when the user calls :func:`poll`.

    The engine calls ``enter()`` when user code starts (a method, a
    constructor) and ``leave()`` when the engine's own code takes over again
    (the method returns, or calls macroflow): between the two, ``engine.user``
    is True and a subclass may serve, by ``engine.serve_arrived()``, with
    ``engine.serving`` set to the serving thread.

    Example:
        >>> class Eng: user, epoch, undetached = False, 0, ()
        >>> s = Service(Eng())
        >>> s.enter(); s.engine.user, s.engine.epoch
        (True, 1)
        >>> s.leave(); s.engine.user
        False
    """

    name = "poll"

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def enter(self) -> None:
        eng = self.engine
        if eng.undetached:
            eng.kept_copies()  # (see Engine.kept_copies)
        eng.epoch += 1
        eng.user = True  # last: the service may run from here on

    def leave(self) -> None:
        self.engine.user = False

    def run_engine(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run the engine method ``fn`` for user code: ``leave()``, ``fn(*args)``,
        ``enter()`` (not after Ctrl-C: the method is being ended and does not
        go back to user code). The engine's ``_from_user`` is this method.

        Example:
            >>> class Eng: user, epoch, undetached = True, 0, ()
            >>> s = Service(Eng())
            >>> s.run_engine(lambda: s.engine.user), s.engine.user
            (False, True)
        """
        self.leave()
        try:
            r = fn(*args)
        except INTERRUPTS:
            raise
        except BaseException:
            self.enter()
            raise
        self.enter()
        return r

    def run_user(self, fn: Callable[..., Any], args: tuple, kwargs: Optional[dict]) -> Any:
        """Run user code ``fn(*args, **kwargs)`` (a method, a handler): ``enter()``,
        the call, ``leave()`` however it ends; return what it returned.

        Example:
            >>> class Eng: user, epoch, undetached = False, 0, ()
            >>> s = Service(Eng())
            >>> s.run_user(lambda x: (s.engine.user, x), (1,), None), s.engine.user
            ((True, 1), False)
        """
        self.enter()
        try:
            return fn(*args, **kwargs) if kwargs else fn(*args)
        finally:
            self.leave()

    def stop(self) -> None:
        """No more service (the computation ends)."""

    def serve(self) -> int:
        """Serve now, as the thread that calls it; the caller keeps the engine out.
        The CPU time it takes is added to ``engine.service_cpu``."""
        eng = self.engine
        eng.serving = threading.get_ident()
        t = time.thread_time()
        try:
            return eng.serve_arrived()
        finally:
            eng.serving = 0
            eng.service_cpu += time.thread_time() - t


def _take_signal(signum: int, handler: Any) -> Any:
    """Install ``handler`` for ``signum`` with SA_RESTART (system calls other
    than sleeps and waits go on rather than fail with EINTR); returns the
    handler it replaces."""
    previous = signal.signal(signum, handler)
    signal.siginterrupt(signum, False)
    return previous


def _signal_free(signum: int, engine: Any) -> bool:
    """Whether this service may take ``signum``: Python runs handlers in the
    main thread only, and context 0 is the user's process (another context
    is a process of macroflow's own, whatever it inherited). The handler of
    an ended service is free: see :func:`_give_back`."""
    if threading.current_thread() is not threading.main_thread():
        return False
    current = signal.getsignal(signum)
    return current in (signal.SIG_DFL, None) or getattr(engine, "id", 0) != 0 or \
        getattr(getattr(current, "__self__", None), "stopped", False) is True


def _give_back(signum: int, handler: Any, previous: Any) -> None:
    """Undo :func:`_take_signal` when a service ends. Where the signal had no
    handler, the service's own stays, doing nothing: the default would end
    the process should one more signal come (a SIGIO the kernel had already
    sent, a last tick)."""
    if signal.getsignal(signum) is handler and previous not in (None, signal.SIG_DFL):
        signal.signal(signum, previous)


#: signals whose Python handlers the main thread must run as they come
HANDLED_SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1,
                             signal.SIGUSR2, signal.SIGALRM, signal.SIGVTALRM, signal.SIGPROF})


#: packages whose modules (the package and every module in it) are loaded
#: with :data:`HANDLED_SIGNALS` blocked, whoever imports them and whenever:
#: numpy starts its BLAS threads as it loads, scipy its own BLAS's as
#: ``scipy.linalg`` (or another module that links it) loads, and a thread
#: takes the signal mask of the thread that starts it
QUIET_MODULES = frozenset({"numpy", "scipy"})
# module name -> what to call with the module once it has loaded
_when_loaded: dict = {}


def _handled_blocked(fn: Callable[[Any], Any], arg: Any) -> Any:
    """``fn(arg)`` with :data:`HANDLED_SIGNALS` blocked in this thread (and
    in the threads it starts meanwhile, which keep that mask).

    Example:
        >>> _handled_blocked(lambda s: s in signal.pthread_sigmask(signal.SIG_BLOCK, []),
        ...                  signal.SIGTERM)
        True
    """
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, HANDLED_SIGNALS)
    try:
        return fn(arg)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


class QuietFinder:
    """The finder (first in :data:`sys.meta_path`) that has the modules of
    :data:`QUIET_MODULES` loaded with the handled signals blocked, so that
    the threads it starts as it loads never take one: taken by a BLAS
    thread, a SIGTERM did not interrupt the main thread's wait (one to
    ``macroflow run`` waited for the job to end), and its handler ran only
    once that wait was over. It finds nothing itself: it asks the finders
    after it, and wraps the loader's ``exec_module`` of what they find.

    Example:
        >>> any(isinstance(f, QuietFinder) for f in sys.meta_path)  # (import macroflow put it there)
        True
        >>> QuietFinder().find_spec("json") is None
        True
    """

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name.partition(".")[0] not in QUIET_MODULES:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if isinstance(finder, QuietFinder) or find is None:  # (itself, or a twin)
                continue
            spec = find(name, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        run = getattr(loader, "exec_module", None)
        if run is None:
            return spec
        create = getattr(loader, "create_module", None)

        # (an extension module's library, and the threads it starts, load in
        # create_module; a package's __init__ imports them in exec_module)
        def create_module(spec: Any) -> Any:
            return _handled_blocked(create, spec)

        def exec_module(module: Any) -> None:
            _handled_blocked(run, module)
            for hook in _when_loaded.pop(name, ()) if _when_loaded else ():
                hook(module)
        try:
            loader.exec_module = exec_module
            if create is not None:
                loader.create_module = create_module
        except AttributeError:
            pass  # (a loader that takes no attribute: it loads as it would)
        return spec


def install_quiet_finder() -> None:
    """Put a :class:`QuietFinder` first in :data:`sys.meta_path` (once).

    Example:
        >>> install_quiet_finder(); sum(isinstance(f, QuietFinder) for f in sys.meta_path)
        1
    """
    if not any(isinstance(f, QuietFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, QuietFinder())


def when_loaded(name: str, hook: Callable[[Any], None]) -> None:
    """Call ``hook(module)`` once module ``name`` (of a package of :data:`QUIET_MODULES`)
    has loaded: now if it has, else when it does.

    Example:
        >>> seen = []
        >>> when_loaded("numpy", lambda m: seen.append(m.__name__))
        >>> import numpy
        >>> seen
        ['numpy']
    """
    module = sys.modules.get(name)
    if module is not None and not getattr(getattr(module, "__spec__", None), "_initializing", False):
        hook(module)
    else:
        _when_loaded.setdefault(name, []).append(hook)


def numpy() -> Any:
    """numpy, imported the first time macroflow needs it (an array arrived,
    say): a program that never makes an array does not pay for its import,
    which was 60% of ``import macroflow``'s.

    Example:
        >>> numpy().zeros(2).tolist()
        [0.0, 0.0]
    """
    np = sys.modules.get("numpy")
    if np is None:
        import numpy as np
    return np


def start_thread(target: Callable[..., Any], name: str, args: tuple = (),
                 daemon: bool = True) -> threading.Thread:
    """Start a thread of the runtime's that blocks every signal, so that the
    kernel gives a signal sent to the process (Ctrl-C, SIGTERM, a timer's)
    to the main thread, where Python runs its handler at once. Taken by
    another thread, the signal interrupted that thread's wait, not the main
    thread's: its handler waited for the main thread's own wait to end (a
    method's ``time.sleep(30)``: a SIGTERM'd rank was never said to leave).

    Example:
        >>> t = start_thread(lambda: None, "example")
        >>> t.join(); t.name
        'example'
    """
    t = threading.Thread(target=target, args=args, name=name, daemon=daemon)
    # (the thread takes this mask from the one that starts it: no moment
    # when a signal could still reach it)
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
    try:
        t.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
    return t


_live: "weakref.WeakSet[Any]" = weakref.WeakSet()  # services with a thread and a lock


def quiesce(wait: float = 1.0) -> None:
    """Stop every service of this process and wait (``wait`` seconds at most)
    for a serve in progress to end: before MPI ends in a process that is
    leaving, since a serve calls into MPI, and MPI called after its end
    prints an error and may abort.

    Example:
        >>> quiesce()   # no service here: nothing to do
    """
    for t in list(_live):
        t.stopped = True
        if t.lock.acquire(timeout=wait):
            t.lock.release()


_forking: List[Any] = []  # the locks _before_fork holds
_fork_keeps: List[bool] = []  # whether _before_fork keeps a Ctrl-C back
_fork_held: List[int] = []  # a Ctrl-C it kept


def _hold_interrupt(signum: int, frame: Any) -> None:
    _fork_held.append(signum)


_guarded: List[bool] = []  # non-empty while fork() forks: it keeps Ctrl-C itself


def fork(interrupted: Optional[Callable[[int], Any]] = None) -> int:
    """``os.fork()`` for the runtime's own processes. A Ctrl-C meanwhile is
    kept, and raised in the parent once the fork has returned (raised in a
    fork hook, Python drops it: the program went on), after
    ``interrupted(pid)`` (to note the child, which was made); the child
    starts with SIGINT ignored (Ctrl-C is context 0's to handle), so it never
    unwinds the parent's stack, whatever comes before it takes over.

    Example:
        >>> pid = fork()
        >>> if pid == 0:
        ...     os._exit(0 if signal.getsignal(signal.SIGINT) is signal.SIG_IGN else 1)
        >>> os.waitpid(pid, 0)[1]
        0
    """
    main = threading.current_thread() is threading.main_thread()
    came: List[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: came.append(signum)) \
        if main else None
    _guarded.append(True)
    pid = -1
    try:
        pid = os.fork()
    finally:
        _guarded.pop()
        if pid == 0:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        elif main and previous is not None:
            signal.signal(signal.SIGINT, previous)
    if pid == 0:
        return 0  # (what came before the fork is the parent's to raise)
    if came:
        if interrupted is not None:
            interrupted(pid)
        if previous is signal.default_int_handler:
            raise KeyboardInterrupt
        if callable(previous):
            previous(signal.SIGINT, None)
    return pid


def _before_fork() -> None:
    # A child forked by user code must not inherit a lock held by a serving
    # thread. A Ctrl-C while it waits for one would be lost (Python reports,
    # and drops, what a fork hook raises) and would leave locks taken that
    # the parent then releases: it is kept, and raised once the fork returns
    # (the runtime's own forks keep it themselves: see fork). What is kept
    # has lists of its own: a Ctrl-C pending as the handler is set runs it
    # at once, before anything else here.
    keep = not _guarded and threading.current_thread() is threading.main_thread() and \
        signal.getsignal(signal.SIGINT) is signal.default_int_handler
    _fork_keeps.append(keep)
    if keep:
        signal.signal(signal.SIGINT, _hold_interrupt)
    for t in list(_live):
        t.lock.acquire()
        _forking.append(t)


def _after_fork(child: bool) -> None:
    taken, _forking[:] = _forking[:], []
    keeps, _fork_keeps[:] = _fork_keeps[:], []
    for t in taken:
        t.lock.release()
    if any(keeps):
        # a Ctrl-C the fork held back is handled now, by _hold_interrupt
        # (this call runs what is pending), not after the handler is back
        signal.pthread_sigmask(signal.SIG_BLOCK, ())
        signal.signal(signal.SIGINT, signal.default_int_handler)
        held, _fork_held[:] = bool(_fork_held), []
        if not child and held:
            # raised here, it would be dropped as the hook's own error: a
            # moment later, from another thread, it reaches the fork's caller
            # (a signal, not _thread.interrupt_main, which would wait for a
            # lock the main thread waits on to be taken or time out)
            threading.Timer(0.05, signal.pthread_kill,
                            (threading.main_thread().ident, signal.SIGINT)).start()


def _after_fork_parent() -> None:
    _after_fork(False)


def _after_fork_child() -> None:
    _after_fork(True)
    for t in list(_live):
        t.stopped = True  # the thread is not in the child
    _live.clear()


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_parent,
                    after_in_child=_after_fork_child)


def _keep_interrupts(previous: Callable[[Any], Any]) -> Callable[[Any], Any]:
    # Python drops (prints and forgets) what a finalizer, a weakref callback
    # or a fork hook raises. A Ctrl-C that lands in one -- a future released
    # by the garbage collector, say: about one Ctrl-C in twenty during
    # `bench micro` -- was lost and the program ran on. It is sent again a
    # moment later, from another thread (raised here, it would be dropped
    # too), where the main thread takes it as it would have the first.
    def hook(unraisable: Any) -> None:
        if unraisable.exc_type is KeyboardInterrupt and \
                threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            threading.Timer(0.05, signal.pthread_kill,
                            (threading.main_thread().ident, signal.SIGINT)).start()
            return
        previous(unraisable)
    hook.macroflow = True  # type: ignore[attr-defined]
    return hook


if not getattr(sys.unraisablehook, "macroflow", False):
    sys.unraisablehook = _keep_interrupts(sys.unraisablehook)


class ServiceThread(Service):
    """A thread serves the context while user code runs there.

    The thread wakes now and then (every 50 ms at most, more often while
    user code starts and ends) to see whether the same user code has been
    running since it last looked; once it has, and until it ends, the
    thread sleeps on the transport's descriptor and serves each arrival,
    under a lock that ``leave()`` takes, so the thread and the engine never
    run at once. It never watches the descriptor while the engine does,
    which would wake two threads for every message. It gets the interpreter
    at once while the method sleeps or runs numpy code that releases it, but
    only after the switch interval (5 ms) while the method runs Python, and
    again after each system call of its own: about 10 ms.

    Example:
        >>> class Eng:
        ...     user, epoch, serving, closed, service_cpu, undetached = False, 0, 0, False, 0.0, ()
        ...     def serve_arrived(self): self.got += 1; return 0
        >>> eng = Eng(); eng.got = 0
        >>> r, w = os.pipe()
        >>> t = ServiceThread(eng, r, period=0.001)
        >>> t.enter(); time.sleep(0.05); t.leave()   # the method sleeps: it is served
        >>> eng.got > 0
        True
        >>> t.stop(); os.close(r); os.close(w)
    """

    name = "thread"
    IDLE_MAX = 0.05  # the longest it sleeps while the context is idle
    LOOK = 0.005  # how soon it looks again once user code has started

    def __init__(self, engine: Any, fd: int, period: float = LOOK) -> None:
        super().__init__(engine)
        self.period = period
        self.lock = threading.Lock()
        self.busy = False  # the thread holds the lock to serve
        self.stopped = False
        self.ep = select.epoll()
        self.ep.register(fd, select.EPOLLIN)
        _live.add(self)
        self.thread = start_thread(self._run, f"macroflow-service-{getattr(engine, 'id', '')}")

    def leave(self) -> None:
        self.engine.user = False  # first: the thread starts no serving from here on
        if self.busy:  # then wait out a serve in progress
            self.lock.acquire()
            self.lock.release()

    def _run(self) -> None:
        eng = self.engine
        seen = -1
        nap = self.period
        watching = False
        waiting = False  # frames the descriptor does not show wait (Transport.nap)
        try:
            while not self.stopped and not eng.closed:
                if watching:
                    if not waiting:
                        self.ep.poll(self.IDLE_MAX)
                else:
                    time.sleep(nap)
                e = eng.epoch
                if not eng.user:
                    # idle, or in its own code: look less and less often (a
                    # look while the engine runs Python costs it a switch)
                    seen, nap, watching = e, min(2 * nap, self.IDLE_MAX), False
                    continue
                if e != seen:  # user code started since the last look: look again soon
                    seen, nap, watching = e, self.period, False
                    continue
                with self.lock:
                    self.busy = True  # before it looks at eng.user: see leave()
                    try:
                        if eng.user and eng.epoch == e and not self.stopped:
                            self.serve()
                            watching = True
                            flag = getattr(getattr(eng, "transport", None), "nap", None)
                            waiting = flag is not None and flag(True)
                    finally:
                        self.busy = False
        finally:
            self.ep.close()

    def stop(self) -> None:
        self.stopped = True
        _live.discard(self)


class ServiceSignal(Service):
    """The kernel interrupts user code when a request arrives (SIGIO), and
    the handler serves between two bytecodes of the method.

    Two samplers decide when arrivals are signalled. A CPU-time timer
    (``ITIMER_VIRTUAL``, SIGVTALRM), armed by ``enter()`` unless it runs
    already, fires in the method's own thread once the process has computed
    for ``CPU_LOOK`` seconds; a watcher thread samples every few
    milliseconds (every 50 ms at most while the context idles). When user
    code is running at the timer's tick, or at two of the watcher's samples
    in a row, the sampler asks the transport to signal arrivals
    (``signal_arrivals``); when the engine's own code runs again, the first
    signal or sample that sees it turns them off, so the engine's own
    traffic never pays for a signal. The timer is what starts signals while
    the method computes: a thread that wakes from a sleep may wait for the
    interpreter for as long as the method keeps making short system calls
    (each one hands the interpreter back before the waiting thread runs).
    The watcher starts them while the method sleeps or waits, which uses no
    CPU time.
    The handler serves at once during Python, when the current numpy
    operation ends, and in the middle of ``time.sleep`` (which then sleeps
    on). System calls other than sleeps and waits restart (SA_RESTART), and
    a single operation in C may hold the interpreter for long: the watcher
    also serves, every ``FALLBACK`` seconds while user code runs, whatever
    the handler could not. Both serve under one lock that ``leave()`` takes.

    Example:
        >>> class Transport:
        ...     def signal_arrivals(self, on, again=False): return True
        >>> class Eng:
        ...     id, user, epoch, serving, closed, transport = 1, False, 0, 0, False, Transport()
        ...     service_cpu, undetached = 0.0, ()
        ...     def serve_arrived(self): self.got += 1; return 0
        >>> eng = Eng(); eng.got = 0
        >>> s = ServiceSignal(eng, look=0.001)
        >>> s.enter(); os.kill(os.getpid(), signal.SIGIO); s.leave()   # a request came
        >>> eng.got > 0
        True
        >>> s.stop()
    """

    name = "signal"
    LOOK = 0.005  # how often the watcher samples while user code starts and ends
    IDLE_MAX = 0.05  # ... and at most how seldom while the context idles
    FALLBACK = 0.05  # how often it serves itself while user code runs
    HANDOVER = 0.005  # the longest the handler waits for the watcher's serve to end
    CPU_LOOK = 0.01  # CPU seconds of the process before the timer's first look

    def __init__(self, engine: Any, look: float = LOOK) -> None:
        super().__init__(engine)
        self.look = look
        self.lock = threading.Lock()
        self.busy = False  # the watcher holds the lock to serve
        self.stopped = False
        self.signalling = False
        self.handling = False
        self.signals = 0  # signals (SIGIO, timer ticks) handled while user code ran
        self.pid = os.getpid()
        self.handler = self._on_signal  # one bound method: getsignal() returns this very object
        self.previous = _take_signal(signal.SIGIO, self.handler)
        # the CPU-time timer, where SIGVTALRM is free (else the watcher alone)
        self.armed = False
        self.ticker: Any = None
        if _signal_free(signal.SIGVTALRM, engine):
            self.ticker = self._on_tick
            self.previous_tick = _take_signal(signal.SIGVTALRM, self.ticker)
        _live.add(self)
        self.thread = start_thread(self._watch, f"macroflow-service-{getattr(engine, 'id', '')}")

    def enter(self) -> None:
        if not self.armed and self.ticker is not None and not self.stopped:
            if signal.getsignal(signal.SIGVTALRM) is self.ticker:
                self.armed = True
                signal.setitimer(signal.ITIMER_VIRTUAL, self.CPU_LOOK)
            else:
                self.ticker = None  # user code took SIGVTALRM: the watcher alone
        eng = self.engine
        if eng.undetached:
            eng.kept_copies()  # (see Engine.kept_copies)
        eng.epoch += 1
        eng.user = True  # last: the service may run from here on

    def leave(self) -> None:
        self.engine.user = False  # first: nobody starts serving from here on
        if self.busy:  # then wait out the watcher's serve in progress
            self.lock.acquire()
            self.lock.release()

    def run_engine(self, fn: Callable[..., Any], *args: Any) -> Any:
        # Service.run_engine with leave() and enter()'s common case inline:
        # every call, wait and reply of user code comes through here
        eng = self.engine
        eng.user = False
        if self.busy:
            self.lock.acquire()
            self.lock.release()
        try:
            r = fn(*args)
        except INTERRUPTS:
            raise
        except BaseException:
            self.enter()
            raise
        if self.armed or self.ticker is None or self.stopped:  # the timer needs nothing
            if eng.undetached:
                eng.kept_copies()
            eng.epoch += 1
            eng.user = True
        else:
            self.enter()
        return r

    def run_user(self, fn: Callable[..., Any], args: tuple, kwargs: Optional[dict]) -> Any:
        # Service.run_user with enter()'s common case and leave() inline: every
        # method and remote action runs through here
        eng = self.engine
        if self.armed or self.ticker is None or self.stopped:
            if eng.undetached:
                eng.kept_copies()
            eng.epoch += 1
            eng.user = True
        else:
            self.enter()
        try:
            return fn(*args, **kwargs) if kwargs else fn(*args)
        finally:
            eng.user = False
            if self.busy:
                self.lock.acquire()
                self.lock.release()

    def _off(self) -> None:
        """The engine's own code runs: turn signals off, unless the watcher
        is busy (it turns them off itself at its next sample)."""
        if self.lock.acquire(blocking=False):
            try:
                if self.signalling and not self.engine.user and not self.stopped:
                    self._signals(False)
            finally:
                self.lock.release()

    def _on_tick(self, signum: int, frame: Any) -> None:
        if self.handling or os.getpid() != self.pid:
            return
        self.armed = False
        if self.stopped:
            return
        if not self.engine.user:
            if self.signalling:
                self._off()
            return  # enter() arms the timer again
        self._serve_here(start=True)  # and what came before signals were on
        # look again later: what a signal's handler could not serve
        self.armed = True
        signal.setitimer(signal.ITIMER_VIRTUAL, self.FALLBACK)

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.stopped or self.handling or os.getpid() != self.pid:
            return  # the computation ended, or a forked child
        eng = self.engine
        if not eng.user:
            # the engine's own code runs: it serves itself. A signal while
            # none are asked for comes from a connection made as they were
            # turned off: turn them off again, there too
            if not self.signalling:
                eng.transport.signal_arrivals(False, again=True)
            else:
                self._off()
            return
        self._serve_here(start=False)

    def _serve_here(self, start: bool) -> None:
        """Serve from a signal's handler, in the thread that runs user code;
        ``start`` also turns arrival signals on."""
        self.signals += 1
        self.handling = True
        try:
            # waiting here hands the interpreter to the watcher, if it serves
            if self.lock.acquire(timeout=self.HANDOVER):
                try:
                    if self.engine.user and not self.stopped:
                        if start and not self.signalling:
                            self._signals(True)
                        self.serve()
                finally:
                    self.lock.release()
        finally:
            self.handling = False

    def _signals(self, on: bool) -> None:
        # under the lock
        if on and signal.getsignal(signal.SIGIO) is not self.handler:
            return  # user code took SIGIO: the watcher serves alone
        self.signalling = on
        self.engine.transport.signal_arrivals(on)

    def _watch(self) -> None:
        eng = self.engine
        nap = self.look
        samples = 0  # in a row, with user code running
        while not self.stopped and not eng.closed:
            time.sleep(nap)
            if eng.user:
                samples += 1
                if samples < 2:
                    nap = self.look
                    continue
                with self.lock:
                    self.busy = True  # before it looks at eng.user: see leave()
                    try:
                        if eng.user and not self.stopped:
                            if not self.signalling:
                                self._signals(True)
                            elif signal.getsignal(signal.SIGIO) is not self.handler:
                                self._signals(False)  # user code took SIGIO: theirs now
                            self.serve()  # what came before, and what no signal could reach
                    finally:
                        self.busy = False
                nap = self.FALLBACK
            else:
                samples = 0
                if self.signalling:
                    with self.lock:
                        if not eng.user and not self.stopped:
                            self._signals(False)
                    nap = self.look
                else:
                    nap = min(2 * nap, self.IDLE_MAX)

    def stop(self) -> None:
        if self.stopped:
            return
        self.stopped = True
        _live.discard(self)
        if os.getpid() != self.pid:
            return
        with self.lock:
            if self.signalling:
                self.signalling = False
                try:
                    self.engine.transport.signal_arrivals(False)
                except Exception:
                    pass  # closed already
        _give_back(signal.SIGIO, self.handler, self.previous)
        if self.ticker is not None:
            if self.armed and signal.getsignal(signal.SIGVTALRM) is self.ticker:
                signal.setitimer(signal.ITIMER_VIRTUAL, 0)
            self.armed = False
            _give_back(signal.SIGVTALRM, self.ticker, self.previous_tick)
        self.engine = None  # the handler may stay: it keeps no computation alive


class ServiceTimer(Service):
    """A timer signal (SIGALRM) serves the context while user code runs.

    ``enter()`` starts a periodic timer unless one runs already; the first
    tick that finds the engine's own code running stops it, so a stream of
    short methods costs about one tick and two ``setitimer`` calls per
    ``period``, and an idle context nothing. A tick that finds user code
    running serves between two bytecodes of the method (or interrupts
    ``time.sleep``, which then sleeps on). It ticks every ``period`` while it
    has served something in the last ``HOLD`` seconds, else twice as far
    apart each time, up to ``period_max``. Each tick costs the method tens
    of microseconds (a signal, a look at the transport, caches lost), so the
    period trades latency for speed: 5 ms gives a median wait of about 3 ms.

    Example:
        >>> class Eng:
        ...     user, epoch, serving, service_cpu, undetached = False, 0, 0, 0.0, ()
        ...     def serve_arrived(self): self.got += 1; return 0
        >>> eng = Eng(); eng.got = 0
        >>> s = ServiceTimer(eng, period=0.001)
        >>> s.enter(); time.sleep(0.05); s.leave()   # the method sleeps: it is served
        >>> eng.got > 0
        True
        >>> s.stop()
    """

    name = "timer"
    HOLD = 0.05  # it ticks every period for this long after it last served

    def __init__(self, engine: Any, period: float = 0.005, period_max: float = 0.02) -> None:
        super().__init__(engine)
        self.period = period
        self.period_max = period_max
        self.interval = period
        self.last = 0.0  # when it last served something
        self.armed = False
        self.ticking = False
        self.stopped = False
        self.signals = 0  # ticks while user code ran
        self.pid = os.getpid()
        self.handler = self._tick  # one bound method: getsignal() returns this very object
        self.previous = _take_signal(signal.SIGALRM, self.handler)

    def enter(self) -> None:
        if not self.armed and not self.stopped:
            if signal.getsignal(signal.SIGALRM) is self.handler:
                self.armed = True
                signal.setitimer(signal.ITIMER_REAL, self.interval, self.interval)
            else:
                self.stopped = True  # user code took SIGALRM: it is theirs now
        eng = self.engine
        if eng.undetached:
            eng.kept_copies()
        eng.epoch += 1
        eng.user = True

    def _tick(self, signum: int, frame: Any) -> None:
        if self.ticking or self.stopped or os.getpid() != self.pid:
            return  # a tick during a tick, the computation ended, or a forked child
        eng = self.engine
        if not eng.user:
            # the engine's own code runs (it serves itself); enter() starts again
            self.armed = False
            self.interval = self.period
            signal.setitimer(signal.ITIMER_REAL, 0)
            return
        self.signals += 1
        self.ticking = True
        try:
            now = time.monotonic()
            if self.serve():
                self.last = now
            interval = self.period if now - self.last < self.HOLD else \
                min(2 * self.interval, self.period_max)
            if interval != self.interval and self.armed:
                self.interval = interval
                signal.setitimer(signal.ITIMER_REAL, interval, interval)
        finally:
            self.ticking = False

    def stop(self) -> None:
        if self.stopped and not self.armed:
            return
        self.stopped = True
        self.armed = False
        if os.getpid() == self.pid and signal.getsignal(signal.SIGALRM) is self.handler:
            signal.setitimer(signal.ITIMER_REAL, 0)
            _give_back(signal.SIGALRM, self.handler, self.previous)
            self.engine = None


def start_service(engine: Any, name: Optional[str] = None) -> Service:
    """The service mechanism ``name`` (see :func:`service_setting`) for ``engine``.

    Signals need the engine in the main thread and the signal unused by
    anyone else (in context 0, the user's process; the other contexts are
    processes of their own) and, for ``signal``, a transport that can signal
    arrivals; where they cannot be had, the thread serves instead.

    Example:
        >>> class Eng:
        ...     id, user, epoch, serving, transport = 0, False, 0, 0, None
        >>> type(start_service(Eng(), "poll")).__name__
        'Service'
    """
    name = service_setting(name)
    if name == "poll":
        return Service(engine)
    transport = getattr(engine, "transport", None)
    if name == "timer" and _signal_free(signal.SIGALRM, engine):
        return ServiceTimer(engine)
    # a transport that has signal_arrivals says whether it can (with False:
    # asking for no signals changes nothing)
    if name == "signal" and hasattr(transport, "signal_arrivals") and \
            _signal_free(signal.SIGIO, engine) and transport.signal_arrivals(False):
        return ServiceSignal(engine)
    fd = transport.fileno() if transport is not None else None
    return Service(engine) if fd is None else ServiceThread(engine, fd)


def poll() -> int:
    """Serve the requests that have arrived for this context and need no
    user code (value requests, releases, gets and puts, ``thread="now"``
    remote service requests); in a method, calls and everything else stay
    queued for the engine. Returns how many were served; when nothing is
    pending it is a quick look. In main (context 0's program, which is
    served only while it waits) it serves what a wait would: remote service
    requests run inline or in new threads, and calls to this context's
    objects, once each. In an SPMD run's function (or a remote action) it is
    Tulip's Poll: the remote actions and calls that have arrived run too,
    before it returns.

    A context serves these by itself while a method computes (see the
    guide's section on service while a context computes); a compute loop
    that wants them served at points of its choosing calls this.

    Example:
        >>> import macroflow as mf
        >>> @mf.persistent
        ... class Solver:
        ...     def run(self, steps):
        ...         total = 0
        ...         for i in range(steps):
        ...             total += i          # one step of the computation
        ...             mf.poll()           # serve requests that need no user code
        ...         return total
        >>> with mf.init(contexts=2, transport="inproc"):
        ...     Solver.create(on=1).run(1000).result()
        499500
    """
    from .context import current_engine
    return current_engine().poll_user()
