"""Futures: the value of a call that may not have been computed yet.

A :class:`Future` names its value by a computation tag (the issuing context
and a counter, Mentat's tag) and by its *home*, the context that will hold the
value. Nothing is sent to the holder of a future until someone needs the value:
passing the future to another call adds an arc (the home sends the value
straight to the consumer); ``result()`` asks the home for a copy.

A future belongs to the computation that made it (its engine's): waiting on
it, passing it on or pickling it once that computation has ended raises
:class:`macroflow.StaleReference`. It is awaitable: in asyncio code on the
caller's side, ``await f`` lets the event loop run other tasks while this
context's engine makes progress; in a coroutine method, ``await f`` waits as
``f.result()`` does, parking only the method's lightweight thread.
"""

from __future__ import annotations

import sys
import threading
import time
import types
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

from . import errors
from .threads import getcurrent

PENDING, FINISHED = 0, 1

FutureId = Tuple[int, int]


class Future:
    """The eventual result of a call; every call returns one at once.

    Only strict use blocks: :meth:`result`, :func:`macroflow.gather`,
    :func:`macroflow.wait`. Pass a future as an argument to another call and
    the value goes from its producer to the consumer without passing through
    the caller. Futures are made by calls: ``mf.Future()`` raises TypeError.

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

    def __init__(self, engine: Any = None, fid: FutureId = (0, 0), home: int = 0,
                 target: Any = None, site: Any = None):
        # made by the engine for every call, never by the user
        if engine is None:
            raise TypeError("mf.Future() cannot be made directly: every call returns one "
                            "(handle.method(...), Cls.create(...)), and mf.Future is for "
                            "isinstance checks and type hints")
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

        Note that a future nobody has asked for may stay not done here even
        after its producer finished (unless its call site's values come
        unasked, learned from earlier use): call :meth:`result` or
        :func:`macroflow.wait`, which ask.
        One whose context is known to be lost is done, failed with
        :class:`ContextLost`.

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
        if self._state == FINISHED:
            return True
        eng = self._engine
        if eng is not None and eng.lost:
            home = self._home
            if home in eng.lost and home not in eng.heirs and not eng.closed \
                    and threading.get_ident() == eng.thread:
                # its home is gone: the failure is known here without asking
                # (a loop on done() alone would not see it)
                self._set(False, errors.ContextLost(home, eng.lost[home]))
        return self._state == FINISHED

    def result(self, timeout: Optional[float] = None) -> Any:
        """Wait for the value and return it; re-raise the call's exception.

        A remote exception keeps its type and message; the remote traceback is
        its ``__cause__``. ``timeout`` (seconds) raises
        :class:`macroflow.TimeoutError` without cancelling the call.
        A future whose value is here keeps it after its computation ended;
        one still waiting then raises :class:`macroflow.StaleReference`.

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
        elif timeout is not None:
            _check_timeout(timeout)  # a bad one is refused even when nothing need wait
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
        elif timeout is not None:
            _check_timeout(timeout)
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
        if not callable(fn):
            # (else a TypeError from inside the engine when the value came,
            # naming neither this future nor the caller's line)
            raise TypeError(f"add_done_callback takes a function of the future; got "
                            f"{type(fn).__name__} {fn!r:.60}")
        if self._state == FINISHED:
            fn(self)
            return
        self._callbacks.append(fn)
        try:
            self._engine.request_value(self)
        except BaseException:
            self._callbacks.remove(fn)  # refused (another thread, an ended computation)
            raise
        if "asyncio" in sys.modules:
            _drive_from_loop(self)

    def remove_done_callback(self, fn: Callable[["Future"], Any]) -> int:
        """Forget ``fn`` as a done callback (every time it was added); returns
        how many times it was, as asyncio's futures do (``asyncio.wait``
        calls it on the futures still pending at its timeout).

        Example:
            >>> import macroflow as mf
            >>> @mf.regular
            ... class Math:
            ...     def square(self, x): return x * x
            >>> with mf.init(contexts=2, transport="inproc"):
            ...     f = Math().square(6)
            ...     f.add_done_callback(print)
            ...     f.remove_done_callback(print), f.result()
            (1, 36)
        """
        n = len(self._callbacks)
        self._callbacks[:] = [c for c in self._callbacks if c != fn]
        return n - len(self._callbacks)

    def cancelled(self) -> bool:
        """False: a call, once made, is not cancelled (asyncio.wait asks).

        Example:
            >>> import macroflow as mf
            >>> @mf.regular
            ... class Math:
            ...     def square(self, x): return x * x
            >>> with mf.init(contexts=2, transport="inproc"):
            ...     f = Math().square(3)
            ...     f.cancelled(), f.result()
            (False, 9)
        """
        return False

    @property
    def home(self) -> int:
        """The context that holds (or will hold) this future's value.

        Example:
            >>> import macroflow as mf
            >>> @mf.persistent
            ... class Acc:
            ...     def add(self, x): return x
            >>> with mf.init(contexts=2, transport="inproc"):
            ...     acc = Acc.create(on=1)
            ...     acc.add(1).home == mf.info(acc).context
            True
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
        if self._waiters:  # (most have none: no list made for them)
            waiters, self._waiters = self._waiters, []
            for w in waiters:
                w.wake(None)
        if not self._callbacks:
            return
        callbacks, self._callbacks = self._callbacks, []
        if self._engine is not None and self._engine.undetached:
            self._engine.kept_copies()  # user code runs: see Engine.kept_copies
        for fn in callbacks:
            try:
                fn(self)
            except (Exception, SystemExit):  # a callback's bug must not stop the engine
                _callback_failed(self, fn)  # (sys.exit() too, as in a method)

    def __await__(self):
        if self._state != FINISHED and getattr(getcurrent(), "engine", None) is None:
            eng = self._engine
            if not (eng.in_inline or eng.serving == threading.get_ident()):
                # asyncio code on the caller's side: the event loop drives the engine
                return (yield from _wait_async(self).__await__())
            # a handler run inline or at once: result() says it cannot wait
        # done, or in a method's lightweight thread: park it as result() does
        return self.result()

    def __reduce__(self):
        eng = self._engine
        if eng.closed:
            raise stale_future(self)
        # A future that travels inside a value (not as an arc) may be asked for
        # by its new holder at any time, so its home must keep the value.
        self._escaped = True
        return (_rebuild, (self._fid, self._home, self._target, eng.computation,
                           site_label(self._site) or None))

    def __del__(self):
        try:
            eng = self._engine
        except AttributeError:  # its construction failed: nothing to release
            return
        if eng is not None and not self._escaped and self._fid[0] == eng.id:
            try:
                eng.release(self)
            except Exception:
                pass

    def __repr__(self) -> str:
        state = "pending" if self._state == PENDING else ("error" if self._exc else "done")
        what = f" {site_label(self._site)}" if self._site else ""
        return f"<Future{what} {self._fid[0]}.{self._fid[1]} @ctx{self._home} {state}>"


class Arrivals:
    """A done-callback for several futures: each that finishes here is queued,
    in the order they finish, and the one waiter parked for them (if any) woken.

    What ``mf.as_completed`` and ``mf.wait(return_when=...)`` are built on:
    the engine's ``wait_arrival`` parks on it; a future holds it among its
    callbacks until it finishes or ``detach`` takes it back.

    Example:
        >>> import macroflow as mf
        >>> from macroflow.core.context import current_engine
        >>> @mf.regular
        ... class M:
        ...     def one(self): return 1
        >>> with mf.init(contexts=2, transport="inproc"):
        ...     arr = Arrivals()
        ...     f = arr.attach([M().one()])[0]
        ...     current_engine().wait_arrival(arr, 10), arr.queue.popleft() is f
        (True, True)
    """

    __slots__ = ("queue", "waiter", "__weakref__")

    def __init__(self) -> None:
        from collections import deque
        self.queue: Any = deque()
        self.waiter: Any = None

    def __call__(self, f: Future) -> None:
        self.queue.append(f)
        w = self.waiter
        if w is not None:
            w.wake(None)

    def attach(self, fs: List[Future]) -> List[Future]:
        """Follow ``fs`` (asking for their values): the finished ones are
        queued at once, in list order. Returns ``fs``."""
        for f in fs:
            f.add_done_callback(self)
        return fs

    def detach(self, fs: Any) -> None:
        """Stop following those of ``fs`` that have not finished."""
        for f in fs:
            if f._state != FINISHED:
                try:
                    f._callbacks.remove(self)
                except ValueError:
                    pass


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

    __slots__ = ("label", "strict", "__weakref__")

    def __init__(self, label: str):
        self.label = label
        self.strict = 0
        _SITES.add(self)


#: every call site of this process, so that each computation starts having learned nothing
_SITES: "weakref.WeakSet[CallSite]" = weakref.WeakSet()


def forget_learned() -> None:
    """Make every call site of this process lazy again, as it was before
    any computation: what one computation learned must not change how the
    next runs (which futures are done() unasked, how many messages flow).

    Example:
        >>> site = CallSite("Accumulator.add")
        >>> site.strict = 3
        >>> forget_learned()
        >>> site.strict
        0
    """
    for site in list(_SITES):
        site.strict = 0


def site_label(site: Any) -> str:
    return site if isinstance(site, str) else getattr(site, "label", "")


_SITES_NAMED: Dict[str, "CallSite"] = {}  # a rebuilt future's call site, by its label
_SITES_NAMED_MAX = 256


def _rebuild(fid: FutureId, home: int, target: Any, computation: str,
             label: Optional[str] = None) -> Future:
    from .context import current_engine
    running = running_computation()
    if running != computation:
        raise errors.StaleReference(f"future {fid[0]}.{fid[1]} @ctx{home}", computation, running)
    f = current_engine().adopt_future(fid, home, target)
    if label and f._site is None:
        # named as where it was made: <Future B.slow 1.2 @ctx2 pending>
        site = _SITES_NAMED.get(label)
        if site is None:
            if len(_SITES_NAMED) >= _SITES_NAMED_MAX:
                _SITES_NAMED.clear()
            site = _SITES_NAMED[label] = CallSite(label)
        f._site = site
    return f


# -- identity ------------------------------------------------------------------
def running_computation() -> Optional[str]:
    """The id of the computation running here, or None if none is.

    Example:
        >>> import macroflow as mf
        >>> with mf.init(contexts=1, transport="inproc") as s:
        ...     running_computation() == s.computation
        True
        >>> running_computation() is None
        True
    """
    from .context import _state
    eng = getattr(getcurrent(), "engine", None) or _state.current or _state.default
    if eng is None or eng.closed:
        return None
    return eng.computation


def current_engine_of(computation: Optional[str], label: str, ref: Any) -> Any:
    """The running engine, if it belongs to ``computation``; else StaleReference.

    ``label`` and ``ref`` name the reference in the error ("handle", the
    handle). A ``computation`` of None belongs to none: any will do.

    Example:
        >>> import macroflow as mf
        >>> with mf.init(contexts=1, transport="inproc") as s:
        ...     current_engine_of(s.computation, "handle", None).id
        0
        >>> current_engine_of(s.computation, "handle", "h")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        macroflow.core.errors.StaleReference: handle 'h' belongs to computation ..., which has ended (no computation is running)
    """
    from .context import current_engine
    try:
        eng = current_engine()
    except RuntimeError:
        if computation is not None and running_computation() is None:
            raise errors.StaleReference(f"{label} {ref!r}", computation, None) from None
        raise
    if computation is not None and eng.computation != computation:
        raise errors.StaleReference(f"{label} {ref!r}", computation, eng.computation)
    return eng


def stale_future(f: Future) -> errors.StaleReference:
    """The error for using ``f`` outside its computation (see StaleReference).

    Example:
        >>> import macroflow as mf
        >>> @mf.regular
        ... class M:
        ...     def one(self): return 1
        >>> with mf.init(contexts=2, transport="inproc"):
        ...     f = M.create(on=1).one()
        >>> type(stale_future(f)).__name__
        'StaleReference'
    """
    return errors.StaleReference(f"future {f!r}", f._engine.computation, running_computation())


# -- coroutine methods -----------------------------------------------------------
CoroutineType = types.CoroutineType


def _check_timeout(timeout: Any) -> None:
    from .context import check_timeout  # (context imports this module)
    check_timeout(timeout)


def run_coroutine(coro: Any) -> Any:
    """Run a coroutine method to its end in the calling lightweight thread.

    ``await`` on a :class:`Future` inside it waits as ``result()`` does (the
    thread parks, the context serves others meanwhile), so the coroutine
    never yields to a driver. Awaiting something that needs an event loop
    (``asyncio.sleep``, an asyncio future) raises RuntimeError at that await:
    a context runs no event loop.

    Example:
        >>> async def add(a, b):
        ...     return a + b
        >>> run_coroutine(add(2, 3))
        5
    """
    try:
        yielded = coro.send(None)
    except StopIteration as e:
        return e.value
    except RuntimeError as e:
        if "no running event loop" not in str(e):
            raise
        raise RuntimeError(  # asyncio.sleep and friends look for a loop before they yield
            "an async def method or handler can await only macroflow futures (and coroutines that await "
            "them): it called asyncio code that needs an event loop, and a context runs none; "
            "call asyncio code from the caller's side instead") from e
    err = RuntimeError(
        f"an async def method or handler can await only macroflow futures (and coroutines that await "
        f"them): it awaited something that needs an event loop (it yielded {yielded!r}), "
        f"and a context runs none; call asyncio code from the caller's side instead")
    try:
        coro.throw(err)
    except StopIteration as e:
        return e.value
    coro.close()  # it caught the error and awaited again
    raise err


# -- awaiting from asyncio -------------------------------------------------------
POLL_S = 0.001  # inproc has no descriptor to watch: idle engines are polled this often


def _callback_failed(f: Future, fn: Any) -> None:
    """Say on stderr which done callback of which future raised, where, and
    the traceback; the engine goes on (a callback's bug must not stop it)."""
    eng = f._engine
    where = "" if eng is None else f" on context {eng.id}"
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    print(f"macroflow: done callback {name} of {f!r}{where} raised (ignored):\n"
          f"{errors.format_user(sys.exc_info()[1])}", end="", file=sys.stderr)


async def _wait_async(f: Future) -> Any:
    import asyncio
    eng = f._engine
    eng.request_value(f)  # asks once; raises StaleReference for an ended computation
    if f._state != FINISHED:
        if getcurrent() is not eng.root:
            raise RuntimeError("a macroflow future can be awaited from asyncio only in the "
                               "thread that started the computation")
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()

        def wake(_f: Future) -> None:
            if not waiter.done():
                waiter.set_result(None)

        f._callbacks.append(wake)
        driver = _driver(eng, loop)
        driver.acquire(waiter)
        try:
            await waiter
        finally:
            driver.release(waiter)
            if wake in f._callbacks:  # cancelled before the value came
                f._callbacks.remove(wake)
    return f.result()


_drivers: "weakref.WeakKeyDictionary[Any, LoopDriver]" = weakref.WeakKeyDictionary()


def _drive_from_loop(f: Future) -> None:
    """A done callback added from asyncio code (``asyncio.wait`` adds its own
    to each future) runs when the engine steps, and nothing stepped it
    there: an asyncio wait never saw the futures finish. While such a
    future is pending, the loop drives the engine, as for an ``await``."""
    import asyncio
    loop = asyncio._get_running_loop()
    eng = f._engine
    if loop is None or f._state == FINISHED or getcurrent() is not eng.root:
        return
    waiter = loop.create_future()
    driver = _driver(eng, loop)

    def done(_f: Future) -> None:
        if waiter in driver.waiters:
            driver.release(waiter)

    f._callbacks.append(done)
    driver.acquire(waiter)


def _driver(eng: Any, loop: Any) -> "LoopDriver":
    d = _drivers.get(loop)
    if d is None or d.engine is not eng:
        d = _drivers[loop] = LoopDriver(eng, loop)
    return d


class LoopDriver:
    """Makes a context's engine progress from an asyncio event loop.

    Active while some task awaits a :class:`Future`. Each turn steps the
    engine without blocking (``local``: the engines of the whole in-process
    world for ``inproc``), then schedules the next turn: at once while there
    is work queued, at the next engine timer, and otherwise when the
    transport's epoll descriptor becomes readable (``local``, through
    ``loop.add_reader``) or after :data:`POLL_S` (``inproc``, which has no
    descriptor: its other contexts only run when stepped). Every new await
    also schedules a turn, so calls issued since the last one are served.

    Example:
        >>> import asyncio, macroflow as mf
        >>> @mf.regular
        ... class M:
        ...     def sq(self, x): return x * x
        >>> async def amain():
        ...     return await M.create(on=1).sq(7)
        >>> with mf.init(contexts=2, transport="inproc"):
        ...     asyncio.run(amain())
        49
    """

    def __init__(self, engine: Any, loop: Any):
        self.engine = engine
        self.loop = loop
        world = engine.driver
        self.engines = list(world.engines) if world is not engine else [engine]
        self.fd: Optional[int] = engine.transport.fileno() if world is engine else None
        # the asyncio futures of the awaiting tasks (a dict: each leaves in O(1),
        # where gathering 100,000 left a list in O(n) each)
        self.waiters: Dict[Any, None] = {}
        self.reading = False
        self.next: Any = None  # the scheduled turn
        self.next_soon = False

    def acquire(self, waiter: Any) -> None:
        self.waiters[waiter] = None
        if self.fd is not None and not self.reading:
            self.loop.add_reader(self.fd, self.turn)
            self.reading = True
        self._schedule(0.0)

    def release(self, waiter: Any) -> None:
        del self.waiters[waiter]
        if not self.waiters:
            if self.reading:
                self.loop.remove_reader(self.fd)
                self.reading = False
            if self.next is not None:
                self.next.cancel()
                self.next = None

    def _schedule(self, delay: float) -> None:
        if self.next is not None:
            if self.next_soon or delay > 0.0:
                return  # a turn that comes as soon or sooner is already scheduled
            self.next.cancel()
        self.next_soon = delay <= 0.0
        if self.next_soon:
            self.next = self.loop.call_soon(self.turn)
        else:
            self.next = self.loop.call_later(delay, self.turn)

    def turn(self) -> None:
        if self.next is not None:
            self.next.cancel()
            self.next = None
        if not self.waiters:
            return
        main = self.engine
        # while tasks await, context 0 starts no regular call that could run
        # elsewhere (as in a wait with a timeout): one would hold the loop,
        # every task and a Ctrl-C, until it returned
        timed, main.timed_wait = main.timed_wait, True
        try:
            for eng in self.engines:
                eng.step(0)
        except Exception as e:  # the waiting tasks get it rather than the loop's log
            for w in list(self.waiters):
                if not w.done():
                    w.set_exception(e)
            return
        finally:
            main.timed_wait = timed
        if not self.waiters:
            return
        if any(eng.busy() for eng in self.engines):
            self._schedule(0.0)
            return
        if self.fd is not None and self.engine.transport.nap(True):
            self._schedule(0.0)  # frames came that the descriptor does not show
            return
        delay = None if self.fd is not None else POLL_S
        for eng in self.engines:
            due = eng.next_due()
            if due is not None:
                left = max(0.0, due - time.monotonic())
                delay = left if delay is None else min(delay, left)
        if self.fd is not None:
            # what the transport must do unasked (close a stalled handshake)
            # does not make its descriptor readable: come back by then
            due = self.engine.transport.next_due()
            if due is not None:
                left = max(0.0, due - time.monotonic()) + 1e-3
                delay = left if delay is None else min(delay, left)
        if delay is not None:
            self._schedule(delay)


__all__ = ["Future", "CallSite", "PENDING", "FINISHED", "run_coroutine", "running_computation",
           "current_engine_of", "stale_future"]
