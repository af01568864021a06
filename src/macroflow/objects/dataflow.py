"""Strict use of futures: wait, gather; and questions about the computation."""

from __future__ import annotations

import time
from typing import Any, Dict, Iterable, List, Optional, Tuple

from ..core.context import SYSTEM, current_engine
from ..core.future import CallSite, Future, stale_future

_STATS_SITE = CallSite("stats")


def _engine_for(fs: List[Future]) -> Any:
    # futures of an ended computation say so, rather than "not running"
    try:
        return current_engine()
    except RuntimeError:
        for f in fs:
            if f._engine.closed:
                raise stale_future(f) from None
        raise


def _left(deadline: Optional[float]) -> Optional[float]:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def wait(futures: Iterable[Any], timeout: Optional[float] = None) -> Tuple[List[Future], List[Future]]:
    """Wait until every future has its value here, or ``timeout`` seconds pass.

    Returns ``(done, not_done)``, two lists of futures; never raises for a
    failed call (look at ``f.exception()``) nor for the timeout.

    Example:
        >>> import macroflow as mf
        >>> @mf.regular
        ... class M:
        ...     def one(self): return 1
        >>> with mf.init(contexts=2, transport="inproc"):
        ...     done, pending = mf.wait([M().one() for _ in range(3)], timeout=10)
        ...     len(done), len(pending)
        (3, 0)
    """
    fs = [f for f in futures if isinstance(f, Future)]
    if not fs:
        return [], []
    eng = _engine_for(fs)
    for f in fs:
        eng.request_value(f)
    deadline = None if timeout is None else time.monotonic() + timeout
    for f in fs:
        if f.done():
            continue
        try:
            eng.wait_future(f, _left(deadline))
        except TimeoutError:
            break
    done = [f for f in fs if f.done()]
    return done, [f for f in fs if not f.done()]


def gather(futures: Iterable[Any], timeout: Optional[float] = None) -> List[Any]:
    """The values of ``futures`` in order (other items are passed through).

    Raises the first failed call's exception, in list order.

    Example:
        >>> import macroflow as mf
        >>> @mf.regular
        ... class M:
        ...     def sq(self, x): return x * x
        >>> with mf.init(contexts=2, transport="inproc"):
        ...     mf.gather([M().sq(3), 10, M().sq(4)])
        [9, 10, 16]
    """
    items = list(futures)
    eng = _engine_for([f for f in items if isinstance(f, Future)])
    for f in items:
        if isinstance(f, Future):
            eng.request_value(f)
    deadline = None if timeout is None else time.monotonic() + timeout
    out = []
    for f in items:
        if isinstance(f, Future):
            out.append(f.result(_left(deadline)))
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
    """How many contexts the computation has.

    Example:
        >>> import macroflow as mf
        >>> mf.run(mf.num_contexts, contexts=3, transport="inproc")
        3
    """
    return current_engine().size


def stats() -> Dict[int, Dict[str, int]]:
    """Counters of every live context: a dict from context id to its counters.

    Among them: ``bytes_sent``, ``bytes_received``, ``messages_sent``,
    ``messages_received``, ``calls_executed``, ``calls_issued``,
    ``values_sent``, ``instances_created``; docs/guide.md (Statistics)
    describes every key. Asking costs one message each way per context.

    Example:
        >>> import macroflow as mf
        >>> sorted(mf.run(mf.stats, contexts=2, transport="inproc"))
        [0, 1]
    """
    eng = current_engine()
    live = [c for c in range(eng.size) if c not in eng.lost]
    futs = {c: eng.issue(SYSTEM, "stats", "stats", (), {}, c, site=_STATS_SITE, pinned=True)
            for c in live}
    return {c: f.result() for c, f in futs.items()}
