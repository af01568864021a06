"""Mentat's parallel objects: persistent (stateful monitors) and regular (stateless).

``@persistent`` classes get ``Cls.create(*args, on=None, **kw)``, which places
one instance in some context and returns a handle at once. The instance runs
one method at a time; calls from one caller (the main program, or one running
method) run in the order issued; a method
guarded with :func:`guard` is accepted only while its predicate holds.

``@regular`` classes return an unbound handle when called: every call may be
served by a different, new or reused, instance in any context, so calls run
in parallel. Both kinds are ordinary classes underneath: the decorators add,
they do not wrap, so instances still pickle by reference.

A handle reserves no public name: every public attribute of a handle is a
remote method of its class, whatever it is called. Destroying an object is
:func:`destroy`, and what the runtime knows about a handle (its context, its
global pointer...) is :func:`info`. The one name the decorators reserve is
the class attribute ``create``.
"""

from __future__ import annotations

import inspect
import threading
import types
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple, TypeVar

from ..core.context import _state as _ctx_state
from ..core.context import as_int, current_engine
from ..core.errors import CallError, StaleReference
from ..core.future import CallSite, Future, current_engine_of, running_computation
from ..core.gptr import GlobalPointer
from ..core.rsr import protocols_of
from ..core.threads import getcurrent
from .hosting import CREATE, DESTROY, PERSISTENT, REGULAR, ctor_capture
from .methods import constructor_info, method_info, user_new

_get_ident = threading.get_ident

T = TypeVar("T", bound=type)


def _check_on(eng: Any, on: Any) -> int:
    cid = as_int(on)  # an int, or a numpy integer
    if cid is None:
        raise TypeError(f"on= must be a context id (int); got {on!r}")
    on = cid
    if not 0 <= on < eng.size:
        raise ValueError(f"on={on}: there are {eng.size} contexts (0..{eng.size - 1})")
    if on in eng.heirs or on in eng.retiring:
        # (a context that died is not refused here: calls to it fail with
        # ContextLost, as every call sent to it later does)
        how = "was removed" if on in eng.heirs else "is being removed"
        raise ValueError(f"on={on}: context {on} {how} (mf.remove_context); it takes "
                         f"no new objects: place this one on another context")
    return on


class _RemoteMethod:
    __slots__ = ("handle", "info")

    def __init__(self, handle: Any, info: Any):
        self.handle = handle
        self.info = info

    def __call__(self, *args: Any, **kwargs: Any) -> Future:
        info = self.info
        n = len(args)
        if kwargs or not info.simple or n < info.nmin or (info.nmax is not None and n > info.nmax):
            info.check(args, kwargs)  # the slow path, or the error
        return self.handle._call(info, args, kwargs)

    def __repr__(self) -> str:
        return f"<remote method {self.info.label} of {self.handle!r}>"


class _Handle:
    """What both kinds of handle share: ``handle.name`` is the remote method ``name``.

    The handle's own state is kept under underscore names, which are never
    remote methods (those are public), so no user method is shadowed.
    """

    _cls: type
    _comp: Optional[str]  # the computation it belongs to

    def __getattr__(self, name: str) -> _RemoteMethod:
        if name.startswith("_"):  # not set yet, or private: never a remote method
            raise AttributeError(f"{type(self).__name__} has no attribute {name!r}; "
                                 f"only public methods are called through a handle")
        # cached in the instance dict: later lookups do not come here
        m = self.__dict__[name] = _RemoteMethod(self, method_info(self._cls, name))
        return m


def _engine_of(handle: Any) -> Any:
    """The running engine, if ``handle`` belongs to its computation (a handle
    made outside any belongs to every one); else StaleReference, or
    RuntimeError when nothing runs."""
    eng = getattr(getcurrent(), "engine", None)  # current_engine()'s first look, inline
    if eng is None:
        eng = _ctx_state.current or _ctx_state.default  # and its second, for main's thread
        if eng is not None and _get_ident() == eng.thread \
                and (handle._comp is None or eng.computation == handle._comp):
            return eng
        try:
            eng = current_engine()
        except RuntimeError:
            eng = None
    if eng is None or (handle._comp is not None and eng.computation != handle._comp):
        eng = current_engine_of(handle._comp, "handle", handle)  # raises the right error
    return eng


def _check_travel(handle: Any, comp: Optional[str]) -> None:
    # sent in a call of another computation: refused where the call is made,
    # not where it is used (pickled outside any computation, it is kept as it is)
    if comp is not None:
        running = running_computation()
        if running is not None and running != comp:
            raise StaleReference(f"handle {handle!r}", comp, running)


class PersistentHandle(_Handle):
    """A reference to one persistent object; calling a method returns a Future.

    Handles are values: pass them to other calls, return them from methods,
    keep them in objects. Every public attribute is a remote method; ask
    :func:`info` where the object lives, and :func:`destroy` to end it. A
    handle belongs to the computation that made the object: using it in
    another raises :class:`macroflow.StaleReference`.

    Example:
        >>> import macroflow as mf
        >>> @mf.persistent
        ... class Counter:
        ...     def __init__(self): self.n = 0
        ...     def incr(self): self.n += 1; return self.n
        >>> with mf.init(contexts=2, transport="inproc"):
        ...     c = Counter.create()
        ...     _ = c.incr()
        ...     c.incr().result()
        2
    """

    def __init__(self, cls: type, oid: Any, context: int, computation: Optional[str],
                 created: Optional[Future] = None):
        self._cls = cls
        self._oid = oid
        self._ctx = context
        self._comp = computation
        self._created = created

    def _call(self, info: Any, args: tuple, kwargs: dict) -> Future:
        eng = _engine_of(self)
        if kwargs:
            return eng.issue(PERSISTENT, (self._oid,), info.name, args, kwargs, self._ctx,
                             site=info, oid=self._oid)
        return eng.issue_plain(PERSISTENT, (self._oid,), info.name, args, self._ctx, info,
                               self._oid)

    def __reduce__(self):
        _check_travel(self, self._comp)
        return (PersistentHandle, (self._cls, self._oid, self._ctx, self._comp))

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, PersistentHandle) and other._oid == self._oid
                and other._comp == self._comp)

    def __hash__(self) -> int:
        return hash(self._oid)

    def __repr__(self) -> str:
        return f"<{self._cls.__qualname__} {self._oid[0]}.{self._oid[1]} @ctx{self._ctx}>"


class RegularHandle(_Handle):
    """An unbound handle to a regular class: no instance until a call needs one.

    Each call is placed by the instantiation managers (or on the context given
    to ``Cls.create(on=...)``) and served by an idle instance there, made with
    the constructor arguments the handle carries. A handle made while a
    computation runs belongs to it; ``Cls(...)`` made when none runs names no
    context and may be used in any.

    Example:
        >>> import macroflow as mf
        >>> @mf.regular
        ... class Math:
        ...     def add(self, a, b): return a + b
        >>> with mf.init(contexts=2, transport="inproc"):
        ...     m = Math()
        ...     m.add(m.add(1, 2), 3).result()
        6
    """

    def __init__(self, cls: type, args: tuple = (), kwargs: Optional[dict] = None,
                 on: Optional[int] = None, computation: Optional[str] = None):
        self._cls = cls
        self._args = args
        self._kwargs = kwargs or {}
        self._on = on
        self._comp = computation
        self._target: Optional[tuple] = None  # (cls, args, kwargs, key, size): see _call

    def _call(self, info: Any, args: tuple, kwargs: dict) -> Future:
        eng = _engine_of(self)
        target = self._target
        if target is None:
            target = self._capture(f"{info.label} here")
        if self._on is not None:
            dest, pinned = self._on, True
        else:
            dest, pinned = eng.placement.place_call(eng), False
        return eng.issue(REGULAR, target, info.name, args, kwargs, dest, site=info, pinned=pinned)

    def _capture(self, where: str) -> tuple:
        # the constructor arguments taken as values, at the handle's first
        # call or passing on (a copy elsewhere, at its first there): what
        # goes out later is what the key says, whatever becomes of the originals
        try:
            cargs, ckw, key, size = ctor_capture(self._args, self._kwargs)
        except Exception as e:  # a __reduce__ may raise anything
            raise CallError(
                f"cannot send the constructor arguments of {self._cls.__qualname__}() "
                f"(they go with its calls: {where}): {type(e).__name__}: {e}") from e
        target = self._target = (self._cls, cargs, ckw, key, size)
        return target

    def __reduce__(self):
        _check_travel(self, self._comp)
        target = self._target or self._capture("passed on in a message")
        return (RegularHandle, (self._cls, target[1], target[2], self._on, self._comp))

    def __repr__(self) -> str:
        where = f" @ctx{self._on}" if self._on is not None else ""
        return f"<regular {self._cls.__qualname__}{where}>"


@dataclass(frozen=True)
class HandleInfo:
    """What the runtime knows about a handle; returned by :func:`info`.

    Attributes:
        kind: "persistent" or "regular".
        cls: the class.
        context: where a persistent object lives; for a regular handle, the
            context every call runs on (``create(on=N)``), or None.
        id: a persistent object's id (unique in its computation), else None.
        created: the future of the constructor, on the handle that
            ``create()`` returned (None on copies passed around, and for
            regular handles).
        gptr: a persistent object's :class:`macroflow.GlobalPointer`, else None.
        computation: the id of the computation the handle belongs to (None
            for a regular handle made when no computation ran).

    Example:
        >>> import macroflow as mf
        >>> @mf.regular
        ... class Math:
        ...     def add(self, a, b): return a + b
        >>> i = mf.info(Math())
        >>> i.kind, i.cls is Math, i.context, i.gptr
        ('regular', True, None, None)
    """

    kind: str
    cls: type
    context: Optional[int]
    id: Optional[Tuple[int, int]]
    created: Optional[Future]
    gptr: Optional[GlobalPointer]
    computation: Optional[str]


def info(handle: Any) -> HandleInfo:
    """What the runtime knows about ``handle``: a frozen :class:`HandleInfo`.

    Raises:
        TypeError: ``handle`` is not a handle.
        macroflow.StaleReference: it belongs to another computation.

    Example:
        >>> import macroflow as mf
        >>> @mf.persistent
        ... class Box:
        ...     def put(self, x): return x
        >>> with mf.init(contexts=3, transport="inproc"):
        ...     b = Box.create(on=2)
        ...     i = mf.info(b)
        ...     i.kind, i.cls is Box, i.context, i.gptr.context, i.created.result()
        ('persistent', True, 2, 2, None)
    """
    if isinstance(handle, PersistentHandle):
        eng = _engine_of(handle)
        gptr = GlobalPointer(handle._ctx, "object", handle._oid, protocols_of(eng, handle._ctx),
                             handle._comp)
        return HandleInfo("persistent", handle._cls, handle._ctx, handle._oid, handle._created,
                          gptr, handle._comp)
    if isinstance(handle, RegularHandle):
        if handle._comp is not None:  # one made outside any computation fits every one
            _engine_of(handle)
        return HandleInfo("regular", handle._cls, handle._on, None, None, None, handle._comp)
    raise TypeError(f"mf.info() takes a handle (from Cls.create() or a @mf.regular Cls()); "
                    f"got {type(handle).__name__}")


def destroy(handle: Any) -> Future:
    """Destroy a persistent object after the calls already sent to it; returns a Future.

    Later calls fail with :class:`macroflow.ObjectDestroyed`. A method named
    ``__mf_destroy__`` on the class, if any, runs last. A collection
    (:class:`macroflow.Collection`) is destroyed with all its elements.

    Raises:
        TypeError: ``handle`` is not the handle of a persistent object.
        macroflow.StaleReference: it belongs to another computation.

    Example:
        >>> import macroflow as mf
        >>> @mf.persistent
        ... class Box:
        ...     def put(self, x): return x
        >>> with mf.init(contexts=2, transport="inproc"):
        ...     b = Box.create()
        ...     mf.destroy(b).result()
        ...     type(b.put(1).exception()).__name__
        'ObjectDestroyed'
    """
    if not isinstance(handle, PersistentHandle):
        gone = getattr(type(handle), "__mf_destroy__", None)
        if gone is not None and not isinstance(handle, type):
            return gone(handle)  # something made of objects (a collection): all of them
        if isinstance(handle, RegularHandle):
            raise TypeError(f"mf.destroy() ends a persistent object; {handle!r} is a handle to a "
                            f"regular class, whose instances the runtime makes and reuses itself")
        raise TypeError(f"mf.destroy() takes the handle of a persistent object; "
                        f"got {type(handle).__name__}")
    eng = _engine_of(handle)
    return eng.issue(PERSISTENT, (handle._oid,), DESTROY, (), {}, handle._ctx,
                     site=CallSite(f"{handle._cls.__qualname__}.destroy"), oid=handle._oid)


def _create_persistent(cls: type, *args: Any, on: Optional[int] = None, **kwargs: Any) -> PersistentHandle:
    eng = current_engine()
    constructor_info(cls).check(args, kwargs)
    dest = eng.placement.place_object(eng) if on is None else _check_on(eng, on)
    oid = eng.new_fid()
    fut = eng.issue(CREATE, (oid, cls), None, args, kwargs, dest,
                    site=CallSite(f"{cls.__qualname__}.create"), fid=oid)
    return PersistentHandle(cls, oid, dest, eng.computation, fut)


def _create_regular(cls: type, *args: Any, on: Optional[int] = None, **kwargs: Any) -> RegularHandle:
    eng = current_engine()
    constructor_info(cls).check(args, kwargs)
    _refuse_futures(cls, args, kwargs)
    return RegularHandle(cls, args, kwargs, None if on is None else _check_on(eng, on), eng.computation)


#: Names a decorated class may not define, and why. Handles reserve no name.
RESERVED = {"create": "Cls.create(...) is how objects of the class are made"}
_CREATORS = (_create_persistent, _create_regular)


def _marks(attr: Any) -> dict:
    """The attributes set on a class attribute's function (a guard's, say), if any."""
    fn = attr.__func__ if isinstance(attr, (staticmethod, classmethod)) else attr
    return fn.__dict__ if isinstance(fn, types.FunctionType) else {}


def _check_guards(cls: type, what: str) -> None:
    seen = set()
    for klass in cls.__mro__[:-1]:
        for name, attr in klass.__dict__.items():
            if name in seen:
                continue  # overridden: not what the class's objects run
            seen.add(name)
            marks = _marks(attr)
            where = "" if klass is cls else f" (inherited from {klass.__qualname__})"
            if "__mf_guard__" in marks and name.startswith("_"):
                raise TypeError(
                    f"{cls.__qualname__}.{name}{where} has a guard, but "
                    + ("a constructor runs once, as the object is made: there is no call "
                       "to hold back" if name == "__init__" else
                       "only public methods are called through a handle, and a guard "
                       "holds back calls")
                    + "; put the guard on the public methods that must wait")
            if "__mf_guard_of__" in marks:
                raise TypeError(
                    f"{cls.__qualname__}.{name}{where} is not a method: @mf.guard was used without "
                    f"a predicate, so it took the method for the predicate and replaced it; "
                    f"write @mf.guard(lambda self: <condition>) above def {name}(self, ...)")
            if what == "regular" and "__mf_guard__" in marks:
                raise TypeError(
                    f"{cls.__qualname__}.{name}{where} has a guard, but @mf.regular objects are "
                    f"stateless (any instance serves any call): a guard has no state to look "
                    f"at; make {cls.__qualname__} @mf.persistent, or test the condition in the caller")


_HEAPTYPE = 1 << 9  # Py_TPFLAGS_HEAPTYPE: a class statement's (or type()'s)
_IMMUTABLETYPE = 1 << 8  # Py_TPFLAGS_IMMUTABLETYPE: its attributes cannot be set


def _check_class(cls: Any, what: str) -> None:
    if not isinstance(cls, type):
        raise TypeError(f"@mf.{what} decorates a class; got {type(cls).__name__}")
    if not cls.__flags__ & _HEAPTYPE or cls.__flags__ & _IMMUTABLETYPE:
        name = cls.__qualname__
        raise TypeError(f"@mf.{what} decorates a class defined in Python; {name} is a built-in "
                        f"(or compiled) type, whose attributes cannot be set: decorate a "
                        f"subclass of it (class My{name[:1].upper()}{name[1:]}({name}): ...)")
    kind = getattr(cls, "__mf_kind__", None)
    if kind not in (None, what):
        if "__mf_kind__" in cls.__dict__:
            raise TypeError(f"{cls.__qualname__} is already @{kind}")
        base = next(k for k in cls.__mro__ if "__mf_kind__" in k.__dict__)
        raise TypeError(f"{cls.__qualname__} derives from {base.__qualname__}, which is "
                        f"@mf.{kind}: a class and its bases are of one kind; make "
                        f"{cls.__qualname__} @mf.{kind} too")
    if inspect.iscoroutinefunction(cls.__init__):
        raise TypeError(f"{cls.__qualname__}.__init__ is async def: a constructor cannot wait "
                        f"(Python refuses it too: __init__() should return None); make it a "
                        f"plain def, and give the class an async method for the rest")
    _check_guards(cls, what)
    for name, why in RESERVED.items():
        for klass in cls.__mro__[:-1]:
            found = klass.__dict__.get(name)
            if found is not None and getattr(found, "__func__", None) not in _CREATORS:
                where = "" if klass is cls else f" (inherited from {klass.__qualname__})"
                raise TypeError(f"{cls.__qualname__} defines {name!r}{where}, a name @mf.{what} "
                                f"reserves: {why}; rename it")


def persistent(cls: T) -> T:
    """Mark a class as a persistent parallel object (Mentat).

    Adds ``Cls.create(*args, on=None, **kw) -> handle``. The object has state
    and one thread of control: one method runs at a time, in the order each
    caller (the main program, or one running method) issued them, subject to
    :func:`guard`. Calling the class directly
    still makes an ordinary local instance (handy for serial tests).

    Example:
        >>> import macroflow as mf
        >>> @mf.persistent
        ... class Accumulator:
        ...     def __init__(self, start=0): self.total = start
        ...     def add(self, x): self.total += x; return self.total
        >>> mf.run(lambda: Accumulator.create(10).add(5).result(), contexts=2, transport="inproc")
        15
    """
    _check_class(cls, "persistent")
    cls.__mf_kind__ = "persistent"
    cls.create = classmethod(_create_persistent)
    return cls


def _regular_new(klass: type, *args: Any, **kwargs: Any) -> RegularHandle:
    constructor_info(klass).check(args, kwargs)
    _refuse_futures(klass, args, kwargs)
    return RegularHandle(klass, args, kwargs, None, running_computation())


def _refuse_futures(cls: type, args: tuple, kwargs: dict) -> None:
    # A regular handle's constructor arguments go with its calls as values
    # (see RegularHandle._capture): a future among them reached the
    # constructor as a Future, not its value, and every call failed far from here
    from ..core.errors import CallError
    for where, x in [*enumerate(args), *kwargs.items()]:
        items = x.values() if isinstance(x, dict) else x if isinstance(x, (list, tuple)) else (x,)
        if any(isinstance(i, Future) for i in items):
            what = f"argument {where}" if isinstance(where, int) else f"argument {where}="
            raise CallError(f"{cls.__qualname__}(): {what} is or holds a future; a regular "
                            f"object's constructor arguments go with its calls as values, "
                            f"not as dataflow arcs: pass its value (f.result()), or pass the "
                            f"future to the method instead")


def regular(cls: T) -> T:
    """Mark a class as a regular (stateless) parallel object (Mentat).

    ``Cls(*args)`` returns an unbound handle; each method call on it may run
    on a different instance in a different context, so many calls run in
    parallel. ``Cls.create(*args, on=N)`` gives a handle whose calls all run
    on context N. Methods must not rely on state kept between calls.

    Example:
        >>> import macroflow as mf
        >>> @mf.regular
        ... class Math:
        ...     def square(self, x): return x * x
        >>> mf.run(lambda: mf.gather([Math().square(i) for i in range(4)]), contexts=2, transport="inproc")
        [0, 1, 4, 9]
    """
    _check_class(cls, "regular")
    cls.__mf_kind__ = "regular"
    cls.__mf_new__ = staticmethod(user_new(cls))
    cls.__new__ = staticmethod(_regular_new)
    cls.create = classmethod(_create_regular)
    return cls


def _check_guard_fits(predicate: Callable[..., Any], fn: Any, target: Any) -> None:
    # A predicate with parameters gets every call's arguments: one that
    # cannot take the method's own would fail each call with a TypeError
    # that does not say it was the guard. Tried with the arguments of the
    # shortest call and of the longest (every parameter given).
    try:
        guard_sig = inspect.signature(predicate)
        params = list(inspect.signature(target).parameters.values())
    except (TypeError, ValueError):
        return  # (a builtin, say: nothing to compare)
    if not isinstance(fn, staticmethod):
        params = params[1:]  # self, or cls
    shortest: Tuple[List[Any], Dict[str, Any]] = ([], {})
    longest: Tuple[List[Any], Dict[str, Any]] = ([], {})
    for p in params:
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            longest[0].append(None)
            if p.default is p.empty:
                shortest[0].append(None)
        elif p.kind == p.KEYWORD_ONLY:
            longest[1][p.name] = None
            if p.default is p.empty:
                shortest[1][p.name] = None
    for args, kwargs in (shortest, longest):
        try:
            guard_sig.bind(None, *args, **kwargs)
        except TypeError as e:
            name = getattr(target, "__qualname__", "the method")
            raise TypeError(
                f"the guard of {name}{inspect.signature(target)} takes {guard_sig}, which "
                f"cannot take the method's arguments ({e}): a predicate with parameters is "
                f"called as predicate(self, *args, **kwargs) with each call's arguments; give "
                f"it the method's parameters, or only self") from None


def guard(predicate: Callable[..., Any]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Accept calls to the decorated method only while ``predicate`` holds.

    ``predicate(self)`` (or ``predicate(self, *args, **kwargs)`` if it takes
    more parameters) is evaluated by the object before it accepts a call; a
    call whose guard is false waits without holding a thread, and later calls
    whose guards hold may pass it (Mentat's select/accept).

    ``mf.guard(predicate)`` decorates a method (a function, or a static or
    class method) of a ``@mf.persistent`` class. Refused with TypeError: a
    guard on a method of a ``@mf.regular`` class (stateless: there is no
    state to guard), ``@mf.guard`` without a predicate (found when the class
    is decorated, since it would replace the method), and decorating
    anything that is not a method.

    Example:
        >>> import macroflow as mf
        >>> @mf.persistent
        ... class Slot:
        ...     def __init__(self): self.items = []
        ...     def put(self, x): self.items.append(x)
        ...     @mf.guard(lambda self: len(self.items) > 0)
        ...     def get(self): return self.items.pop(0)
        >>> def main():
        ...     s = Slot.create()
        ...     got = s.get()          # waits: empty
        ...     s.put(42)
        ...     return got.result()
        >>> mf.run(main, contexts=2, transport="inproc")
        42
    """
    if not callable(predicate):
        raise TypeError(f"mf.guard() takes a predicate; got {type(predicate).__name__}")
    if inspect.iscoroutinefunction(predicate) or inspect.isasyncgenfunction(predicate):
        # (its coroutine would be true, never run: the guard would always hold)
        raise TypeError(f"mf.guard({_name(predicate)}): the predicate is an async function; a "
                        f"guard is evaluated at once, between calls: write a plain function")
    try:
        sig = inspect.signature(predicate)
    except (TypeError, ValueError):
        sig = None
    takes_args = False
    if sig is not None:
        params = list(sig.parameters.values())
        takes_args = len(params) > 1 or any(p.kind == p.VAR_POSITIONAL for p in params)
        try:
            sig.bind_partial(None)
        except TypeError:
            raise TypeError(f"mf.guard({_name(predicate)}): the predicate is called with the "
                            f"object, as predicate(self) (or predicate(self, *args) to see the "
                            f"call's arguments), but its signature is {sig}; write "
                            f"mf.guard(lambda self: <condition>)") from None

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        # on the function itself: the object finds it through getattr(cls, name),
        # which unwraps a staticmethod or classmethod put around the guard
        target = fn.__func__ if isinstance(fn, (staticmethod, classmethod)) else fn
        if not callable(target) or isinstance(target, type):
            raise TypeError(f"mf.guard(predicate) decorates a method of a @mf.persistent class, "
                            f"as in @mf.guard(lambda self: <condition>) above def method(self); "
                            f"got {type(fn).__name__}")
        if "__mf_guard__" in getattr(target, "__dict__", {}):
            raise TypeError(f"{_name(target)} has two guards (@mf.guard twice): a method has one; "
                            f"make it one predicate that says both, as in "
                            f"@mf.guard(lambda self: <first> and <second>)")
        if takes_args:
            _check_guard_fits(predicate, fn, target)
        if isinstance(target, types.FunctionType):
            # a copy is marked, not the function: another class (or the module)
            # may hold the same function, and its calls have no guard
            target = _copy_function(target)
            fn = type(fn)(target) if isinstance(fn, (staticmethod, classmethod)) else target
        target.__mf_guard__ = predicate  # type: ignore[attr-defined]
        target.__mf_guard_args__ = takes_args  # type: ignore[attr-defined]
        return fn

    # a class decorator that finds this in place of a method: a bare @mf.guard
    deco.__mf_guard_of__ = predicate  # type: ignore[attr-defined]
    return deco


def _name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


def _copy_function(fn: types.FunctionType) -> types.FunctionType:
    new = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__,
                             fn.__closure__)
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__qualname__, new.__module__, new.__doc__ = fn.__qualname__, fn.__module__, fn.__doc__
    new.__annotations__ = dict(fn.__annotations__)
    new.__dict__.update(fn.__dict__)
    return new


def rtf(value: Any) -> None:
    """Return-to-future: give the running method's caller ``value`` now.

    The method keeps running; the object stays busy until it ends, so its
    later side effects are seen by later calls. Call it at most once.

    Raises:
        RuntimeError: outside a parallel object's method, in a constructor, or
        called twice.

    Example:
        >>> import macroflow as mf
        >>> @mf.persistent
        ... class Log:
        ...     def __init__(self): self.n = 0
        ...     def write(self, x):
        ...         mf.rtf("queued")     # the caller goes on at once
        ...         self.n += 1          # ...while the object finishes the work
        ...     def count(self): return self.n
        >>> def main():
        ...     log = Log.create()
        ...     return log.write(1).result(), log.count().result()
        >>> mf.run(main, contexts=2, transport="inproc")
        ('queued', 1)
    """
    g = getcurrent()
    call = getattr(g, "call", None)
    if call is None:
        raise RuntimeError("mf.rtf() can only be called inside a method of a parallel object")
    if call.kind == CREATE:
        raise RuntimeError("mf.rtf() was called in a constructor: a constructor has no value "
                           "to give early (its caller gets the handle at once, and its "
                           "calls wait for the constructor to end)")
    if call.answered:  # (said here: a traceback then ends at the user's call of rtf)
        raise RuntimeError("mf.rtf() was already called in this method: its caller has the "
                           "first value")
    g.engine.answer(call, value)


