"""SPMD runs and remote actions (Tulip's execution model and RemoteAction)."""

from __future__ import annotations

import weakref
from typing import Any, Callable, List, Optional, Tuple


from ..core import errors, marshal
from ..core.context import as_int, current_engine, positive_count
from ..core.future import CallSite, Future, running_computation
from ..core.threads import getcurrent
from .collectives import _check_timeout
from .model import HANDLERS, KIND, USAGE, Handle, _name, action_head, env_timeout, model_of


def spmd(fn: Callable[..., Any], *args: Any, n: Optional[int] = None,
         transport: Optional[str] = None, timeout: Optional[float] = None) -> List[Any]:
    """Run ``fn(*args)`` in every context at once (SPMD, as in Tulip) and
    return the list of its results by rank.

    Inside ``fn``, :func:`rank` and :func:`size` say which context this is
    and how many run; collectives, one-sided get/put and remote actions work
    between them, beside parallel objects. Outside a computation it starts
    one of ``n`` contexts (as :func:`macroflow.run` does) and ends it after;
    inside one it runs on contexts ``0..n-1`` (default: all). Under
    ``mpiexec -n N python script.py`` the same script runs one context per
    rank (``macroflow run -n N --spmd script.py`` runs a script's ``main``).

    Args:
        fn: a picklable function; every context gets ``args``. An ``async
            def`` function runs to its end in each context, awaiting
            macroflow's futures and handles as a coroutine method does.
        n: number of contexts (default: the computation's, or the CPU count).
        transport: for a new computation (see :func:`macroflow.init`).
        timeout: default timeout in seconds of the run's collectives (default
            MACROFLOW_COLLECTIVE_TIMEOUT, else none: a context that ends or
            fails without joining a collective is reported at once anyway).

    Raises:
        The error of the context that failed first in rank order (an error
        that only followed from another context's is not chosen over it);
        for a context whose function called ``sys.exit()``, a
        :class:`macroflow.MacroflowError` that names it (the caller does not
        exit).

    Example:
        >>> import macroflow as mf
        >>> def main(scale):
        ...     return mf.allreduce(mf.rank() * scale)
        >>> mf.spmd(main, 10, n=3, transport="inproc")
        [30, 30, 30]
    """
    if not callable(fn):
        raise TypeError(f"mf.spmd(): fn must be callable; got {type(fn).__name__}")
    if n is not None:
        n = positive_count(n, "mf.spmd(): n")
    if timeout is None:
        timeout = env_timeout()
    else:
        _check_timeout(timeout, "mf.spmd()")  # as a collective's
    if running_computation() is None:
        from ..launch import choose_transport, run
        try:
            choose_transport(transport, n)  # (its words name run's contexts=, ours n=)
        except ValueError as e:
            raise ValueError(str(e).replace(f"contexts={n}", f"mf.spmd(): n={n}")
                             .replace("pass contexts=", "pass n=")) from None
        return run(_in_computation, fn, args, n, timeout, contexts=n, transport=transport)
    if transport is not None:
        raise ValueError("mf.spmd(): transport= is for a new computation; one is running "
                         "(its contexts run fn)")
    return _in_computation(fn, args, n, timeout)


def _in_computation(fn: Callable[..., Any], args: tuple, n: Optional[int],
                    timeout: Optional[float]) -> List[Any]:
    eng = current_engine()
    size = eng.size if n is None else n
    if size > eng.size:
        raise ValueError(f"mf.spmd(): n={n}, but the computation has {eng.size} contexts; "
                         f"add some (mf.add_contexts) or ask for fewer")
    gone = [r for r in range(size) if r in eng.lost]
    if gone:
        # a run's ranks are contexts 0..size-1: one that has left would keep
        # the others waiting in their first collective
        raise errors.ContextLost(
            gone[0], f"{eng.lost[gone[0]]}; an SPMD run's ranks are contexts 0..n-1, so "
                     f"mf.spmd(n={size}) cannot run without it (contexts gone: {gone}; ask "
                     f"for n={gone[0]} or fewer)")
    model = model_of(eng)
    run_id = (eng.id, next(model.run_seq))
    # counters in shared memory for the run's barriers, used if every context
    # of the run can map them (the run's first barrier finds out)
    # MPI's own collectives for one run at a time, started by context 0
    # (nested runs, or runs started elsewhere, go by messages): every context
    # of a run takes the path the run's starter chose
    native = eng.id == 0 and not model.native_runs
    counters = region = None
    from . import memory, shmbarrier  # (numpy: loaded with the first run)
    if size > 1 and shmbarrier.problem() is None and model.offers_counters(size, native):
        counters = memory.shared_zeros(shmbarrier.ShmBarrier.nbytes(size), "u1")
        region = memory.describe(counters)
    model.native_runs += native
    try:
        try:
            futures = [eng.issue(KIND, None, "main", (run_id, size, timeout, fn, args, region,
                                                      native), {}, r) for r in range(size)]
        except errors.CallError as e:
            # (named as the user knows it, not by the runtime's call that carries it)
            name = getattr(fn, "__qualname__", None) or repr(fn)
            raise errors.CallError(str(e).replace("the arguments of main:", f"the arguments of "
                                                  f"SPMD function {name}:", 1)) from e.__cause__
        return _results(fn, futures)
    finally:
        model.native_runs -= native
        # the contexts that mapped them keep their mapping (and an error
        # raised from here must not hold them)
        counters = region = None  # noqa: F841


def _results(fn: Callable[..., Any], futures: List[Any]) -> List[Any]:
    """What each context's function returned; raise what went wrong."""
    results: List[Any] = []
    called = []
    failures = []
    for r, f in enumerate(futures):
        try:
            value, entered, signature, caught, last = f.result()
            results.append(value)
            # a context that caught a collective's error knows the run went wrong
            called.append(None if caught else (entered, signature, last))
        except errors.Terminated:
            raise  # this process was asked to end (SIGTERM): not a context's failure
        except SystemExit as e:
            # a context's sys.exit() is that context's failure, not the caller's exit
            failures.append((r, _exited(r, fn, e)))
            results.append(None)
        except Exception as e:
            failures.append((r, e))
            results.append(None)
    if failures:
        raise _cause(failures)
    if None not in called and any(c[:2] != called[0][:2] for c in called):
        # a collective whose messages crossed (a broadcast against a reduce,
        # different roots) can complete everywhere with wrong values
        raise errors.CollectiveError(
            "the contexts of the run called different collectives (kind, root, op or order) and "
            "the results may be wrong: " + "; ".join(
                f"context {r} entered {c[0]}" + (f", the last {c[2]}" if c[2] else "")
                + f" (signature {c[1]:08x})" for r, c in enumerate(called)),
            missing=[])
    return results


def _cause(failures: List[Tuple[int, BaseException]]) -> BaseException:
    """The error a failed run raises: a context's own error before the
    collective errors it caused elsewhere; among collective errors, that of a
    context that names itself missing (the failure started there), else of
    one the others name, else context 0's.

    Example:
        >>> e1 = errors.CollectiveError("context 1 cannot map the counters", missing=[1])
        >>> e0 = errors.CollectiveError("context 1 failed in its SPMD function", missing=[1])
        >>> str(_cause([(0, e0), (1, e1), (2, e0)]))
        'context 1 cannot map the counters'
        >>> e2 = errors.CollectiveError("context 0 failed in its SPMD function", missing=[0])
        >>> str(_cause([(0, e0), (1, e1), (2, e2)]))  # 2 heard of it from 0 first
        'context 1 cannot map the counters'
        >>> str(_cause([(0, e0), (2, ValueError("bad"))]))
        'bad'
    """
    for _, e in failures:
        if not isinstance(e, errors.CollectiveError):
            return e
    for r, e in failures:  # a context that names itself: the news started there
        if getattr(e, "missing", None) == [r]:
            return e
    named = {m for _, e in failures for m in getattr(e, "missing", ())}
    return next((e for r, e in failures if r in named), failures[0][1])


def _exited(rank: int, fn: Callable[..., Any], e: SystemExit) -> errors.MacroflowError:
    """The error mf.spmd raises for a context whose function called sys.exit().

    Example:
        >>> print(_exited(1, len, SystemExit(3)))
        context 1's SPMD function len called sys.exit(3): a run's function returns or raises; the run failed
    """
    how = "sys.exit()" if e.code is None else f"sys.exit({e.code!r})"
    name = getattr(fn, "__qualname__", None) or repr(fn)
    err = errors.MacroflowError(f"context {rank}'s SPMD function {name} called {how}: "
                                f"a run's function returns or raises; the run failed")
    err.__cause__ = e
    return err


def rank() -> int:
    """This context's rank in the SPMD run: its context id (0..size()-1).

    Example:
        >>> import macroflow as mf
        >>> mf.spmd(mf.rank, n=2, transport="inproc")
        [0, 1]
    """
    return current_engine(USAGE).id


def size() -> int:
    """How many contexts run the SPMD function (outside a run: how many the
    computation has).

    Example:
        >>> import macroflow as mf
        >>> mf.spmd(mf.size, n=2, transport="inproc")
        [2, 2]
    """
    eng = current_engine(USAGE)
    run = model_of(eng).any_run()
    return eng.size if run is None else run.size


_ACTION_SITE = CallSite("remote action")


def remote_action(rank: int, handler: Any, *args: Any) -> Handle:
    """Run ``handler(*args)`` in context ``rank``; return a :class:`Handle`
    that completes, with the handler's return value, once it has run there
    (Tulip's acknowledged RemoteAction).

    The handler runs in a lightweight thread of that context when its engine
    is free: while it waits (a collective, a handle, a future), polls
    (:func:`macroflow.poll`) or has nothing else to do; it may itself wait.
    The request is one remote service request, and the value comes back
    unasked as one message: two frames in all, as a remote service request
    ping-pong.

    Args:
        rank: the context.
        handler: any picklable callable, or the name of one registered with
            :func:`register_handler` in every context (a name travels in
            fewer bytes than a function).

    Raises:
        ValueError: ``rank`` is not a context of the computation, or
            ``handler`` is the empty str.
        TypeError: ``rank`` is not an integer, or ``handler`` is neither
            callable nor a str.
        macroflow.CallError: the handler or the arguments cannot be pickled.

    Example:
        >>> import macroflow as mf
        >>> def where(x):
        ...     return (mf.rank(), x)
        >>> def main():
        ...     h = mf.remote_action((mf.rank() + 1) % mf.size(), where, mf.rank())
        ...     got = h.wait()
        ...     mf.barrier()
        ...     return got
        >>> mf.spmd(main, n=2, transport="inproc")
        [(1, 0), (0, 1)]
    """
    # current_engine()'s first look, inline: a handler's or method's thread knows its engine
    eng = getattr(getcurrent(), "engine", None) or current_engine(USAGE)
    r = rank if type(rank) is int else as_int(rank)  # an int, or a numpy integer
    if r is None:
        raise TypeError(f"mf.remote_action(): rank must be an int (a context id); got "
                        f"{type(rank).__name__} {rank!r}")
    rank = r
    if not 0 <= rank < eng.size:
        raise ValueError(f"mf.remote_action(): rank must be a context in 0..{eng.size - 1}; "
                         f"got {rank!r}")
    if not (callable(handler) or isinstance(handler, str)):
        raise TypeError(f"mf.remote_action(): handler must be callable or the name of a "
                        f"registered handler; got {type(handler).__name__}")
    if handler == "":
        raise ValueError("mf.remote_action(): handler must be callable or the name of a "
                         "registered handler; got '' (no handler has an empty name)")
    head, carried = action_head(handler)
    fid = (eng.id, next(eng.seq))  # eng.new_fid(), inline
    try:
        data, bufs = marshal.dumps_args((*args, handler, fid[0], fid[1]) if carried
                                        else (*args, fid[0], fid[1]))
    except errors.StaleReference:
        raise  # a future of another computation among the arguments: as it is
    except Exception as e:  # a __reduce__ may raise anything
        what = (f"remote action {_name(handler)} (the handler or its arguments)" if carried
                else f"the arguments of remote action {_name(handler)}")
        raise errors.CallError(f"cannot send {what}: {type(e).__name__}: {e}") from e
    f = Future(eng, fid, rank, None, _ACTION_SITE)
    f._eager = True  # the value comes unasked
    f._escaped = True  # and is kept nowhere: nothing to release at its home
    if rank in eng.lost:
        f._set(False, errors.ContextLost(rank, eng.lost[rank]))
    else:
        eng.eager[fid] = weakref.ref(f)  # failed with ContextLost should rank be lost
        eng.post_frame(rank, [head + data, *bufs] if bufs else [head + data])
    return Handle(eng, f, ("remote action", handler, rank))


def register_handler(name: str, fn: Callable[..., Any]) -> None:
    """Name a remote action handler, so ``mf.remote_action(rank, name, ...)``
    finds it. Register it in every context: at import of a module they all
    import, or before the computation starts (forked contexts inherit it;
    ranks spawned by the mpi transport and workers that join over TCP do not
    run the program's ``__main__``, so there only a module they import
    registers it). Passing the function itself works everywhere.

    Example:
        >>> import macroflow as mf
        >>> def double(x):
        ...     return 2 * x
        >>> mf.register_handler("double", double)
        >>> mf.spmd(lambda: mf.remote_action(0, "double", 21).wait(), n=1, transport="inproc")
        [42]
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"register_handler(): name must be a non-empty str; got {name!r}")
    if not callable(fn):
        raise TypeError(f"register_handler(): fn must be callable; got {type(fn).__name__}")
    HANDLERS[name] = fn
