"""Mentat's objects in a context: the object table and the calls that run on it.

This is the object model's part of each engine (see "How a model plugs into
the core" in the guide). Importing it registers, with
:func:`macroflow.core.context.register_model`, a :class:`ObjectHost` per
engine, which serves three kinds of CALL (the ``kind`` field of the message):

==========  ================================================================
PERSISTENT  a method of a persistent object hosted here (or its destruction,
            method ``DESTROY``): queued at the object, a monitor that runs
            one call at a time, in each caller's order, subject to guards
CREATE      the constructor of a persistent object: makes it here
REGULAR     a method of a regular (stateless) class: served by an idle
            instance of the context's pool, or a new one; a call that was not
            pinned may be passed on to another context by placement
==========  ================================================================

Global pointers of kind ``"object"`` name hosted objects: a remote service
request to one runs with its instance, and the object's guards are looked at
again afterwards.
"""

from __future__ import annotations

import bisect
import collections
import hashlib
import heapq
import inspect
import pickle
from collections import deque
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

from ..core import errors, marshal
from ..core.context import (CALL, EAGER, EARLY_MAX, MISSING, PINNED, RSR, RUNTIME_FILES, Call,
                            CallKind, Engine, Model, look_again, register_model)
from ..core.context import _Unreadable as Unreadable
from ..core.future import CoroutineType, run_coroutine, site_label
from ..core.threads import INTERRUPTS, getcurrent
from .methods import build

# kinds of call targets
PERSISTENT, REGULAR, CREATE = "p", "r", "c"

DESTROY = "__mf_destroy__"
_GONE = ("destroyed", "missing", "broken")  # left once their last call has run


class HostedObject:
    """A persistent object living in this context: a monitor with a call queue.

    The queue is kept so that choosing the next call never rescans calls that
    cannot run: a call whose arguments are missing waits in its caller's
    *lane* with every later call of that caller (per-caller order), and costs
    nothing until its argument arrives; calls that may run wait in ``ready``
    (a heap by arrival order) or, if their method has a guard, in ``gready``
    (sorted by arrival), whose guards are evaluated when the object picks.

    Example:
        >>> obj = HostedObject((0, 1), "Counter")
        >>> obj.state, obj.label, obj.queued
        ('new', 'Counter', 0)
    """

    __slots__ = ("oid", "cls", "instance", "create", "lanes", "ready", "gready", "queued",
                 "arrivals", "busy", "state", "error", "label", "guarded", "running", "held",
                 "gstamp", "gfresh")

    def __init__(self, oid, label):
        self.oid = oid
        self.cls = None
        self.instance = None
        self.create: Optional[Call] = None  # the constructor call, until it runs
        self.lanes: Dict[Any, Deque[Call]] = {}  # caller -> its calls from the first blocked one
        self.ready: List[Tuple[int, Call]] = []  # heap of unguarded calls that may run
        self.gready: List[Tuple[int, Call]] = []  # guarded calls that may run, by arrival
        # every call in gready but those in gfresh had a false guard in state gstamp
        self.gstamp = -1
        self.gfresh: List[Tuple[int, Call]] = []
        self.queued = 0  # calls waiting in lanes, ready and gready
        self.arrivals = 0
        self.busy = False
        self.running: Optional[Call] = None
        self.state = "new"  # new -> live | broken -> destroyed; missing: never created here
        self.error: Optional[BaseException] = None
        self.label = label
        self.guarded: frozenset = frozenset()  # names of methods with a guard
        self.held: Optional[List[Any]] = None  # requests that came before the constructor ran


class _OwnLabel(str):
    """An object's label that is its own (``__mf_object_label__``): it names
    the object whole. ``calls``, if the object has ``__mf_call_namer__``, names
    its calls (``calls(method, args)``), and outlives the object with the
    label (it holds no state of the object's that matters).

    Example:
        >>> _OwnLabel("the Collection of Cell").calls is None
        True
    """

    calls: Optional[Callable[[str, tuple], str]] = None


def _call_name(label: Any, call: Call, plain: str) -> str:
    """How ``call`` to an object labelled ``label`` is named: as the label's
    ``calls`` names it (see :class:`_OwnLabel`), else ``plain``.

    Example:
        >>> from macroflow.core.context import Call
        >>> _call_name("Counter", Call((0, 1), "p", None, "incr", (), {}, None, 0, 0), "incr()")
        'incr()'
    """
    calls = getattr(label, "calls", None)
    if calls is not None:
        try:
            return calls(call.method, call.args)
        except Exception:
            pass
    return plain


def _run_hook(hook: Callable[[], Any]) -> None:
    r = hook()
    if isinstance(r, CoroutineType):
        run_coroutine(r)


def _describe(target, method) -> str:
    cls = target[1] if isinstance(target, tuple) and len(target) > 1 else None
    name = getattr(cls, "__qualname__", None) or "object"
    return f"{name}.{method}" if method else name


class ObjectHost(Model):
    """The persistent objects hosted by one engine, and the regular-instance pool.

    Made by every engine (the object model registers it); the engine's own
    code never looks inside.

    Example:
        >>> import macroflow as mf
        >>> from macroflow.core.context import current_engine
        >>> with mf.init(contexts=1, transport="inproc"):
        ...     host = current_engine().models["objects"]
        ...     type(host).__name__, sorted(host.kinds), host.objects
        ('ObjectHost', ['c', 'p', 'r'], {})
    """

    name = "objects"
    pointers = ("object",)

    def __init__(self, eng: Engine):
        super().__init__(eng)
        self.objects: Dict[Any, HostedObject] = {}
        # Calls to an object id with no object here: the constructor is on its
        # way, or the object is gone. Frames from one context arrive in the
        # order sent, so once a later call from the object's creator has come,
        # its constructor would have come too (the engine's `seen` holds the
        # highest call number received from each context): `unborn` holds the
        # ids still waiting, by creator.
        self.unborn: Dict[int, List[Any]] = {}
        # recently removed objects: their labels (those whose constructor
        # failed: ("broken", label, the error))
        self.tombstones: Dict[Any, Any] = {}
        self.orphans: Dict[Any, str] = {}  # objects of removed contexts: their labels
        # idle regular instances by class and constructor arguments, the
        # least recently used set of arguments first (see REGULAR_POOL_KEYS)
        self.regular_pool: "collections.OrderedDict[Any, List[Any]]" = collections.OrderedDict()
        # Large constructor arguments of regular objects go once to each
        # context (see RegularCalls.outgoing): the keys this context sent to
        # each, least recently used first, and the arguments each sender sent
        # here, by key. A sender says which of its keys to forget, so both
        # sides agree on what is here without a message of their own.
        self.ctor_sent: Dict[int, "collections.OrderedDict[bytes, int]"] = {}  # key -> size
        self.ctor_sent_bytes: Dict[int, int] = {}  # the sizes of those, by context
        self.ctor_held: Dict[int, Dict[bytes, Tuple[tuple, dict, int]]] = {}
        # A regular call's class goes once to each context with a number
        # that its later calls send instead (see RegularCalls.outgoing): a
        # class named in a pickle costs a module lookup at each end, and
        # keeps the call from the C pickler (about 4 us of a null call).
        self.cls_sent: Dict[int, Dict[type, int]] = {}  # by context: class -> its number
        self.cls_held: Dict[int, Dict[int, type]] = {}  # by sender: number -> class
        calls = ObjectCalls(self)
        self.kinds = {PERSISTENT: calls, CREATE: calls, REGULAR: RegularCalls(self)}

    # ------------------------------------------------------------------ the engine's hooks
    def resolve(self, kind: str, ident: Any) -> Any:
        obj = self.objects.get(ident)
        return obj.instance if obj is not None and obj.state == "live" else MISSING

    def served(self, kind: str, ident: Any) -> None:
        obj = self.objects.get(ident)
        if obj is None:
            return
        eng = self.eng
        if eng._in_serve:
            # the handler may have changed what the guards see, but no
            # method may start from here (a method computes, or called
            # mf.poll()): the engine's loop looks again
            data, bufs = marshal.dumps((RSR, ("object", ident), look_again, (), "inline"))
            eng.inbox.append((eng.id, [data, *bufs], eng.load()))
        else:
            self._pump(obj)  # the handler may have changed what the guards see

    def hold(self, kind: str, ident: Any, release: Any) -> bool:
        obj = self.objects.get(ident)
        if obj is None:
            if self._fate(ident) is not None:
                return False
            obj = self.objects[ident] = HostedObject(ident, "object")
            self._wait_for_creator(ident[0], ident)  # its constructor is on its way
        elif obj.state != "new":
            return False
        if obj.held is None:
            obj.held = []
        obj.held.append(release)
        return True

    def why_not(self, kind: str, ident: Any) -> Optional[str]:
        obj = self.objects.get(ident)
        fate = self.tombstones.get(ident) if obj is None else None
        if obj is not None and obj.state == "broken" or type(fate) is tuple:
            err = obj.error if obj is not None else fate[2]
            return (f"its object's constructor failed"
                    f"{f' ({type(err).__name__}: {err})' if err is not None else ''}")
        return None

    def _release(self, obj: HostedObject) -> bool:
        # requests held for an object that now lives, or never will; True:
        # one of them started a thread, which should run before its calls
        held, obj.held = obj.held, None
        if not held:
            return False
        target = obj.instance if obj.state == "live" else MISSING
        started = False
        for release in held:
            started = release(target) or started
        if target is MISSING and not obj.busy and not obj.queued and obj.create is None \
                and self.objects.get(obj.oid) is obj and obj.state == "missing":
            del self.objects[obj.oid]  # it stood in for requests only
        return started

    def lost(self, peer: int) -> None:
        self.cls_sent.pop(peer, None)
        self.cls_held.pop(peer, None)
        self.ctor_sent.pop(peer, None)
        self.ctor_sent_bytes.pop(peer, None)
        self.ctor_held.pop(peer, None)
        for oid in self.unborn.pop(peer, ()):
            obj = self.objects.get(oid)
            if obj is not None and obj.state == "new" and obj.create is None:
                obj.state = "missing"  # its creator is gone before it sent the constructor
                self._release(obj)
                self._pump(obj)

    def snapshot(self, d: Dict[str, Any]) -> None:
        d["objects"] = len(self.objects)

    def hand_over(self) -> Any:
        # the heir answers later calls to these objects: they were removed
        labels = {oid: f"{obj.label} (on context {self.eng.id}, which was removed)"
                  for oid, obj in self.objects.items()}
        labels.update(self.orphans)
        for obj in list(self.objects.values()):
            obj.state = "destroyed"
            self._release(obj)
        return labels

    def take_over(self, cid: int, data: Any) -> None:
        self.orphans.update(data)

    # ------------------------------------------------------------------ the object table
    def _unknown_object(self, oid, call: Call, target) -> HostedObject:
        obj = self.objects[oid] = HostedObject(oid, _describe(target, None))
        if call.kind == CREATE:
            return obj
        fate = self._fate(oid)
        if fate is None:
            self._wait_for_creator(oid[0], oid)  # its constructor is on its way
        elif fate == "missing":
            obj.state = "missing"
        elif type(fate) is tuple:  # its constructor failed
            _, obj.label, obj.error = fate
            obj.state = "broken"
        else:
            obj.label, obj.state = fate, "destroyed"
        return obj

    def _fate(self, oid) -> Any:
        # an id with no object here: None while its constructor may still
        # come, else "missing", the label of the object it was, or
        # ("broken", label, error) if its constructor failed
        label = self.tombstones.get(oid) or self.orphans.get(oid)
        if label is not None:
            return label
        if self.eng.seen.get(oid[0], 0) >= oid[1]:
            return "missing"
        return None

    def _wait_for_creator(self, creator: int, oid) -> None:
        self.unborn.setdefault(creator, []).append(oid)
        self.eng.call_watch[creator] = self._check_unborn

    def _check_unborn(self, creator: int) -> None:
        waiting = self.unborn.pop(creator)
        seen = self.eng.seen[creator]
        for oid in waiting:
            obj = self.objects.get(oid)
            if obj is None or obj.state != "new" or obj.create is not None:
                continue
            if oid[1] >= seen:  # equal: this is the constructor arriving
                self._wait_for_creator(creator, oid)
                continue
            obj.state = "missing"  # its constructor would have come by now
            self._release(obj)
            self._pump(obj)

    def _forget_object(self, obj: HostedObject) -> None:
        # a destroyed object leaves once its last call has run; so does one
        # whose constructor failed, its error kept (without the frames its
        # traceback holds, which may hold large values) for its later calls
        if self.objects.get(obj.oid) is obj:
            del self.objects[obj.oid]
            if len(self.tombstones) >= EARLY_MAX:
                del self.tombstones[next(iter(self.tombstones))]
            if obj.state == "broken":
                err = obj.error
                if err is not None:
                    err.__traceback__ = None
                self.tombstones[obj.oid] = ("broken", obj.label, err)
            else:
                self.tombstones[obj.oid] = obj.label

    # ------------------------------------------------------------------ running calls
    def _pump(self, obj: HostedObject) -> None:
        if obj.busy:
            return
        call = self._pick(obj)
        if call is not None:
            obj.busy = True
            self.eng.spawn(self._run_object, obj, call)

    def _pick(self, obj: HostedObject) -> Optional[Call]:
        eng = self.eng
        if obj.state == "new":
            # nothing runs before the constructor, which may still be on its way
            call = obj.create
            if call is None or call.missing:
                return None
            obj.create = None
            obj.queued -= 1
            eng.stats.calls_examined += 1
            return call
        ready, gready = obj.ready, obj.gready
        if gready and obj.state != "live":  # no guards: every call fails in arrival order
            if not ready or gready[0][0] < ready[0][0]:
                obj.queued -= 1
                obj.gstamp = -1
                eng.stats.calls_examined += 1
                return gready.pop(0)[1]
        elif gready:
            call = self._pick_guarded(obj, ready[0][0] if ready else None)
            if call is not None:
                return call
            if eng.retire is not None and not ready and not obj.lanes:
                self._fail_waiting(obj)  # nothing left here could make a guard hold
        if ready:
            obj.queued -= 1
            eng.stats.calls_examined += 1
            return heapq.heappop(ready)[1]
        return None

    def _pick_guarded(self, obj: HostedObject, first: Optional[int]) -> Optional[Call]:
        # The first guarded call that came before the first unguarded one
        # (arrival order ``first``) whose guard holds, or None. A guard false
        # in a state of the object is false until the state may change: until
        # a method of this context ends or a remote service request runs here
        # (``stamp``). Those evaluated false in this state are not evaluated
        # again, so calls arriving behind a thousand waiting ones cost one
        # guard each, not a thousand.
        eng = self.eng
        if eng.undetached:
            eng.kept_copies()  # guards are user code (see Engine.kept_copies)
        st = eng.stats
        stamp = st.calls_executed + st.rsr_executed
        todo = obj.gfresh if obj.gstamp == stamp else obj.gready
        later = []  # not evaluated: they came after the first unguarded call
        for entry in list(todo):
            order, call = entry
            if first is not None and order > first:
                later.append(entry)
                continue
            meth = getattr(obj.cls, call.method, None)
            guard = meth.__mf_guard__
            st.calls_examined += 1
            st.guards_evaluated += 1
            try:
                eng.in_guard = (obj.label, call.method)  # a wait in it raises
                try:
                    # bool() here: a value without a truth value (a numpy array) fails the call
                    if meth.__mf_guard_args__:
                        ok = guard(obj.instance, *eng._fill(call.args, call),
                                   **eng._fill_kw(call))
                    else:
                        ok = guard(obj.instance)
                    if inspect.isawaitable(ok):  # (true, and never run: it would always hold)
                        getattr(ok, "close", lambda: None)()
                        raise TypeError(f"the guard of {obj.label}.{call.method}() returned "
                                        f"{type(ok).__name__} {ok!r}, which a guard cannot "
                                        f"wait for: it must return a truth value at once")
                    ok = bool(ok)
                finally:
                    eng.in_guard = None
            except INTERRUPTS:
                raise
            except BaseException as e:  # a failing guard fails its call
                note = f"raised by the guard of {obj.label}.{call.method}()"
                was, e = e, errors.exited(f"the guard of {obj.label}.{call.method}() on "
                                          f"context {eng.id}", e)
                if e is was and hasattr(e, "add_note") and note not in getattr(e, "__notes__", ()):
                    e.add_note(note)  # (3.11 on) its message may not say it was the guard
                obj.gready.remove(entry)
                obj.queued -= 1
                eng._finish(call, False, e)
                continue  # (a guard changes nothing: the others stand as they were)
            if ok:
                obj.gready.remove(entry)
                obj.queued -= 1
                obj.gstamp = -1  # gfresh may hold it still, and the method changes the state
                return call
            # later calls whose guards hold may pass this one
        obj.gfresh, obj.gstamp = later, stamp
        return None

    def _fail_waiting(self, obj: HostedObject) -> None:
        # The context is being removed, so takes no new calls, and nothing
        # queued at the object can run: its waiting guarded calls could only
        # wait for ever (and keep the removal from ending). They fail.
        eng = self.eng
        waiting, obj.gready, obj.gfresh = obj.gready, [], []
        for _, call in waiting:
            obj.queued -= 1
            eng._finish(call, False, errors.ObjectDestroyed(
                f"{obj.label}.{call.method}() was waiting for its guard when context {eng.id} "
                f"was removed: no call could reach its object any more to make it hold"))

    def retiring(self) -> None:
        for obj in list(self.objects.values()):
            if obj.gready and not obj.busy:
                self._pump(obj)  # (a guarded call that waits fails there)
        self.eng.transport.flush()

    def _run_object(self, obj: HostedObject, call: Call) -> None:
        eng = self.eng
        g = getcurrent()
        while call is not None:
            g.call = obj.running = call
            if obj.state == "live" and call.kind == PERSISTENT and call.method != DESTROY:
                # the common case, one call deep: a method of a live object
                eng._invoke(getattr(obj.instance, call.method, None), call)
            elif self._execute_on_object(obj, call):
                # requests held for the constructor started threads: they
                # run before the calls queued behind them
                g.call = obj.running = None
                obj.busy = False
                self.eng.spawn(self._pump, obj)
                return
            g.call = obj.running = None
            # (calls in lanes wait for an argument: only these may be picked)
            call = self._pick(obj) if obj.ready or obj.gready or obj.create is not None \
                else None
        obj.busy = False
        if obj.state in _GONE and not obj.queued:
            self._forget_object(obj)

    def _run_live(self, obj: HostedObject, call: Call) -> None:
        # _run_object's commonest case: a method of a live object that was
        # idle with nothing queued, one call deep
        if obj.state != "live":  # (started from a method thread, it starts a step later)
            self._run_object(obj, call)
            return
        g = getcurrent()
        g.call = obj.running = call
        self.eng._invoke(getattr(obj.instance, call.method, None), call)
        g.call = obj.running = None
        if obj.ready or obj.gready or obj.create is not None:
            call = self._pick(obj)  # (queued while it ran)
            if call is not None:
                self._run_object(obj, call)
                return
        obj.busy = False
        if obj.state in _GONE and not obj.queued:
            self._forget_object(obj)

    def _execute_on_object(self, obj: HostedObject, call: Call) -> bool:
        # True: the constructor ran and released requests that started threads
        eng = self.eng
        if call.kind == CREATE:
            cls = call.target[1]
            eng.stats.calls_executed += 1
            try:
                args, kwargs = eng._args(call)
                svc = eng.service
                if svc is None:
                    inst = build(cls, args, kwargs)
                else:
                    inst = svc.run_user(build, (cls, args, kwargs), None)
            except INTERRUPTS:
                raise
            except BaseException as e:
                name = getattr(cls, "__qualname__", None) or type(cls).__name__
                e = errors.exited(f"{name}() on context {eng.id}", e)
                obj.state, obj.error = "broken", e
                eng._finish(call, False, e)
                self._release(obj)
                return False
            obj.instance = inst
            obj.state = "live"
            named = getattr(inst, "__mf_object_label__", None)
            if named is not None:  # (an object that stands for another's, as a collection's part)
                obj.label = _OwnLabel(named)
                namer = getattr(inst, "__mf_call_namer__", None)
                if namer is not None:
                    obj.label.calls = namer()
            eng._finish(call, True, None)
            return self._release(obj)
        if obj.state != "live":
            if obj.state == "broken" and call.method == DESTROY:
                obj.state = "destroyed"  # an object whose constructor failed can go
                eng._finish(call, True, None)
                return
            eng._finish(call, False, self._dead_object_error(obj, call))
            return
        if call.method == DESTROY:
            obj.state = "destroyed"
            inst, obj.instance = obj.instance, None
            hook = getattr(inst, "__mf_destroy__", None)
            ok, err = True, None
            if hook is not None:
                try:
                    svc = eng.service  # served while it runs, as a method is
                    if svc is None:
                        _run_hook(hook)
                    else:
                        svc.run_user(_run_hook, (hook,), None)
                except INTERRUPTS:
                    raise
                except BaseException as e:  # the object is gone all the same
                    ok, err = False, errors.exited(
                        f"{obj.label}.__mf_destroy__() on context {eng.id}", e)
            eng._finish(call, ok, err)
            return
        eng._invoke(getattr(obj.instance, call.method, None), call)

    def _dead_object_error(self, obj: HostedObject, call: Call) -> errors.ObjectDestroyed:
        what = "destroy()" if call.method == DESTROY else \
            _call_name(obj.label, call, f"{call.method}()")
        if obj.state == "broken":
            err = errors.ObjectDestroyed(f"{obj.label} could not be created, so {what} cannot "
                                         f"run: {type(obj.error).__name__}: {obj.error}")
            err.__cause__ = obj.error
            return err
        if obj.state == "missing":
            return errors.ObjectDestroyed(
                f"no object {obj.oid[0]}.{obj.oid[1]} on context {self.eng.id} "
                f"(destroyed, or never created here), so {what} cannot run")
        # (an object's own label names it whole: no id of ours after it)
        who = obj.label
        if type(who) is not _OwnLabel:
            who = f"{who} {obj.oid[0]}.{obj.oid[1]}"
        if call.method == DESTROY:
            return errors.ObjectDestroyed(f"{who} was already destroyed")
        return errors.ObjectDestroyed(f"{who} was destroyed; {what} cannot run")


class _HostedKind(CallKind):
    """A call kind of the object model: it serves through the engine's ObjectHost."""

    def __init__(self, host: ObjectHost):
        super().__init__(host.eng)
        self.host = host


class ObjectCalls(_HostedKind):
    """PERSISTENT and CREATE calls: queued at their object, run one at a time.

    Example:
        >>> import macroflow as mf
        >>> from macroflow.core.context import current_engine
        >>> with mf.init(contexts=1, transport="inproc"):
        ...     type(current_engine().call_kinds[PERSISTENT]).__name__
        'ObjectCalls'
    """

    def refuse(self, msg: tuple) -> tuple:
        method = msg[4]
        what = f"{method}()" if method else "its constructor"
        return self.eng.failing(msg, errors.ObjectDestroyed(
            f"{what} reached context {self.eng.id} as it was being removed; its objects "
            f"take no new calls"))

    def accept(self, call: Call) -> None:
        host = self.host
        target = call.target
        oid = target[0]
        obj = host.objects.get(oid)
        if obj is None:
            obj = host._unknown_object(oid, call, target)
        call.obj = obj
        if call.kind == CREATE:
            obj.cls = target[1]
            obj.guarded = _guarded_methods(target[1])
            obj.label = f"{getattr(target[1], '__qualname__', 'object')}"
            obj.create = call
            obj.queued += 1
            if obj.queued > 1:
                _reclassify(obj)  # calls that came first were sorted without the class
        elif not obj.busy and not obj.queued and not call.missing and obj.state == "live" \
                and call.method not in obj.guarded:
            obj.busy = True  # idle, nothing queued, no guard: run it now
            self.eng.spawn(host._run_live if call.method != DESTROY else host._run_object,
                           obj, call)
            return
        elif not _enqueue(obj, call) and obj.state == "live":
            return  # in its caller's lane, behind a missing argument: nothing new may run
        host._pump(obj)

    def arguments_ready(self, call: Call) -> None:
        obj = call.obj
        if obj.create is not call:
            lane = obj.lanes.get(call.caller)
            if lane is not None and lane[0] is call:
                # the caller's first blocked call is free: so are the calls
                # behind it, up to the next one still missing an argument
                lane.popleft()
                if not obj.busy and not obj.ready and not obj.gready and obj.state == "live" \
                        and call.method not in obj.guarded and (not lane or lane[0].missing):
                    # the only call that may run (a chain's link, the next
                    # still waiting for its argument): run it now, as _pick
                    # would, without the heap
                    if not lane:
                        del obj.lanes[call.caller]
                    obj.queued -= 1
                    self.eng.stats.calls_examined += 1
                    obj.busy = True
                    self.eng.spawn(self.host._run_object, obj, call)
                    return
                _make_eligible(obj, call)
                while lane and not lane[0].missing:
                    _make_eligible(obj, lane.popleft())
                if not lane:
                    del obj.lanes[call.caller]
        self.host._pump(obj)

    def label(self, call: Call) -> str:
        obj = call.obj
        if obj is not None:
            # a class may name its calls in its users' terms (a collection's
            # host names the element's method): see _OwnLabel
            return _call_name(obj.label, call, f"{obj.label}.{call.method}")
        return str(call.method)

    def check_wait(self, call: Call, f: Any) -> None:
        obj = call.obj
        if obj is not None and f._target == obj.oid:
            if f._fid == call.fid:
                raise errors.DeadlockError(
                    f"{self.label(call)} waits for its own result (its future came back to it): "
                    f"it can never come while the method waits for it.")
            name = site_label(f._site)
            if name is None:  # a future handed to it: the call it stands for names it
                slot = self.eng.slots.get(f._fid)
                waited = getattr(slot, "call", None)
                name = self.label(waited) if waited is not None else "a method"
            raise errors.DeadlockError(
                f"{self.label(call)} waits on a call to its own object "
                f"({name}); a persistent object runs one method at a "
                f"time, so that call can never start. Return the future instead "
                f"(elaboration) or restructure the method.")

    def queued_behind(self, call: Call) -> Optional[Call]:
        obj = call.obj
        if obj is None or obj.running is call:
            return None  # it computes: no cycle through it
        lane = obj.lanes.get(call.caller)
        return lane[0] if lane and lane[0] is not call else obj.running if obj.busy else None

    def abandon(self, call: Call) -> None:
        obj = call.obj
        if obj is not None and obj.busy:
            obj.busy = False
            self.host._pump(obj)


def _unknown_class(number: int, src: int, here: int) -> type:
    """What stands for a class number that ``src`` never sent here: a
    class whose construction fails the call, saying so.

    Example:
        >>> cls = _unknown_class(3, 0, 1)
        >>> try:
        ...     cls.__mf_new__(cls).null()
        ... except errors.CallError as e:
        ...     print(e)
        context 1 does not know class number 3 of context 0: the call that sent it never came
    """
    return Unreadable.of(errors.CallError(
        f"context {here} does not know class number {number} of context {src}: the call "
        f"that sent it never came"))


class RegularCalls(_HostedKind):
    """REGULAR calls: any instance serves; placement may pass a call on.

    Example:
        >>> import macroflow as mf
        >>> from macroflow.core.context import current_engine
        >>> with mf.init(contexts=1, transport="inproc"):
        ...     type(current_engine().call_kinds[REGULAR]).__name__
        'RegularCalls'
    """

    moves = True

    def arrived(self, call: Call, msg: tuple, src: int) -> bool:
        return not call.route & PINNED and self._maybe_transfer(call, msg, src)

    def refuse(self, msg: tuple) -> tuple:
        # a stateless call runs elsewhere: arrived() passes it on
        return msg[:8] + (msg[8] & ~PINNED, msg[9])

    def accept(self, call: Call) -> None:
        if call.missing == 0:
            self._start_free(call)

    def arguments_ready(self, call: Call) -> None:
        self._start_free(call)

    def label(self, call: Call) -> str:
        return f"{getattr(call.target[0], '__qualname__', 'object')}.{call.method}"

    def _start_free(self, call: Call) -> None:
        eng = self.eng
        if eng.timed_wait and not call.route & PINNED and self._offload(call):
            return
        eng.spawn(self._run_free, call)

    def _offload(self, call: Call) -> bool:
        """Main waits here with a timeout: a regular call that could run anywhere
        goes to another context, so that it cannot hold main past its deadline."""
        eng = self.eng
        dest = eng.placement.choose(eng, exclude=eng.id)
        if dest is None or dest == eng.id:
            return False
        try:
            args, kwargs = eng._args(call)
        except BaseException:
            return False  # an argument failed: failing the call here is quick
        route = (call.route & EAGER) | PINNED
        eng.active -= 1
        eng._move(call, dest, (CALL, call.fid, call.kind, self.outgoing(call.target, dest),
                               call.method, args, kwargs, None, route, call.caller))
        return True

    def _maybe_transfer(self, call: Call, msg: tuple, src: int) -> bool:
        eng = self.eng
        pl = eng.placement
        hops = msg[8] >> 2
        # a call from here was counted when issued, a remote one not yet
        if eng.retire is None and (hops >= pl.transfer_limit or
                                   eng.load() - (src == eng.id) < pl.threshold):
            return False  # (a retiring context passes every stateless call on)
        dest = pl.choose(eng, exclude=eng.id)
        if dest is None or dest == eng.id:
            return False
        if src == eng.id:
            eng.active -= 1
        eng._move(call, dest, (CALL,) + msg[1:3] + (self.outgoing(msg[3], dest),) + msg[4:8]
                  + (((hops + 1) << 2) | (msg[8] & 3), msg[9]))
        return True

    def outgoing(self, target: tuple, dest: int) -> tuple:
        """What goes to ``dest`` for a call's ``target``
        ``(cls, args, kwargs, key, size)``: the class goes once to each
        context, as ``(number, cls)``, then only its number; large
        constructor arguments go once, then only their key."""
        cls = target[0]
        ids = self.host.cls_sent.get(dest)
        if ids is None:
            ids = self.host.cls_sent[dest] = {}
        try:
            head = ids.get(cls)
            if head is None:
                n = ids[cls] = len(ids)  # (unsent takes back only the last one given)
                head = (n, cls)
        except TypeError:  # a class whose metaclass makes it unhashable: as it is
            head = cls
        key = target[3]
        if target[4] < CTOR_ONCE or key is None:
            return (head,) + target[1:]
        sent = self.host.ctor_sent.get(dest)
        if sent is None:
            sent = self.host.ctor_sent[dest] = collections.OrderedDict()
        if key in sent:
            sent.move_to_end(key)
            return (head, key)
        sent[key] = target[4]
        held = self.host.ctor_sent_bytes[dest] = self.host.ctor_sent_bytes.get(dest, 0) + target[4]
        forget = []
        while len(sent) > 1 and (len(sent) > CTOR_HELD or held > CTOR_HELD_BYTES):
            k, n = sent.popitem(last=False)  # the least recently used set
            forget.append(k)
            held -= n
        self.host.ctor_sent_bytes[dest] = held
        return (head,) + target[1:] + (tuple(forget),)

    def unsent(self, sent: tuple, dest: int) -> None:
        """``outgoing``'s ``sent`` did not go (a method argument could not be
        pickled): ``dest`` does not hold what it would have told it to."""
        head = sent[0]
        if type(head) is tuple:  # the class and its number: given again next time
            ids = self.host.cls_sent.get(dest)
            if ids is not None and ids.get(head[1]) == head[0] == len(ids) - 1:
                del ids[head[1]]
        if len(sent) == 6:
            mine = self.host.ctor_sent.get(dest)
            if mine is not None:
                # (the sizes of those it would have had forgotten are not
                # kept: they count as none until sent again)
                self.host.ctor_sent_bytes[dest] -= mine.pop(sent[3], 0)
                for k in sent[5]:
                    mine[k] = 0
                    mine.move_to_end(k, last=False)

    def incoming(self, msg: tuple, src: int) -> tuple:
        """A CALL ``msg`` as it came from ``src``, with its target made whole
        (see :meth:`outgoing`): what is passed on or served from here on."""
        target = msg[3]
        head = target[0]
        if type(head) is int:
            cls = self.host.cls_held.get(src, {}).get(head)
            if cls is None:  # (its first call never came: nothing sends it so)
                cls = _unknown_class(head, src, self.eng.id)
            target = (cls,) + target[1:]
        elif type(head) is tuple:  # a class sent with the number its later calls name it by
            held = self.host.cls_held.get(src)
            if held is None:
                held = self.host.cls_held[src] = {}
            held[head[0]] = head[1]
            target = (head[1],) + target[1:]
        n = len(target)
        if n == 5:
            return msg if target is msg[3] else msg[:3] + (target,) + msg[4:]
        held = self.host.ctor_held
        if n == 6:  # arguments to keep: src sends only their key from now on
            cls, cargs, ckw, key, size, forget = target
            mine = held.get(src)
            if mine is None:
                mine = held[src] = {}
            mine[key] = (cargs, ckw, size)
            for k in forget:
                mine.pop(k, None)
            target = target[:5]
        else:
            cls, key = target
            got = held.get(src, {}).get(key)
            target = (cls, None, None, key, 0) if got is None else (cls, *got[:2], key, got[2])
        return msg[:3] + (target,) + msg[4:]

    def _run_free(self, call: Call) -> None:
        eng = self.eng
        g = getcurrent()
        g.call = call
        cls, cargs, ckw, key, _size = call.target
        if cargs is None:
            eng._finish(call, False, errors.CallError(
                f"{self.label(call)}: the constructor arguments of {cls.__qualname__}() "
                f"are not known on context {eng.id} (its sender sends them once, and sent "
                f"only their key here): call it again"))
            return
        key = cls if key is None else (cls, key)
        pool = self.host.regular_pool
        free = pool.get(key)
        if free is not None:
            pool.move_to_end(key)
        inst = free.pop() if free else None
        if inst is None:
            try:
                inst = build(cls, cargs, ckw)
            except INTERRUPTS:
                raise
            except BaseException as e:
                eng._finish(call, False, e)
                return
            eng.stats.instances_created += 1
        try:
            eng._invoke(getattr(inst, call.method, None), call)
        finally:
            free = pool.get(key)
            if free is None:
                free = pool[key] = []
                if len(pool) > REGULAR_POOL_KEYS:
                    pool.popitem(last=False)  # the instances of the least used arguments go
            free.append(inst)


#: sets of constructor arguments (per class) whose idle regular instances a
#: context keeps: a sweep of handles made each with other arguments would
#: otherwise keep an instance of each for good
REGULAR_POOL_KEYS = 64


#: constructor arguments this large (pickled, in bytes) go once to each
#: context, then only their key; smaller ones go with every call
CTOR_ONCE = 4096
#: sets of large constructor arguments a context keeps for each sender, the
#: least recently used going first, and their bytes at most (the last set
#: is kept whatever its size)
CTOR_HELD = 32
CTOR_HELD_BYTES = 256 << 20


def ctor_capture(cargs: tuple, ckw: dict) -> Tuple[tuple, dict, Optional[bytes], int]:
    """Constructor arguments taken as values: a copy of them, their key and
    size (see :func:`ctor_key`). A handle keeps the copy, so that what it sends
    is always what its key says, whatever the caller does to the originals.

    Example:
        >>> import numpy as np
        >>> a = np.zeros(4)
        >>> (copy,), kw, key, size = ctor_capture((a,), {})
        >>> a[:] = 7
        >>> copy.tolist(), key == ctor_key((np.zeros(4),), {})[0]
        ([0.0, 0.0, 0.0, 0.0], True)
    """
    if not (cargs or ckw):
        return cargs, ckw, None, 0
    data, bufs = marshal.dumps((cargs, ckw))
    key, size = _digest(data, bufs)
    copies = [bytearray(_view(b)) for b in bufs]
    cargs, ckw = marshal.loads(data, copies)
    return cargs, ckw, key, size


def _view(b: Any) -> memoryview:
    try:
        return b.raw() if isinstance(b, pickle.PickleBuffer) else memoryview(b)
    except BufferError:  # (not contiguous: its bytes, copied)
        return memoryview(memoryview(b).tobytes())


def _digest(data: bytes, bufs: List[Any]) -> Tuple[bytes, int]:
    digest = hashlib.blake2b(data, digest_size=16)
    size = len(data)
    for b in bufs:
        view = _view(b)
        digest.update(view)
        size += view.nbytes
    return digest.digest(), size


def ctor_key(cargs: tuple, ckw: dict) -> Tuple[Optional[bytes], int]:
    """What makes two sets of constructor arguments the same, and their size:
    a 128-bit BLAKE2 digest of their pickle, arrays' contents included (the
    pickle alone leaves out-of-band buffers out: arrays of one shape looked
    alike), and its length in bytes; ``(None, 0)`` for no arguments. Regular
    instances made with the same key are interchangeable.

    Example:
        >>> import numpy as np
        >>> (a, n), (b, _) = ctor_key((np.zeros(8192),), {}), ctor_key((np.ones(8192),), {})
        >>> a == b, a == ctor_key((np.zeros(8192),), {})[0], n > 65536, ctor_key((), {})
        (False, True, True, (None, 0))
    """
    if not (cargs or ckw):
        return None, 0
    return _digest(*marshal.dumps((cargs, ckw)))


def _enqueue(obj: HostedObject, call: Call) -> bool:
    """Queue ``call`` at ``obj``; True if it may run (not in a lane)."""
    obj.arrivals += 1
    call.order = obj.arrivals
    obj.queued += 1
    lane = obj.lanes.get(call.caller)
    if lane is not None:
        lane.append(call)  # behind a call of the same caller that is still missing an argument
        return False
    if call.missing:
        obj.lanes[call.caller] = deque((call,))
        return False
    _make_eligible(obj, call)
    return True


def _make_eligible(obj: HostedObject, call: Call) -> None:
    if call.method in obj.guarded:
        bisect.insort(obj.gready, (call.order, call))
        bisect.insort(obj.gfresh, (call.order, call))  # its guard is yet to be evaluated
    else:
        heapq.heappush(obj.ready, (call.order, call))


def _reclassify(obj: HostedObject) -> None:
    # calls that came before the constructor were sorted before the class (and
    # so its guards) was known
    calls = [c for _, c in obj.ready] + [c for _, c in obj.gready]
    obj.ready, obj.gready, obj.gfresh, obj.gstamp = [], [], [], -1
    for c in calls:
        _make_eligible(obj, c)
    heapq.heapify(obj.ready)


def _guarded_methods(cls) -> frozenset:
    found = cls.__dict__.get("__mf_guarded__")
    if found is None:
        found = frozenset(n for n in dir(cls)
                          if getattr(getattr(cls, n, None), "__mf_guard__", None) is not None)
        try:
            setattr(cls, "__mf_guarded__", found)
        except (AttributeError, TypeError):
            pass
    return found


register_model(ObjectHost.name, ObjectHost)
RUNTIME_FILES.add(__file__)  # remote tracebacks start at the user's code, not here
