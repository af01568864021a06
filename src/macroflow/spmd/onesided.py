"""Registered memory and one-sided get and put (Tulip's tulip_Get / tulip_Put).

``mf.register(array)`` names a buffer of this context with a
:class:`MemoryPointer`; any context of the computation then reads it with
``mf.get`` and writes it with ``mf.put`` without the owner's user code
taking part. How the bytes move is chosen per request, fastest first:

1. the owner is this context: a copy;
2. the owner is a process on this host: the requester copies the bytes
   itself, from a shared mapping when the buffer was allocated with
   :func:`macroflow.shared_empty`, else with the kernel's cross-process copy
   (``process_vm_readv``/``writev``): the owner's CPU does nothing, like
   the T3D's network DMA in the paper;
3. otherwise (another host, or the kernel refuses): a request message that
   the owner serves even while one of its methods computes, and whose
   answer is copied into ``out``.

A put is not atomic (as in Tulip): puts that overlap in the same region at
the same time leave each byte from one of them, in no defined order; order
them with a barrier or a handle's ``wait()``. Do not change the data given
to a put, nor read ``out`` of a get, before the handle completes.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import numpy as np

from ..core import errors
from ..core.context import Engine, current_engine
from ..core.future import current_engine_of
from ..core.gptr import GlobalPointer
from ..core.rsr import protocols_of
from . import memory
from .model import (GET, PUT, REVOKED, USAGE, Done, Handle, engine_side, env_onesided, local_future,
                    model_of)

#: the largest get read through an MPI window by default; larger ones are
#: answered by the owner, their bytes received straight into the caller's
#: array. Measured on MPICH 5 (`macroflow bench tulip`, Figure 1 on mpi, and
#: an owner asleep in a barrier): reads of a dynamic window beat a request
#: (9 against 77 us at 8 B, the owner polling), and up to 16 KiB they need
#: nothing of the owner; from 32 KiB on MPICH waits for the owner to look at
#: MPI, which an owner asleep in a barrier does not (400 ms for 32 KiB, 500
#: ms for 64 KiB), while a request wakes it. See docs/benchmarks.md
WINDOW_MAX = 16 * 1024


class MemoryPointer(GlobalPointer):
    """A global pointer to registered memory: a range of elements of one
    buffer in one context (Tulip's global pointer: context and address).

    ``len(gp)`` is its number of elements, ``gp.dtype`` their type; slicing
    (``gp[100:200]``, ``gp[5]``) gives a pointer to a part of the range.
    Picklable: pass it to other contexts (``mf.allgather(gp)``).

    Example:
        >>> import macroflow as mf, numpy as np
        >>> def main():
        ...     gp = mf.register(np.arange(10.0))
        ...     part = gp[2:5]
        ...     return len(gp), len(part), part.offset, str(part.dtype), mf.get(part).wait()
        >>> mf.spmd(main, n=1, transport="inproc")
        [(10, 3, 2, 'float64', array([2., 3., 4.]))]
    """

    __slots__ = ("dtype", "offset", "length", "region", "_direct")

    def __mf_rsr_check__(self) -> None:
        """Refuse :func:`macroflow.rsr` of a part of the buffer: its handler
        gets the object a pointer names, the whole registered buffer.

        Example:
            >>> import macroflow as mf, numpy as np
            >>> def main():
            ...     gp = mf.register(np.arange(10.0))
            ...     gp.__mf_rsr_check__()  # the whole buffer: nothing to say
            ...     try:
            ...         gp[2:4].__mf_rsr_check__()
            ...     except ValueError as e:
            ...         return str(e).split(";")[0]
            >>> mf.spmd(main, n=1, transport="inproc")
            ['mf.rsr(): the pointer names part [2:4] of a registered buffer of 10 elements']
        """
        whole = self.region.nbytes // self.dtype.itemsize \
            if self.region is not None and self.dtype.itemsize else None
        if self.offset != 0 or (whole is not None and self.length != whole):
            raise ValueError(
                f"mf.rsr(): the pointer names part [{self.offset}:{self.offset + self.length}] of "
                f"a registered buffer{f' of {whole} elements' if whole is not None else ''}; a "
                f"handler gets the whole buffer: pass the pointer mf.register() returned, and "
                f"the part's bounds as arguments")

    def __init__(self, context: int, ident: Any, protocols: Tuple[Tuple[str, str], ...],
                 computation: Optional[str], dtype: Any, offset: int, length: int,
                 region: Any):
        super().__init__(context, "memory", ident, protocols, computation)
        self.dtype = np.dtype(dtype)
        self.offset = offset
        self.length = length
        self.region = region
        # after a get through a shared mapping: (engine, model, the range's
        # bytes there, the owner's watch), so that the next get of this
        # pointer is a check and a copy (see get)
        self._direct: Any = None

    def __len__(self) -> int:
        return self.length

    @property
    def nbytes(self) -> int:
        """How many bytes the pointer's range holds.

        Example:
            >>> import macroflow as mf, numpy as np
            >>> mf.spmd(lambda: mf.register(np.zeros(10))[2:4].nbytes, n=1, transport="inproc")
            [16]
        """
        return self.length * self.dtype.itemsize

    def __getitem__(self, key: Any) -> "MemoryPointer":
        n = self.length
        if isinstance(key, slice):
            if key.step not in (None, 1):
                raise ValueError(f"a memory pointer's slice must be contiguous (step 1); "
                                 f"got step {key.step}")
            start = 0 if key.start is None else _index(key.start, n, "start")
            stop = n if key.stop is None else _index(key.stop, n, "stop")
            if stop < start:
                stop = start  # empty, as Python's and numpy's slices that end before they start
        elif isinstance(key, (int, np.integer)) and not isinstance(key, bool):
            start = _index(key, n, "index")
            stop = start + 1
        else:
            raise TypeError(f"a memory pointer is indexed by an int or a slice; "
                            f"got {type(key).__name__}")
        return MemoryPointer(self.context, self.ident, self.protocols, self.computation,
                             self.dtype, self.offset + start, stop - start, self.region)

    def __reduce__(self):
        return (MemoryPointer, (self.context, self.ident, self.protocols, self.computation,
                                self.dtype, self.offset, self.length, self.region))

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, MemoryPointer) and super().__eq__(other)
                and other.offset == self.offset and other.length == self.length)

    def __hash__(self) -> int:
        return hash((self.context, self.ident, self.offset, self.length))

    def __repr__(self) -> str:
        return (f"MemoryPointer(ctx={self.context}, {self.ident}, "
                f"[{self.offset}:{self.offset + self.length}] of {self.dtype})")


def _elements(n: int) -> str:
    return "1 element" if n == 1 else f"{n} elements"


def _index(i: Any, n: int, what: str) -> int:
    """A slice bound (0..n, or -n..-1 from the end) or an element index (0..n-1)."""
    i = int(i)
    top = n if what != "index" else n - 1
    j = i + n if i < 0 else i
    if not 0 <= j <= top:
        raise IndexError(f"{what} {i} is outside the pointer's range of {_elements(n)} "
                         f"(0..{top})")
    return j


def _bytes(a: np.ndarray) -> np.ndarray:
    return a.reshape(-1).view(np.uint8)


def register(buffer: Any) -> MemoryPointer:
    """Register ``buffer`` (a C-contiguous numpy array, or any writable
    bytes-like object) so that every context of the computation can read and
    write it with :func:`get` and :func:`put`; return its pointer.

    The buffer is not copied: puts change it in place. Keep it alive and
    registered while others may use it; a buffer from
    :func:`macroflow.shared_empty` is read and written through shared
    memory by the other contexts of its host.

    Raises:
        TypeError: not a buffer, or an array of Python objects.
        ValueError: the array is not C-contiguous.

    Example:
        >>> import macroflow as mf, numpy as np
        >>> def main():
        ...     mine = np.zeros(3)
        ...     ptrs = mf.allgather(mf.register(mine))
        ...     mf.put(ptrs[(mf.rank() + 1) % mf.size()], np.full(3, mf.rank() + 1.0)).wait()
        ...     mf.barrier()
        ...     return mine
        >>> mf.spmd(main, n=2, transport="inproc")
        [array([2., 2., 2.]), array([1., 1., 1.])]
    """
    eng = current_engine(USAGE)
    if isinstance(buffer, np.ndarray):
        arr = buffer
    else:
        try:
            view = memoryview(buffer)
        except TypeError:
            raise TypeError(f"mf.register(): buffer must be a numpy array or a bytes-like "
                            f"object; got {type(buffer).__name__}") from None
        arr = None
        if view.format.lstrip("@=<>!") not in ("B", "b", "c"):
            # typed items (array.array("d"), a cast memoryview): as numpy reads them
            try:
                arr = np.asarray(view)
            except (TypeError, ValueError):
                arr = None
        if arr is None:
            arr = np.frombuffer(view, dtype=np.uint8)
    if arr.dtype.hasobject:
        raise TypeError(f"mf.register(): an array of dtype {arr.dtype} holds Python objects, "
                        f"not data another process can copy; register an array of numbers")
    if not arr.flags.c_contiguous:
        raise ValueError("mf.register(): the array is not C-contiguous (a strided view?); "
                         "register the array it views, or np.ascontiguousarray(a)")
    model = model_of(eng)
    ident = eng.new_fid()
    region = memory.describe(_bytes(arr))  # as bytes: numpy cannot export datetime64 as a buffer
    region.window = engine_side(eng, _keep, model, ident, arr)
    return MemoryPointer(eng.id, ident, protocols_of(eng, eng.id), eng.computation, arr.dtype,
                         0, arr.size, region)


def _keep(model: Any, ident: Any, arr: np.ndarray) -> bool:
    """Hold the array (and attach it to the transport's window, if there is
    one); True if attached."""
    data = _bytes(arr)
    win = model.window() if arr.size else None
    attached = win is not None and win.attach(data)
    model.regions[ident] = (arr, data, bool(arr.flags.writeable), attached)
    return attached


def unregister(gp: MemoryPointer) -> None:
    """Forget memory this context registered; later gets and puts on it fail.

    Every context is told, and has heard when it returns: a get or put that
    one of them starts afterwards fails at the call. Contexts of this host copy from and to
    the buffer directly, without asking, so make sure none is in flight (a
    barrier) before the buffer is freed or reused.

    Raises:
        TypeError: not a MemoryPointer.
        ValueError: it names memory of another context, is not registered,
            or is a part of a registered buffer (a slice of its pointer).

    Example:
        >>> import macroflow as mf, numpy as np
        >>> def main():
        ...     gp = mf.register(np.zeros(2))
        ...     mf.unregister(gp)
        ...     try:
        ...         mf.get(gp)
        ...     except ValueError as e:
        ...         return "unregistered" in str(e)
        >>> mf.spmd(main, n=1, transport="inproc")
        [True]
    """
    eng = _engine(gp, "unregister")
    if gp.context != eng.id:
        raise ValueError(f"mf.unregister(): {gp!r} names memory of context {gp.context}; "
                         f"only the context that registered it (this is {eng.id}) can")
    model = model_of(eng)
    if gp.ident not in model.regions:
        raise ValueError(f"mf.unregister(): {gp!r} is not registered (unregistered already?)")
    whole = model.regions[gp.ident][0].size
    if gp.offset != 0 or gp.length != whole:
        # it forgets the whole buffer: a part of it named would say otherwise
        raise ValueError(f"mf.unregister(): {gp!r} is part [{gp.offset}:{gp.offset + gp.length}] "
                         f"of a buffer of {_elements(whole)}; unregister the pointer "
                         f"mf.register() returned (the whole buffer is forgotten)")
    acks, entry = engine_side(eng, _forget, eng, model, gp.ident)
    for f in acks:  # every context has heard when this returns
        try:
            f.result()
        except errors.ContextLost:
            pass  # a context that is gone copies nothing
    if entry[3]:  # every context has ended its reads through the window too
        engine_side(eng, model.window().detach, entry[1])


def _forget(eng: Engine, model: Any, ident: Any) -> Tuple[list, Any]:
    entry = model.regions.pop(ident, None)
    # the others copy directly, without asking: tell them it is gone, and
    # wait until each has heard (a barrier in shared memory sends no message
    # that would come after the news)
    acks = []
    for r in eng.context_ids():
        if r != eng.id and r not in eng.lost:
            f = local_future(eng)
            acks.append(f)
            try:
                model.request(r, f, None, ("unregister", ident, r), REVOKED, ident)
            except ConnectionError:
                f._set(True, None)
    return acks, entry


def _engine(gp: Any, who: str) -> Engine:
    if type(gp) is not MemoryPointer and not isinstance(gp, MemoryPointer):
        raise TypeError(f"mf.{who}(): expected a MemoryPointer (from mf.register); "
                        f"got {type(gp).__name__}")
    try:
        eng = current_engine()
    except RuntimeError:
        eng = None
    if eng is not None and eng.computation == gp.computation and not eng.closed:
        return eng
    return current_engine_of(gp.computation, "memory pointer", gp)  # says what is wrong


def get(gp: MemoryPointer, out: Optional[np.ndarray] = None) -> Handle:
    """Start copying the memory ``gp`` points to into ``out``; return a
    :class:`Handle` whose ``wait()`` returns ``out`` (Tulip's tulip_Get).

    Args:
        gp: where to read (a :class:`MemoryPointer`, possibly sliced).
        out: a writable C-contiguous array of ``gp.dtype`` with ``len(gp)``
            elements (any shape); default a new 1-D array.

    Raises:
        TypeError, ValueError: ``out`` does not match ``gp`` (dtype, size,
            layout), or ``gp`` is this context's and not registered.
        macroflow.StaleReference: ``gp`` is from another computation.

    Example:
        >>> import macroflow as mf, numpy as np
        >>> def main():
        ...     ptrs = mf.allgather(mf.register(np.full(4, float(mf.rank()))))
        ...     right = np.empty(4)
        ...     h = mf.get(ptrs[(mf.rank() + 1) % mf.size()], out=right)
        ...     h.wait()
        ...     mf.barrier()                  # nobody frees memory another may read
        ...     return right
        >>> mf.spmd(main, n=2, transport="inproc")
        [array([1., 1., 1., 1.]), array([0., 0., 0., 0.])]
    """
    d = gp._direct if type(gp) is MemoryPointer else None
    if d is not None and type(out) is np.ndarray:
        # this pointer's memory was read through a shared mapping before:
        # the same checks as below, and a copy
        eng, model, src, watch = d
        if (out.size == gp.length and (out.dtype is gp.dtype or out.dtype == gp.dtype)
                and out.flags.c_contiguous and out.flags.writeable and not eng.closed
                and model.onesided == "direct" and gp.ident not in model.revoked
                and not watch.gone()):
            _bytes(out)[:] = src
            model.counts["spmd_gets_direct"] += 1
            return Handle(eng, Done(out), ("get", gp, None))
    eng = _engine(gp, "get")
    dt = gp.dtype
    if out is None:
        out = np.empty(gp.length, dt)
    else:
        _check_array(out, gp, "get", "out")
        if not out.flags.writeable:
            raise ValueError("mf.get(): out is read-only")
    return _transfer(eng, gp, "get", _bytes(out), out)



def put(gp: MemoryPointer, data: Any) -> Handle:
    """Start copying ``data`` into the memory ``gp`` points to; return a
    :class:`Handle` whose ``wait()`` returns None once the data is there
    (Tulip's tulip_Put). Not atomic (see the module's notes).

    Args:
        gp: where to write.
        data: ``len(gp)`` elements of ``gp.dtype``: an array of that dtype
            (any shape), any bytes-like object (``bytes``, ``bytearray``,
            ``memoryview``, ``array.array``) whose items are of that type,
            raw bytes if the memory's items are one byte each (registered
            from a ``bytearray`` or a ``uint8`` array), or numbers and
            sequences numpy converts to it.

    Raises:
        TypeError, ValueError: ``data`` has another dtype or size, or the
            registered buffer is read-only.

    Example:
        >>> import macroflow as mf, numpy as np
        >>> def main():
        ...     mine = np.zeros(4)
        ...     ptrs = mf.allgather(mf.register(mine))
        ...     if mf.rank() == 0:
        ...         mf.put(ptrs[1][1:3], [7.0, 8.0]).wait()
        ...     mf.barrier()
        ...     return mine
        >>> mf.spmd(main, n=2, transport="inproc")
        [array([0., 0., 0., 0.]), array([0., 7., 8., 0.])]
        >>> def text():
        ...     mine = bytearray(5)
        ...     mf.put(mf.register(mine), b"hello").wait()
        ...     return bytes(mine)
        >>> mf.spmd(text, n=1, transport="inproc")
        [b'hello']
    """
    eng = _engine(gp, "put")
    dt = gp.dtype
    if isinstance(data, np.generic):
        kind = data.dtype.kind
        if kind in "biufc":
            data = data.item()  # a number, as a Python number is (not a buffer of its type)
        elif kind in "mM":  # a date or a time span: an array of its own dtype, not 8 raw bytes
            data = np.asarray(data)
    if isinstance(data, np.ndarray):
        arr = data if data.flags.c_contiguous else np.ascontiguousarray(data)
    elif isinstance(data, str):
        raise TypeError(f"mf.put(): data is a str; put bytes (data.encode()) into memory of "
                        f"1-byte items, or {_elements(len(gp))} of {dt}")
    else:
        try:
            view: Optional[memoryview] = memoryview(data)
        except TypeError:
            view = None
        if view is not None:
            arr = _from_buffer(view, gp)
        else:
            arr = _convert(data, dt, len(gp))
    _check_array(arr, gp, "put", "data")
    return _transfer(eng, gp, "put", _bytes(arr), None)


def _convert(data: Any, dt: np.dtype, n: int) -> np.ndarray:
    """Numbers (or sequences of them) as an array of ``dt``, refused where
    the memory would cut them short (see :func:`_check_lossless`) or, for
    floating-point memory, could not hold them (1e300 into float32 memory
    would be inf).

    Example:
        >>> _convert([1, 2.5], np.dtype("float32"), 2)
        array([1. , 2.5], dtype=float32)
        >>> _convert(1e300, np.dtype("float32"), 1)
        Traceback (most recent call last):
        ...
        TypeError: mf.put(): data holds a number that float32 memory cannot hold (its largest magnitude is 3.40282e+38)
    """
    _check_lossless(data, dt)
    try:
        with np.errstate(over="raise", invalid="raise"):
            return np.asarray(data, dtype=dt)
    except OverflowError:
        raise TypeError(_too_big(dt)) from None
    except FloatingPointError:
        most = np.finfo(dt).max if dt.kind in "fc" else None
        raise TypeError(f"mf.put(): data holds a number that {dt} memory cannot hold"
                        + (f" (its largest magnitude is {float(most):g})" if most is not None else "")
                        ) from None
    except (TypeError, ValueError) as e:
        raise TypeError(f"mf.put(): data cannot be made {_elements(n)} of {dt}: {e}") from None


def _check_lossless(data: Any, dt: np.dtype) -> None:
    """Refuse values that the memory's dtype would cut short (1.7 into int
    memory stored 1): fractions into integers, complex into real numbers.

    Example:
        >>> _check_lossless([1, 2], np.dtype("int32"))
        >>> _check_lossless([1.7, 2], np.dtype("int32"))
        Traceback (most recent call last):
        ...
        TypeError: mf.put(): data holds float64 values, which int32 memory would cut short; convert them first if that is what you mean
        >>> _check_lossless(None, np.dtype("float64"))
        Traceback (most recent call last):
        ...
        TypeError: mf.put(): data holds None, not numbers; put numbers, or an array of float64
    """
    try:
        given = np.asarray(data).dtype
    except (TypeError, ValueError, OverflowError):
        return  # (np.asarray with the memory's dtype says what is wrong)
    kind, to = given.kind, np.dtype(dt).kind
    if kind == "O" and _big_ints(data):
        # ints beyond 64 bits, which numpy keeps as objects: a float rounds
        # them, as it rounds any int beyond 2**53; an integer cannot hold them
        if to in "fc":
            return
        raise TypeError(_too_big(dt))
    if kind in "OSU" or (kind == "V" and to != "V"):
        # None would be stored as NaN, "7" as 7: numpy converts what is no number
        raise TypeError(f"mf.put(): data holds {_what(data, given)}, not numbers; put numbers, "
                        f"or an array of {dt}")
    if (kind in "fc" and to in "iub") or (kind == "c" and to == "f"):
        raise TypeError(f"mf.put(): data holds {given} values, which {dt} "
                        f"memory would cut short; convert them first if that is what you mean")
    if to in "mM" and not np.can_cast(given, dt):
        # 3 into datetime64[D] memory was stored as 1970-01-04
        raise TypeError(f"mf.put(): data holds {given} values, not {dt}; put "
                        f"np.{np.dtype(dt).name.split('[')[0]} values, or an array of {dt}")


def _too_big(dt: Any) -> str:
    """The error of a put of an int that memory of ``dt`` cannot hold.

    Example:
        >>> _too_big(np.dtype("int8"))
        'mf.put(): data holds an int that int8 memory cannot hold (-128..127)'
    """
    dt = np.dtype(dt)
    span = f" ({np.iinfo(dt).min}..{np.iinfo(dt).max})" if dt.kind in "iu" else ""
    return f"mf.put(): data holds an int that {dt} memory cannot hold{span}"


def _big_ints(data: Any) -> bool:
    """Whether ``data`` (a number, or nested sequences of them) holds only
    Python ints, one at least beyond what numpy keeps in 64 bits.

    Example:
        >>> _big_ints(10**30), _big_ints([10**30, 1]), _big_ints([10**30, None]), _big_ints([1])
        (True, True, False, False)
    """
    try:
        flat = np.asarray(data, dtype=object).ravel().tolist()
    except (TypeError, ValueError):
        return False
    return all(type(x) is int for x in flat) and any(not -2**63 <= x < 2**64 for x in flat)


def _what(data: Any, given: np.dtype) -> str:
    """How an error names values that are no numbers."""
    if data is None:
        return "None"
    if given.kind in "SU":
        return "strings"
    return f"values numpy keeps as {given} (None, or objects of mixed or other types)"


def _from_buffer(view: memoryview, gp: MemoryPointer) -> np.ndarray:
    """A bytes-like object's items as an array, for a put into ``gp``: raw
    bytes become the memory's items when those are one byte each; items of
    another type are not converted (the caller's dtype check refuses them)."""
    dt = gp.dtype
    try:
        arr = np.asarray(view)
    except (TypeError, ValueError) as e:
        raise TypeError(f"mf.put(): data's buffer (format {view.format!r}) is not one numpy "
                        f"reads: {e}; put an array of {dt}") from None
    if view.format.lstrip("@=<>!") in ("B", "b", "c"):  # raw bytes
        if dt.itemsize != 1:
            raise TypeError(f"mf.put(): data is {view.nbytes} raw bytes, and the pointer's "
                            f"memory holds {dt} ({dt.itemsize} bytes each): put "
                            f"{_elements(len(gp))} of {dt} (np.frombuffer(data, dtype={_spelled(dt)}) reads "
                            f"bytes laid out as {dt})")
        arr = np.ascontiguousarray(arr).view(dt)
    return arr if arr.flags.c_contiguous else np.ascontiguousarray(arr)


def _spelled(dt: np.dtype) -> str:
    """How Python code names ``dt``.

    Example:
        >>> _spelled(np.dtype("float64")), _spelled(np.dtype("datetime64[D]"))
        ('np.float64', "np.dtype('datetime64[D]')")
    """
    return f"np.{dt.name}" if getattr(np, dt.name, None) is dt.type else f"np.dtype({str(dt)!r})"


def _transfer(eng: Engine, gp: MemoryPointer, who: str, mine: np.ndarray,
              value: Any) -> Handle:
    """Copy between ``gp``'s memory and ``mine`` (its bytes; to ``mine`` for a
    get, from it for a put) by the fastest way there is; the handle's value
    is ``value``."""
    model = model_of(eng)
    itemsize = gp.dtype.itemsize
    n = gp.length * itemsize
    off = gp.offset * itemsize
    getting = who == "get"
    what = (who, gp, None)
    if gp.context == eng.id:
        entry = model.regions.get(gp.ident)
        if entry is None:
            raise ValueError(f"mf.{who}(): {gp!r} is not registered (unregistered?)")
        if getting:
            mine[:] = entry[1][off:off + n]
        elif not entry[2]:
            raise ValueError(f"mf.{who}(): the registered buffer is read-only")
        else:
            entry[1][off:off + n] = mine
        return Handle(eng, Done(value), what)
    if gp.ident in model.revoked:
        raise ValueError(f"mf.{who}(): {gp!r} was unregistered by context {gp.context}")
    if gp.context in eng.lost:
        # as a request to it fails: not read from memory that outlived its
        # context (in one process, or a shared mapping)
        f = local_future(eng)
        f._set(False, errors.ContextLost(gp.context, eng.lost[gp.context]))
        return Handle(eng, f, what)
    if n == 0:
        return Handle(eng, Done(value), what)
    mode = model.onesided
    if mode is None:
        mode = model.onesided = env_onesided()
    if getting:
        if mode == "direct":
            acc = memory.access()
            src = acc.source(gp.region, off, n)
            if src is not None:
                mine[:] = src[0]
                gp._direct = (eng, model, src[0], src[1])
                model.counts["spmd_gets_direct"] += 1
                return Handle(eng, Done(value), what)
            if acc.read(gp.region, off, memoryview(mine)):
                model.counts["spmd_gets_direct"] += 1
                return Handle(eng, Done(value), what)
    elif gp.region.readonly:
        raise ValueError(f"mf.{who}(): the registered buffer is read-only")
    elif mode == "direct" and memory.access().write(gp.region, off, memoryview(mine)):
        model.counts["spmd_puts_direct"] += 1
        return Handle(eng, Done(value), what)
    f = local_future(eng)
    if getting and gp.region.window and (mode == "window" or mode == "direct"
                                         and n <= WINDOW_MAX):
        win = model.window()
        if win is not None and win.reaches(gp.context):
            engine_side(eng, model.window_get, f, value, mine, gp.context,
                        gp.region.address + off, n)
            return Handle(eng, f, what)
    if getting:
        engine_side(eng, model.request, gp.context, f, (value, mine), what, GET, gp.ident, off, n)
    else:
        engine_side(eng, model.request, gp.context, f, None, what, PUT, gp.ident, off, mine)
        out = model.puts_out
        if len(out) >= 64:
            out[:] = [p for p in out if not p.done()]
        out.append(f)
    return Handle(eng, f, what)


def _check_array(a: np.ndarray, gp: MemoryPointer, who: str, name: str) -> None:
    if not isinstance(a, np.ndarray):
        raise TypeError(f"mf.{who}(): {name} must be a numpy array; got {type(a).__name__}")
    if a.dtype is not gp.dtype and a.dtype != gp.dtype:
        raise TypeError(f"mf.{who}(): {name} has dtype {a.dtype}, the pointer's memory holds "
                        f"{gp.dtype} (no conversion is made: convert it first)")
    if a.size != gp.length:
        raise ValueError(f"mf.{who}(): {name} has {_elements(a.size)}, the pointer's range "
                         f"[{gp.offset}:{gp.offset + gp.length}] has {gp.length}")
    if not a.flags.c_contiguous:
        raise ValueError(f"mf.{who}(): {name} must be C-contiguous")

