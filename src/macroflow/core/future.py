"""Futures: the value of a call that may not have been computed yet.

A :class:`Future` names its value by a computation tag (the issuing context
and a counter, Mentat's tag) and by its *home*, the context that will hold the
value. Nothing is sent to the holder of a future until someone needs the value:
passing the future to another call adds an arc (the home sends the value
straight to the consumer); ``result()`` asks the home for a copy.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Tuple


PENDING, FINISHED = 0, 1

FutureId = Tuple[int, int]


class Future:
    """The eventual result of a call; every call returns one at once.

    Only strict use blocks: :meth:`result`, :func:`macroflow.gather`,
    :func:`macroflow.wait`. Pass a future as an argument to another call and
    the value goes from its producer to the consumer without passing through
    the caller.

    Example:
        >>> import macroflow as mf
        >>> @mf.regular
        ... class Math:
        ...     def square(self, x):
        ...         return x * x
        >>> with mf.init(contexts=2, transport="inproc"):
        ...     f = Math().square(7)
        ...     f.result(), f.done(), f.exception()
        (49, True, None)
    """

    __slots__ = ("_engine", "_fid", "_home", "_target", "_state", "_value", "_exc",
                 "_asked", "_waiters", "_callbacks", "_escaped", "_site", "_eager", "_ready_remote", "_arcs",
                 "_big",
                 "__weakref__")

    def __init__(self, engine: Any, fid: FutureId, home: int, target: Any = None, site: Any = None):
        self._engine = engine
        self._fid = fid
        self._home = home
        self._target = target  # object id of a persistent call, for deadlock checks
        self._state = PENDING
        self._value: Any = None
        self._exc: Optional[BaseException] = None
        self._asked = False
        self._waiters: List[Any] = []
        self._callbacks: List[Callable[["Future"], Any]] = []
        self._escaped = False
        self._site = site  # the call site: its label, and how its futures get used
        self._eager = False  # the home sends the value unasked (learned strict use)
        self._ready_remote = False  # eager, but too large: the home said it is ready
        self._arcs = 0  # calls it was passed to as an argument (they pull its value)
        self._big = False  # its value was large: release it at once, not in a batch

    # -- the public surface ------------------------------------------------
    def done(self) -> bool:
        """True once the value (or an exception) has arrived here. Never blocks.

        Note that a future nobody has asked for stays not done here even after
        its producer finished: call :meth:`result` or :func:`macroflow.wait`.

        Example:
            >>> import macroflow as mf
            >>> @mf.regular
            ... class Math:
            ...     def square(self, x): return x * x
            >>> with mf.init(contexts=2, transport="inproc"):
            ...     f = Math().square(3)
            ...     f.done()             # nobody has asked for the value yet
            ...     f.result()
            ...     f.done()
            False
            9
            True
        """
        return self._state == FINISHED

    def result(self, timeout: Optional[float] = None) -> Any:
        """Wait for the value and return it; re-raise the call's exception.

        A remote exception keeps its type and message; the remote traceback is
        its ``__cause__``. ``timeout`` (seconds) raises
        :class:`macroflow.TimeoutError` without cancelling the call.

        Example:
            >>> import macroflow as mf
            >>> @mf.persistent
            ... class Acc:
            ...     def __init__(self): self.total = 0
            ...     def add(self, x): self.total += x; return self.total
            ...     @mf.guard(lambda self: self.total > 100)
            ...     def big(self): return self.total
            >>> with mf.init(contexts=2, transport="inproc"):
            ...     acc = Acc.create()
            ...     acc.add(5).result(timeout=10)
            ...     try:
            ...         acc.big().result(timeout=0.05)   # its guard does not hold
            ...     except mf.TimeoutError:
            ...         print("not ready; the call still waits in the object")
            5
            not ready; the call still waits in the object
        """
        if self._state != FINISHED:
            self._engine.wait_future(self, timeout)
        if self._exc is not None:
            raise self._exc
        return self._value

    def exception(self, timeout: Optional[float] = None) -> Optional[BaseException]:
        """Wait like :meth:`result`, then return the exception or None.

        Example:
            >>> import macroflow as mf
            >>> @mf.regular
            ... class Math:
            ...     def divide(self, a, b): return a / b
            >>> with mf.init(contexts=2, transport="inproc"):
            ...     m = Math()
            ...     type(m.divide(1, 0).exception()).__name__, m.divide(6, 3).exception()
            ('ZeroDivisionError', None)
        """
        if self._state != FINISHED:
            self._engine.wait_future(self, timeout)
        return self._exc

    def add_done_callback(self, fn: Callable[["Future"], Any]) -> None:
        """Call ``fn(future)`` when the value arrives here (asks for it now).

        Callbacks run on the context's progress engine and must not block.

        Example:
            >>> import macroflow as mf
            >>> @mf.regular
            ... class Math:
            ...     def square(self, x): return x * x
            >>> with mf.init(contexts=2, transport="inproc"):
            ...     got = []
            ...     f = Math().square(6)
            ...     f.add_done_callback(lambda fut: got.append(fut.result()))
            ...     f.result(), got
            (36, [36])
        """
        if self._state == FINISHED:
            fn(self)
            return
        self._callbacks.append(fn)
        self._engine.request_value(self)

    @property
    def home(self) -> int:
        """The context that holds (or will hold) this future's value.

        Example:
            >>> import macroflow as mf
            >>> @mf.persistent
            ... class Acc:
            ...     def __init__(self): self.total = 0
            ...     def add(self, x): self.total += x; return self.total
            >>> with mf.init(contexts=3, transport="inproc"):
            ...     acc = Acc.create(on=2)
            ...     f = acc.add(1)
            ...     f.home, acc.context, f.result()
            (2, 2, 1)
        """
        return self._home

    # -- used by the engine --------------------------------------------------
    def _set(self, ok: bool, value: Any) -> None:
        if self._state == FINISHED:
            return
        if ok:
            self._value = value
        else:
            self._exc = value
        self._state = FINISHED
        waiters, self._waiters = self._waiters, []
        for w in waiters:
            w.wake(None)
        callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            try:
                fn(self)
            except Exception:  # a callback's bug must not stop the engine
                import traceback
                traceback.print_exc()

    def __reduce__(self):
        # A future that travels inside a value (not as an arc) may be asked for
        # by its new holder at any time, so its home must keep the value.
        self._escaped = True
        return (_rebuild, (self._fid, self._home, self._target))

    def __del__(self):
        eng = self._engine
        if eng is not None and not self._escaped and self._fid[0] == eng.id:
            try:
                eng.release(self)
            except Exception:
                pass

    def __repr__(self) -> str:
        state = "pending" if self._state == PENDING else ("error" if self._exc else "done")
        what = f" {site_label(self._site)}" if self._site else ""
        return f"<Future{what} {self._fid[0]}.{self._fid[1]} @ctx{self._home} {state}>"


class CallSite:
    """What the engine learns about one call site (a method, or an internal call).

    ``strict`` counts how many of its recent futures the caller asked for with
    ``result()`` before passing them anywhere: Mentat's compiler knew statically
    where a result would be used; macroflow learns it at run time, and when a
    site is strict the producer sends small values back unasked, saving the
    request message.

    Example:
        >>> CallSite("Accumulator.add").strict
        0
    """

    __slots__ = ("label", "strict")

    def __init__(self, label: str):
        self.label = label
        self.strict = 0


def site_label(site: Any) -> str:
    return site if isinstance(site, str) else getattr(site, "label", "")


def _rebuild(fid: FutureId, home: int, target: Any) -> Future:
    from .context import current_engine
    return current_engine().adopt_future(fid, home, target)


__all__ = ["Future", "CallSite", "PENDING", "FINISHED"]
