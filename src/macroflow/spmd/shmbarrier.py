"""A barrier in shared memory for the contexts of one host, polled, never blocking.

Tulip's SGI lesson (Beckman and Gannon, section 4.4): a barrier tree that
fitted in one 128-byte cache line serialised every update, and the barrier
grew linear in the number of processors; spreading its counters over
separate lines fixed it. :class:`ShmBarrier` keeps one arrival counter per
rank and offers three layouts of them, to use and to compare:

========  ====================================================================
padded    each rank's counter alone in its own :attr:`ShmBarrier.LINE`-byte
          slot (two 64-byte lines, because CPUs fetch lines in adjacent
          pairs); a rank writes only its own slot, a waiter reads all n
packed    the n counters side by side, in one line for n <= 8: every
          arrival invalidates the line every waiter reads
central   one counter that every rank increments under a lock (a POSIX
          semaphore that lives in the shared memory itself); the ranks fight
          for one line and one lock, as the paper guessed SGI's barrier did
========  ====================================================================

Counters are epochs: a rank's counter is how many barriers it has entered,
so barrier ``e`` is complete when every counter is at least ``e`` (central:
when the counter is at least ``e * n``); nothing is ever reset, and no sense
reversal is needed. Entering (:meth:`~ShmBarrier.arrive`) is a store;
testing (:meth:`~ShmBarrier.complete`) is a few loads, with no system call,
so a context polls it between serving requests, as Tulip's barrier called
``tulip_Poll()`` while it waited. For a context that would rather sleep,
:meth:`~ShmBarrier.sleep_flag` and :meth:`~ShmBarrier.sleepers` tell the
rank that completes a barrier whom to wake.

Memory order: the loads and stores are numpy's, which need a CPU that keeps
a store after the stores before it and a load after the loads before it
(x86-64's total store order): then the data a rank wrote before it arrived
is visible to a rank that saw the barrier complete. What TSO does not keep,
a store followed by a load of another word, the sleep hand-shake needs (a
rank flags that it sleeps, then checks; the last to arrive stores, then
reads the flags): :meth:`~ShmBarrier.arrive` and
:meth:`~ShmBarrier.sleep_flag` end with a locked read-modify-write (a
private lock taken and released), which x86 executes as a full fence. On
other CPUs :func:`problem` says why the barrier is not offered.

Why a semaphore for the central layout's lock: it can live in the shared
buffer (``sem_init`` with ``pshared=1``), so any process that maps the
buffer, forked or not, uses the same lock; taking a free one and giving it
back are two atomic instructions in the C library (about 0.3 us each through
ctypes here), and a rank that finds it taken sleeps in the kernel instead of
spinning. A lock made before a fork (``multiprocessing.Lock``) is not in the
buffer, so a peer that only maps the buffer could not use it, and an
``fcntl`` lock costs two system calls per arrival. Rank 0's constructor
initialises the semaphore; another rank's first arrival waits (yielding the
CPU) until it has, and fails after :data:`READY_TIMEOUT` seconds. A rank
that dies while it holds the lock (a few instructions of an arrival) leaves
the others waiting for it: the central layout is there to compare; the
padded one has no lock.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import time
from typing import Any, Dict, List, Optional

import numpy as np

from ..transport.ring import TSO_MACHINES
from ..transport.ring import fence as _fence  # a locked instruction on x86 (see the notes)

__all__ = ["ShmBarrier", "LAYOUTS", "problem"]

#: the layouts of :class:`ShmBarrier`
LAYOUTS = ("padded", "packed", "central")
#: seconds a rank's first arrival at a central barrier waits for rank 0 to set it up
READY_TIMEOUT = 10.0

_SEM_BYTES = 32  # sizeof(sem_t) on 64-bit glibc and musl (16 on 32-bit glibc)
_READY = 0x7475_6C69_7021  # rank 0 initialised the semaphore of a central barrier

_libc = ctypes.CDLL(None, use_errno=True)
for _name in ("sem_init", "sem_wait", "sem_post"):
    getattr(_libc, _name).restype = ctypes.c_int
_libc.sem_init.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint]
_libc.sem_wait.argtypes = [ctypes.c_void_p]
_libc.sem_post.argtypes = [ctypes.c_void_p]

def problem(machine: Optional[str] = None) -> Optional[str]:
    """Why :class:`ShmBarrier` cannot be used on this CPU, or None when it can.

    Args:
        machine: a ``platform.machine()`` name (default: this one's).

    Example:
        >>> problem("x86_64") is None
        True
        >>> problem("aarch64")  # doctest: +ELLIPSIS
        'ShmBarrier needs a CPU with total store order (x86, x86-64); this one is aarch64...'
    """
    machine = platform.machine() if machine is None else machine
    if machine.lower() in TSO_MACHINES:
        return None
    return (f"ShmBarrier needs a CPU with total store order (x86, x86-64); this one is "
            f"{machine}, whose loads and stores numpy cannot order without fences; use the "
            f"barrier of messages (mf.barrier) instead")


def _positive_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"ShmBarrier: {what} must be an int, not {type(value).__name__}")
    return int(value)


def _check_n(n: Any) -> int:
    n = _positive_int(n, "n (the number of ranks)")
    if n < 1:
        raise ValueError(f"ShmBarrier: n (the number of ranks) must be >= 1, got {n}")
    return n


def _check_layout(layout: Any) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"ShmBarrier: layout must be one of {', '.join(LAYOUTS)}; got {layout!r}")
    return layout


class ShmBarrier:
    """One rank's side of a barrier whose state lives in shared memory.

    Every rank of the barrier makes its own ShmBarrier over the same bytes:
    memory made before the ranks were forked (``mf.shared_zeros(
    ShmBarrier.nbytes(n), np.uint8)``), or a mapping of a peer's (see
    :mod:`macroflow.spmd.memory`). The bytes must hold zeros before the first
    barrier. ``arrive()`` enters the next barrier and returns its epoch (1,
    2, ...); ``complete(epoch)`` says whether every rank has entered it. Use
    an object from one thread at a time.

    Args:
        buf: a writable, C-contiguous buffer of at least ``nbytes(n, layout)``
            bytes, 8-byte aligned, in memory the ranks share.
        n: how many ranks meet in the barrier.
        rank: this one, ``0 <= rank < n``.
        layout: "padded" (the default), "packed" or "central" (see the module).

    Raises:
        TypeError: ``buf`` is not a buffer, or ``n``/``rank`` not ints.
        ValueError: ``buf`` is read-only, not contiguous, too small or
            misaligned; ``n`` < 1; ``rank`` outside ``0..n-1``; an unknown layout.
        RuntimeError: this CPU does not keep stores in order (see :func:`problem`).

    Example:
        >>> import macroflow as mf
        >>> buf = mf.shared_zeros(ShmBarrier.nbytes(2), np.uint8)
        >>> b0, b1 = ShmBarrier(buf, 2, 0), ShmBarrier(buf, 2, 1)
        >>> e = b0.arrive()
        >>> e, b0.complete(e)
        (1, False)
        >>> b1.arrive(), b0.complete(e), b1.complete(e)
        (1, True, True)
    """

    #: bytes per counter in the padded layout: two 64-byte lines, because the
    #: CPU's adjacent-line prefetch moves lines in pairs
    LINE = 128

    __slots__ = ("n", "rank", "layout", "_mem", "_words", "_counters", "_sleep", "_entered",
                 "_counter", "_ready", "_sem", "_epoch", "_done")

    @staticmethod
    def nbytes(n: int, layout: str = "padded") -> int:
        """Bytes of shared memory a barrier of ``n`` ranks needs.

        padded: one :attr:`LINE` per rank (its counter, and the word it
        flags sleep in); packed: n counters, then n sleep words; central: a
        line for the semaphore and the counter, then two words per rank.

        Example:
            >>> [ShmBarrier.nbytes(4, layout) for layout in LAYOUTS]
            [512, 64, 192]
        """
        n, layout = _check_n(n), _check_layout(layout)
        if layout == "padded":
            return n * ShmBarrier.LINE
        if layout == "packed":
            return 16 * n
        return ShmBarrier.LINE + 16 * n

    def __init__(self, buf: Any, n: int, rank: int, layout: str = "padded"):
        why = problem()
        if why is not None:
            raise RuntimeError(why)
        n, layout = _check_n(n), _check_layout(layout)
        rank = _positive_int(rank, "rank")
        if not 0 <= rank < n:
            raise ValueError(f"ShmBarrier: rank must be in 0..{n - 1}, got {rank}")
        try:
            m = memoryview(buf)
        except TypeError:
            raise TypeError(f"ShmBarrier: buf must be a buffer (a numpy array, mmap, "
                            f"bytearray...), not {type(buf).__name__}") from None
        if m.readonly:
            raise ValueError("ShmBarrier: buf is read-only; the barrier writes to it")
        if not m.c_contiguous:
            raise ValueError("ShmBarrier: buf must be C-contiguous")
        need = self.nbytes(n, layout)
        if m.nbytes < need:
            raise ValueError(f"ShmBarrier: buf has {m.nbytes} bytes; a {layout} barrier of "
                             f"{n} ranks needs ShmBarrier.nbytes({n}, {layout!r}) = {need}")
        mem = np.frombuffer(m.cast("B"), np.uint8, count=need)
        address = mem.__array_interface__["data"][0]
        if address % 8:
            raise ValueError(f"ShmBarrier: buf must start at an 8-byte aligned address, got "
                             f"{address:#x} (shared_zeros gives page-aligned memory)")
        self.n, self.rank, self.layout = n, rank, layout
        self._mem = mem  # keeps the buffer alive
        words = self._words = mem.view(np.int64)
        self._counters = self._entered = self._counter = self._ready = None
        self._sem = 0
        stride = self.LINE // 8
        if layout == "padded":
            self._counters = words[::stride]
            self._sleep = words[1::stride]
            self._epoch = int(self._counters[rank])
        elif layout == "packed":
            self._counters = words[:n]
            self._sleep = words[n:2 * n]
            self._epoch = int(self._counters[rank])
        else:
            self._sem = address
            self._ready = words[_SEM_BYTES // 8:_SEM_BYTES // 8 + 1]
            self._counter = words[_SEM_BYTES // 8 + 1:_SEM_BYTES // 8 + 2]
            self._entered = words[stride::2]
            self._sleep = words[stride + 1::2]
            self._epoch = int(self._entered[rank])
            if rank == 0 and self._ready.item() != _READY:
                if _libc.sem_init(address, 1, 1) != 0:
                    e = ctypes.get_errno()
                    raise OSError(e, f"ShmBarrier: sem_init of the central lock failed: "
                                     f"{os.strerror(e)}")
                self._ready[0] = _READY  # after the semaphore's stores (TSO keeps them in order)
        self._done = 0  # the highest epoch seen complete

    # ------------------------------------------------------------------ the barrier

    def arrive(self) -> int:
        """Enter the next barrier; return its epoch (1 for the first, then 2, ...).

        Returns at once (central: once it had the lock, held for a few
        instructions by whoever has it). Whatever this process stored before
        is visible to a rank that then sees the barrier complete.

        Example:
            >>> b = ShmBarrier(bytearray(ShmBarrier.nbytes(1)), 1, 0)
            >>> b.arrive(), b.arrive(), b.epoch
            (1, 2, 2)
        """
        e = self._epoch + 1
        if self._counter is None:
            self._counters[self.rank] = e
            self._epoch = e
            _fence()
            return e
        self._take()
        try:
            self._counter[0] += 1
            self._entered[self.rank] = e
        finally:
            _libc.sem_post(self._sem)  # a locked instruction: the fence too
        self._epoch = e
        return e

    def complete(self, epoch: int) -> bool:
        """Has every rank entered barrier ``epoch``? A few loads, no system call.

        Example:
            >>> b = ShmBarrier(bytearray(ShmBarrier.nbytes(1, "packed")), 1, 0, "packed")
            >>> b.complete(1), b.complete(b.arrive())
            (False, True)
        """
        if epoch <= self._done:
            return True
        if self._counter is None:
            ok = min(self._counters.tolist()) >= epoch
        else:
            ok = self._counter.item() >= epoch * self.n
        if ok:
            self._done = epoch
        return ok

    def sleep_flag(self, epoch: int) -> None:
        """Say that this rank is about to sleep until barrier ``epoch`` completes.

        Call it, then test :meth:`complete` once more before sleeping: the
        rank that completes the barrier stores its arrival, then reads
        :meth:`sleepers`, so one of the two sees the other.

        Raises:
            ValueError: this rank has not entered barrier ``epoch``.

        Example:
            >>> buf = bytearray(ShmBarrier.nbytes(2))
            >>> b0, b1 = ShmBarrier(buf, 2, 0), ShmBarrier(buf, 2, 1)
            >>> e = b1.arrive()
            >>> b1.sleep_flag(e)
            >>> b0.sleepers(e), b0.sleepers(e + 1)
            ([1], [])
        """
        if isinstance(epoch, bool) or not isinstance(epoch, (int, np.integer)) \
                or not 1 <= epoch <= self._epoch:
            raise ValueError(f"ShmBarrier.sleep_flag(): epoch must be a barrier this rank "
                             f"entered, 1..{self._epoch}; got {epoch!r}")
        self._sleep[self.rank] = epoch
        _fence()

    def sleepers(self, epoch: int) -> List[int]:
        """The ranks that may sleep until barrier ``epoch`` completes: those
        that flagged it, or a later one (a rank that entered barrier
        ``epoch`` without waiting for it, and then slept in a later one,
        flagged only the later one; waking it early costs a look).

        Example:
            >>> buf = bytearray(ShmBarrier.nbytes(3))
            >>> b = ShmBarrier(buf, 3, 1)
            >>> b.arrive(), b.arrive()
            (1, 2)
            >>> b.sleep_flag(2)
            >>> ShmBarrier(buf, 3, 0).sleepers(1), ShmBarrier(buf, 3, 0).sleepers(3)
            ([1], [])
        """
        return [r for r, e in enumerate(self._sleep.tolist()) if e >= epoch]

    # ------------------------------------------------------------------ state

    @property
    def epoch(self) -> int:
        """How many barriers this rank has entered (the last one's epoch).

        Example:
            >>> ShmBarrier(bytearray(ShmBarrier.nbytes(1)), 1, 0).epoch
            0
        """
        return self._epoch

    def statistics(self) -> Dict[str, Any]:
        """What this rank's side holds: layout, ranks, epoch entered, the
        highest epoch seen complete, and every rank's count of barriers
        entered as the memory holds it now.

        Example:
            >>> buf = bytearray(ShmBarrier.nbytes(2, "central"))
            >>> b = ShmBarrier(buf, 2, 0, "central")
            >>> _ = b.arrive()
            >>> b.statistics()
            {'layout': 'central', 'n': 2, 'rank': 0, 'epoch': 1, 'completed': 0, 'entered': [1, 0]}
        """
        entered = self._counters if self._counter is None else self._entered
        return {"layout": self.layout, "n": self.n, "rank": self.rank, "epoch": self._epoch,
                "completed": self._done, "entered": entered.tolist()}

    def __repr__(self) -> str:
        return (f"<ShmBarrier {self.layout} rank {self.rank} of {self.n}, epoch {self._epoch}, "
                f"completed {self._done}>")

    # ------------------------------------------------------------------ central's lock

    def _take(self) -> None:
        if self._ready.item() != _READY:
            self._wait_ready()
        while _libc.sem_wait(self._sem) != 0:
            e = ctypes.get_errno()
            if e != errno.EINTR:
                raise OSError(e, f"ShmBarrier: sem_wait on the central lock failed: "
                                 f"{os.strerror(e)}")

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT
        while self._ready.item() != _READY:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"ShmBarrier: rank {self.rank} arrived at a central barrier whose lock rank "
                    f"0 has not set up after {READY_TIMEOUT:g} s: rank 0 makes its ShmBarrier "
                    f"over the same memory first (or the buffer is not shared, or not zeroed)")
            os.sched_yield()
