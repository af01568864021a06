"""Collectives of an SPMD run that keep serving while they wait (Tulip's barrier).

A vendor's blocking barrier cannot serve a remote request while it waits;
these can. Every collective is a small state machine driven by messages up
and down a binomial tree (see :mod:`macroflow.spmd.model`): the calling
lightweight thread only waits for its future, so its context's engine goes
on serving gets, puts, remote actions, values and calls meanwhile, and
``barrier_async`` does not wait at all.

Every context of a run must call the same collectives in the same order, as
in MPI. What goes wrong is reported, not left to hang: a context whose
function ends or fails before it joins a collective the others wait in ends
that collective with :class:`macroflow.CollectiveError` at once; two contexts
that call different collectives at the same place get the error naming
both; a collective that is not complete after its timeout asks every context
how far it got and names those that did not arrive.
"""

from __future__ import annotations

import numbers
import operator
import sys
import time
import zlib
from threading import get_ident
from typing import Any, Callable, List, Optional, Tuple


from ..core import errors
from ..core.context import as_int, current_engine
from ..core.future import Future
from ..core.threads import getcurrent
from .model import (_UNKNOWN, CAUGHT, COLL, CORES, STATUS, USAGE, WAKE, Run, SpmdModel,
                    engine_side, local_future, model_of)

STATUS_WAIT = 2.0  # seconds a timed-out collective waits for the others to say how far they got
CHECK_AFTER = 1.0  # a collective still waiting after this long asks the others what they
# called at its place (and again after twice as long, and so on): a mismatch is an error
POLL_SPIN = 2e-3  # seconds a context waiting in a polled collective does not sleep at first
QUICK_LOOKS = 20  # times a waiting thread looks before it parks (about 1 us each)


# A NaN wins a min or a max, as in np.minimum and np.maximum: a comparison
# with it is False, so without a test the result would depend on the order
# in which the tree combined the values.

def _min(a: Any, b: Any) -> Any:
    return _pick(a, b, "minimum", operator.le)


def _max(a: Any, b: Any) -> Any:
    return _pick(a, b, "maximum", operator.ge)


def _pick(a: Any, b: Any, ufunc: str, keep_a: Callable[[Any, Any], bool]) -> Any:
    np = sys.modules.get("numpy")  # (no array nor numpy scalar without it)
    if np is not None:
        if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
            return getattr(np, ufunc)(a, b)
        if isinstance(a, np.floating) and a != a:
            return a
    if isinstance(a, float) and a != a:
        return a
    return a if keep_a(a, b) else b


#: the named reduction operations (numpy arrays combine element by element)
OPS = {"sum": operator.add, "prod": operator.mul, "min": _min, "max": _max}


def _concat(a: List[Any], b: List[Any]) -> List[Any]:
    return a + b


def _nothing(a: Any, b: Any) -> None:
    return None


def children(rel: int, n: int) -> List[int]:
    """The children of relative rank ``rel`` in the binomial tree of ``n``
    ranks rooted at 0: ``rel + 2**k`` for every ``2**k`` below ``rel``'s
    lowest set bit. Each child's subtree is a contiguous range of ranks.

    Example:
        >>> children(0, 8), children(4, 8), children(6, 8), children(1, 8), children(0, 5)
        ([1, 2, 4], [5, 6], [7], [], [1, 2, 4])
    """
    out = []
    bit = 1
    while bit < n and not rel & bit:
        if rel + bit < n:
            out.append(rel + bit)
        bit <<= 1
    return out


def parent(rel: int) -> int:
    """The parent of relative rank ``rel`` > 0: ``rel`` without its lowest set bit.

    Example:
        >>> [parent(r) for r in range(1, 8)]
        [0, 0, 2, 0, 4, 4, 6]
    """
    return rel & (rel - 1)


_UP = ("barrier", "reduce", "allreduce", "allgather")


class Collective:
    """One collective of a run, in one context."""

    __slots__ = ("model", "run", "seq", "kind", "name", "root", "op", "opname", "value", "ups",
                 "sent_up", "future", "epoch", "quick", "native")

    def __init__(self, model: SpmdModel, run: Run, kind: str, name: str, value: Any,
                 op: Callable[[Any, Any], Any], root: int, opname: Optional[str] = None):
        self.model = model
        self.run = run
        self.seq = run.entered
        self.kind = kind
        self.name = name
        self.root = root
        self.op = op
        self.opname = opname
        self.value = value
        self.ups: dict = {}
        self.sent_up = False
        self.future = local_future(model.eng)
        self.epoch = 0  # a barrier in shared memory: its epoch, while it sleeps
        # what completes it without a message (an MPI request, counters in
        # shared memory): the waiting thread tries it a few times before it parks
        self.quick: Optional[Callable[[], Any]] = None
        self.native = False  # in the transport's collective: the tree's messages wait

    # -- the tree
    def up_children(self) -> List[int]:
        return children(self.run.rank, self.run.size)

    def down_children(self) -> List[int]:
        n, r = self.run.size, self.root if self.kind == "broadcast" else 0
        rel = (self.run.rank - r) % n
        return [(c + r) % n for c in children(rel, n)]

    def start(self) -> None:
        run = self.run
        if self.ended():
            return
        natives = self.model.natives(run)
        # a barrier in shared memory beats MPI's where the run offers one (see _start)
        shared = self.kind == "barrier" and run.offered and run.shm is not None
        if natives is not None and not shared and natives.can(self.kind, self.value, self.opname):
            self.start_native(natives)
            return
        if self.kind == "barrier":
            if run.shm is _UNKNOWN:
                # the run's first barrier goes by messages and finds out
                # whether every context can use the counters in shared memory
                self.value = 1 if run.counters is not None else 0
                self.op = _min
                run.probe = self
            elif run.shm is not None:
                self.start_shared(run.shm)
                return
        self.start_tree()

    def ended(self) -> bool:
        """Fail it, and say so, if the run failed or a context ended before it."""
        run = self.run
        if run.failed is not None:
            self.fail(run.failed)
            return True
        for rank, (entered, failure) in run.ended.items():
            if failure is None and entered <= self.seq:
                self.fail(_never_joins(self, rank, entered))
                return True
        return False

    def start_tree(self) -> None:
        """Do it by messages up and down the run's binomial tree."""
        run = self.run
        for src, msg in run.early.pop(self.seq, ()):
            self.message(src, msg)
            if self.future._state:
                return
        try:
            if self.kind in _UP:
                self.try_up()
            elif run.rank == self.root:  # broadcast
                self.down(self.value)
        except _Unsent:
            pass  # it failed, on every context (see send)

    def start_native(self, natives: Any) -> None:
        """Let the transport do it (MPI's non-blocking collectives), polled by the engine."""
        op = natives.start(self.kind, self.value, self.opname)
        self.native = True

        def poll() -> bool:
            # failed meanwhile (a context ended without joining): still driven
            # until MPI ends it (the context that did not join catches up)
            if not op.test():
                return False
            if not self.future._state:
                if op.fallback:  # every rank learnt it at once: all go by the tree
                    self.native = False
                    self.quick = None
                    if not self.ended():
                        self.start_tree()
                else:
                    self.complete(op.result())
            return True

        if not poll():
            spin = _spin(self.run)
            if spin > 0:
                self.quick = poll
            self.model.eng.add_poller(poll, spin=spin)

    def start_shared(self, shm: Any) -> None:
        """A barrier in shared memory (every context of the run is on this
        host): arrive with a store, poll the others' counters for a while
        (never when the run has more contexts than cores), then sleep until
        the context that completes the barrier sends a WAKE."""
        epoch = shm.arrive()
        if shm.complete(epoch):  # the last to arrive: wake those that sleep
            _wake_sleepers(self.model, self.run, shm, epoch, self.seq)
            self.complete(None)
            _complete_shared(self.run)  # earlier ones in flight (barrier_async)
            return
        self.wait_shared(shm, epoch)

    def wait_shared(self, shm: Any, epoch: int) -> None:
        """The rest of :meth:`start_shared`, once this context has arrived."""
        self.epoch = epoch
        spin = _spin(self.run)
        until = time.monotonic() + spin

        def poll() -> bool:
            if self.future._state:  # failed meanwhile (a context ended without joining)
                return True
            if shm.complete(epoch):
                _complete_shared(self.run)
                return True
            if time.monotonic() < until:
                return False
            shm.sleep_flag(epoch)  # then look once more: one of us sees the other
            if shm.complete(epoch):
                _complete_shared(self.run)
            return True  # a WAKE completes it (see on_wake)

        if spin > 0:
            self.quick = lambda: shm.complete(epoch) and not self.complete(None)
            self.model.eng.add_poller(poll, spin=spin)
        else:
            poll()

    def message(self, src: int, msg: tuple) -> None:
        _, _, seq, kind, phase, payload, root = msg
        if phase == "f":  # it failed on context src (its op raised, or it saw a mismatch)
            text, missing = payload
            _give_up(self, errors.CollectiveError(text, missing=missing), "failed")
            return
        if kind != self.kind or root != self.root:
            err = errors.CollectiveError(
                f"{self.name}: context {src} called mf.{kind}() as collective #{seq + 1} of "
                f"the run, where context {self.run.rank} called {self.name}: every context "
                f"must call the same collectives in the same order" if kind != self.kind else
                f"{self.name}: context {src} gave root={root} to collective #{seq + 1} of the "
                f"run, context {self.run.rank} root={self.root}: every context must give the "
                f"same root", missing=[])
            # src may wait for a message of ours that will never come: told at once
            self.send(src, "f", (str(err), []))
            _give_up(self, err, "did not match another context's")
            return
        if self.native:  # a context that left MPI's collective first: kept for the tree
            self.run.early.setdefault(self.seq, []).append((src, msg))
            return
        try:
            if phase == "u":
                self.ups[src] = payload
                self.try_up()
            elif phase == "d":
                self.down(payload)
            else:  # "r": a reduction's result, to its root
                self.complete(payload)
        except _Unsent:
            pass  # it failed, on every context (see send)

    def try_up(self) -> None:
        if self.sent_up:
            return
        kids = self.up_children()
        ups = self.ups
        if len(ups) < len(kids):
            return
        self.sent_up = True
        acc = [self.value] if self.kind == "allgather" else self.value
        try:
            for c in kids:
                acc = self.op(acc, ups[c])
        except Exception as e:
            self.ups = {}  # (what came is not kept: a large array may be a view of a ring)
            err = errors.CollectiveError(
                f"{self.name}: the operation "
                f"{self.opname or getattr(self.op, '__qualname__', self.op)!r} "
                f"failed on context {self.run.rank}: {type(e).__name__}: {e}",
                missing=[self.run.rank])
            # the others wait for what this context will never send: they
            # are told at once, and the run's later collectives fail here
            for r in range(self.run.size):
                if r != self.run.rank:
                    self.send(r, "f", (str(err), err.missing))
            _give_up(self, err, "failed")
            return
        self.ups = {}
        rank = self.run.rank
        if rank:
            self.send(parent(rank), "u", acc)
            if self.kind == "reduce" and rank != self.root:
                self.complete(None)
            return
        if self.kind == "reduce":
            if self.root == 0:
                self.complete(acc)
            else:
                self.send(self.root, "r", acc)
                self.complete(None)
        else:
            self.down(None if self.op is _nothing else acc)

    def down(self, value: Any) -> None:
        for c in self.down_children():
            self.send(c, "d", value)
        self.complete(value)

    def send(self, dest: int, phase: str, payload: Any) -> None:
        try:
            self.model.send(dest, (COLL, self.run.ident, self.seq, self.kind, phase, payload,
                                   self.root))
        except ConnectionError:
            pass  # the peer's loss is reported to every collective by the model
        except Exception as e:
            if phase == "f":
                raise  # (a text and ranks: nothing that fails to pickle)
            # what this context gives (or passes on) cannot be pickled: the
            # collective fails on every context, told at once, rather than
            # the others waiting for it for ever while this one goes on
            err = errors.CollectiveError(
                f"{self.name}: what context {self.run.rank} gives cannot be sent (it cannot "
                f"be pickled): {type(e).__name__}: {e}", missing=[self.run.rank])
            err.__cause__ = e
            for r in range(self.run.size):
                if r != self.run.rank:
                    self.send(r, "f", (str(err), err.missing))
            _give_up(self, err, "failed")
            raise _Unsent() from e

    def complete(self, value: Any) -> None:
        run = self.run
        run.colls.pop(self.seq, None)
        if self.kind == "barrier":
            if run.shm is _UNKNOWN and self.op is _min:
                try:
                    run.shm = _shared(run) if value == 1 else None
                except errors.CollectiveError as e:
                    # the others go on in shared memory: this context cannot
                    # join them, so the run's collectives fail here (and, when
                    # its function fails, everywhere) rather than hang
                    run.shm = None
                    run.failed = e
                    for c in [self, *run.colls.values()]:
                        c.fail(e)
                    return
            value = None
        self.future._set(True, value)

    def fail(self, exc: BaseException) -> None:
        self.run.colls.pop(self.seq, None)
        self.future._set(False, exc)


class _Unsent(Exception):
    """A collective's message could not be pickled: it failed (Collective.send)."""


def _wake_sleepers(model: SpmdModel, run: Run, shm: Any, epoch: int, seq: int) -> None:
    """This context completed barrier ``epoch`` (collective ``seq`` of the
    run): wake the contexts that sleep in it."""
    for r in shm.sleepers(epoch):
        if r != run.rank:
            try:
                model.send(r, (WAKE, run.ident, seq))
            except ConnectionError:
                pass


def _shared(run: Run) -> Any:
    """The run's barrier in shared memory, once every context said it can map
    the counters; CollectiveError if this context cannot make it after all
    (the others would then wait in shared memory for a context that does not
    come there)."""
    from . import shmbarrier
    try:
        return shmbarrier.ShmBarrier(run.counters, run.size, run.rank)
    except Exception as e:
        raise errors.CollectiveError(
            f"mf.barrier(): context {run.rank} cannot use the run's barrier counters in shared "
            f"memory ({type(e).__name__}: {e}), which the other contexts use from now on, so "
            f"the run's collectives cannot go on (MACROFLOW_SHM_BARRIER=0 keeps every barrier "
            f"on messages)", missing=[run.rank]) from e


def _spin(run: Run) -> float:
    """How long a waiting context polls without sleeping: never when the run
    has more contexts than this host has cores (the others need the CPU)."""
    return POLL_SPIN if run.size <= CORES else 0.0


def _never_joins(c: Collective, rank: int, entered: int) -> errors.CollectiveError:
    return errors.CollectiveError(
        f"{c.name}: context {rank} ended its SPMD function after {entered} collective(s), "
        f"so it never joins this one (collective #{c.seq + 1} of the run): every context "
        f"must call the same collectives", missing=[rank])


def on_message(model: SpmdModel, run: Run, src: int, msg: tuple) -> None:
    """A COLL message for ``run``: to its collective, or kept until this context enters it."""
    c = run.colls.get(msg[2])
    if c is not None:
        c.message(src, msg)
    elif msg[2] >= run.entered:
        run.early.setdefault(msg[2], []).append((src, msg))


def on_wake(model: SpmdModel, run: Run, src: int, msg: tuple) -> None:
    """Barrier ``msg[2]`` of ``run``, in shared memory, is complete (the
    context that completed it saw this one sleep)."""
    _complete_shared(run)


def _complete_shared(run: Run) -> None:
    """Complete every barrier in shared memory this context waits for that
    is complete: a later one completing means the earlier ones did (a
    context may have several in flight, with barrier_async)."""
    shm = run.shm
    if not shm or shm is _UNKNOWN:
        return
    for c in list(run.colls.values()):
        if c.epoch and not c.future._state and shm.complete(c.epoch):
            c.complete(None)


def on_ended(model: SpmdModel, run: Run, rank: int, entered: int, failure: Optional[str],
             missing: Optional[List[int]] = None) -> None:
    """Context ``rank`` ended the run's function after ``entered`` collectives
    (``missing``: those a failure it caught named)."""
    run.ended[rank] = (entered, failure)
    if failure is not None and CAUGHT not in failure and run.aborted is None:
        run.aborted = errors.CollectiveError(
            f"mf.poll(): context {rank} failed in its SPMD function ({failure}), so the run "
            f"cannot complete: this context's function ends here", missing=[rank])
    if failure is not None and run.failed is None:
        run.told = True
        what = (f"ended its SPMD function after a collective failed there, an error it caught "
                f"({failure.replace(CAUGHT, ': ', 1)})" if CAUGHT in failure
                else f"failed in its SPMD function ({failure})")
        run.failed = errors.CollectiveError(
            f"context {rank} {what}, so the run's collectives cannot complete",
            missing=missing or [rank])
        for c in list(run.colls.values()):
            c.fail(run.failed)
        return
    for c in list(run.colls.values()):
        if c.seq >= entered:
            c.fail(_never_joins(c, rank, entered))


def _enter(kind: str, name: str, value: Any, op: Callable[[Any, Any], Any], root: int,
           opname: Optional[str] = None, timeout: Optional[float] = None) -> Collective:
    if timeout is not None:
        _check_timeout(timeout, name)  # before it counts as this context's next collective
    eng = current_engine(USAGE)
    model = model_of(eng)
    run = model.current_run(name)
    r = as_int(root)  # an int, or a numpy integer
    if r is None:  # (a TypeError, as a context id of another type is elsewhere)
        raise TypeError(f"{name}: root must be a rank in 0..{run.size - 1} (an int); "
                        f"got {root!r}")
    if not 0 <= r < run.size:
        raise ValueError(f"{name}: root must be a rank in 0..{run.size - 1}; got {root!r}")
    root = r
    if model.puts_out:
        _land_puts(eng, model)
    probe = run.probe
    if kind == "barrier" and probe is not None and not probe.future._state:
        # Every context takes the path the run's first barrier found for the
        # barriers after it, so none starts before that is known here: one
        # started behind a first barrier_async() not yet complete went by
        # messages where it had completed, in shared memory where it had, and
        # from then on each context counted barriers of its own (one waited
        # for ever at the end; every barrier before it completed one early).
        # (Waited for as a collective is: a mismatch or a timeout is said.)
        _wait(probe, timeout)
    return engine_side(eng, _begin, model, run, kind, name, value, op, root, opname)


def _land_puts(eng: Any, model: SpmdModel) -> None:
    """Wait until this context's puts by message have been applied: a
    collective orders them, on every path, as it orders direct puts (done
    before their call returns). A put that failed keeps its error in its handle."""
    out, model.puts_out = model.puts_out, []
    for f in out:
        if not f.done():
            eng.wait_future(f, None)


def _begin(model: SpmdModel, run: Run, kind: str, name: str, value: Any, op: Any,
           root: int, opname: Optional[str]) -> Collective:
    c = Collective(model, run, kind, name, value, op, root, opname)
    _entered(model, run, kind, root, op)
    run.colls[c.seq] = c
    c.start()
    return c


_SIGNS: dict = {}  # (kind, root, op) -> what a collective adds to a run's signature, its label
_ROOTED = ("broadcast", "reduce")


def _op_name(op: Any) -> str:
    """How a reduction's op is named in a run's signature and its errors."""
    for name, fn in OPS.items():
        if fn is op:
            return name
    if isinstance(op, str):
        return op
    return f"{getattr(op, '__module__', '')}.{getattr(op, '__qualname__', type(op).__name__)}"


def function_of(c: Collective) -> str:
    """The function of ``mf`` that made collective ``c`` (``barrier_async``
    makes a barrier), as errors name it.

    Example:
        >>> function_of(type("C", (), {"name": "mf.barrier_async()"})())
        'barrier_async'
    """
    return c.name[3:].split("(", 1)[0]


def label(kind: str, root: int, op: Optional[str] = None) -> str:
    """How errors name a collective: its function, its root if it has one,
    and a reduction's ``op`` if given.

    Example:
        >>> label("broadcast", 1), label("barrier", 0), label("reduce", 1, "max")
        ('mf.broadcast(root=1)', 'mf.barrier()', 'mf.reduce(root=1, op=max)')
    """
    given = ([f"root={root}"] if kind in _ROOTED else []) + ([f"op={op}"] if op else [])
    return f"mf.{kind}({', '.join(given)})"


def _entered(model: SpmdModel, run: Run, kind: str, root: int, op: Any = None) -> None:
    run.entered += 1
    # what this context called, in order: compared between contexts when the
    # run ends (the op too: a tree whose nodes combine with different ops
    # completes, with a value neither op gives)
    try:
        known = _SIGNS.get((kind, root, op))
    except TypeError:  # an op that cannot be hashed: by its name
        op = _op_name(op)
        known = _SIGNS.get((kind, root, op))
    if known is None:
        opname = _op_name(op) if kind in ("reduce", "allreduce") else None
        sign = f"{kind}@{root}:{opname};" if opname else f"{kind}@{root};"
        known = (sign.encode(), label(kind, root, opname))
        if len(_SIGNS) < 4096:  # (ops made afresh at each call are not all kept)
            _SIGNS[(kind, root, op)] = known
    run.signature = zlib.crc32(known[0], run.signature)
    run.last = known[1]
    model.counts["spmd_collectives"] += 1


def _fast_barrier(model: SpmdModel, run: Run, shm: Any, name: str) -> Optional[Collective]:
    """A barrier in shared memory that completes within a few looks, with no
    Collective made (None); else the Collective that waits for it, this
    context having arrived. Only when nothing is unusual: no failure, no
    context ended, nothing arrived early for it (the full path handles those)."""
    seq = run.entered
    if run.failed is not None or run.ended or seq in run.early:
        return _begin(model, run, "barrier", name, None, _nothing, 0, None)
    epoch = shm.arrive()
    last = shm.complete(epoch)  # the last to arrive: it wakes those that sleep
    done = last
    if not done and run.size <= CORES:
        # the others are often a few microseconds away: parking this thread
        # and stepping the engine costs more than looking a few times
        for _ in range(QUICK_LOOKS):
            if shm.complete(epoch):
                done = True
                break
    if done:
        _entered(model, run, "barrier", 0)
        if last:
            _wake_sleepers(model, run, shm, epoch, seq)
        if run.colls:
            _complete_shared(run)  # earlier ones in flight (barrier_async)
        return None
    c = Collective(model, run, "barrier", name, None, _nothing, 0, None)
    _entered(model, run, "barrier", 0)
    run.colls[seq] = c
    c.wait_shared(shm, epoch)
    return c


def _wait(c: Collective, timeout: Optional[float]) -> Any:
    if timeout is None:
        timeout = c.run.timeout
    else:
        _check_timeout(timeout, c.name)
    f = c.future
    quick = c.quick
    if quick is not None and not f._state:
        # the others are often a few microseconds away: parking this thread
        # and stepping the engine costs more than looking a few times
        for _ in range(QUICK_LOOKS):
            quick()
            if f._state:
                break
    deadline = None if timeout is None else time.monotonic() + timeout
    check = CHECK_AFTER
    while True:
        # wait in slices: after each, ask the others what they called here
        left = None if deadline is None else deadline - time.monotonic()
        try:
            return f.result(check if left is None else max(0.0, min(check, left)))
        except errors.TimeoutError:
            if f.done():
                return f.result()
        if left is not None and left <= check:
            late = _late(c)
            if not late[0]:
                # every context has arrived: the tree's messages are on their
                # way (on inproc, behind a context that held the one thread),
                # and the collective completes unless something is wrong
                try:
                    return f.result(STATUS_WAIT)
                except errors.TimeoutError:
                    pass
            raise _timed_out(c, timeout, late)  # type: ignore[arg-type]
        err = _mismatch(c)
        if err is not None:
            engine_side(c.model.eng, _give_up, c, err, "did not match another context's")
            raise err
        check *= 2


def _ask(c: Collective) -> None:
    """Ask every other context of ``c``'s run how far it got (its answers
    fill ``run.status``); wait STATUS_WAIT seconds at most for them."""
    eng = c.model.eng
    run = c.run
    wait = local_future(eng)

    def ask() -> None:
        run.status = {}
        run.status_wait = wait
        for r in range(run.size):
            if r != run.rank and r not in eng.lost:
                c.model.send(r, (STATUS, run.ident, run.rank))
        if run.size == 1:
            wait._set(True, None)

    engine_side(eng, ask)
    try:
        wait.result(STATUS_WAIT)
    except errors.TimeoutError:
        pass


def _mismatch(c: Collective) -> Optional[errors.CollectiveError]:
    """The error for another context that waits, at ``c``'s place in the
    run, in another collective (or the same with another root); None if none
    does."""
    _ask(c)
    mine = label(function_of(c), c.root)
    for r, got in sorted(c.run.status.items()):
        for seq, kind, root, fn in got[2]:
            if seq == c.seq and (kind, root) != (c.kind, c.root):
                return errors.CollectiveError(
                    f"{c.name} (collective #{c.seq + 1} of the run): context {c.run.rank} "
                    f"called {mine} where context {r} called {label(fn, root)}; every "
                    f"context must call the same collectives, with the same root, in the "
                    f"same order", missing=[])
    return None


def _check_timeout(timeout: Any, name: str) -> None:
    # as result() does: TypeError for what is no number, ValueError for a number
    # that is no timeout (a collective's must be > 0: at 0 none could complete)
    # (numpy's integers and floats are numbers.Real too)
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise TypeError(f"{name}: timeout must be a number of seconds > 0, or None; "
                        f"got {timeout!r}")
    if not timeout > 0:
        raise ValueError(f"{name}: timeout must be a number of seconds > 0, or None; "
                         f"got {timeout!r}")


def _late(c: Collective) -> Tuple[List[int], List[str]]:
    """Ask every other context how far it got: those that did not arrive at
    ``c``, and a line for each saying how far."""
    run = c.run
    _ask(c)
    missing, lines = [], []
    for r in range(run.size):
        if r == run.rank:
            continue
        got = run.status.get(r)
        if got is None:
            missing.append(r)
            lines.append(f"context {r}: did not answer within {STATUS_WAIT:g} s")
        elif got[0] <= c.seq:
            missing.append(r)
            lines.append(f"context {r}: has entered {got[0]} collective(s), {got[1]}")
    return missing, lines


def _timed_out(c: Collective, timeout: float,
               late: Tuple[List[int], List[str]]) -> errors.CollectiveError:
    """The error of ``c`` not complete after ``timeout``, naming the contexts
    ``late`` (see _late) says did not arrive; ``c`` fails with it."""
    missing, lines = late
    err = errors.CollectiveError(
        f"{c.name} (collective #{c.seq + 1} of the run) not complete after {timeout:g} s; "
        + (f"contexts that did not arrive: {missing}\n  " + "\n  ".join(lines) if missing
           else f"every context has arrived, and {STATUS_WAIT:g} s later the tree's messages "
                f"have not"),
        missing=missing)
    engine_side(c.model.eng, _give_up, c, err)
    return err


def _give_up(c: Collective, err: BaseException, how: str = "timed out") -> None:
    c.fail(err)
    if c.run.failed is None:  # later collectives would be out of step
        c.run.failed = errors.CollectiveError(
            f"an earlier collective of the run (#{c.seq + 1}, {c.name}) {how} on context "
            f"{c.run.rank}; the run's collectives are out of step", missing=err.missing)
        c.run.failed._first = err  # what the others are told (see SpmdModel._end)


def _op(op: Any, name: str) -> Callable[[Any, Any], Any]:
    if isinstance(op, str):
        fn = OPS.get(op)
        if fn is None:
            raise ValueError(f"{name}: op must be one of {sorted(OPS)} or a binary callable; "
                             f"got {op!r}")
        return fn
    if not callable(op):
        raise TypeError(f"{name}: op must be one of {sorted(OPS)} or a binary callable; "
                        f"got {type(op).__name__}")
    return op


# ---------------------------------------------------------------------- the API
def barrier(timeout: Optional[float] = None) -> None:
    """Wait until every context of the run has called it; serve requests meanwhile.

    Args:
        timeout: seconds before giving up (default: the run's, see
            :func:`macroflow.spmd`); then the error names the contexts that
            did not arrive.

    Raises:
        macroflow.CollectiveError: another context ended or failed without
            joining, joined a different collective, or the timeout passed.
        macroflow.ContextLost: a context of the run ended.

    Example:
        >>> import macroflow as mf
        >>> def main():
        ...     mf.barrier()
        ...     return mf.rank()
        >>> mf.spmd(main, n=2, transport="inproc")
        [0, 1]
    """
    # current_engine(), model_of() and model.current_run(), inline: a run's
    # function calls barriers in loops (the Python calls are most of its cost)
    w = getcurrent()
    eng = getattr(w, "engine", None) or current_engine(USAGE)
    model = eng.models[SpmdModel.name]
    call = getattr(w, "call", None)
    run = model.by_call.get(call.fid) if call is not None else None
    if run is None:
        run = model.current_run("mf.barrier()")  # (which says what is wrong)
    shm = run.shm
    if shm is None or shm is _UNKNOWN:
        _wait(_enter("barrier", "mf.barrier()", None, _nothing, 0, timeout=timeout), timeout)
        return
    if model.puts_out:
        _land_puts(eng, model)
    if timeout is not None:
        _check_timeout(timeout, "mf.barrier()")
    if eng.user and eng.serving != get_ident():  # engine_side(), inline
        c = eng._from_user(_fast_barrier, model, run, shm, "mf.barrier()")
    else:
        c = _fast_barrier(model, run, shm, "mf.barrier()")
    if c is not None:
        _wait(c, timeout)


def barrier_async() -> Future:
    """Enter a barrier and return at once: a Future that completes when every
    context of the run has entered it. The context computes meanwhile.

    Example:
        >>> import macroflow as mf
        >>> def main():
        ...     f = mf.barrier_async()
        ...     work = sum(range(1000))      # overlaps the barrier
        ...     f.result()
        ...     return work
        >>> mf.spmd(main, n=2, transport="inproc")
        [499500, 499500]
    """
    return _enter("barrier", "mf.barrier_async()", None, _nothing, 0).future


def broadcast(value: Any = None, root: int = 0, timeout: Optional[float] = None) -> Any:
    """Return ``root``'s ``value`` in every context (the others' are ignored).

    Values are copied (pickled; numpy arrays travel as raw buffers).
    Under MPI, with every context of the computation in the run, an
    allreduce of numpy arrays of numbers with a named op, and every barrier,
    are MPI's own non-blocking ``Iallreduce`` / ``Ibarrier``: every context
    must then pass arrays of the same dtype and shape, as MPI requires.

    Example:
        >>> import macroflow as mf
        >>> def main():
        ...     return mf.broadcast({"step": mf.rank()}, root=1)
        >>> mf.spmd(main, n=2, transport="inproc")
        [{'step': 1}, {'step': 1}]
    """
    c = _enter("broadcast", "mf.broadcast()", value, _nothing, root, timeout=timeout)
    return _wait(c, timeout)


def reduce(value: Any, op: Any = "sum", root: int = 0, timeout: Optional[float] = None) -> Any:
    """Combine every context's ``value`` with ``op``, in rank order; ``root``
    gets the result, the others None.

    Args:
        op: "sum", "prod", "min", "max" (numpy arrays element by element,
            numpy's rules for their dtypes; a NaN wins a min or a max) or any
            associative binary callable (it need not commute).

    Example:
        >>> import macroflow as mf
        >>> def main():
        ...     return mf.reduce(mf.rank() + 1, op="prod", root=1)
        >>> mf.spmd(main, n=3, transport="inproc")
        [None, 6, None]
    """
    name = "mf.reduce()"
    return _wait(_enter("reduce", name, value, _op(op, name), root, timeout=timeout), timeout)


def allreduce(value: Any, op: Any = "sum", timeout: Optional[float] = None) -> Any:
    """Combine every context's ``value`` with ``op``, in rank order; every
    context gets the result (see :func:`reduce` for ``op``).

    Example:
        >>> import macroflow as mf, numpy as np
        >>> def main():
        ...     return mf.allreduce(np.full(2, mf.rank()), op="max")
        >>> mf.spmd(main, n=2, transport="inproc")
        [array([1, 1]), array([1, 1])]
    """
    name = "mf.allreduce()"
    return _wait(_enter("allreduce", name, value, _op(op, name), 0,
                        op if isinstance(op, str) else None, timeout), timeout)


def allgather(value: Any, timeout: Optional[float] = None) -> List[Any]:
    """Every context's ``value``, as a list by rank, in every context.

    Example:
        >>> import macroflow as mf
        >>> mf.spmd(lambda: mf.allgather(mf.rank() * 10), n=3, transport="inproc")
        [[0, 10, 20], [0, 10, 20], [0, 10, 20]]
    """
    return _wait(_enter("allgather", "mf.allgather()", value, _concat, 0, timeout=timeout),
                 timeout)
