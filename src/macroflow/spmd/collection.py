"""Distributed collections: pC++'s user model, on parallel objects and the SPMD model.

A :class:`Collection` is an index space of *elements*, ordinary Python
objects, spread over the contexts of a computation by a distribution (pC++'s
collection of elements over processors). Each context that holds elements
has one persistent host object (:class:`_Host`), which builds its elements
where they live and keeps them in a dict; the collection itself is a small
picklable value naming those hosts, so it travels to other contexts, to
methods and to SPMD functions.

Operations on the whole collection issue one call per host and combine the
parts with one more call that takes their futures as arguments (dataflow:
nothing waits in between):

    coll.apply("step", dt)        host_0.apply(...)  host_1.apply(...)  ...
                                      \\________________|_______________/
                                          _Combine.combine(parts)  -> one Future

Inside an SPMD function, ``coll.local()`` gives the elements of this context
directly, and ``coll.pointer(i, "data")`` a global pointer to an element's
array, which any context reads with :func:`macroflow.get`.

This module sits above both models: it uses the object model (hosts, calls,
futures) and the SPMD model (registered memory), and neither knows of it.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np

from ..core.context import MISSING, current_engine
from ..core.errors import CallError
from ..core.future import CallSite, Future, current_engine_of
from ..objects.methods import constructor_info, method_info
from ..objects.hosting import PERSISTENT
from ..objects.persistent import PersistentHandle, _engine_of, destroy, persistent, regular
from .onesided import MemoryPointer, register, unregister

DISTRIBUTIONS = ("block", "cyclic")
Index = Union[int, Tuple[int, ...]]


# -- the layout of an index space over contexts (pure functions of the numbers)
def _block_range(p: int, n: int, P: int) -> range:
    """The flat indices position ``p`` of ``P`` holds under the block
    distribution: contiguous, sizes differing by at most one (the first
    ``n % P`` positions hold one more)."""
    base, extra = divmod(n, P)
    start = p * base + min(p, extra)
    return range(start, start + base + (1 if p < extra else 0))


def _indices(p: int, n: int, P: int, distribution: str) -> range:
    if distribution == "block":
        return _block_range(p, n, P)
    return range(p, n, P)


def _position(k: int, n: int, P: int, distribution: str) -> int:
    if distribution == "cyclic":
        return k % P
    base, extra = divmod(n, P)
    big = extra * (base + 1)  # the first `extra` positions hold base + 1 each
    return k // (base + 1) if k < big else extra + (k - big) // base


def _unflatten(k: int, shape: Tuple[int, ...]) -> Index:
    if len(shape) == 1:
        return k
    out = []
    for dim in reversed(shape):
        k, r = divmod(k, dim)
        out.append(r)
    return tuple(reversed(out))


def _label(cls: type, index: Index, what: Optional[str] = None) -> str:
    where = f"{cls.__qualname__} element {index}"
    return f"{where}, {what}" if what else where


def _tag(e: BaseException, where: str) -> None:
    """Put ``where`` (which element) in front of ``e``'s message, keeping its
    type and traceback. When the type would not rebuild the new message the
    same way after travelling (its constructor takes other arguments than its
    message: KeyError's quoting, OSError's numbers...), ``where`` goes in a
    note of the exception (shown with its traceback) instead."""
    args = e.args
    if not args or (len(args) == 1 and isinstance(args[0], str) and str(e) == args[0]):
        text = f"{where}: {args[0]}" if args else where
        try:
            same = str(type(e)(text)) == text
        except Exception:
            same = False
        if same:
            e.args = (text,)
            return
    e.add_note(f"raised by {where}")


def _call_each(elements: Any, cls: type, what: str, fn: Callable[..., Any]) -> List[Any]:
    """``[fn(element) for element]``, every element run even when one raises;
    then the first error (in index order) is raised, naming its element, with
    the indices of any others that failed in a note."""
    results: List[Any] = []
    failed: List[Tuple[Index, BaseException]] = []
    for index, element in elements:
        try:
            results.append(fn(element))
        except Exception as e:
            failed.append((index, e))
            results.append(None)
    if failed:
        index, first = failed[0]
        _tag(first, _label(cls, index, what))
        if len(failed) > 1:
            first.add_note(f"{what} raised in {len(failed) - 1} other element(s) of this "
                           f"context too: {', '.join(str(i) for i, _ in failed[1:])}")
        raise first
    return results


def _call_label(cls: str, shape: Tuple[int, ...], method: str, args: tuple) -> str:
    """A collection host's call named in the terms of its element class ``cls``.

    Example:
        >>> _call_label("Cell", (6,), "pointer", (2, "data"))
        "Cell element 2's pointer to .data"
    """
    if method == "call":
        return f"{cls}.{args[1]} of element {_unflatten(args[0], shape)}"
    if method == "apply":
        what = args[0] if isinstance(args[0], str) else getattr(args[0], "__qualname__", "fn")
        return f"{cls}.{what}" if isinstance(args[0], str) else f"{what} on {cls} elements"
    if method == "map_blocks":
        return f"map_blocks({getattr(args[0], '__qualname__', 'fn')}) on {cls} elements"
    if method == "pointer":
        return f"{cls} element {_unflatten(args[0], shape)}'s pointer to .{args[1]}"
    return f"{cls} elements' {method}"


_OP_SITES: dict = {}  # a collection's apply and map_blocks of a function: their call sites


def _host_call(host: Any, method: str, args: tuple, site: Any) -> Future:
    """Call ``method`` of a collection's host with ``site`` as its call site
    (the element's method, or the collection's operation), as an element's
    handle does: its future and errors name that, not _Host."""
    return _engine_of(host).issue(PERSISTENT, (host._oid,), method, args, {}, host._ctx,
                                  site=site, oid=host._oid)


@persistent
class _Host:
    """The elements of one collection that live in one context, by flat index.

    Made by :class:`Collection` on each context that holds elements; its
    methods run one at a time (a persistent object), so the elements of one
    context run one method at a time too.

    Example:
        >>> class Cell:
        ...     def __init__(self, index, scale): self.value = index * scale
        ...     def get(self): return self.value
        >>> h = _Host(Cell, (6,), "cyclic", 2, 1, (10,))   # a plain local instance
        >>> sorted(h.elements), h.apply("get", (), {})
        ([1, 3, 5], [10, 30, 50])
    """

    def __init__(self, cls: type, shape: Tuple[int, ...], distribution: str, ncontexts: int,
                 position: int, ctor_args: tuple):
        self.cls = cls
        self.shape = shape
        self.elements = {}  # flat index -> element, in index order
        self.pointers = {}  # (flat index, attribute) -> (the array registered, its pointer)
        n = 1
        for d in shape:
            n *= d
        for k in _indices(position, n, ncontexts, distribution):
            index = _unflatten(k, shape)
            try:
                self.elements[k] = cls(index, *ctor_args)
            except Exception as e:
                _tag(e, _label(cls, index, "constructor"))
                raise

    @property
    def __mf_object_label__(self) -> str:
        """How errors name this host: by the collection it is part of.

        Example:
            >>> class Cell:
            ...     def __init__(self, index): pass
            >>> _Host(Cell, (6,), "cyclic", 2, 1, ()).__mf_object_label__
            'the Collection of Cell (its elements [1, 3, 5] here)'
        """
        ks = list(self.elements)
        shown = ks if len(ks) <= 4 else ks[:3] + ["..."]
        return (f"the Collection of {self.cls.__qualname__} (its elements "
                f"[{', '.join(map(str, shown))}] here)")

    def __mf_call_namer__(self) -> Callable[[str, tuple], str]:
        """What names a call of this host in the element class's terms (for
        errors such as a DeadlockError's, which would otherwise name _Host):
        ``namer(method, args)``. It holds the class's name and the shape
        only, so the label of a destroyed collection keeps it, not the
        elements.

        Example:
            >>> class Cell:
            ...     def __init__(self, index): pass
            >>> name = _Host(Cell, (2, 3), "block", 1, 0, ()).__mf_call_namer__()
            >>> name("call", (4, "step", (), {})), name("apply", ("step",))
            ('Cell.step of element (1, 1)', 'Cell.step')
        """
        return functools.partial(_call_label, self.cls.__qualname__, self.shape)

    def _items(self) -> Iterator[Tuple[Index, Any]]:
        shape = self.shape
        return ((_unflatten(k, shape), el) for k, el in self.elements.items())

    def apply(self, method: Any, args: tuple, kwargs: dict) -> List[Any]:
        if isinstance(method, str):
            what = f"{method}()"
            return _call_each(self._items(), self.cls, what,
                              lambda el: getattr(el, method)(*args, **kwargs))
        what = getattr(method, "__qualname__", repr(method))
        return _call_each(self._items(), self.cls, what,
                          lambda el: method(el, *args, **kwargs))

    def map_blocks(self, fn: Callable[..., Any], args: tuple, kwargs: dict, attr: str) -> List[Any]:
        what = f"map_blocks({getattr(fn, '__qualname__', 'fn')}) on .{attr}"
        return _call_each(self._items(), self.cls, what,
                          lambda el: fn(_attribute(el, attr), *args, **kwargs))

    def call(self, k: int, method: str, args: tuple, kwargs: dict) -> Any:
        try:
            return getattr(self.elements[k], method)(*args, **kwargs)
        except Exception as e:
            _tag(e, _label(self.cls, _unflatten(k, self.shape), f"{method}()"))
            raise

    def pointer(self, k: int, attr: str) -> MemoryPointer:
        index = _unflatten(k, self.shape)
        try:
            arr = _attribute(self.elements[k], attr)
            if not isinstance(arr, np.ndarray):
                raise TypeError(f"attribute {attr!r} holds a {type(arr).__name__}; "
                                f"coll.pointer() needs a numpy array there")
            known = self.pointers.get((k, attr))
            if known is not None and known[0] is arr:
                return known[1]
            gp = register(arr)
        except Exception as e:
            _tag(e, _label(self.cls, index, f"pointer to .{attr}"))
            raise
        if known is not None:
            # the element replaced its array: the old one is stale, and kept
            # alive by its registration until it is forgotten
            unregister(known[1])
        self.pointers[(k, attr)] = (arr, gp)
        return gp


    def __mf_destroy__(self) -> None:
        # the collection is destroyed: its arrays' registrations (which keep
        # them alive) and its elements go
        for _arr, gp in self.pointers.values():
            try:
                unregister(gp)
            except Exception:
                pass  # (already unregistered)
        self.pointers.clear()
        self.elements.clear()


def _attribute(element: Any, attr: str) -> Any:
    try:
        return getattr(element, attr)
    except AttributeError:
        raise AttributeError(f"the element has no attribute {attr!r} (map_blocks and pointer "
                             f"read the array an element keeps there)") from None


def _in_order(parts: List[List[Any]], distribution: str, ncontexts: int) -> List[Any]:
    """The hosts' parts of a result (one list per context, in distribution
    order) put back in flat index order.

    Example:
        >>> _in_order([[0, 2, 4], [1, 3]], "cyclic", 2), _in_order([[0, 1], [2]], "block", 2)
        ([0, 1, 2, 3, 4], [0, 1, 2])
    """
    if distribution == "block":
        return [x for part in parts for x in part]
    out: List[Any] = [None] * sum(len(part) for part in parts)
    for p, part in enumerate(parts):
        out[p::ncontexts] = part
    return out


@regular
class _Combine:
    """Combines the hosts' parts of one operation when they have all arrived."""

    def combine(self, parts: List[List[Any]], distribution: str, ncontexts: int) -> List[Any]:
        return _in_order(parts, distribution, ncontexts)

    def all_done(self, parts: List[Any]) -> None:
        return None


class _ElementHandle:
    """One element of a collection: ``coll[i].method(*args)`` returns a Future,
    as a persistent object's handle does. Calls run in the element's context,
    one at a time with the other elements there, in the order each caller
    issued them.

    Example:
        >>> import macroflow as mf
        >>> class Cell:
        ...     def __init__(self, index): self.index = index
        ...     def twice(self): return 2 * self.index
        >>> with mf.init(contexts=2, transport="inproc"):
        ...     coll = mf.Collection(Cell, 4)
        ...     coll[3], coll[3].twice().result()
        (<Cell element 3 of a Collection, on context 1>, 6)
    """

    __slots__ = ("_coll", "_k")

    def __init__(self, coll: "Collection", k: int):
        self._coll = coll
        self._k = k

    def __getattr__(self, name: str) -> Callable[..., Future]:
        if name.startswith("_"):
            raise AttributeError(f"{type(self).__name__} has no attribute {name!r}; "
                                 f"only public methods of the element are called through it")
        coll, k = self._coll, self._k
        info = method_info(coll._cls, name)

        def remote(*args: Any, **kwargs: Any) -> Future:
            info.check(args, kwargs)
            host = coll._host(k)
            # the element's method is the call site (not _Host.call): futures
            # and errors name it, and eager routing learns per element method
            return _engine_of(host).issue(PERSISTENT, (host._oid,), "call",
                                          (k, name, args, kwargs), {}, host._ctx, site=info,
                                          oid=host._oid)

        remote.__name__ = name
        return remote

    def __reduce__(self):
        return (_ElementHandle, (self._coll, self._k))

    def __repr__(self) -> str:
        c = self._coll
        return (f"<{c._cls.__qualname__} element {_unflatten(self._k, c._shape)} of a "
                f"Collection, on context {c._owner_of(self._k)}>")


class Collection:
    """A distributed collection: elements of ``element_class``, one per index
    of ``shape``, spread over the contexts (pC++'s collection).

    Each element is an ordinary object built where it lives as
    ``element_class(index, *ctor_args)``: the index comes first, so an
    element knows its place from the start and can build its own part of
    the data there (a block of rows from its index) instead of receiving it.
    The index is an int for a 1-D shape, a tuple of ints otherwise. Nothing
    is added to the element (no attribute set on it, so a class with
    ``__slots__`` works); an element that needs its collection gets it as a
    method argument (the collection is a picklable value).

    The flat index space (C order: the last index varies fastest) is spread
    over the contexts by ``distribution``: ``"block"`` gives each context a
    contiguous range (sizes differ by at most one, the first contexts hold
    the larger ones), ``"cyclic"`` deals the elements round robin (element k
    on the k-th context modulo their number). One persistent object per
    context keeps its elements, so the elements of one context run one
    method at a time; elements of different contexts run in parallel.

    The constructor returns once every element is built, and raises the
    error of an element whose constructor failed (its index in the message).
    Create a collection once (in main, or in one context) and pass it
    around: it pickles as a small value naming where its elements are.

    Args:
        element_class: a class (not a ``@mf.regular`` one), called as
            ``element_class(index, *ctor_args)`` in the element's context.
        shape: an int (a 1-D collection of that many elements) or a tuple
            of ints, each at least 1.
        ctor_args: passed to every element's constructor (copied to each
            context that holds elements).
        distribution: "block" (default) or "cyclic".
        contexts: the contexts to spread over: an int n (the first n
            running contexts: 0..n-1 unless some were removed) or a
            sequence of context ids; default every context.

    Raises:
        ValueError: a bad shape, distribution or contexts.
        TypeError: ``element_class`` is not a class, or is ``@mf.regular``.
        macroflow.CallError: the constructor does not take
            ``(index, *ctor_args)``.

    Example:
        >>> import macroflow as mf, numpy as np
        >>> class Cell:
        ...     def __init__(self, index, start):
        ...         self.data = np.full(3, start + index, dtype=float)
        ...     def step(self, dt):
        ...         self.data += dt
        ...         return float(self.data.sum())
        >>> def main():
        ...     coll = mf.Collection(Cell, 4, 10.0, distribution="cyclic")
        ...     where = [coll.owner(i) for i in range(len(coll))]
        ...     sums = coll.apply("step", 1.0).result()
        ...     return where, sums, coll[2].step(0.5).result()
        >>> mf.run(main, contexts=2, transport="inproc")
        ([0, 1, 0, 1], [33.0, 36.0, 39.0, 42.0], 40.5)
    """

    def __init__(self, element_class: type, shape: Union[int, Sequence[int]], *ctor_args: Any,
                 distribution: str = "block", contexts: Union[None, int, Sequence[int]] = None):
        if not isinstance(element_class, type):
            raise TypeError(f"mf.Collection(): element_class must be a class; "
                            f"got {type(element_class).__name__}")
        if getattr(element_class, "__mf_kind__", None) == "regular":
            raise TypeError(f"mf.Collection(): {element_class.__qualname__} is @mf.regular, whose "
                            f"calls make handles, not objects; elements are plain classes")
        self._shape = _check_shape(shape)
        if distribution not in DISTRIBUTIONS:
            raise ValueError(f"mf.Collection(): distribution must be one of "
                             f"{', '.join(map(repr, DISTRIBUTIONS))}; got {distribution!r}")
        eng = current_engine()
        self._cls = element_class
        self._distribution = distribution
        self._where = _check_contexts(contexts, eng.context_ids())
        n = 1
        for d in self._shape:
            n *= d
        self._size = n
        try:
            constructor_info(element_class).check((_unflatten(0, self._shape),) + ctor_args, {})
        except CallError as e:
            raise CallError(f"{e} (elements are built as {element_class.__qualname__}(index, "
                            f"*ctor_args), the index first)") from None
        self._comp = eng.computation
        self._id = eng.new_fid()
        P = len(self._where)
        hosts = [_Host.create(element_class, self._shape, distribution, P, p, ctor_args, on=ctx)
                 for p, ctx in enumerate(self._where[:min(n, P)])]
        # positions past n hold nothing (fewer elements than contexts): no host
        self._hosts = tuple(hosts)
        built = [h._created for h in hosts]
        failed = [f.exception() for f in built]
        if any(failed):
            for h, err in zip(hosts, failed):
                if err is None:
                    destroy(h)
            raise next(e for e in failed if e is not None)

    # -- where elements are
    def _flat(self, index: Any) -> int:
        shape = self._shape
        if isinstance(index, tuple):
            if len(index) != len(shape):
                raise IndexError(f"a collection of shape {shape} is indexed by "
                                 f"{_how_indexed(shape)}; got the {len(index)}-tuple {index!r}")
            parts = index
        elif len(shape) == 1:
            parts = (index,)
        else:
            raise IndexError(f"a collection of shape {shape} is indexed by {_how_indexed(shape)}; "
                             f"got {index!r}")
        k = 0
        for i, dim in zip(parts, shape):
            if isinstance(i, bool) or not _is_int(i):
                raise TypeError(f"a collection's index is made of ints; got {index!r}")
            if not 0 <= i < dim:
                raise IndexError(f"index {index!r} is outside the collection of shape {shape} "
                                 f"(each index from 0 to its dimension - 1, as in {_last(shape)})")
            k = k * dim + int(i)
        return k

    def _owner_of(self, k: int) -> int:
        return self._where[_position(k, self._size, len(self._where), self._distribution)]

    def _host(self, k: int) -> PersistentHandle:
        return self._hosts[_position(k, self._size, len(self._where), self._distribution)]

    def owner(self, index: Index) -> int:
        """The context that holds element ``index``.

        Raises:
            IndexError: ``index`` is outside the collection's shape.

        Example:
            >>> import macroflow as mf
            >>> class Cell:
            ...     def __init__(self, index): pass
            >>> def main():
            ...     block = mf.Collection(Cell, 5)
            ...     grid = mf.Collection(Cell, (2, 3), distribution="cyclic")
            ...     return [block.owner(i) for i in range(5)], grid.owner((1, 0))
            >>> mf.run(main, contexts=2, transport="inproc")
            ([0, 0, 0, 1, 1], 1)
        """
        return self._owner_of(self._flat(index))

    def __getitem__(self, index: Index) -> _ElementHandle:
        return _ElementHandle(self, self._flat(index))

    def __len__(self) -> int:
        return self._size

    def __iter__(self) -> Iterator[_ElementHandle]:
        return (_ElementHandle(self, k) for k in range(self._size))

    @property
    def shape(self) -> Tuple[int, ...]:
        """The index space, a tuple of ints (``len(coll)`` is its size).

        Example:
            >>> import macroflow as mf
            >>> class Cell:
            ...     def __init__(self, index): pass
            >>> mf.run(lambda: mf.Collection(Cell, 3).shape, contexts=1, transport="inproc")
            (3,)
        """
        return self._shape

    @property
    def distribution(self) -> str:
        """How elements are spread: "block" or "cyclic".

        Example:
            >>> import macroflow as mf
            >>> class Cell:
            ...     def __init__(self, index): pass
            >>> def main():
            ...     return mf.Collection(Cell, 3, distribution="cyclic").distribution
            >>> mf.run(main, contexts=1, transport="inproc")
            'cyclic'
        """
        return self._distribution

    @property
    def contexts(self) -> Tuple[int, ...]:
        """The contexts the elements are spread over, in distribution order
        (the first holds element 0); with fewer elements than contexts the
        last ones hold none.

        Example:
            >>> import macroflow as mf
            >>> class Cell:
            ...     def __init__(self, index): pass
            >>> mf.run(lambda: mf.Collection(Cell, 8, contexts=[2, 0]).contexts,
            ...        contexts=3, transport="inproc")
            (2, 0)
        """
        return self._where

    # -- operations on every element
    def apply(self, method: Union[str, Callable[..., Any]], *args: Any, **kwargs: Any) -> Future:
        """Run ``element.method(*args, **kwargs)`` on every element, in
        parallel where they live; return one Future of the list of results
        in flat index order.

        ``method`` is the name of a method of the element class, or a
        function, called as ``method(element, *args, **kwargs)``. Arguments
        may be futures (arcs: they go to every context that needs them).
        Every element runs it even when one raises; the future then raises
        the error of a failed element, its index in the message.

        Raises:
            macroflow.CallError: no such method, or arguments it does not take.
            TypeError: ``method`` is neither a str nor callable.

        Example:
            >>> import macroflow as mf
            >>> class Cell:
            ...     def __init__(self, index): self.index = index
            ...     def where(self): return (self.index, mf.context_id())
            >>> def main():
            ...     coll = mf.Collection(Cell, 4, distribution="cyclic")
            ...     scaled = coll.apply(lambda el, k: el.index * k, 3)
            ...     return coll.apply("where").result(), scaled.result()
            >>> mf.run(main, contexts=2, transport="inproc")
            ([(0, 0), (1, 1), (2, 0), (3, 1)], [0, 3, 6, 9])
        """
        if isinstance(method, str):
            site: Any = method_info(self._cls, method)
            site.check(args, kwargs)
        elif not callable(method):
            raise TypeError(f"Collection.apply(): method must be a method name (str) or a "
                            f"function of the element; got {type(method).__name__}")
        else:
            site = self._site("apply", method)
        return self._combine([_host_call(h, "apply", (method, args, kwargs), site)
                              for h in self._hosts])

    def _site(self, op: str, fn: Any) -> CallSite:
        """The call site of ``op(fn)`` on every host: futures and errors
        name it in the element class's terms, not the hosts'."""
        # (as _call_label names the same calls where they run)
        label = _call_label(self._cls.__qualname__, self._shape, op, (fn,))
        site = _OP_SITES.get(label)
        if site is None:
            if len(_OP_SITES) >= 256:
                _OP_SITES.clear()  # (functions made afresh, each with a name of its own)
            site = _OP_SITES[label] = CallSite(label)
        return site

    def map_blocks(self, fn: Callable[..., Any], *args: Any, attr: str = "data",
                   **kwargs: Any) -> Future:
        """Return a Future of ``[fn(element.data, *args, **kwargs) ...]`` over
        every element, in flat index order, run where the elements live.

        The rule: an element keeps its block of data (typically a numpy
        array) in the attribute ``data``; ``attr=`` names another. ``fn``
        gets the element's own array, not a copy: it may change it in place.

        Raises:
            TypeError: ``fn`` is not callable, or ``attr`` not a str.

        Example:
            >>> import macroflow as mf, numpy as np
            >>> class Rows:
            ...     def __init__(self, index):
            ...         self.data = np.arange(4.0).reshape(2, 2) + 10 * index
            >>> def main():
            ...     coll = mf.Collection(Rows, 2)
            ...     return coll.map_blocks(np.dot, np.array([1.0, 1.0])).result()
            >>> mf.run(main, contexts=2, transport="inproc")
            [array([1., 5.]), array([21., 25.])]
        """
        if not callable(fn):
            raise TypeError(f"Collection.map_blocks(): fn must be callable; "
                            f"got {type(fn).__name__}")
        if not isinstance(attr, str):
            raise TypeError(f"Collection.map_blocks(): attr must be an attribute name (str); "
                            f"got {type(attr).__name__}")
        site = self._site("map_blocks", fn)
        return self._combine([_host_call(h, "map_blocks", (fn, args, kwargs, attr), site)
                              for h in self._hosts])

    def _combine(self, parts: List[Future]) -> Future:
        if len(parts) == 1:
            return parts[0]  # one host's list is in index order already
        eng = current_engine_of(self._comp, "collection", self)
        # on the caller's context: the parts come straight there, where the
        # list is most likely wanted, and nothing queues behind it at a host
        return _Combine.create(on=eng.id).combine(parts, self._distribution, len(self._where))

    def destroy(self) -> Future:
        """Destroy every element, on every context, once the calls already
        made to them have run; the pointers given out to their arrays are
        unregistered. Returns a Future of None, done when all are gone.
        ``mf.destroy(coll)`` does the same.

        A collection lives until the computation ends otherwise: one made
        for a step and dropped keeps its elements' memory.

        The elements of a context removed (:func:`macroflow.remove_context`)
        went with it: the rest are destroyed, and the future is done.

        Raises:
            macroflow.StaleReference: the collection is of another computation.

        Example:
            >>> import macroflow as mf
            >>> class Cell:
            ...     def __init__(self, index): self.value = index
            ...     def get(self): return self.value
            >>> def main():
            ...     coll = mf.Collection(Cell, 4)
            ...     coll.destroy().result()
            ...     return type(coll.apply("get").exception()).__name__
            >>> mf.run(main, contexts=2, transport="inproc")
            'ObjectDestroyed'
        """
        eng = current_engine_of(self._comp, "collection", self)
        # (the elements of a context removed went with it: nothing to end there)
        gone = [destroy(h) for h in self._hosts if h._ctx not in eng.heirs]
        return _Combine.create(on=eng.id).all_done(gone)

    __mf_destroy__ = destroy

    # -- inside a context
    def local(self) -> List[Tuple[Index, Any]]:
        """The elements that live in this context, as (index, element) pairs
        in index order: the objects themselves, to read and change directly
        (inside an SPMD function, say).

        Use them between the collection's calls, not during one: a method
        of an element that waits lets this context run other code meanwhile.

        Raises:
            macroflow.StaleReference: the collection is of another computation.

        Example:
            >>> import macroflow as mf
            >>> class Cell:
            ...     def __init__(self, index): self.value = index * index
            >>> def each(coll):
            ...     return [(i, el.value) for i, el in coll.local()]
            >>> def main():
            ...     return mf.spmd(each, mf.Collection(Cell, 5))
            >>> mf.run(main, contexts=2, transport="inproc")
            [[(0, 0), (1, 1), (2, 4)], [(3, 9), (4, 16)]]
        """
        eng = current_engine_of(self._comp, "collection", self)
        try:
            p = self._where.index(eng.id)
        except ValueError:
            return []
        if p >= len(self._hosts):
            return []
        host = eng.models["objects"].resolve("object", self._hosts[p]._oid)
        if host is MISSING:
            raise RuntimeError(f"the elements of {self!r} on context {eng.id} are gone "
                               f"(their host object was destroyed)")
        return list(host._items())

    def pointer(self, index: Index, attr: str = "data") -> MemoryPointer:
        """A :class:`macroflow.MemoryPointer` to the numpy array that element
        ``index`` keeps in ``attr``: any context reads it with
        :func:`macroflow.get` (and writes it with :func:`macroflow.put`)
        without the owner's code taking part.

        The owner registers the array the first time it is asked (waiting
        here for that answer). The pointer names that array: change it in
        place (``el.data[:] = ...``) and the pointer stays good; an element
        that replaces its array gets a new pointer when asked again, and the
        old one is unregistered.

        Raises:
            IndexError: ``index`` is outside the collection.
            AttributeError, TypeError: the element has no numpy array in ``attr``.

        Example:
            >>> import macroflow as mf, numpy as np
            >>> class Block:
            ...     def __init__(self, index): self.data = np.full(3, float(index))
            >>> def main():
            ...     coll = mf.Collection(Block, 2)
            ...     return mf.get(coll.pointer(1)).wait()
            >>> mf.run(main, contexts=2, transport="inproc")
            array([1., 1., 1.])
        """
        if not isinstance(attr, str):
            raise TypeError(f"Collection.pointer(): attr must be an attribute name (str); "
                            f"got {type(attr).__name__}")
        k = self._flat(index)
        return self._host(k).pointer(k, attr).result()

    # -- a value
    def __eq__(self, other: object) -> bool:
        return isinstance(other, Collection) and (other._id, other._comp) == (self._id, self._comp)

    def __hash__(self) -> int:
        return hash(self._id)

    def __repr__(self) -> str:
        shape = self._shape[0] if len(self._shape) == 1 else self._shape
        return (f"<Collection of {self._cls.__qualname__}, shape {shape}, "
                f"{self._distribution} over contexts {list(self._where)}>")


def _is_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer))


def _how_indexed(shape: Tuple[int, ...]) -> str:
    return "an int" if len(shape) == 1 else f"a tuple of {len(shape)} ints"


def _last(shape: Tuple[int, ...]) -> str:
    last = tuple(d - 1 for d in shape)
    return str(last[0] if len(last) == 1 else last)


def _check_shape(shape: Any) -> Tuple[int, ...]:
    dims = (shape,) if not isinstance(shape, (tuple, list)) else tuple(shape)
    wrong = any(isinstance(d, bool) or not _is_int(d) for d in dims)
    if not dims or wrong or any(d < 1 for d in dims):
        # (a dimension that is no int is a TypeError, as elsewhere in macroflow)
        raise (TypeError if wrong else ValueError)(
            f"mf.Collection(): shape must be an int >= 1 or a non-empty tuple of "
            f"ints >= 1 (one per dimension); got {shape!r}")
    return tuple(int(d) for d in dims)


def _check_contexts(contexts: Any, ids: List[int]) -> Tuple[int, ...]:
    if contexts is None:
        return tuple(ids)
    if _is_int(contexts) and not isinstance(contexts, bool):
        if not 1 <= contexts <= len(ids):
            raise ValueError(f"mf.Collection(): contexts={contexts!r}; the computation has "
                             f"{len(ids)} contexts, so give 1..{len(ids)}, or a list of ids")
        return tuple(ids[:int(contexts)])
    try:
        where = tuple(contexts)
    except TypeError:
        raise ValueError(f"mf.Collection(): contexts must be None (all), an int n (the first "
                         f"n running contexts) or a list of context ids; got {contexts!r}") from None
    bad = [c for c in where if isinstance(c, bool) or not _is_int(c) or c not in ids]
    if not where or bad or len(set(where)) != len(where):
        raise ValueError(f"mf.Collection(): contexts must be distinct ids of this "
                         f"computation's contexts ({ids}); got {contexts!r}")
    return tuple(int(c) for c in where)
