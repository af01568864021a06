"""Remote service requests (Nexus): run a handler where a global pointer points.

An RSR is one-way: no reply, no future. The handler runs in the pointer's
context with the object the pointer names, either inline on that context's
progress engine (cheapest; it must not wait), in a new lightweight thread
(it may wait on futures), or at once, even while a method computes there
(it must not wait). RSRs bypass a persistent object's monitor, as an
interrupt would: use them for library-level machinery, not user methods.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Tuple

from . import errors, marshal
from .context import MISSING, RSR, RSR_NOW, current_engine, rsr_frame
from .future import current_engine_of
from .gptr import GlobalPointer

THREADS = ("inline", "new", "now")


def export(obj: Any) -> GlobalPointer:
    """Register ``obj`` (any object, e.g. a numpy array) in this context and
    return a global pointer that names it from anywhere.

    Example:
        >>> import macroflow as mf, numpy as np
        >>> with mf.init(contexts=1, transport="inproc"):
        ...     g = mf.export(np.zeros(4))
        ...     g.context, g.kind
        (0, 'export')
    """
    eng = current_engine()
    ident = eng.new_fid()
    eng.exports[ident] = obj
    return GlobalPointer(eng.id, "export", ident, protocols_of(eng, eng.id), eng.computation)


def unexport(gptr: GlobalPointer) -> None:
    """Forget an object registered with :func:`export` in this context.

    Raises:
        TypeError: ``gptr`` is not a GlobalPointer.
        ValueError: it names another context, a persistent object (end
            those with mf.destroy), or nothing (unexported already).
        macroflow.StaleReference: ``gptr`` belongs to another computation.

    Example:
        >>> import macroflow as mf
        >>> with mf.init(contexts=1, transport="inproc"):
        ...     g = mf.export([1, 2])
        ...     mf.unexport(g)
    """
    _check_gptr(gptr, "unexport", "mf.export()")
    eng = current_engine_of(gptr.computation, "global pointer", gptr)
    if gptr.kind != "export":
        what = "a persistent object" if gptr.kind == "object" else f"a {gptr.kind!r}"
        raise ValueError(f"mf.unexport(): {gptr!r} names {what}, not an object registered "
                         f"with mf.export(); a persistent object ends with mf.destroy(handle)")
    if gptr.context != eng.id:
        raise ValueError(f"{gptr!r} names context {gptr.context}, not this one ({eng.id})")
    if eng.exports.pop(gptr.ident, MISSING) is MISSING:
        # as `del d[k]` does: a second unexport is a mistake (which pointer
        # was meant?), not something to pass over
        raise ValueError(f"mf.unexport(): {gptr!r} names nothing in context {eng.id}: it was "
                         f"unexported already")


def _check_gptr(gptr: Any, who: str, source: str) -> None:
    if not isinstance(gptr, GlobalPointer):
        raise TypeError(f"mf.{who}(): gptr must be a GlobalPointer (from {source}); "
                        f"got {type(gptr).__name__}")


def protocols_of(eng: Any, ctx: int) -> Tuple[Tuple[str, str], ...]:
    """The (protocol, address) pairs that reach context ``ctx``, best first, as
    this context knows them (a global pointer carries them).

    Example:
        >>> import macroflow as mf
        >>> from macroflow.core.context import current_engine
        >>> with mf.init(contexts=2, transport="inproc"):
        ...     [p for p, _ in protocols_of(current_engine(), 1)]
        ['inproc']
    """
    t = eng.transport
    if t is None:
        return (("inproc", ""),)
    if ctx == eng.id:
        addresses = getattr(t, "addresses", None)
        return tuple(addresses()) if addresses is not None else (t.address(),)
    known = getattr(t, "directory", {}).get(ctx)
    if known and not isinstance(known, str):
        return tuple(known)
    # not described to us: reachable by what this context speaks, at an
    # address its transport knows
    addresses = getattr(t, "addresses", None)
    mine = addresses() if addresses is not None else (t.address(),)
    return tuple((p, "") for p, _ in mine)


def spoken(eng: Any) -> Tuple[str, ...]:
    """The protocols this context speaks."""
    known = eng.__dict__.get("_spoken")
    if known is not None:  # a context's protocol modules are fixed when it starts
        return known
    t = eng.transport
    if t is None:
        known = ("inproc",)
    else:
        addresses = getattr(t, "addresses", None)
        known = tuple(p for p, _ in (addresses() if addresses is not None else (t.address(),)))
    eng._spoken = known
    return known


def rsr(gptr: GlobalPointer, handler: Callable[..., Any], *args: Any, thread: str = "inline") -> None:
    """Send a remote service request: run ``handler(obj, *args)`` where ``gptr`` points.

    Asynchronous and one-way: it returns at once and nothing comes back
    (send an RSR back, or call a persistent object, to answer).

    Args:
        gptr: names the target (``mf.info(handle).gptr`` or :func:`export`'s result).
        handler: a picklable function; ``obj`` is the object the pointer names.
        thread: "inline" runs it on the target's progress engine (it must not
            wait); "new" runs it in a new lightweight thread (it may wait);
            "now" runs it as soon as it arrives, even while a method computes
            there, in whichever thread serves the context then (the engine's,
            or its service mechanism's): like an interrupt, it must not wait
            or block, and it may run while a method of the same object runs.

    Raises:
        TypeError: ``gptr`` is not a GlobalPointer, or ``handler`` is not callable.
        ValueError: unknown ``thread``, no protocol shared with the target, a
            pointer to a context that does not exist, or a pointer to a part
            of registered memory (a slice: the handler gets the whole buffer).
        macroflow.ContextLost: the pointer's context is lost (or was removed).
        macroflow.StaleReference: ``gptr`` belongs to another computation.
        macroflow.CallError: the handler or the arguments cannot be pickled.

    Messages from one context to another are served in the order they were
    sent, so a call sent after an RSR to the same context runs after the
    handler has; a "now" request may pass messages sent before it that
    wait for a computing method to end.

    Example:
        >>> import macroflow as mf
        >>> @mf.persistent
        ... class Box:
        ...     def __init__(self): self.items = []
        ...     def contents(self): return list(self.items)
        >>> def put(box, x):
        ...     box.items.append(x)
        >>> with mf.init(contexts=2, transport="inproc"):
        ...     b = Box.create(on=1)
        ...     mf.rsr(mf.info(b).gptr, put, 5)      # returns None at once
        ...     mf.rsr(mf.info(b).gptr, put, 6)
        ...     b.contents().result()         # sent after the RSRs: served after them
        ...     mf.stats()[1]["rsr_executed"]
        [5, 6]
        2
    """
    if thread not in THREADS:
        raise ValueError(f"thread must be 'inline', 'new' or 'now'; got {thread!r}")
    if type(gptr) is GlobalPointer:
        try:
            eng = current_engine()
        except RuntimeError:
            eng = None
        if eng is None or (eng.computation != gptr.computation and gptr.computation is not None):
            eng = current_engine_of(gptr.computation, "global pointer", gptr)  # raises why
        sent = gptr._sent
        head = None
        if sent is not None and sent[0]() is eng:
            try:
                head = sent[1].get((handler, thread))
            except TypeError:  # an unhashable handler: kept nowhere
                pass
        if head is None:
            head = _first(eng, gptr, handler, thread)
    else:
        _check_gptr(gptr, "rsr", "mf.export() or mf.info(handle).gptr")
        # a model's pointer may name a part of its object, which the handler
        # would not get (see MemoryPointer.__mf_rsr_check__)
        check = getattr(gptr, "__mf_rsr_check__", None)
        if check is not None:
            check()
        eng = current_engine_of(gptr.computation, "global pointer", gptr)
        head = _first(eng, gptr, handler, thread)
    ctx = gptr.context
    if ctx in eng.lost:  # (one it sent to meanwhile was dropped, never said)
        raise errors.ContextLost(ctx, eng.lost[ctx])
    if args:
        try:
            data, bufs = _encode(args)
        except marshal.PICKLE_ERRORS as e:
            raise errors.CallError(f"cannot send remote service request "
                                   f"{getattr(handler, '__qualname__', handler)}: {e}") from e
        eng.post_frame(ctx, [head + data, *bufs] if bufs else [head + data])
    else:
        eng.post_frame(ctx, [head])


_encode = marshal.dumps_args
_SENT_MAX = 16  # (handler, thread) pairs kept per pointer; more start afresh


def _first(eng: Any, gptr: GlobalPointer, handler: Callable[..., Any], thread: str) -> bytes:
    """Check a request that this context has not sent to ``gptr`` with
    ``handler`` before, and return the start of its frames (kept for the
    next request if the handler is stateless)."""
    _check_gptr(gptr, "rsr", "mf.export() or mf.info(handle).gptr")
    if not callable(handler):
        raise TypeError(f"mf.rsr(): handler must be callable (a picklable function); "
                        f"got {type(handler).__name__}")
    if not 0 <= gptr.context < eng.size:  # (one made by hand: ours are all in range)
        raise ValueError(f"mf.rsr(): {gptr!r} names context {gptr.context}; there are "
                         f"{eng.size} contexts (0..{eng.size - 1})")
    mine = spoken(eng)
    if gptr.protocols and not set(mine) & set(gptr.protocol_names()):
        raise ValueError(f"{gptr!r} is reachable by {gptr.protocol_names()}, "
                         f"this context speaks {mine}")
    keep = marshal.stateless(handler)
    try:
        head = rsr_frame(RSR_NOW if thread == "now" else RSR, gptr.gid, handler, thread,
                         fresh=not keep)
    except marshal.PICKLE_ERRORS as e:
        raise errors.CallError(f"cannot send remote service request "
                               f"{getattr(handler, '__qualname__', handler)}: {e}") from e
    if not keep:
        # a handler with state of its own (a bound method, a partial): its
        # pickle is made each time, so a change to it reaches the target
        return head
    sent = gptr._sent
    if sent is None or sent[0]() is not eng or len(sent[1]) >= _SENT_MAX:
        sent = gptr._sent = (weakref.ref(eng), {})
    sent[1][(handler, thread)] = head
    return head
