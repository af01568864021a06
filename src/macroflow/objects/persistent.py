"""Mentat's parallel objects: persistent (stateful monitors) and regular (stateless).

``@persistent`` classes get ``Cls.create(*args, on=None, **kw)``, which places
one instance in some context and returns a handle at once. The instance runs
one method at a time; calls from one caller run in the order issued; a method
guarded with :func:`guard` is accepted only while its predicate holds.

``@regular`` classes return an unbound handle when called: every call may be
served by a different, new or reused, instance in any context, so calls run
in parallel. Both kinds are ordinary classes underneath: the decorators add,
they do not wrap, so instances still pickle by reference.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Optional, TypeVar

from ..core.context import CREATE, DESTROY, PERSISTENT, REGULAR, current_engine
from ..core.future import CallSite, Future
from ..core.gptr import GlobalPointer
from ..core.rsr import protocols_of
from ..core.threads import getcurrent
from .methods import constructor_info, method_info

T = TypeVar("T", bound=type)


def _check_on(eng: Any, on: Any) -> int:
    if isinstance(on, bool) or not isinstance(on, int):
        raise TypeError(f"on= must be a context id (int); got {on!r}")
    if not 0 <= on < eng.size:
        raise ValueError(f"on={on}: there are {eng.size} contexts (0..{eng.size - 1})")
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
    """What both kinds of handle share: ``handle.method`` is a remote method."""

    cls: type

    def __getattr__(self, name: str) -> _RemoteMethod:
        if name.startswith("__") or name == "cls":  # not set yet: no recursion
            raise AttributeError(name)
        # cached in the instance dict: later lookups do not come here
        m = self.__dict__[name] = _RemoteMethod(self, method_info(self.cls, name))
        return m


class PersistentHandle(_Handle):
    """A reference to one persistent object; calling a method returns a Future.

    Handles are values: pass them to other calls, return them from methods,
    keep them in objects. ``context`` is where the object lives, ``gptr`` its
    global pointer, ``created`` the future of its constructor.

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

    def __init__(self, cls: type, oid: Any, context: int, created: Optional[Future] = None):
        self.cls = cls
        self.oid = oid
        self.context = context
        self.created = created

    def _call(self, info: Any, args: tuple, kwargs: dict) -> Future:
        eng = current_engine()
        return eng.issue(PERSISTENT, (self.oid,), info.name, args, kwargs, self.context,
                         site=info, oid=self.oid)

    def destroy(self) -> Future:
        """Destroy the object after the calls already sent to it; returns a Future.

        Later calls fail with :class:`macroflow.ObjectDestroyed`. A method
        named ``__mf_destroy__`` on the class, if any, runs last.

        Example:
            >>> # acc.destroy().result()
        """
        eng = current_engine()
        return eng.issue(PERSISTENT, (self.oid,), DESTROY, (), {}, self.context,
                         site=CallSite(f"{self.cls.__qualname__}.destroy"), oid=self.oid)

    @property
    def gptr(self) -> GlobalPointer:
        """The object's global pointer, for :func:`macroflow.rsr`."""
        return GlobalPointer(self.context, "object", self.oid,
                             protocols_of(current_engine(), self.context))

    def __reduce__(self):
        return (PersistentHandle, (self.cls, self.oid, self.context))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PersistentHandle) and other.oid == self.oid

    def __hash__(self) -> int:
        return hash(self.oid)

    def __repr__(self) -> str:
        return f"<{self.cls.__qualname__} {self.oid[0]}.{self.oid[1]} @ctx{self.context}>"


class RegularHandle(_Handle):
    """An unbound handle to a regular class: no instance until a call needs one.

    Each call is placed by the instantiation managers (or on the context given
    to ``Cls.create(on=...)``) and served by an idle instance there, made with
    the constructor arguments the handle carries.

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

    def __init__(self, cls: type, args: tuple = (), kwargs: Optional[dict] = None, on: Optional[int] = None):
        self.cls = cls
        self.args = args
        self.kwargs = kwargs or {}
        self.on = on

    def _call(self, info: Any, args: tuple, kwargs: dict) -> Future:
        eng = current_engine()
        if self.on is not None:
            dest, pinned = self.on, True
        else:
            dest, pinned = eng.placement.place_call(eng), False
        return eng.issue(REGULAR, (self.cls, self.args, self.kwargs), info.name, args, kwargs,
                         dest, site=info, pinned=pinned)

    def __reduce__(self):
        return (RegularHandle, (self.cls, self.args, self.kwargs, self.on))

    def __repr__(self) -> str:
        where = f" @ctx{self.on}" if self.on is not None else ""
        return f"<regular {self.cls.__qualname__}{where}>"


def _create_persistent(cls: type, *args: Any, on: Optional[int] = None, **kwargs: Any) -> PersistentHandle:
    eng = current_engine()
    constructor_info(cls).check(args, kwargs)
    dest = eng.placement.place_object(eng) if on is None else _check_on(eng, on)
    oid = eng.new_fid()
    fut = eng.issue(CREATE, (oid, cls), None, args, kwargs, dest,
                    site=CallSite(f"{cls.__qualname__}.create"), fid=oid)
    return PersistentHandle(cls, oid, dest, fut)


def _create_regular(cls: type, *args: Any, on: Optional[int] = None, **kwargs: Any) -> RegularHandle:
    eng = current_engine()
    constructor_info(cls).check(args, kwargs)
    return RegularHandle(cls, args, kwargs, None if on is None else _check_on(eng, on))


def _check_class(cls: Any, what: str) -> None:
    if not isinstance(cls, type):
        raise TypeError(f"@mf.{what} decorates a class; got {type(cls).__name__}")
    if getattr(cls, "__mf_kind__", None) not in (None, what):
        raise TypeError(f"{cls.__qualname__} is already @{cls.__mf_kind__}")
    if "create" in cls.__dict__:
        raise TypeError(f"{cls.__qualname__} defines 'create', which @mf.{what} needs for itself")


def persistent(cls: T) -> T:
    """Mark a class as a persistent parallel object (Mentat).

    Adds ``Cls.create(*args, on=None, **kw) -> handle``. The object has state
    and one thread of control: one method runs at a time, in the order each
    caller issued them, subject to :func:`guard`. Calling the class directly
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
    return RegularHandle(klass, args, kwargs)


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
    orig_new = cls.__new__
    cls.__mf_new__ = staticmethod(orig_new if orig_new is not object.__new__ else object.__new__)
    cls.__new__ = staticmethod(_regular_new)
    cls.create = classmethod(_create_regular)
    return cls


def guard(predicate: Callable[..., Any]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Accept calls to the decorated method only while ``predicate`` holds.

    ``predicate(self)`` (or ``predicate(self, *args, **kwargs)`` if it takes
    more parameters) is evaluated by the object before it accepts a call; a
    call whose guard is false waits without holding a thread, and later calls
    whose guards hold may pass it (Mentat's select/accept).

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
    try:
        params = list(inspect.signature(predicate).parameters.values())
        takes_args = len(params) > 1 or any(p.kind == p.VAR_POSITIONAL for p in params)
    except (TypeError, ValueError):
        takes_args = False

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        # on the function itself: the object finds it through getattr(cls, name),
        # which unwraps a staticmethod or classmethod put around the guard
        target = fn.__func__ if isinstance(fn, (staticmethod, classmethod)) else fn
        target.__mf_guard__ = predicate  # type: ignore[attr-defined]
        target.__mf_guard_args__ = takes_args  # type: ignore[attr-defined]
        return fn

    return deco


def rtf(value: Any) -> None:
    """Return-to-future: give the running method's caller ``value`` now.

    The method keeps running; the object stays busy until it ends, so its
    later side effects are seen by later calls. Call it at most once.

    Raises:
        RuntimeError: outside a parallel object's method, or called twice.

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
    g.engine.answer(call, value)


