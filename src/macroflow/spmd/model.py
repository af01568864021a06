"""The SPMD model's part of each context (Tulip): runs, memory, collectives.

Every context of an SPMD run executes the same function (``mf.spmd``). The
model plugs into the core like the object model does: a call kind, ``spmd``,
that runs a run's function in a lightweight thread, a pointer kind,
``action``, that remote actions name (a remote service request run in a new
lightweight thread, whose value goes back unasked: see :func:`serve_action`),
and its own messages:

============  ===============================================================
GET           (op, request, ident, byte offset, nbytes): read registered memory
              and answer with MEMREPLY; served even while a method computes
PUT           (op, request, ident, byte offset, data): write registered memory,
              answer with MEMREPLY; served even while a method computes
MEMREPLY      (op, request, ok, data or error): completes a get or put handle
COLL          (op, run, seq, kind, phase, payload, root): one step of collective
              number ``seq`` of a run (phase "u" up the tree, "d" down it,
              "r" a reduction's result to its root, "f" (error text, missing):
              it failed on the sender, whose op raised or who saw a mismatch)
ENDED         (op, run, rank, entered, failure, natives, missing): a context's
              function of the run ended after entering ``entered`` collectives;
              natives: the transport's own collectives it started and has not
              seen end (see SpmdModel.catch_up), or None; missing: where it
              caught a collective's failure, the contexts that one named
STATUS        (op, run, asker): how far are you? (a timed-out collective
              asks, to name who did not arrive); served while computing
STATUS_REPLY  (op, run, rank, entered, where, waiting: (seq, kind, root, function)
              of each collective it waits in)
REVOKED       (op, request, ident): the sender unregistered the memory
              ``ident``; the receiver stops copying it directly and answers
              with MEMREPLY (served while computing)
WAKE          (op, run, seq): barrier ``seq`` of the run, in shared memory, is
              complete, and the receiver had said it would sleep
LOST          (op, run, rank, how): context ``rank`` of the run was lost, as the
              sender saw (the receiver may have no connection of its own to it)
============  ===============================================================

Collectives go up and down a binomial tree rooted at context 0 (the
subtree of each node is a contiguous range of ranks, so a reduction
combines values in rank order and an operation need only be associative);
a broadcast goes down a tree rooted at its root. They are driven by
messages, not by a waiting thread: ``barrier_async`` returns at once and the
tree goes on while the context computes or waits for something else.
"""

from __future__ import annotations

import itertools
import os
import pickle
import threading
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Optional, Tuple

from ..core import errors, marshal
from ..core.context import (RSR, RUNTIME_FILES, Call, CallKind, Engine, Model, _raw,
                            check_timeout, current_engine, register, register_model, rsr_frame)
from ..core.future import FINISHED, CoroutineType, Future, run_coroutine, stale_future
from ..core.threads import INTERRUPTS, getcurrent

# remote tracebacks start at the user's code: the SPMD model's frames around it say nothing
_HERE = os.path.dirname(os.path.abspath(__file__))
RUNTIME_FILES.update(os.path.join(_HERE, f) for f in os.listdir(_HERE) if f.endswith(".py"))

KIND = "spmd"
GET, PUT, MEMREPLY, COLL, ENDED, STATUS, STATUS_REPLY, REVOKED, WAKE, LOST = range(20, 30)
_UNKNOWN = object()
CAUGHT = " (caught): "  # in an ENDED's failure: the function caught it and returned
CORES = os.cpu_count() or 1  # more contexts than this on the host: oversubscribed
#: what an SPMD function called outside any computation says to do instead
USAGE = ("run the function on every context with mf.spmd(fn, n=N) (or start a computation: "
         "mf.run(main, contexts=N), 'with mf.init(contexts=N):')")
_RUNS_KEPT = 8  # runs whose messages are still routed after their function ended here
_EARLY_RUNS_MAX = 64  # runs not started here whose early messages are kept

#: name -> callable, for remote actions named by a string (see register_handler)
HANDLERS: Dict[str, Callable[..., Any]] = {}


def engine_side(eng: Engine, fn: Callable[..., Any], *args: Any) -> Any:
    """Run ``fn(*args)`` as engine code: from user code (a run's function),
    with the context's service mechanism kept out while it runs."""
    if eng.user and eng.serving != threading.get_ident():
        return eng._from_user(fn, *args)
    return fn(*args)


def local_future(eng: Engine) -> Future:
    """A future this context sets itself (a handle's, a collective's)."""
    f = Future(eng, eng.new_fid(), eng.id)
    f._asked = True  # its value is set here: nothing to ask for
    f._escaped = True  # and no slot at a home to release
    return f


class Done:
    """What a handle holds in place of a future when its operation completed
    at the call (a get or put done by a direct copy): nothing to wait for.

    Example:
        >>> Done(5).result(), Done(5)._state == FINISHED
        (5, True)
    """

    __slots__ = ("_value",)
    _state = FINISHED
    _exc = None  # as a finished future's: Handle.wait reads the two

    def __init__(self, value: Any):
        self._value = value

    def result(self, timeout: Optional[float] = None) -> Any:
        return self._value


class Handle:
    """A non-blocking operation in progress (Tulip's service handle).

    ``test()`` makes progress and says whether it is done (Tulip's Probe);
    ``wait(timeout=None)`` waits for it and returns its value (a get's
    array, a remote action's result, None for a put) or raises its error
    (Tulip's Wait). While it waits, the context serves gets, puts, remote
    actions, values and calls.

    Example:
        >>> import macroflow as mf, numpy as np
        >>> def main():
        ...     gp = mf.register(np.arange(4.0))
        ...     h = mf.get(gp)
        ...     return h.test(), h.wait()
        >>> mf.spmd(main, n=1, transport="inproc")
        [(True, array([0., 1., 2., 3.]))]
    """

    __slots__ = ("_eng", "_f", "_what", "_arrived")

    def __init__(self, eng: Engine, f: Any, what: Any):
        self._eng = eng
        self._f = f
        self._what = what

    def __reduce__(self) -> Any:
        # its future and engine are this context's: nothing elsewhere could wait for it
        raise TypeError(f"{self!r} cannot leave the context that started it (a result, an "
                        f"argument, a value in a message): wait() for it there and pass "
                        f"its value")

    def test(self) -> bool:
        """Serve what has arrived, then say whether the operation is done.

        Raises:
            macroflow.StaleReference: the operation is not done and its
                computation has ended.

        Example:
            >>> import macroflow as mf, numpy as np
            >>> def main():
            ...     ptrs = mf.allgather(mf.register(np.ones(2)))
            ...     h = mf.get(ptrs[1 - mf.rank()])
            ...     while not h.test():
            ...         pass                  # compute meanwhile
            ...     mf.barrier()
            ...     return h.wait()
            >>> mf.spmd(main, n=2, transport="inproc")
            [array([1., 1.]), array([1., 1.])]
        """
        if self._f._state == FINISHED:
            if not next(_TICKS) & _SERVE_EVERY:
                self._eng.poll_user()  # (see _SERVE_EVERY)
            return True
        if self._eng.closed:  # its computation ended: nothing will ever finish it
            raise stale_future(self._f)
        self._eng.poll_user()
        return self._f._state == FINISHED

    def done(self) -> bool:
        """Whether the operation is done, without making progress.

        Example:
            >>> import macroflow as mf, numpy as np
            >>> def main():
            ...     gp = mf.register(np.zeros(3))
            ...     return mf.put(gp, [1.0, 2.0, 3.0]).done()   # its own memory: at once
            >>> mf.spmd(main, n=1, transport="inproc")
            [True]
        """
        return self._f._state == FINISHED

    def wait(self, timeout: Optional[float] = None) -> Any:
        """Wait until done; return the value or raise the error.

        Raises:
            macroflow.TimeoutError: not done after ``timeout`` seconds (the
                operation goes on: wait again for it). Its result reaching
                this context only after the deadline counts as late too: on
                ``inproc``, where a handler that computes holds the one
                thread, the wait ends when it does, and raises this.
            macroflow.ContextLost: the context it needed ended.

        Example:
            >>> import macroflow as mf
            >>> def main():
            ...     return mf.remote_action(1 - mf.rank(), pow, 2, 10).wait(timeout=30)
            >>> mf.spmd(main, n=2, transport="inproc")
            [1024, 1024]
        """
        f = self._f
        if timeout is not None:
            timeout = check_timeout(timeout)  # a bad one is refused even when the handle is done
        if timeout is None or f._state == FINISHED:  # (math.inf: None)
            if f._state != FINISHED:  # f.result(), inline: a remote action's commonest wait
                self._eng.wait_future(f, None)
                if not next(_TICKS) & _SERVE_EVERY:
                    self._check_run()  # (served while it waited)
            elif not next(_TICKS) & _SERVE_EVERY:
                self._eng.poll_user()  # (see _SERVE_EVERY)
            if f._exc is not None:
                raise f._exc
            return f._value
        try:
            f.exception(timeout)  # (a value that came after the deadline is late too)
        except errors.TimeoutError:
            raise errors.TimeoutError(f"{describe(self._what)}: not done after {timeout} s "
                                      f"(it goes on: wait again for it)") from None
        return f.result()

    def __await__(self) -> Any:
        """``await handle`` is ``handle.wait()``, for an ``async def`` SPMD
        function or handler (and asyncio code, whose loop drives the engine
        meanwhile, as for a future).

        Example:
            >>> import macroflow as mf, numpy as np
            >>> async def main():
            ...     return await mf.get(mf.register(np.arange(3.0)))
            >>> mf.spmd(main, n=1, transport="inproc")
            [array([0., 1., 2.])]
        """
        f = self._f
        if f._state != FINISHED:
            yield from f.__await__()
        return self.wait()

    def _check_run(self) -> None:
        # what mf.poll() checks: a run that cannot complete (another
        # context's function failed) ends a function that loops on handles
        call = getattr(getcurrent(), "call", None)
        if call is not None:
            kind = self._eng.call_kinds.get(call.kind)
            if kind is not None:
                kind.polled(call)

    def __repr__(self) -> str:
        state = "done" if self._f._state == FINISHED else "pending"
        return f"<Handle {describe(self._what)} {state}>"


# A loop of handles done at once (gets and puts that copy shared memory
# themselves) would never serve: one reading a flag that a failed context
# would have set polled for ever. Every 64th such test() or wait() serves
# what has arrived, as mf.poll() does, and raises if the run cannot complete;
# every 64th wait that waited (it served meanwhile) raises so too.
_SERVE_EVERY = 63
_TICKS = itertools.count(1)


def describe(what: Any) -> str:
    """What a handle or request is, in words (kept as a tuple until asked:
    formatting it for every get would cost more than the get)."""
    if isinstance(what, tuple):
        kind, target, where = what
        if kind == "remote action":
            name = target if isinstance(target, str) else getattr(target, "__qualname__",
                                                                  "handler")
            return f"remote action {name} on context {where}"
        return f"{kind} of {target!r}"
    return str(what)


class Run:
    """One SPMD run as one context sees it."""

    __slots__ = ("ident", "size", "rank", "timeout", "entered", "colls", "early", "ended",
                 "failed", "aborted", "status", "status_wait", "call_fid", "natives", "counters",
                 "shm",
                 "signature", "offered", "told", "last", "probe")

    def __init__(self, ident: Any, size: int, rank: int, timeout: Optional[float]):
        self.ident = ident
        self.size = size
        self.rank = rank
        self.timeout = timeout  # collectives' default
        self.entered = 0  # collectives entered here
        self.colls: Dict[int, Any] = {}  # seq -> Collective, entered and not complete
        self.early: Dict[int, List[Tuple[int, tuple]]] = {}  # seq -> messages before entry
        self.ended: Dict[int, Tuple[int, Optional[str]]] = {}  # rank -> (entered, failure)
        self.failed: Optional[BaseException] = None  # ends every later collective
        # another context's function failed, or a context was lost: the run
        # cannot complete, and mf.poll() in this context's function raises it
        self.aborted: Optional[BaseException] = None
        # answers to STATUS: rank -> (entered, where, (seq, kind, root) of each pending)
        self.status: Dict[int, Tuple[int, str, tuple]] = {}
        self.status_wait: Optional[Future] = None
        self.call_fid: Any = None
        self.natives: Any = _UNKNOWN  # the transport's own collectives for the run, or None
        self.counters: Any = None  # this context's view of the run's barrier counters
        self.shm: Any = _UNKNOWN  # the ShmBarrier every context can use, or None
        self.offered = False  # barriers go in shared memory if every context can map it
        # the run's first barrier, by messages, while it finds out whether the
        # barriers after it go in shared memory (see collectives._enter)
        self.probe: Any = None
        self.told = False  # `failed` is another context's failure, which it told everyone
        self.signature = 0  # a CRC of the collectives entered, kinds and roots, in order
        self.last = ""  # the last collective entered, as errors name it


class SpmdCalls(CallKind):
    """Runs a run's function ("main") in a lightweight thread, where it may
    wait (a collective, a handle, a future); a remote action's handler runs
    as one of its calls too (see :func:`serve_action`)."""

    yields_on_poll = True
    keeps_exit = True  # mf.spmd names the context whose function exited (program._exited)
    runs = ""  # (its labels say it: "SPMD function f", "remote action h")

    def __init__(self, eng: Engine, model: "SpmdModel"):
        super().__init__(eng)
        self.model = model

    def accept(self, call: Call) -> None:
        if not call.missing:
            self.arguments_ready(call)

    def arguments_ready(self, call: Call) -> None:
        self.eng.spawn(self._run, call)

    def _run(self, call: Call) -> None:
        getcurrent().call = call
        if call.method == "main":
            self.eng._invoke(self.model.run_main, call)
        else:
            self.eng._invoke(None, call)

    def polled(self, call: Call) -> None:
        # a run that cannot complete ends a function that polls (waiting for
        # a flag a failed context would have set, say), rather than leave it
        # polling for ever while mf.spmd waits for it
        run = self.model.by_call.get(call.fid)
        if run is not None and run.aborted is not None:
            raise run.aborted

    @staticmethod
    def user_result(value: Any) -> Any:
        """What the user's function returned, in what run_main returns."""
        return value[0] if type(value) is tuple and value else value

    def label(self, call: Call) -> str:
        if call.method == "action" and call.args:
            return f"remote action {_name(call.args[0])}"
        if call.method == "main" and len(call.args) > 3:
            return f"SPMD function {_name(call.args[3])}"
        return f"spmd {call.method}"


def _name(fn: Any) -> str:
    return fn if isinstance(fn, str) else getattr(fn, "__qualname__", repr(fn))


#: what a remote action's request names (a remote service request's pointer):
#: the SPMD model of the context it goes to
ACTION = ("action", 0)
_HEADS_MAX = 256  # handlers whose request heads are kept; more start afresh
_heads: Dict[Any, bytes] = {}


class Action:
    """A remote action's handler as its request carries it: the remote
    service request's handler, called with the target's SPMD model, the
    handler's arguments and the requester's future id (see :func:`serve_action`).
    A stateless handler travels inside it, in the request's head that both
    ends keep; any other (``None`` here) travels with the arguments, pickled
    and unpickled afresh each time.

    Example:
        >>> Action(len), Action("tests.named").handler
        (Action(len), 'tests.named')
    """

    __slots__ = ("handler",)

    def __init__(self, handler: Any):
        self.handler = handler

    def __call__(self, model: "SpmdModel", *args: Any) -> None:
        # the future's id comes last, after the arguments: leading arrays
        # travel described (see marshal.dumps_args); before it, the handler
        # when the head does not hold it
        if self.handler is None:
            serve_action(model, args[-2], args[-1], args[-3], args[:-3])
        else:
            serve_action(model, args[-2], args[-1], self.handler, args[:-2])

    def __repr__(self) -> str:
        return f"Action({_name(self.handler)})"

    def __reduce__(self) -> Any:
        return (Action, (self.handler,))


def action_head(handler: Any) -> Tuple[bytes, bool]:
    """The start of a remote action's request with ``handler`` (see
    :func:`macroflow.core.context.rsr_frame`), and whether the handler must
    follow the arguments. A stateless handler (a function, a name: see
    :func:`macroflow.core.marshal.stateless`) is pickled into the head once
    here and decoded once by each receiver; any other has state that may
    change (a bound method's object, a partial's arguments), so it travels
    with the arguments, each request carrying its current value.

    Raises:
        macroflow.CallError: the handler cannot be pickled.

    Example:
        >>> from macroflow.core.context import RSR, _peek_op, _rsr_msg
        >>> head, carried = action_head(len)
        >>> _peek_op(head) == RSR, carried, _rsr_msg([head])[1:3]
        (True, False, (('action', 0), Action(len)))
        >>> action_head([].append)[1]
        True
    """
    try:
        head = _heads.get(handler)  # a stateless handler seen before is a key
    except TypeError:  # unhashable: it has state, and travels with the arguments
        head = None
    if head is not None:
        return head, False
    carried = not marshal.stateless(handler)
    key = None if carried else handler  # Action(None): the handler follows the arguments
    head = _heads.get(key)
    if head is None:
        try:
            head = rsr_frame(RSR, ACTION, Action(key), "new")
        except marshal.PICKLE_ERRORS as e:
            raise errors.CallError(f"cannot send remote action {_name(handler)}: "
                                   f"{type(e).__name__}: {e}") from e
        if len(_heads) >= _HEADS_MAX:
            _heads.clear()
        _heads[key] = head
    return head, carried


def serve_action(model: "SpmdModel", a0: int, a1: int, handler: Any, args: tuple) -> None:
    """A remote action's request, in a new lightweight thread of its target:
    run the handler as a call of the SPMD kind would (so it may wait, and
    ``mf.poll()`` in it lets what has arrived run), then send its value or
    its error to the requester, unasked, as the answer to future (a0, a1)."""
    eng = model.eng
    fid = (a0, a1)
    model.counts["spmd_actions_served"] += 1
    w = getcurrent()
    # a call record for the thread: waits in the handler take part in
    # deadlock probes, and mf.poll() knows the kind it runs for
    w.call = Call(fid, KIND, None, "action", (handler, args, {}), {}, None, 0, a0)
    svc = eng.service
    try:
        if svc is None:
            value = _run_action(handler, args, {})
        else:  # user code: the context serves meanwhile
            value = svc.run_user(_run_action, (handler, args, {}), None)
        ok = True
    except INTERRUPTS:
        raise  # Ctrl-C ends the program, it is not the handler's exception
    except BaseException as e:
        e = errors.exited(f"remote action {_name(handler)} on context {eng.id}", e)
        ok, value = False, e
    finally:
        w.call = None
    if ok and type(value) in marshal.PLAIN:  # _pickle_value's first case, inline
        eng.send_value(a0, (fid, None), True, pickle.dumps(value, 5), [])
    else:
        eng.send_value(a0, (fid, None), *eng._pickle_value(ok, value))


def _run_action(handler: Any, args: tuple, kwargs: dict) -> Any:
    if isinstance(handler, str):
        fn = HANDLERS.get(handler)
        if fn is None:
            raise errors.CallError(f"no remote action handler named {handler!r} on context "
                                   f"{current_engine().id} (registered: {sorted(HANDLERS)}); "
                                   f"register it with mf.register_handler({handler!r}, fn) in "
                                   f"every context, at import of a module they all import "
                                   f"(ranks spawned by the mpi transport, and workers that "
                                   f"joined over TCP, do not run the program's __main__), "
                                   f"or pass the function itself")
        handler = fn
    value = handler(*args, **kwargs)
    if type(value) is CoroutineType:  # an async def handler: run it here, as a method is
        value = run_coroutine(value)
    return value


class SpmdModel(Model):
    """The SPMD model's state in one context: registered memory, requests in
    flight, and the runs it takes part in.

    Example:
        >>> import macroflow as mf
        >>> with mf.init(contexts=1, transport="inproc"):
        ...     m = current_engine().models["spmd"]
        ...     sorted(m.kinds), m.pointers, m.regions
        (['spmd'], ('memory', 'action'), {})
    """

    name = "spmd"
    pointers = ("memory", "action")

    def __init__(self, eng: Engine):
        super().__init__(eng)
        self.kinds = {KIND: SpmdCalls(eng, self)}
        self.regions: Dict[Any, Any] = {}  # ident -> (array, its bytes, writable)
        self.revoked: set = set()  # idents of memory other contexts unregistered
        self.requests: Dict[int, Tuple[int, Future, Any, Any]] = {}  # req -> (peer, f, out, what)
        self.landed: set = set()  # gets whose reply was received into their array
        self.req_seq = itertools.count()
        self.runs: "OrderedDict[Any, Run]" = OrderedDict()
        self.early: "OrderedDict[Any, List[Tuple[int, tuple]]]" = OrderedDict()
        self.by_call: Dict[Any, Run] = {}  # the fid of a run's function here -> its run
        self.run_seq = itertools.count()
        # runs started here that may use the transport's own collectives: one
        # at a time (two runs' MPI collectives on one communicator would match
        # each other's), and only context 0's, which every context follows
        self.native_runs = 0
        self.counts = {"spmd_gets_direct": 0, "spmd_gets_window": 0, "spmd_gets_served": 0,
                       "spmd_gets_in_place": 0, "spmd_puts_direct": 0, "spmd_puts_served": 0,
                       "spmd_collectives": 0, "spmd_actions_served": 0}
        self.onesided: Optional[str] = None  # how gets and puts may go (env_onesided)
        self._window: Any = False  # the transport's one-sided window (False: not asked yet)
        self.window_gets: Dict[int, int] = {}  # context -> window gets from it in flight
        # puts sent to their owner and maybe not applied yet: a collective
        # waits for them before it begins, so that a barrier orders them (as
        # a direct put, done before its call returns, is ordered)
        self.puts_out: List[Future] = []

    # ------------------------------------------------------------------ the engine's hooks
    def exposed(self, bufs: List[Any]) -> bool:
        # a result in (or in part of) registered memory: a put from another
        # context changes it without a message here
        if not self.regions:
            return False
        from . import memory  # (loaded already: mf.register uses it)
        spans = []
        for m in map(_raw, bufs):
            if m.nbytes:
                start = memory._address(m)
                spans.append((start, start + m.nbytes))
        for entry in self.regions.values():
            data = entry[1]
            if data.nbytes:
                lo = memory._address(memoryview(data))
                if any(a < lo + data.nbytes and lo < b for a, b in spans):
                    return True
        return False

    def resolve(self, kind: str, ident: Any) -> Any:
        if kind == "action":
            return self  # a remote action's request (see serve_action)
        from ..core.context import MISSING
        entry = self.regions.get(ident)
        return MISSING if entry is None else entry[0]

    def lost(self, peer: int) -> None:
        exc = errors.ContextLost(peer, self.eng.lost.get(peer, "lost"))
        for req, (p, f, _, _) in list(self.requests.items()):
            if p == peer:
                del self.requests[req]
                self.landed.discard(req)
                f._set(False, exc)
        how = self.eng.lost.get(peer, "lost")
        for run in self.runs.values():
            if peer >= run.size:
                continue
            if run.aborted is None and peer not in run.ended:
                # the others of the run may never have spoken to it, so their
                # transports cannot tell: this context does
                for r in range(run.size):
                    if r != self.eng.id and r != peer and r not in self.eng.lost:
                        self.send(r, (LOST, run.ident, peer, how))
            self.run_lost(run, exc)

    def run_lost(self, run: "Run", exc: BaseException) -> None:
        """A context of ``run`` was lost: its collectives fail, and so does
        mf.poll() in this context's function (see SpmdCalls.polled)."""
        if run.aborted is None:
            run.aborted = exc
        if run.failed is None:
            run.failed = exc
            for c in list(run.colls.values()):
                c.fail(exc)

    def snapshot(self, d: Dict[str, Any]) -> None:
        d.update(self.counts)

    # ------------------------------------------------------------------ runs
    def run_main(self, run_id: Any, size: int, timeout: Optional[float], fn: Callable[..., Any],
                 args: tuple, counters: Any = None, native: bool = True) -> Any:
        """A run's function, in this context (user code: the call kind runs it);
        ``native``: the run may use the transport's own collectives."""
        eng = self.eng
        call = getcurrent().call
        run = engine_side(eng, self._start, run_id, size, timeout, call.fid, counters, native)
        failure = None
        try:
            value = fn(*args)
            if type(value) is CoroutineType:  # an async def function: run here, as a method is
                value = run_coroutine(value)
            # with what it called, for mf.spmd to check that every context agreed
            return value, run.entered, run.signature, run.failed is not None, run.last
        except BaseException as e:
            failure = f"{type(e).__name__}: {e}"
            raise
        finally:
            engine_side(eng, self._end, run, failure)

    def _start(self, run_id: Any, size: int, timeout: Optional[float], fid: Any,
               counters: Any = None, native: bool = True) -> Run:
        run = Run(run_id, size, self.eng.id, timeout)
        if not native:
            run.natives = None
        run.call_fid = fid
        self.onesided = env_onesided()  # a bad value fails the run at its start, everywhere
        # counters come only where the run's starter chose barriers in
        # shared memory (see offers_counters): every context takes its choice
        if counters is not None:
            run.offered = True
            from . import memory
            try:
                run.counters = memory.access().view(counters)
            except (OSError, ValueError):
                run.counters = None
        self.runs[run_id] = run
        while len(self.runs) > _RUNS_KEPT:
            old_id, old = self.runs.popitem(last=False)
            self.by_call.pop(old.call_fid, None)
        self.by_call[fid] = run
        for src, msg in self.early.pop(run_id, ()):
            self.dispatch(src, msg)
        return run

    def _end(self, run: Run, failure: Optional[str]) -> None:
        self.by_call.pop(run.call_fid, None)
        missing = None
        if failure is None and run.failed is not None and not run.told:
            # the function caught its collectives' failure and returned: the
            # others may wait in a collective this context counted as entered.
            # They are told what went wrong first (a timeout names who did
            # not arrive), not that the run is out of step since
            cause = getattr(run.failed, "_first", run.failed)
            failure = f"{type(cause).__name__}{CAUGHT}{cause}"
            missing = getattr(cause, "missing", None) or None
        natives = None if run.natives is _UNKNOWN or run.natives is None \
            else run.natives.unfinished()
        for r in range(run.size):
            if r != self.eng.id and r not in self.eng.lost:
                self.send(r, (ENDED, run.ident, self.eng.id, run.entered, failure, natives,
                              missing))

    def offers_counters(self, size: int, native: bool) -> bool:
        """Whether a run of ``size`` contexts that this context starts offers
        its barriers counters in shared memory: decided here, for all, as
        every context must take the same path (by its own core count, a rank
        of a host with fewer cores went by MPI's barrier while the others
        found out about shared memory by messages, and both waited for
        ever). Under MPI too when the run has no more contexts than cores:
        measured (2 ranks on one host), a barrier in shared memory took 7.5 us
        and MPI's Ibarrier polled by the engine 12 to 19 us; oversubscribed (4
        ranks on 2 cores) the Ibarrier won, 140 against 265 us."""
        from ..launch import _switch  # (0 or 1; anything else is refused, saying so)
        if not _switch("MACROFLOW_SHM_BARRIER", True, "MPI's or the messages' barriers",
                       "barriers in shared memory where they can be"):
            return False
        return size <= CORES or not native or self._natives_for(size) is None

    def natives(self, run: Run) -> Any:
        """The transport's own collectives for ``run`` (MPI's), or None: the
        same answer in every context of the run, which all take the same path.
        MACROFLOW_NATIVE_COLLECTIVES=0 turns them off (to compare)."""
        if run.natives is _UNKNOWN:
            run.natives = self._natives_for(run.size)
        return run.natives

    def _natives_for(self, size: int) -> Any:
        """The transport's own collectives for a run of contexts 0..size-1, or None."""
        fn = getattr(self.eng.transport, "native_collectives", None)
        from ..launch import _switch
        if not _switch("MACROFLOW_NATIVE_COLLECTIVES", True,
                       "collectives by macroflow's messages",
                       "the transport's own collectives, MPI's") or fn is None:
            return None
        return fn(list(range(size)))

    def catch_up(self, run: Run, natives: Tuple[int, list]) -> None:
        """Another context's function ended with native collectives started
        that this one never joined (it ended, or failed, first): join them, so
        that no rank's MPI is left holding a collective that cannot end."""
        mine = self.natives(run)
        if mine is None:
            return
        for op in mine.catch_up(*natives):
            if not op.test():
                self.eng.add_poller(op.test)

    def current_run(self, who: str) -> Run:
        """The run whose function is running in this lightweight thread."""
        call = getattr(getcurrent(), "call", None)
        run = self.by_call.get(call.fid) if call is not None else None
        if run is None:
            raise RuntimeError(f"{who} is for the function of an SPMD run (mf.spmd(fn)): "
                               f"every context of the run calls it; call it from fn")
        return run

    def any_run(self) -> Optional[Run]:
        call = getattr(getcurrent(), "call", None)
        run = self.by_call.get(call.fid) if call is not None else None
        if run is None and self.by_call:
            run = next(reversed(self.by_call.values()))
        return run

    # ------------------------------------------------------------------ messages
    def send(self, dest: int, msg: tuple) -> None:
        data, bufs = marshal.dumps(msg)
        self.eng.send_frame(dest, [data, *bufs] if bufs else [data])

    def dispatch(self, src: int, msg: tuple) -> None:
        """A COLL, ENDED, WAKE or LOST message of a run: to the run, or kept until it starts here."""
        run = self.runs.get(msg[1])
        if run is None:
            early = self.early.setdefault(msg[1], [])
            early.append((src, msg))
            while len(self.early) > _EARLY_RUNS_MAX:
                self.early.popitem(last=False)
            return
        if msg[0] == WAKE:
            from .collectives import on_wake
            on_wake(self, run, src, msg)
        elif msg[0] == LOST:
            self.run_lost(run, errors.ContextLost(msg[2], msg[3]))
        elif msg[0] == ENDED:
            from .collectives import on_ended
            on_ended(self, run, msg[2], msg[3], msg[4], msg[6])
            if msg[5] is not None:
                self.catch_up(run, msg[5])
        else:
            from .collectives import on_message
            on_message(self, run, src, msg)

    def window(self) -> Any:
        """The transport's one-sided window (see MpiTransport.window), or None."""
        if self._window is False:
            fn = getattr(self.eng.transport, "window", None)
            self._window = fn() if fn is not None else None
        return self._window

    def window_get(self, f: Future, value: Any, out: Any, ctx: int, address: int,
                   nbytes: int) -> None:
        """Read ``nbytes`` at ``address`` in context ``ctx`` through the window
        into ``out``; ``f`` gets ``value`` when they are there. The engine
        polls the MPI request: the owner does nothing."""
        eng = self.eng
        if ctx in eng.lost:
            f._set(False, errors.ContextLost(ctx, eng.lost[ctx]))
            return
        req = self.window().get(out, ctx, address, nbytes)
        gets = self.window_gets
        gets[ctx] = gets.get(ctx, 0) + 1

        def poll() -> bool:
            if not req.Test():
                if ctx not in eng.lost:
                    return False
                f._set(False, errors.ContextLost(ctx, eng.lost[ctx]))
            else:
                self.counts["spmd_gets_window"] += 1
                f._set(True, value)
            gets[ctx] -= 1
            return True

        for _ in range(_QUICK_LOOKS):  # a small read is often done by now
            if poll():
                return
        eng.add_poller(poll)

    def request(self, dest: int, f: Future, out: Any, what: Any, op: int, *fields: Any) -> None:
        """Send a GET or PUT to the owner; ``f`` completes with its MEMREPLY."""
        if dest in self.eng.lost:
            f._set(False, errors.ContextLost(dest, self.eng.lost[dest]))
            return
        req = next(self.req_seq)
        self.requests[req] = (dest, f, out, what)
        self.send(dest, (op, req) + fields)


def _target(eng: Engine, src: int, req: int, ident: Any, off: int, n: int,
            writing: bool) -> Any:
    """The bytes of registered memory ``ident`` a GET or PUT asks for, or None
    after answering the requester why not."""
    model = eng.models[SpmdModel.name]
    entry = model.regions.get(ident)
    if entry is None:
        error: BaseException = _gone(eng, ident)
    elif off < 0 or off + n > len(entry[1]):
        error = ValueError(f"bytes {off}..{off + n} are outside the registered "
                           f"{len(entry[1])} bytes")
    elif writing and not entry[2]:
        error = ValueError("the registered buffer is read-only: mf.put() cannot write it")
    else:
        return entry[1][off:off + n]
    model.send(src, (MEMREPLY, req, False, error))
    return None


def _serve_get(eng: Engine, src: int, msg: tuple) -> None:
    _, req, ident, off, n = msg
    data = _target(eng, src, req, ident, off, n, False)
    if data is not None:
        model = eng.models[SpmdModel.name]
        model.counts["spmd_gets_served"] += 1
        model.send(src, (MEMREPLY, req, True, pickle.PickleBuffer(data)))


def _serve_put(eng: Engine, src: int, msg: tuple) -> None:
    _, req, ident, off, payload = msg
    got = memoryview(payload).cast("B")
    data = _target(eng, src, req, ident, off, len(got), True)
    if data is not None:
        data[:] = got
        model = eng.models[SpmdModel.name]
        model.counts["spmd_puts_served"] += 1
        model.send(src, (MEMREPLY, req, True, None))


def _gone(eng: Engine, ident: Any) -> BaseException:
    return ValueError(f"no memory registered under {ident} on context {eng.id}: it was "
                      f"unregistered (mf.unregister), or the pointer is not from this run")


def _serve_memreply(eng: Engine, src: int, msg: tuple) -> None:
    _, req, ok, payload = msg
    model = eng.models[SpmdModel.name]
    entry = model.requests.pop(req, None)
    if entry is None:
        return  # its context was reported lost meanwhile: the handle has failed already
    _, f, out, what = entry
    if not ok:
        f._set(False, payload)
        return
    if out is None:  # a put
        f._set(True, None)
        return
    array, view = out
    if req in model.landed:
        model.landed.discard(req)  # the transport received the bytes into the array
        model.counts["spmd_gets_in_place"] += 1
    else:
        view[:] = memoryview(payload).cast("B")
    f._set(True, array)


def _land_memreply(eng: Engine, src: int, head: Any, nbytes: int) -> Optional[memoryview]:
    """The array a get posted, for the bytes of its MEMREPLY to land in (a
    rendezvous: the transport receives them there, not into a buffer of its
    own that the handler would then copy)."""
    model = eng.models.get(SpmdModel.name)
    if model is None or not model.requests:
        return None
    try:
        req = pickle.loads(head, buffers=[b""])[1]  # the payload is the buffer that lands
    except Exception:
        return None
    entry = model.requests.get(req)
    if entry is None or entry[0] != src or entry[2] is None:
        return None
    view = memoryview(entry[2][1])
    if view.nbytes != nbytes or view.readonly:
        return None
    model.landed.add(req)
    return view


def _serve_run_message(eng: Engine, src: int, msg: tuple) -> None:
    eng.models[SpmdModel.name].dispatch(src, msg)


def _serve_status(eng: Engine, src: int, msg: tuple) -> None:
    model = eng.models[SpmdModel.name]
    run = model.runs.get(msg[1])
    waiting: tuple = ()
    if run is None:
        entered, where = 0, "has not started the run's function"
    else:
        entered = run.entered
        pending = sorted(run.colls)
        where = (f"waits in collective #{pending[-1] + 1} ({run.colls[pending[-1]].name})"
                 if pending else ("has ended its function" if run.call_fid not in model.by_call
                                  else "computes"))
        from .collectives import function_of
        waiting = tuple((c.seq, c.kind, c.root, function_of(c))
                        for c in (run.colls[seq] for seq in pending))
    model.send(src, (STATUS_REPLY, msg[1], eng.id, entered, where, waiting))


def _serve_status_reply(eng: Engine, src: int, msg: tuple) -> None:
    model = eng.models[SpmdModel.name]
    run = model.runs.get(msg[1])
    if run is None:
        return
    run.status[msg[2]] = (msg[3], msg[4], msg[5])
    if run.status_wait is not None and len(run.status) >= run.size - 1:
        run.status_wait._set(True, None)


def _serve_revoked(eng: Engine, src: int, msg: tuple) -> None:
    model = eng.models[SpmdModel.name]
    if model.window_gets.get(src):
        # reads of its memory through the window are in flight: they end
        # before the owner hears that we heard (and detaches the memory)
        model.window().flush(src)
    revoked = model.revoked
    if len(revoked) >= 1 << 16:
        revoked.clear()  # a bound; a lost entry makes a stale get go to the owner, who refuses
    revoked.add(msg[2])
    model.send(src, (MEMREPLY, msg[1], True, None))


register(GET, _serve_get, served_while_busy=True)
register(REVOKED, _serve_revoked, served_while_busy=True)
register(PUT, _serve_put, served_while_busy=True)
register(MEMREPLY, _serve_memreply, landing=_land_memreply)
register(COLL, _serve_run_message)
register(WAKE, _serve_run_message)
register(ENDED, _serve_run_message)
register(LOST, _serve_run_message)
register(STATUS, _serve_status, served_while_busy=True)
register(STATUS_REPLY, _serve_status_reply)
register_model(SpmdModel.name, SpmdModel)


def model_of(eng: Engine) -> SpmdModel:
    return eng.models[SpmdModel.name]


_QUICK_LOOKS = 20  # tests of a window read before the engine polls it among the rest

#: the ways a get or put may go, fastest first (see env_onesided)
ONESIDED = ("direct", "window", "message")


def env_onesided() -> str:
    """How gets and puts may go: MACROFLOW_ONESIDED="direct" (the default:
    copy the memory directly when it is on this host, else read it through
    the transport's window (MPI under mpiexec), else ask the owner),
    "window" (never copy directly) or "message" (always ask the owner, as
    for memory on another host): to compare, or to test those paths on one
    host."""
    text = os.environ.get("MACROFLOW_ONESIDED") or "direct"
    if text not in ONESIDED:
        raise ValueError(f"MACROFLOW_ONESIDED must be one of {', '.join(ONESIDED)}; "
                         f"got {text!r}")
    return text


def env_timeout() -> Optional[float]:
    """The collectives' default timeout: MACROFLOW_COLLECTIVE_TIMEOUT seconds, or None."""
    text = os.environ.get("MACROFLOW_COLLECTIVE_TIMEOUT")
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"MACROFLOW_COLLECTIVE_TIMEOUT must be a number of seconds > 0; "
                         f"got {text!r}")
    return value
