"""Call-site checks: a method must exist and take the arguments given.

Checked before anything is sent, so the error names the class and the method
and points at the caller's line. Signatures are analysed once per method; the
common case (positional arguments only) is a length comparison.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Dict, Optional

from ..core.errors import CallError, NoSuchMethod
from ..core.future import CallSite


class MethodInfo(CallSite):
    """A method's checks, and its call site (see :class:`CallSite`)."""

    __slots__ = ("name", "nmin", "nmax", "sig", "simple")

    def __init__(self, cls: type, name: str, fn: Callable[..., Any], takes_self: bool = True):
        super().__init__(f"{cls.__qualname__}.{name}")
        self.name = name
        try:
            sig = inspect.signature(fn)
        except (TypeError, ValueError):
            sig = None
        if sig is not None and takes_self:
            # the instance fills the first parameter: check the rest (a
            # builtin's ``(*args, **kwargs)`` takes it among the others)
            params = list(sig.parameters.values())
            if params and params[0].kind != params[0].VAR_POSITIONAL:
                sig = sig.replace(parameters=params[1:])
        self.sig = sig
        self.nmin, self.nmax, self.simple = 0, None, False
        if sig is not None:
            params = list(sig.parameters.values())
            pos = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
            self.nmin = sum(1 for p in pos if p.default is p.empty)
            var = any(p.kind == p.VAR_POSITIONAL for p in params)
            self.nmax = None if var else len(pos)
            self.simple = all(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
                              for p in params)

    def check(self, args: tuple, kwargs: dict) -> None:
        if self.sig is None:
            return
        if not kwargs and self.simple:
            n = len(args)
            if n >= self.nmin and (self.nmax is None or n <= self.nmax):
                return
        try:
            self.sig.bind(*args, **kwargs)
        except TypeError as e:
            params = self.sig.parameters
            if not any(p.kind == p.VAR_KEYWORD for p in params.values()):
                unknown = [k for k in kwargs if k not in params
                           or params[k].kind == inspect.Parameter.POSITIONAL_ONLY]
                if unknown:  # said first, as Python says it (bind names a missing one first)
                    e = TypeError(f"got an unexpected keyword argument {unknown[0]!r}")
            hint = ""
            if "on" in kwargs and "'on'" in str(e) and self.name == "__init__":
                hint = (f"; to place the object, {self.label}.create(..., on=...) (on= belongs "
                        f"to create, not to the class's call)")
            raise CallError(f"{self.label}(): {e}{hint}") from None


def user_new(cls: type) -> Callable[..., Any]:
    """What makes an instance of ``cls`` itself: the ``__new__`` nearest in
    its MRO, but of a class that is @mf.regular the one it kept (its own
    ``__new__`` makes handles).

    Example:
        >>> class A: pass
        >>> class B(A):
        ...     def __new__(cls, x): return super().__new__(cls)
        >>> user_new(A) is object.__new__, user_new(B) is B.__new__
        (True, True)
    """
    for klass in cls.__mro__:
        own = klass.__dict__
        if "__mf_new__" in own:
            new = own["__mf_new__"]
        elif "__new__" in own:
            new = own["__new__"]
        else:
            continue
        return new.__func__ if isinstance(new, staticmethod) else new
    return object.__new__


def build(cls: type, args: tuple, kwargs: Optional[dict]) -> Any:
    """An instance of ``cls`` made from its constructor's arguments as
    ``cls(*args, **kwargs)`` makes one in plain Python: its ``__new__``
    (see :func:`user_new`), then ``__init__`` if that gave an instance of
    ``cls``.

    Example:
        >>> class P:
        ...     def __new__(cls, x):
        ...         self = super().__new__(cls); self.x = x; return self
        >>> build(P, (5,), None).x
        5
    """
    kwargs = kwargs or {}
    new = user_new(cls)
    inst = new(cls) if new is object.__new__ else new(cls, *args, **kwargs)
    if isinstance(inst, cls):
        inst.__init__(*args, **kwargs)
    return inst


def method_info(cls: type, name: str) -> MethodInfo:
    """Look up (and cache) what a call to ``cls.name`` must look like.

    Static and class methods are methods too: the instance (or the class)
    is not among the arguments the caller gives.

    Raises:
        CallError: ``name`` is not a public method of ``cls``.

    Example:
        >>> class A:
        ...     def f(self, x, y=1): pass
        ...     @staticmethod
        ...     def g(x, y): pass
        ...     @classmethod
        ...     def h(cls, x): pass
        >>> [(method_info(A, n).nmin, method_info(A, n).nmax) for n in "fgh"]
        [(1, 2), (2, 2), (1, 1)]
    """
    cache: Optional[Dict[str, MethodInfo]] = cls.__dict__.get("__mf_methods__")
    if cache is None:
        cache = {}
        _keep(cls, "__mf_methods__", cache)
    info = cache.get(name)
    if info is None:
        fn = getattr(cls, name, None)
        if name.startswith("_") or fn is None or not callable(fn) or isinstance(fn, type):
            public = sorted(n for n in dir(cls) if not n.startswith("_") and callable(getattr(cls, n, None))
                            and n != "create")
            why = ""
            if isinstance(inspect.getattr_static(cls, name, None), property):
                why = (f"; {name!r} is a property, and a handle reaches its object only "
                       f"through methods: add a method that returns it")
            raise NoSuchMethod(f"{cls.__qualname__} has no method {name!r}"
                               f" (methods: {', '.join(public) or 'none'}){why}")
        # a plain function gets the instance as its first argument; what
        # getattr gives for a staticmethod or classmethod does not
        raw = inspect.getattr_static(cls, name, None)
        takes_self = not isinstance(raw, (staticmethod, classmethod)) and \
            (inspect.isfunction(raw) or hasattr(type(raw), "__get__"))
        info = cache[name] = MethodInfo(cls, name, fn, takes_self)
    return info


def _keep(cls: type, name: str, value: Any) -> None:
    # on the class, where it is found again; a builtin class (dict, a
    # collection's element may be one) takes no attributes: found anew each time
    try:
        setattr(cls, name, value)
    except (TypeError, AttributeError):
        pass


def _no_arguments(self: Any) -> None:
    """The constructor of a class that defines none."""


def constructor_info(cls: type) -> MethodInfo:
    """The constructor's signature, for checking ``create()`` arguments.

    Example:
        >>> class A:
        ...     def __init__(self, n): pass
        >>> constructor_info(A).nmin
        1
        >>> constructor_info(A).check((1, 2), {})
        Traceback (most recent call last):
        ...
        macroflow.core.errors.CallError: A(): too many positional arguments

    A class whose ``__new__`` takes the arguments is checked against it:

        >>> class B:
        ...     def __new__(cls, x): return super().__new__(cls)
        >>> constructor_info(B).nmin, constructor_info(B).nmax
        (1, 1)
    """
    info = cls.__dict__.get("__mf_ctor__")
    if info is None:
        init = cls.__init__
        if init is object.__init__:
            new = user_new(cls)
            if new is object.__new__:
                # none defined: the class takes no arguments, as Python says
                # when it is called with some (object.__init__'s own
                # signature takes all)
                init = _no_arguments
            else:
                # its __new__ takes them (float, a class of its own): its
                # first parameter, the class, as __init__'s is the instance
                init = new
        info = MethodInfo(cls, "__init__", init)
        info.label = cls.__qualname__  # errors read "Cls(): ...", as the class is called
        _keep(cls, "__mf_ctor__", info)
    return info


