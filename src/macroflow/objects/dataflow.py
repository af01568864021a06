"""Strict use of futures: wait, gather; and questions about the computation."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, Dict, Iterable, Iterator, List, Optional, Tuple

from ..core import errors
from ..core.context import check_timeout, current_engine
from ..core.future import FINISHED, Arrivals, Future, stale_future



def _deadline(timeout: Any) -> Optional[float]:
    # checked as result() checks it, before anything waits
    timeout = check_timeout(timeout)
    return None if timeout is None else time.monotonic() + timeout


def _engine_for(fs: List[Future]) -> Any:
    """The engine that waits for ``fs``; None if every one has its value here
    already (it keeps it, whatever became of its computation, as result()
    does). A future of an ended computation still waited for says so,
    rather than "not running"."""
    pending = [f for f in fs if f._state != FINISHED]
    if not pending:
        return None
    try:
        return current_engine()
    except RuntimeError:
        for f in pending:
            if f._engine.closed:
                raise stale_future(f) from None
        raise


def _items(futures: Any, who: str) -> List[Any]:
    """The items of what gather or wait was given, or a TypeError saying what it takes."""
    if isinstance(futures, Mapping):
        raise TypeError(f"mf.{who}() takes an iterable of futures, not a {type(futures).__name__} "
                        f"(iterating over it gives its keys): pass d.values(), and zip the "
                        f"result with d's keys if you need them")
    if isinstance(futures, Future):
        raise TypeError(f"mf.{who}() takes an iterable of futures, not one Future: "
                        f"pass [f], or use f.result()")
    if isinstance(futures, (str, bytes, bytearray)):
        # (iterable, but of characters: a value passed by mistake)
        raise TypeError(f"mf.{who}() takes an iterable of futures, not a "
                        f"{type(futures).__name__} ({futures[:20]!r})")
    try:
        it = iter(futures)
    except TypeError:
        raise TypeError(f"mf.{who}() takes an iterable of futures (a list, a tuple, a "
                        f"generator...); got {type(futures).__name__}") from None
    return list(it)  # what a generator raises is its own error, not ours


def _left(deadline: Optional[float]) -> Optional[float]:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


FIRST_COMPLETED = "FIRST_COMPLETED"
FIRST_EXCEPTION = "FIRST_EXCEPTION"
ALL_COMPLETED = "ALL_COMPLETED"
_RETURN_WHEN = (FIRST_COMPLETED, FIRST_EXCEPTION, ALL_COMPLETED)


def wait(futures: Iterable[Any], timeout: Optional[float] = None,
         return_when: str = ALL_COMPLETED) -> Tuple[List[Future], List[Future]]:
    """Wait until every future has its value here (or the first one does, or
    the first fails: ``return_when``), or ``timeout`` seconds pass.

    Returns ``(done, not_done)``, two lists of futures in the order given;
    never raises for a failed call (look at ``f.exception()``) nor for the
    timeout. ``return_when`` is ``mf.ALL_COMPLETED`` (the default),
    ``mf.FIRST_COMPLETED`` or ``mf.FIRST_EXCEPTION`` (every future, unless
    one fails first), as in :mod:`concurrent.futures`, whose constants are
    the same strings.

    Raises:
        TypeError: ``futures`` is not an iterable of futures (a dict, a
            single Future, or an item that is not a Future: the error names
            the first such item and its position).
        ValueError: ``return_when`` is none of the three.

    Example:
        >>> import macroflow as mf
        >>> @mf.regular
        ... class M:
        ...     def one(self): return 1
        >>> with mf.init(contexts=2, transport="inproc"):
        ...     done, pending = mf.wait([M().one() for _ in range(3)], timeout=10)
        ...     first, _ = mf.wait([M().one(), M().one()], return_when=mf.FIRST_COMPLETED)
        ...     len(done), len(pending), len(first) >= 1
        (3, 0, True)
    """
    fs = _futures(futures, "wait")
    if return_when not in _RETURN_WHEN:
        raise ValueError(f"mf.wait()'s return_when must be mf.FIRST_COMPLETED, "
                         f"mf.FIRST_EXCEPTION or mf.ALL_COMPLETED; got {_show(return_when)}")
    deadline = _deadline(timeout)
    if not fs:
        return [], []
    eng = _engine_for(fs)
    if eng is None:
        return list(fs), []
    if return_when == ALL_COMPLETED:
        for f in fs:
            if f._state != FINISHED:
                eng.request_value(f)
        for f in fs:
            if f.done():
                continue
            try:
                eng.wait_future(f, _left(deadline))
            except TimeoutError:
                break
    else:
        arriving = _arriving(eng, fs, timeout, deadline, late=None)
        try:
            for f in arriving:
                if return_when == FIRST_COMPLETED or f._exc is not None:
                    break
        finally:
            arriving.close()  # (its futures' callbacks go now, not when it is collected)
    done = [f for f in fs if f.done()]
    return done, [f for f in fs if not f.done()]


def as_completed(futures: Iterable[Any], timeout: Optional[float] = None) -> Iterator[Future]:
    """Yield the futures as their values arrive here: those done already
    first (in the order given), then each as it finishes.

    Each future is yielded once (a future given twice, once). Failed calls
    are yielded too: ``f.result()`` raises their exception. Leaving the loop
    early is fine: the futures not yet yielded are left as they are.

    Raises:
        TypeError: ``futures`` is not an iterable of futures (as mf.wait).
        macroflow.TimeoutError: from the iteration (``next``), when ``timeout``
            seconds have passed since the call and futures remain.

    Example:
        >>> import macroflow as mf
        >>> @mf.regular
        ... class M:
        ...     def sq(self, x): return x * x
        >>> with mf.init(contexts=2, transport="inproc"):
        ...     sorted(f.result() for f in mf.as_completed([M().sq(x) for x in range(4)]))
        [0, 1, 4, 9]
    """
    fs = _futures(futures, "as_completed")
    deadline = _deadline(timeout)
    # (checked here, not at the first next(): a generator's errors come late)
    return _arriving(_engine_for(fs) if fs else None, fs, timeout, deadline,
                     late=errors.TimeoutError)


def _arriving(eng: Any, fs: List[Future], timeout: Optional[float], deadline: Optional[float],
              late: Optional[type]) -> Iterator[Future]:
    """Each of ``fs`` once, as its value arrives here (those here already
    first, in order). Once ``deadline`` passes with some still to come:
    raise ``late``, or end if it is None."""
    unique = list({id(f): f for f in fs}.values())
    arrivals = Arrivals()
    try:
        arrivals.attach(unique)
        left = len(unique)
        while left:
            while arrivals.queue:
                left -= 1
                yield arrivals.queue.popleft()
            if left and not eng.wait_arrival(arrivals, _left(deadline), unique):
                if late is None:
                    return
                raise late(f"{left} of {len(unique)} futures not ready after "
                           f"{float(timeout):g} s (mf.as_completed's timeout)")  # type: ignore
    finally:
        arrivals.detach(unique)


def _futures(futures: Any, who: str) -> List[Future]:
    fs = _items(futures, who)
    for i, f in enumerate(fs):
        if not isinstance(f, Future):
            t = type(f)  # (whose Future, when it is another library's)
            kind = t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"
            raise TypeError(f"mf.{who}() waits for macroflow futures; item {i} is {_show(f)} "
                            f"({kind}), not a macroflow Future")
    return fs


def _show(x: Any) -> str:
    try:
        text = repr(x)
    except Exception:
        text = f"<{type(x).__name__} object>"
    return text if len(text) <= 60 else text[:57] + "..."


def gather(futures: Iterable[Any], timeout: Optional[float] = None) -> List[Any]:
    """The values of ``futures`` in order (other items are passed through).

    Raises the first failed call's exception, in list order.

    Raises:
        TypeError: ``futures`` is not an iterable: a dict (pass
            ``d.values()``), a single Future (pass ``[f]``), a string,
            None...
        macroflow.TimeoutError: ``timeout`` seconds passed first.

    Example:
        >>> import macroflow as mf
        >>> @mf.regular
        ... class M:
        ...     def sq(self, x): return x * x
        >>> with mf.init(contexts=2, transport="inproc"):
        ...     mf.gather([M().sq(3), 10, M().sq(4)])
        [9, 10, 16]
    """
    deadline = _deadline(timeout)
    items = _items(futures, "gather")
    fs = [f for f in items if isinstance(f, Future)]
    if not fs:  # nothing to wait for (as mf.wait([]) does): no computation needed
        return list(items)
    eng = _engine_for(fs)
    for f in fs:
        if f._state != FINISHED:
            eng.request_value(f)
    out = []
    for i, f in enumerate(items):
        if isinstance(f, Future):
            try:
                out.append(f.result(_left(deadline)))
            except errors.TimeoutError:
                if f.done():  # (it came late: result() says so)
                    raise
                # the time left of gather's own timeout, not that, is in result()'s message
                raise errors.TimeoutError(
                    f"{f!r} not ready after {float(timeout):g} s (mf.gather's timeout)") from None
            except Exception as e:
                # which of many calls failed (a sweep's parameter): said in a
                # note, the exception itself unchanged (Python 3.11 on)
                note = f"(mf.gather: item {i} of {len(items)}, {f!r})"
                if hasattr(e, "add_note") and note not in getattr(e, "__notes__", ()):
                    e.add_note(note)
                raise
        else:
            out.append(f)
    return out


def context_id() -> int:
    """The id of the context running this code (main runs on 0).

    Example:
        >>> import macroflow as mf
        >>> mf.run(mf.context_id, contexts=2, transport="inproc")
        0
    """
    return current_engine().id


def num_contexts() -> int:
    """How many contexts the computation has had: ids run from 0 to
    ``num_contexts() - 1``. Contexts added while running count; so do those
    removed or lost since, whose ids are not given out again
    (:func:`macroflow.contexts` says which are running).

    Example:
        >>> import macroflow as mf
        >>> mf.run(mf.num_contexts, contexts=3, transport="inproc")
        3
    """
    return current_engine().size


def stats(timeout: Optional[float] = None) -> Dict[int, Dict[str, int]]:
    """Counters of every live context: a dict from context id to its counters.

    Among them: ``bytes_sent``, ``bytes_received``, ``messages_sent``,
    ``messages_received``, ``calls_executed``, ``calls_issued``,
    ``values_sent``, ``instances_created``; docs/guide.md (Statistics)
    describes every key. Asking costs one message each way per context.

    A context lost before or while stats asks is left out. A context
    answers at once, even while a method computes there (on ``inproc``,
    where nothing runs beside a method, when the calls that came before
    the request have run). With ``timeout`` (seconds), stats waits that
    long at most.

    Raises:
        macroflow.TimeoutError: some context did not answer within
            ``timeout``; the message names them.

    Example:
        >>> import macroflow as mf
        >>> sorted(mf.run(mf.stats, contexts=2, transport="inproc"))
        [0, 1]
    """
    eng = current_engine()
    eng.poll()  # a context lost since the transport last looked is not asked
    live = [c for c in range(eng.size) if c not in eng.lost]
    futs = {c: eng.ask_stats(c) for c in live}
    if timeout is not None:
        _done, late = wait(list(futs.values()), timeout)
        if late:
            # this context answers as soon as this wait lets it run the call
            # (a timeout of 0 lets it run nothing): only the others can be late
            silent = [c for c, f in futs.items() if not f.done() and c != eng.id]
            if silent:
                raise errors.TimeoutError(
                    f"mf.stats(): context{'s' if len(silent) > 1 else ''} "
                    f"{', '.join(map(str, silent))} did not answer within {timeout} s")
    # a context lost meanwhile is left out, as one lost before
    return {c: f.result() for c, f in futs.items()
            if not isinstance(f.exception(), errors.ContextLost)}
