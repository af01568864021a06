"""Lightweight threads: greenlets that run handlers and park when they wait.

A context runs one OS thread. Its *root* greenlet drives the progress engine;
each method call runs in a :class:`Worker` greenlet taken from a pool, so a
method that waits on a future parks (two stack switches, ~0.6 us) and the
engine goes on serving the context's other objects. A worker that finishes
goes back to the pool, so no call pays for creating a thread.
"""

from __future__ import annotations

from typing import Any, Callable, List, Tuple

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

