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
import threading
import time
import weakref
from typing import Any, Callable, List, Optional, Tuple

import greenlet

getcurrent = greenlet.getcurrent

# What error handling around user code must let through: the end of a
# thread (GreenletExit), and Ctrl-C, which ends the program, not one call.
INTERRUPTS = (greenlet.GreenletExit, KeyboardInterrupt)

DONE = object()  # a worker finished its task and may be reused
PARKED = object()  # a worker is waiting and will be resumed by a Waiter


class Worker(greenlet.greenlet):
    """A pooled greenlet bound to one engine (context).

    Switching to it with a task ``(fn, args)`` runs ``fn(*args)``; when the
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

    def _loop(self, task: Tuple[Callable[..., Any], tuple]) -> None:
        root = self.parent
        while True:
            fn, args = task
            try:
                fn(*args)
            except INTERRUPTS:
                raise  # the engine's root gets it
            except BaseException as e:  # the engine's own bug: report, keep serving
                self.engine.internal_error(self.call, e)
            self.call = None
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


# -------------------------------------------------------------------- service
SERVICES = ("thread+timer", "thread", "timer", "poll")
DEFAULT_SERVICE = "thread+timer"
SERVICE_PERIOD = 0.001  # seconds between two looks at the transport while requests come
SERVICE_PERIOD_MAX = 0.008  # ... and while none come: the timer backs off to this


def service_setting(value: Optional[str] = None) -> str:
    """The service mechanism to use: ``value`` if given, else the
    MACROFLOW_SERVICE environment variable, else :data:`DEFAULT_SERVICE`.

    Example:
        >>> service_setting("thread")
        'thread'
        >>> service_setting("pigeon")
        Traceback (most recent call last):
        ...
        ValueError: the service mechanism must be one of thread+timer, thread, timer, poll; got 'pigeon'
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
        >>> class Eng: user, epoch = False, 0
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
        eng.epoch += 1
        eng.user = True  # last: the service may run from here on

    def leave(self) -> None:
        self.engine.user = False

    def stop(self) -> None:
        """No more service (the computation ends)."""

    def serve(self) -> int:
        """Serve now, as the thread that calls it; the caller keeps the engine out."""
        eng = self.engine
        eng.serving = threading.get_ident()
        try:
            return eng.serve_arrived()
        finally:
            eng.serving = 0


class Ticker:
    """A timer signal (SIGALRM) that serves ``service`` while user code runs.

    ``arm()`` (from ``enter()``) starts a one-shot timer of ``period``
    seconds unless one is armed already, so a stream of short methods costs
    one ``setitimer`` per period, and an idle context nothing. When it fires
    and user code still runs, the handler serves between two bytecodes of
    the method (or interrupts ``time.sleep``, which then sleeps on), unless
    ``lock`` is taken (a thread serves), and arms the timer again: after
    ``period`` if it served something, else after twice as long as the last
    time, up to ``period_max`` (a method that nobody asks anything costs
    little). System calls other than sleeps and waits restart (SA_RESTART).

    Python runs signal handlers in the main thread only: :func:`start_service`
    uses a Ticker where the engine runs there and SIGALRM is free; should
    user code take SIGALRM, the ticker stops.

    Example:
        >>> class Eng:
        ...     user, epoch, serving = False, 0, 0
        ...     def serve_arrived(self): self.got += 1; return 0
        >>> eng = Eng(); eng.got = 0
        >>> service = Service(eng)
        >>> t = Ticker(service, period=0.001)
        >>> t.arm(); service.enter(); time.sleep(0.05); service.leave()   # the method sleeps
        >>> eng.got > 0
        True
        >>> t.stop()
    """

    HANDOVER = 0.005  # the longest the handler waits for a thread that serves

    def __init__(self, service: Service, period: float = SERVICE_PERIOD,
                 lock: Optional[Any] = None, period_max: float = SERVICE_PERIOD_MAX) -> None:
        self.service = service
        self.period = period
        self.period_max = period_max
        self.interval = period
        self.lock = lock
        self.armed = False
        self.stopped = False
        self.pid = os.getpid()
        self.handler = self._tick  # one bound method: getsignal() returns this very object
        self.previous = signal.signal(signal.SIGALRM, self.handler)
        signal.siginterrupt(signal.SIGALRM, False)

    def arm(self) -> None:
        if self.armed or self.stopped:
            return
        if signal.getsignal(signal.SIGALRM) is self.handler:
            self.armed = True
            signal.setitimer(signal.ITIMER_REAL, self.interval)
        else:
            self.stopped = True  # user code took SIGALRM: it is theirs now

    def _tick(self, signum: int, frame: Any) -> None:
        self.armed = False
        eng = self.service.engine
        if not eng.user or eng.serving or self.stopped or os.getpid() != self.pid:
            self.interval = self.period  # the next user code starts afresh
            return  # the engine's own code runs (it serves itself), or a forked child
        served = 0
        lock = self.lock
        if lock is None:
            served = self.service.serve()
        elif lock.acquire(timeout=self.HANDOVER):
            # Waiting here hands the interpreter to a thread that serves
            # (it may hold the lock while it waits for the interpreter, which
            # the method's Python would hold for a switch interval, 5 ms).
            try:
                if eng.user:
                    served = self.service.serve()
            finally:
                lock.release()
        self.interval = self.period if served else min(2 * self.interval, self.period_max)
        if eng.user:
            self.arm()

    def stop(self) -> None:
        if self.stopped and self.armed is None:
            return
        self.stopped = True
        self.armed = None  # type: ignore[assignment]
        if os.getpid() == self.pid and signal.getsignal(signal.SIGALRM) is self.handler:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self.previous if self.previous is not None
                          else signal.SIG_DFL)


class ServiceTimer(Service):
    """Service by a timer signal alone (see :class:`Ticker`).

    Example:
        >>> class Eng:
        ...     user, epoch, serving = False, 0, 0
        ...     def serve_arrived(self): self.got += 1; return 0
        >>> eng = Eng(); eng.got = 0
        >>> s = ServiceTimer(eng, period=0.001)
        >>> s.enter(); time.sleep(0.05); s.leave()
        >>> eng.got > 0
        True
        >>> s.stop()
    """

    name = "timer"

    def __init__(self, engine: Any, period: float = SERVICE_PERIOD) -> None:
        super().__init__(engine)
        self.ticker = Ticker(self, period)

    def enter(self) -> None:
        if not self.ticker.armed:
            self.ticker.arm()
        eng = self.engine
        eng.epoch += 1
        eng.user = True

    def stop(self) -> None:
        self.ticker.stop()


_live_threads: "weakref.WeakSet[ServiceThread]" = weakref.WeakSet()


def _before_fork() -> None:
    # a child forked by user code must not inherit a lock held by a serving thread
    for t in list(_live_threads):
        t.lock.acquire()


def _after_fork_parent() -> None:
    for t in list(_live_threads):
        if t.lock.locked():
            t.lock.release()


def _after_fork_child() -> None:
    for t in list(_live_threads):
        t.stopped = True  # the thread is not in the child
        if t.lock.locked():
            t.lock.release()
    _live_threads.clear()


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_parent,
                    after_in_child=_after_fork_child)


class ServiceThread(Service):
    """A thread serves the context while user code runs there.

    The thread wakes now and then (every 50 ms at most, more often while
    user code starts and ends) to see whether the same user code has been
    running since it last looked; once it has, and until it ends, the
    thread sleeps on the transport's descriptor and serves each arrival,
    under a lock that ``leave()`` takes, so the thread and the engine never
    run at once. It gets the interpreter at once while the method sleeps or
    runs numpy code that releases it, and within the switch interval (5 ms)
    while the method runs Python. With ``timer``, a :class:`Ticker` serves
    during Python as well. It never watches the descriptor while the engine
    does, which would wake two threads for every message.

    Example:
        >>> class Eng:
        ...     user, epoch, serving, closed = False, 0, 0, False
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

    def __init__(self, engine: Any, fd: int, period: float = LOOK,
                 timer: bool = False) -> None:
        super().__init__(engine)
        self.period = period
        self.lock = threading.Lock()
        self.stopped = False
        self.ticker = Ticker(self, lock=self.lock) if timer else None
        if timer:
            self.name = "thread+timer"
        self.ep = select.epoll()
        self.ep.register(fd, select.EPOLLIN)
        _live_threads.add(self)
        self.thread = threading.Thread(target=self._run, daemon=True,
                                       name=f"macroflow-service-{getattr(engine, 'id', '')}")
        self.thread.start()

    def enter(self) -> None:
        ticker = self.ticker
        if ticker is not None and not ticker.armed:
            ticker.arm()
        eng = self.engine
        eng.epoch += 1
        eng.user = True

    def leave(self) -> None:
        # first: neither the thread nor the ticker starts serving from here on
        self.engine.user = False
        lock = self.lock
        lock.acquire()  # then wait out a serve in progress
        lock.release()

    def _run(self) -> None:
        eng = self.engine
        seen = -1
        nap = self.period
        watching = False
        try:
            while not self.stopped and not eng.closed:
                if watching:
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
                    if eng.user and eng.epoch == e and not self.stopped:
                        self.serve()
                        watching = True
        finally:
            self.ep.close()

    def stop(self) -> None:
        self.stopped = True
        _live_threads.discard(self)
        if self.ticker is not None:
            self.ticker.stop()


def start_service(engine: Any, name: Optional[str] = None) -> Service:
    """The service mechanism ``name`` (see :func:`service_setting`) for ``engine``.

    The timer needs the engine to run in the main thread with SIGALRM
    unused by anyone else (in context 0, the user's process; the other
    contexts are processes of their own); where it is not, the thread
    serves alone.

    Example:
        >>> class Eng:
        ...     id, user, epoch, serving, transport = 0, False, 0, 0, None
        >>> type(start_service(Eng(), "poll")).__name__
        'Service'
    """
    name = service_setting(name)
    if name == "poll":
        return Service(engine)
    timer = "timer" in name and threading.current_thread() is threading.main_thread() and (
        signal.getsignal(signal.SIGALRM) in (signal.SIG_DFL, None) or getattr(engine, "id", 0) != 0)
    fd = engine.transport.fileno() if getattr(engine, "transport", None) is not None else None
    if name == "timer" or fd is None:
        return ServiceTimer(engine) if timer else Service(engine)
    return ServiceThread(engine, fd, timer=timer)


def poll() -> int:
    """Serve the requests that have arrived for this context and need no
    user code (value requests, releases, ``thread="now"`` remote service
    requests); calls and everything else stay queued for the engine. Returns
    how many were served; when nothing is pending it is a quick look.

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
    return current_engine().poll()
