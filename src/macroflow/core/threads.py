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

DONE = object()  # a worker finished its task and may be reused
PARKED = object()  # a worker is waiting and will be resumed by a Waiter


class Worker(greenlet.greenlet):
    """A pooled greenlet bound to one engine (context).

    Example:
        >>> # engines create them: engine.spawn(fn, *args)
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
            except greenlet.GreenletExit:
                raise
            except BaseException:  # the engine's own bug: report, keep serving
                import traceback
                traceback.print_exc()
            self.call = None
            task = root.switch(DONE)


class Waiter:
    """One parked worker waiting for one event; wakes at most once.

    Example:
        >>> # w = Waiter(engine, getcurrent()); fut._waiters.append(w); engine.park(w)
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

    Example:
        >>> # pool.get() -> a Worker; pool.put(worker) after it reports DONE
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

