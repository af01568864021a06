"""Shared-memory rings: frames between two contexts on one host without a
system call.

A :class:`Ring` carries the frames of one direction of one connection. Its
reader makes it inside its :class:`RingHost`, one anonymous ``memfd`` per
process (so one descriptor, whatever the number of peers, and nothing is
left in ``/dev/shm`` when a process dies), and offers it to the writer,
which maps it through ``/proc/<reader's pid>/fd/<fd>``. From then on a frame
costs the writer a copy and three stores, and the reader a load it makes
anyway while it polls.

The host's first page holds two words, each on its own pair of cache
lines: BELL, which every writer stores after each frame (a value unique to
the writer and the frame, so the reader looks at its rings only when BELL
has changed since it last looked), and NAP (1 while the reader may not look
for a while: it sleeps, or user code runs; a writer then also pokes the
reader's socket). Each ring starts with its HEAD (the reader's position:
bytes consumed) and TAIL (the writer's: bytes written), again on lines of
their own, then ``cap`` bytes of entries, each 8-byte aligned, never split
at the end of the ring:

======  ============================================================
n >= 0  a frame of one buffer of n bytes; the second word is the load
WRAP    the rest of the ring is unused: go on at its start
MARK    the next frame of this direction travels on the socket
MANY    a frame of several buffers, as LocalTransport frames them on a
        socket (``<II`` count and load, one ``<Q`` length each, the
        buffers), the second word its length
======  ============================================================

Memory order: positions are aligned 8-byte words stored with one
instruction, so on a CPU with total store order (x86-64) the entry's bytes
are visible before the TAIL that announces them, and TAIL before BELL. What
TSO does not order, a store and then a load of another word, the sleep
hand-shake needs (the reader stores NAP then loads BELL; the writer stores
BELL then loads NAP): :func:`fence` sits between each pair. On other CPUs
:func:`problem` says why there are no rings.

Example:
    >>> r = Ring.create(4096)
    >>> w = Ring.open(os.getpid(), r.host.fd, r.offset, 4096, ident=1)
    >>> w.put(b"hello", 3), w.put(b"world", 4)
    (True, True)
    >>> [(bytes(b), load) for b, load in r.take()]
    [(b'hello', 3), (b'world', 4)]
    >>> r.take()
    []
    >>> r.close(); w.close()
"""

from __future__ import annotations

import ctypes
import mmap
import os
import platform
import struct
import threading
from typing import Any, List, Optional, Sequence, Tuple

BELL, NAP = 0, 16  # word indexes in a host's first page: 128 bytes apart
HEAD, TAIL = 0, 16  # word indexes at a ring's start
DATA = 256  # where a ring's entries start
PAGE = mmap.PAGESIZE
IDENT_SHIFT = 44  # a writer's BELL values: (its id + 1) << IDENT_SHIFT, plus its TAIL
ENTRY = struct.Struct("<iI")  # length or kind, load (MANY: length)
WRAP, MARK, MANY = -1, -2, -3
#: CPUs with total store order, where rings (and ShmBarrier) need no fence but at the
#: sleep hand-shake
TSO_MACHINES = {"x86_64", "amd64", "i386", "i486", "i586", "i686", "x86"}

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                       ctypes.c_long]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.restype = ctypes.c_int
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_MAP_FAILED = ctypes.c_void_p(-1).value


class _Map:
    """Shared memory mapped with the C library's ``mmap``. Python's
    ``mmap.mmap`` keeps a duplicate of the descriptor per mapping: one per
    peer and direction, which a context with hundreds of peers cannot
    afford under the usual limit of 1,024 descriptors.

    ``buf`` reads (its slices are bytes) and ``mv`` writes; :meth:`close`
    unmaps, after which neither may be touched.

    Example:
        >>> fd = os.memfd_create("doc")
        >>> os.ftruncate(fd, PAGE)
        >>> m = _Map(fd, PAGE); os.close(fd)
        >>> m.mv[0:2] = b"hi"; m.buf[0:2]
        b'hi'
        >>> m.close()
    """

    __slots__ = ("addr", "size", "buf", "mv")

    def __init__(self, fd: int, size: int, offset: int = 0):
        addr = _libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd,
                          offset)
        if addr is None or addr == _MAP_FAILED:
            err = ctypes.get_errno()
            raise OSError(err, f"mmap of a ring: {os.strerror(err)}")
        self.addr, self.size = addr, size
        self.buf: Any = (ctypes.c_char * size).from_address(addr)
        self.mv = memoryview(self.buf).cast("B")

    def words(self) -> Any:
        """The mapping's first 32 words, as int64s."""
        return (ctypes.c_int64 * 32).from_address(self.addr)

    def close(self) -> None:
        if self.addr:
            self.mv.release()
            self.buf = None
            _libc.munmap(self.addr, self.size)
            self.addr = 0


# taken and released to fence: a locked instruction, which x86 runs as a full fence
_fence_lock = threading.Lock()


def _after_fork_child() -> None:
    global _fence_lock
    _fence_lock = threading.Lock()  # another thread may have held it at the fork


os.register_at_fork(after_in_child=_after_fork_child)


def fence() -> None:
    """A full memory fence (x86): a store before it is visible to other CPUs
    before a load after it is made.

    Example:
        >>> fence()
    """
    lock = _fence_lock
    lock.acquire()
    lock.release()


def problem(machine: Optional[str] = None) -> Optional[str]:
    """Why this CPU cannot use shared-memory rings, or None when it can.

    Example:
        >>> problem("x86_64") is None
        True
        >>> problem("aarch64")  # doctest: +ELLIPSIS
        'shared memory needs a CPU with total store order (x86, x86-64); this one is aarch64...'
    """
    machine = platform.machine() if machine is None else machine
    if machine.lower() in TSO_MACHINES:
        return None
    return (f"shared memory needs a CPU with total store order (x86, x86-64); this one is "
            f"{machine}, whose loads and stores Python cannot order without fences")


class RingHost:
    """A reader's rings, in one ``memfd``: BELL and NAP, then the rings.

    Example:
        >>> h = RingHost()
        >>> r = h.ring(4096)
        >>> r.offset == PAGE, h.words[BELL], h.words[NAP]
        (True, 0, 0)
        >>> h.drop(r); h.rings
        []
        >>> h.close()
    """

    def __init__(self) -> None:
        self.fd = os.memfd_create("macroflow-rings", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, PAGE)
            self.map = _Map(self.fd, PAGE)
        except BaseException:
            os.close(self.fd)
            raise
        self.words: Any = self.map.words()
        self.size = PAGE
        self.rings: List["Ring"] = []

    def ring(self, cap: int) -> "Ring":
        """A new ring of ``cap`` bytes (a power of two >= 64), to read."""
        _check_cap(cap)
        region = -(-(DATA + cap) // PAGE) * PAGE
        os.ftruncate(self.fd, self.size + region)
        r = Ring(_Map(self.fd, DATA + cap, self.size), cap, self, self.size)
        self.size += region
        self.rings.append(r)
        return r

    def drop(self, r: "Ring") -> None:
        """Give the pages of ``r``, a ring of this host whose writer has gone,
        back to the system, and unmap it (it may not be used after). Its
        place in the file is not used again: a writer that still held it
        could only write where nobody reads."""
        if r.words is not None:
            _libc.madvise(r.map.addr, r.map.size, mmap.MADV_REMOVE)
        r.close()
        if r in self.rings:
            self.rings.remove(r)

    def close(self) -> None:
        """Close the descriptor and unmap every ring (none may be used after)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        for r in self.rings:
            r.close()
        self.rings = []
        self.words = None
        self.map.close()


def _check_cap(cap: int) -> None:
    if cap < 64 or cap & (cap - 1):
        raise ValueError(f"a ring's capacity must be a power of two >= 64, not {cap}")


class Ring:
    """One direction of frames in shared memory; see the module's notes.

    The reader makes it (:meth:`RingHost.ring`), the writer maps the
    reader's (:meth:`open`). ``pos`` is the writer's TAIL or the reader's
    HEAD, kept here so that neither reads its own word back; ``seen`` is,
    for the writer, the reader's HEAD as last read (it is read again only
    when the ring looks full).

    Example:
        >>> r = Ring.create(64)
        >>> w = Ring.open(os.getpid(), r.host.fd, r.offset, 64, ident=1)
        >>> w.put(b"x" * 40, 0), w.put(b"y" * 40, 0)   # the second does not fit
        (True, False)
        >>> len(r.take()), w.put(b"y" * 40, 0)           # now it does (after a WRAP)
        (1, True)
        >>> [bytes(b) for b, _ in r.take()]
        [b'yyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyy']
        >>> r.close(); w.close()
    """

    __slots__ = ("map", "mm", "mv", "words", "bell", "host", "cap", "mask", "pos", "seen",
                 "offset", "ident", "owns_host", "__weakref__")

    def __init__(self, mapping: _Map, cap: int, host: Any, offset: int, ident: int = 0):
        _check_cap(cap)
        self.map = mapping
        self.mm = mapping.buf  # slices are bytes; the struct functions read it in place
        self.mv = mapping.mv
        self.words: Any = mapping.words()
        self.host = host  # the reader's RingHost; for a writer, the mapping of its page
        self.bell: Any = host.words
        self.cap = cap
        self.mask = cap - 1
        self.pos = 0
        self.seen = 0
        self.offset = offset
        self.ident = ident << IDENT_SHIFT
        self.owns_host = False

    @classmethod
    def create(cls, cap: int) -> "Ring":
        """A new ring, to read, in a host of its own (tests and tools: a
        transport makes all its rings in one host)."""
        r = RingHost().ring(cap)
        r.owns_host = True
        return r

    @classmethod
    def open(cls, pid: int, fd: int, offset: int, cap: int, ident: int) -> "Ring":
        """Map, to write, the ring at ``offset`` of the host process ``pid``
        holds as ``fd``; ``ident`` (>= 1) tells this writer's BELL values
        apart. OSError if it cannot be opened or is smaller than that."""
        _check_cap(cap)
        if ident < 1 or offset < PAGE or offset % PAGE:
            raise ValueError(f"no ring at offset {offset} (ident {ident})")
        f = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
        try:
            if os.fstat(f).st_size < offset + DATA + cap:
                raise OSError(f"ring {pid}/{fd}@{offset} is smaller than {cap} bytes")
            page = _Page(_Map(f, PAGE))
            try:
                mapping = _Map(f, DATA + cap, offset)
            except OSError:
                page.map.close()
                raise
        finally:
            os.close(f)
        return cls(mapping, cap, page, offset, ident)

    def room(self, need: int) -> bool:
        """Whether ``need`` bytes of entries fit now, a WRAP included."""
        tail = self.pos
        end = self.cap - (tail & self.mask)
        if need > end:
            need += end
        if tail + need - self.seen <= self.cap:
            return True
        self.seen = self.words[HEAD]
        return tail + need - self.seen <= self.cap

    def put(self, data: Any, load: int, kind: int = 0) -> bool:
        """Write one entry: a frame of one buffer ``data`` (kind 0), or the
        body of a MANY frame, or a MARK (``data`` empty); then ring the
        reader's BELL. False if it does not fit now (nothing is written)."""
        n = len(data)
        tail = self.pos
        off = tail & self.mask
        if 16 + n <= self.cap - off and tail + 16 + n - self.seen <= self.cap:
            base = DATA + off  # the common case, inline: room, and not at the end
        else:
            base = self._claim(n)
            if base < 0:
                return False
        if n:
            self.mv[base + 8:base + 8 + n] = data
        if kind:
            ENTRY.pack_into(self.mm, base, kind, n if kind == MANY else load)
        else:
            ENTRY.pack_into(self.mm, base, n, load)
        self._publish(n)
        return True

    def put_parts(self, parts: Sequence[Any], n: int) -> bool:
        """Write one MANY entry whose body is ``parts`` (byte buffers of
        ``n`` bytes in all) one after the other, copied straight in: a
        large frame is not joined first. False if it does not fit now.

        Example:
            >>> r = Ring.create(256)
            >>> w = Ring.open(os.getpid(), r.host.fd, r.offset, 256, ident=1)
            >>> w.put_parts([b"ab", memoryview(b"cde")], 5)
            True
            >>> bytes(r.mv[DATA + 8:DATA + 13]), ENTRY.unpack_from(r.mm, DATA)[0] == MANY
            (b'abcde', True)
            >>> r.close(); w.close()
        """
        base = self._claim(n)
        if base < 0:
            return False
        mv = self.mv
        pos = base + 8
        for p in parts:
            k = len(p)
            mv[pos:pos + k] = p
            pos += k
        ENTRY.pack_into(self.mm, base, MANY, n)
        self._publish(n)
        return True

    def _claim(self, n: int) -> int:
        """Where an entry of ``n`` bytes goes (its offset in the mapping),
        after a WRAP if the ring's end is too near; -1 if it does not fit now."""
        need = 8 + ((n + 7) & -8)
        tail = self.pos
        off = tail & self.mask
        end = self.cap - off
        if need > end:
            if tail + end + need - self.seen > self.cap:
                self.seen = self.words[HEAD]
                if tail + end + need - self.seen > self.cap:
                    return -1
            ENTRY.pack_into(self.mm, DATA + off, WRAP, 0)
            self.pos = tail + end
            return DATA
        if tail + need - self.seen > self.cap:
            self.seen = self.words[HEAD]
            if tail + need - self.seen > self.cap:
                return -1
        return DATA + off

    def _publish(self, n: int) -> None:
        # the entry is written: move TAIL past it, then ring the reader's BELL
        self.pos = tail = self.pos + 8 + ((n + 7) & -8)
        self.words[TAIL] = tail
        self.bell[BELL] = self.ident + tail

    def take(self) -> List[Tuple[bytes, int]]:
        """Every one-buffer frame written so far, as (bytes, load); for tests
        and tools (LocalTransport reads entries itself, MARK and MANY too)."""
        out = []
        head, tail, mm = self.pos, self.words[TAIL], self.mm
        while head != tail:
            off = head & self.mask
            n, load = ENTRY.unpack_from(mm, DATA + off)
            if n == WRAP:
                head += self.cap - off
                continue
            if n < 0:
                raise ValueError(f"take() reads frames of one buffer only; entry kind {n}")
            out.append((mm[DATA + off + 8:DATA + off + 8 + n], load))
            head += 8 + ((n + 7) & -8)
        self.pos = head
        self.words[HEAD] = head
        return out

    def pending(self) -> bool:
        """Whether entries wait to be read (reader)."""
        return self.words[TAIL] != self.pos

    def close(self) -> None:
        """Unmap (the bytes already taken out stay valid; the ring may not be
        used after); a ring made by :meth:`create` closes its host too."""
        if self.words is None:
            return
        self.words = self.bell = self.mm = self.mv = None
        self.map.close()
        if isinstance(self.host, _Page):
            self.host.close()
        elif self.owns_host:
            self.host.close()


class _Page:
    """A writer's mapping of its reader's first page (BELL and NAP)."""

    def __init__(self, mapping: _Map):
        self.map = mapping
        self.words: Any = mapping.words()

    def close(self) -> None:
        self.words = None
        self.map.close()
