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
BULK    a frame of several buffers, some in the ring's bulk area: ``<II``
        count and load, one ``<iIQQ`` descriptor each (slot or -1 when
        the buffer follows inline, 0, offset in the area, length), then
        the inline buffers; the second word its length
======  ============================================================

A ring may have a **bulk area** beside it (``RingHost.ring(cap, bulk=...)``;
its size is in the ring's word ``BULK_WORD``, so the writer finds it when it
maps the ring): room for the large buffers of frames, which then cross with
one copy instead of two. The writer copies such a buffer into a slot of the
area and writes a BULK entry (descriptors of the frame's buffers, and the
small ones inline) in the ring; the reader hands on a numpy array made on
the slot itself, without a copy, and the slot is the writer's again once
nothing refers to that array any more. See :class:`BulkIn` and
:class:`BulkOut`.

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
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from ..core.threads import numpy

BELL, NAP = 0, 16  # word indexes in a host's first page: 128 bytes apart
HEAD, TAIL = 0, 16  # word indexes at a ring's start
DATA = 256  # where a ring's entries start
PAGE = mmap.PAGESIZE
IDENT_SHIFT = 44  # a writer's BELL values: (its id + 1) << IDENT_SHIFT, plus its TAIL
ENTRY = struct.Struct("<iI")  # length or kind, load (MANY: length)
WRAP, MARK, MANY, BULK, POKE = -1, -2, -3, -4, -5  # POKE: see transport.mpi
BULK_WORD = 24  # word of a ring's first line: the size of its bulk area (0: none)
BULK_SLOTS = 64  # buffers that may be out in one bulk area at once
BULK_DESC = struct.Struct("<iIQQ")  # slot (-1: inline), 0, offset in the area, length
_FRAME = struct.Struct("<II")  # a frame's number of buffers and load
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

    def __init__(self, ring_class: Optional[type] = None) -> None:
        self.ring_class = Ring if ring_class is None else ring_class  # (tests: PyRing)
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

    def ring(self, cap: int, bulk: int = 0) -> "Ring":
        """A new ring of ``cap`` bytes (a power of two >= 64), to read, with
        a bulk area of ``bulk`` bytes (a multiple of the page size; 0: none)
        beside it. The file grows by that much, but pages take memory only
        once written.

        Example:
            >>> h = RingHost()
            >>> r = h.ring(4096, bulk=1 << 20)
            >>> r.bulk.size, r.words[BULK_WORD]
            (1048576, 1048576)
            >>> h.close()
        """
        _check_cap(cap)
        if bulk < 0 or bulk % PAGE:
            raise ValueError(f"a bulk area is a multiple of {PAGE} bytes, not {bulk}")
        region = -(-(DATA + cap) // PAGE) * PAGE
        area = PAGE + bulk if bulk else 0
        os.ftruncate(self.fd, self.size + region + area)
        r = self.ring_class(_Map(self.fd, DATA + cap, self.size), cap, self, self.size)
        if bulk:
            try:
                r.bulk = BulkIn(_Map(self.fd, area, self.size + region), bulk)
            except BaseException:
                r.close()
                raise
            r.words[BULK_WORD] = bulk
        self.size += region + area
        self.rings.append(r)
        return r

    def drop(self, r: "Ring") -> None:
        """Give the pages of ``r``, a ring of this host whose writer has gone,
        back to the system, and unmap it (it may not be used after). Its
        place in the file is not used again: a writer that still held it
        could only write where nobody reads."""
        if r.words is not None:
            _libc.madvise(r.map.addr, r.map.size, mmap.MADV_REMOVE)
        r.close(remove=True)
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


#: drain's result: (frames delivered << 4) | what stopped it: the ring is
#: EMPTY, or the peer is HELD (see drain), or the kind of the entry at pos
#: (-n: MARK 2, MANY 3, BULK 4, POKE 5), which is not consumed
EMPTY, HELD = 0, 15


class _PyCore:
    """A ring's positions, and its frames' common steps (the writer's
    :meth:`put` and :meth:`send1`, the reader's :meth:`drain`): the base
    class of :class:`Ring` where the compiled ``_cring.Core`` (the same
    steps in C) was not built, or with ``MACROFLOW_COMPILED=0``. The two are
    tested against each other (tests/test_transport_rings.py).

    Example:
        >>> r = Ring.create(4096)
        >>> w = Ring.open(os.getpid(), r.host.fd, r.offset, 4096, ident=1)
        >>> w.send1(b"abc", 7)   # written; the reader is not asleep
        1
        >>> got = []
        >>> r.drain(lambda peer, bufs, load: got.append((peer, bytes(bufs[0]), load)), 3) >> 4
        1
        >>> got
        [(3, b'abc', 7)]
        >>> r.close(); w.close()
    """

    __slots__ = ("pos", "seen")

    def _attach(self, addr: int, bell_addr: int, cap: int, ident: int) -> None:
        pass  # (the compiled core keeps the mapping's addresses)

    def _detach(self) -> None:
        pass

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
            tail = self.pos  # past a WRAP, if _claim wrote one
        if n:
            self.mv[base + 8:base + 8 + n] = data
        if kind:
            ENTRY.pack_into(self.mm, base, kind, n if kind == MANY or kind == BULK else load)
        else:
            ENTRY.pack_into(self.mm, base, n, load)
        # _publish, inline (every small frame comes this way)
        self.pos = tail = tail + 8 + ((n + 7) & -8)
        self.words[TAIL] = tail
        self.bell[BELL] = self.ident + tail
        return True

    def send1(self, data: Any, load: int) -> int:
        """Write a frame of one buffer, then look at the reader's NAP (after
        a fence): 0 if it does not fit now (nothing written), 1 written, 2
        written and the reader may be asleep (NAP is set: wake it)."""
        if not self.put(data, load):
            return 0
        lock = _fence_lock  # fence(), inline
        lock.acquire()
        lock.release()
        return 2 if self.bell[NAP] else 1

    def drain(self, deliver: Callable[[int, List[Any], int], Any], peer: int,
              held: Any = None) -> int:
        """Reader: hand every frame of one buffer to ``deliver(peer, [bytes],
        load)``, from ``pos`` until the ring is empty or an entry of another
        kind (left at ``pos``) comes; see EMPTY and HELD for the result.
        With ``held`` (a container), stop after a frame once ``peer`` is in
        it: what follows must queue behind what it waits for."""
        mm, mask, cap, words = self.mm, self.mask, self.cap, self.words
        count = 0
        head = self.pos
        while True:
            tail = words[TAIL]
            if head == tail:
                words[HEAD] = head
                return count << 4
            while head != tail:
                off = head & mask
                base = DATA + off
                n, load = ENTRY.unpack_from(mm, base)
                if n >= 0:
                    data = mm[base + 8:base + 8 + n]
                    head += 8 + ((n + 7) & -8)
                    self.pos = head
                    deliver(peer, [data], load)
                    count += 1
                    if self.words is None:
                        return (count << 4) | HELD  # closed by what it delivered
                    if held is not None and peer in held:
                        words[HEAD] = head
                        return (count << 4) | HELD
                elif n == WRAP:
                    head += cap - off
                    self.pos = head
                else:
                    words[HEAD] = head
                    return (count << 4) | -n
            # free the room only after the batch (the writer reads HEAD only when full)
            words[HEAD] = head

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


def _core() -> Tuple[type, Optional[str], Optional[str]]:
    """The base class of Ring: the compiled core where it was built and not
    switched off (``MACROFLOW_COMPILED=0``), else _PyCore and why; and what
    is wrong with the setting, if anything (refused as a computation starts,
    by ``launch.check_settings``, not at import: ``macroflow info`` says it)."""
    how = os.environ.get("MACROFLOW_COMPILED", "").strip()
    if how == "0":
        return _PyCore, "MACROFLOW_COMPILED=0", None
    bad = None
    if how not in ("", "1"):
        bad = (f"the MACROFLOW_COMPILED environment variable must be 0 (the rings' steps "
               f"in Python) or 1 (compiled, which must have been built); got {how!r}")
    try:
        from ._cring import Core
    except ImportError as e:
        if how == "1":
            bad = (f"MACROFLOW_COMPILED=1, but the rings' compiled core "
                   f"(macroflow.transport._cring) was not built here ({e}); "
                   f"`macroflow info` says why, or unset it")
        return _PyCore, ("macroflow.transport._cring was not built: no C compiler or Cython "
                         "at install; `pip install -v` shows why"), bad
    return Core, None, bad


#: IN_PYTHON: why the rings run their steps in Python here, or None;
#: SETTING_ERROR: what is wrong with ``MACROFLOW_COMPILED``, or None (every
#: start refuses it)
_Core, IN_PYTHON, SETTING_ERROR = _core()
#: Whether rings run the compiled core (macroflow.transport._cring).
COMPILED = IN_PYTHON is None


class Ring(_Core):
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

    __slots__ = ("map", "mm", "mv", "words", "bell", "host", "cap", "mask",
                 "offset", "ident", "owns_host", "bulk", "__weakref__")

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
        self._attach(mapping.addr, ctypes.addressof(self.bell), cap, self.ident)
        self.owns_host = False
        # the bulk area beside the ring: a BulkIn for its reader, a BulkOut
        # for its writer, None when the ring has none
        self.bulk: Any = None

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
        maps: List[_Map] = []
        try:
            size = os.fstat(f).st_size
            if size < offset + DATA + cap:
                raise OSError(f"ring {pid}/{fd}@{offset} is smaller than {cap} bytes")
            maps.append(_Map(f, PAGE))
            maps.append(_Map(f, DATA + cap, offset))
            bulk = maps[1].words()[BULK_WORD]
            if bulk:
                at = offset + -(-(DATA + cap) // PAGE) * PAGE
                if bulk < 0 or bulk % PAGE or size < at + PAGE + bulk:
                    raise OSError(f"ring {pid}/{fd}@{offset}: no bulk area of {bulk} bytes")
                maps.append(_Map(f, PAGE + bulk, at))
        except BaseException:
            for m in maps:
                m.close()
            raise
        finally:
            os.close(f)
        r = cls(maps[1], cap, _Page(maps[0]), offset, ident)
        if bulk:
            r.bulk = BulkOut(maps[2], bulk)
        return r

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

    def bulk_body(self, views: Sequence[memoryview], load: int, least: int,
                  most: int) -> Optional[bytes]:
        """Writer: copy every buffer but the first of ``views`` (the buffers,
        as bytes, of a frame with ``load``) of ``least`` bytes or more into a free slot of
        the bulk area, and return the body of the BULK entry that stands for
        the frame (put it with ``put(body, 0, BULK)``), or None if none went
        there (no area, no room) or the body would be over ``most`` bytes;
        nothing is claimed then.

        Example:
            >>> r = RingHost().ring(4096, bulk=1 << 20); r.owns_host = True
            >>> w = Ring.open(os.getpid(), r.host.fd, r.offset, 4096, ident=1)
            >>> big = memoryview(bytes(range(256)) * 400)
            >>> w.put(w.bulk_body([memoryview(b"head"), big], 5, 4096, 2048), 0, BULK)
            True
            >>> bufs, load = r.read_bulk(DATA)  # the entry, where the reader finds it
            >>> bytes(bufs[0]), load, bufs[1].nbytes, bufs[1][:3].tolist(), r.bulk.live
            (b'head', 5, 102400, [0, 1, 2], 1)
            >>> del bufs; r.bulk.live
            0
            >>> w.close(); r.close()
        """
        b = self.bulk
        if b is None:
            return None
        slots = []
        inline = 0
        for i, v in enumerate(views):
            n = v.nbytes
            k = b.claim(n) if i and n >= least else -1
            if k < 0:
                inline += n
            slots.append(k)
        if len(slots) == slots.count(-1):
            return None
        if _FRAME.size + BULK_DESC.size * len(views) + inline > most:
            for k in slots:
                if k >= 0:
                    b.given[k] -= 1
            return None
        parts = [_FRAME.pack(len(views), load)]
        rest = []
        mv = b.mv
        for k, v in zip(slots, views):
            n = v.nbytes
            if k < 0:
                parts.append(BULK_DESC.pack(-1, 0, 0, n))
                rest.append(v)
            else:
                off = b.slots[k][0]
                mv[off:off + n] = v
                parts.append(BULK_DESC.pack(k, 0, off, n))
        b.sent += 1
        return b"".join(parts + rest)

    def read_many(self, base: int) -> Tuple[List[Any], int]:
        """Reader: the buffers and load of the MANY entry at ``base`` (framed
        as LocalTransport frames them on a socket): the first as bytes, the
        others writable, as a socket's frame gives them.

        Example:
            >>> r = Ring.create(256)
            >>> w = Ring.open(os.getpid(), r.host.fd, r.offset, 256, ident=1)
            >>> body = _FRAME.pack(2, 9) + struct.pack("<2Q", 2, 3) + b"hi" + b"you"
            >>> w.put(body, 0, MANY)
            True
            >>> r.read_many(DATA)
            ([b'hi', bytearray(b'you')], 9)
            >>> r.close(); w.close()
        """
        mm, mv = self.mm, self.mv
        nb, load = _FRAME.unpack_from(mm, base + 8)
        lens = struct.unpack_from(f"<{nb}Q", mm, base + 16)
        pos = base + 16 + 8 * nb
        bufs: List[Any] = []
        for i, k in enumerate(lens):
            bufs.append(mm[pos:pos + k] if i == 0 else bytearray(mv[pos:pos + k]))
            pos += k
        return bufs, load

    def read_bulk(self, base: int, landing: Optional[Callable[[int, Any, int], Any]] = None,
                  peer: int = -1) -> Tuple[List[Any], int]:
        """Reader: the buffers and load of the BULK entry at ``base``, written
        by ``peer``; the first buffer (and any inline one) as a ``_ring_read``
        of a MANY entry gives it, each in the area as a numpy array on the
        slot itself, or copied into the buffer ``landing(peer, head, nbytes)``
        gives for it (a transport's landing: a receive posted for it; None:
        the slot's array), which gives the slot back at once."""
        mm = self.mm
        nb, load = _FRAME.unpack_from(mm, base + 8)
        at = base + 8 + _FRAME.size
        pos = at + BULK_DESC.size * nb
        bufs: List[Any] = []
        for i in range(nb):
            k, _, off, n = BULK_DESC.unpack_from(mm, at)
            at += BULK_DESC.size
            if k < 0:
                bufs.append(mm[pos:pos + n] if i == 0 else bytearray(self.mv[pos:pos + n]))
                pos += n
            elif self.bulk is None:
                raise ValueError("a BULK entry in a ring without a bulk area")
            else:
                posted = landing(peer, bufs[0], n) if landing is not None and bufs else None
                if posted is None:
                    bufs.append(self.bulk.take(k, off, n))
                else:
                    self.bulk.copy_out(k, off, n, posted)
                    bufs.append(posted)
        return bufs, load

    def close(self, remove: bool = False) -> None:
        """Unmap (the bytes already taken out stay valid; the ring may not be
        used after); a ring made by :meth:`create` closes its host too. A
        reader's bulk area stays mapped until no array on it is left
        (``remove``: its pages are given back then, as ``RingHost.drop``
        does for the ring)."""
        if self.words is None:
            return
        self._detach()
        self.words = self.bell = self.mm = self.mv = None
        self.map.close()
        if self.bulk is not None:
            self.bulk.close(remove)
        if isinstance(self.host, _Page):
            self.host.close()
        elif self.owns_host:
            self.host.close()


def _pure_twin(cls: type) -> type:
    """``cls`` (Ring) on _PyCore: what Ring is where the compiled core is not
    built, to test the two against each other in one process."""
    if cls.__bases__ == (_PyCore,):
        return cls
    skip = set(cls.__slots__) | {"__dict__", "__weakref__"}
    ns = {k: v for k, v in cls.__dict__.items() if k not in skip}
    ns["__slots__"] = cls.__slots__
    return type(cls.__name__, (_PyCore,), ns)


#: Ring on the pure-Python core, whichever core Ring has (tests).
PyRing = _pure_twin(Ring)


class _Page:
    """A writer's mapping of its reader's first page (BELL and NAP)."""

    def __init__(self, mapping: _Map):
        self.map = mapping
        self.words: Any = mapping.words()

    def close(self) -> None:
        self.words = None
        self.map.close()


class BulkIn:
    """The reader's side of a bulk area: the arrays it hands on are made on
    the area itself, and a slot goes back to the writer (its count in the
    area's first page) when the last array on it is gone.

    The area stays mapped until then, even after :meth:`close` (a result
    the user keeps outlives the computation). ``taken`` counts the buffers
    handed on; ``live`` those still referred to.

    Example:
        >>> h = RingHost(); r = h.ring(4096, bulk=1 << 20)
        >>> a = r.bulk.take(3, 8192, 16); a[:] = 7
        >>> r.bulk.live, r.bulk.back[3]
        (1, 0)
        >>> del a; r.bulk.live, r.bulk.back[3]
        (0, 1)
        >>> h.close()
    """

    __slots__ = ("map", "size", "addr", "back", "live", "taken", "closing", "remove")

    def __init__(self, mapping: _Map, size: int):
        self.map = mapping
        self.size = size
        self.addr = mapping.addr + PAGE
        self.back: Any = (ctypes.c_int64 * BULK_SLOTS).from_address(mapping.addr)
        self.live = 0
        self.taken = 0
        self.closing = False
        self.remove = False

    def _check(self, k: int, off: int, n: int) -> None:
        if not 0 <= k < BULK_SLOTS or off < 0 or n < 1 or off + n > self.size or self.closing:
            raise ValueError(f"no bulk buffer of {n} bytes at {off} (slot {k}) "
                             f"in an area of {self.size}")

    def take(self, k: int, off: int, n: int) -> Any:
        """The ``n`` bytes at ``off`` that the writer gave in slot ``k``, as
        a writable uint8 array on the area (ValueError if out of bounds)."""
        self._check(k, off, n)
        x = _exporter(n).from_address(self.addr + off)
        x.k = k
        x.area = self
        self.live += 1
        self.taken += 1
        return numpy().frombuffer(x, "u1")

    def copy_out(self, k: int, off: int, n: int, into: Any) -> None:
        """Copy the ``n`` bytes at ``off`` that the writer gave in slot ``k``
        into ``into`` (a writable buffer of ``n`` bytes), and give the slot back."""
        self._check(k, off, n)
        mv = memoryview(into).cast("B")
        if mv.nbytes != n:
            raise ValueError(f"a bulk buffer of {n} bytes cannot land in {mv.nbytes} bytes")
        mv[:] = self.map.mv[PAGE + off:PAGE + off + n]
        self.back[k] += 1

    def release(self, k: int) -> None:
        """The last reference to a buffer of slot ``k`` is gone."""
        self.live -= 1
        if self.map.addr:
            self.back[k] += 1
        if self.closing and self.live == 0:
            self._unmap()

    def close(self, remove: bool = False) -> None:
        self.closing = True
        self.remove = self.remove or remove
        if self.live == 0:
            self._unmap()

    def _unmap(self) -> None:
        m = self.map
        if m.addr:
            if self.remove:
                _libc.madvise(m.addr, m.size, mmap.MADV_REMOVE)
            self.back = None
            m.close()


class BulkOut:
    """The writer's side of a bulk area: up to :data:`BULK_SLOTS` slots,
    carved from the area as first needed and used again once the reader
    has given them back (the smallest free one that fits). ``sent``
    counts the frames that went with buffers in the area.

    Example:
        >>> h = RingHost(); r = h.ring(4096, bulk=1 << 20)
        >>> w = Ring.open(os.getpid(), h.fd, r.offset, 4096, ident=1)
        >>> k = w.bulk.claim(5000); w.bulk.slots[k], w.bulk.claim(5000) == k
        ([0, 8192], False)
        >>> r.bulk.back[k] += 1; w.bulk.claim(4000) == k   # given back: used again
        True
        >>> w.close(); h.close()
    """

    __slots__ = ("map", "size", "mv", "back", "given", "slots", "carve", "sent")

    def __init__(self, mapping: _Map, size: int):
        self.map = mapping
        self.size = size
        self.mv = mapping.mv[PAGE:]
        self.back: Any = (ctypes.c_int64 * BULK_SLOTS).from_address(mapping.addr)
        self.given = [0] * BULK_SLOTS  # buffers handed in each slot; free while == back
        self.slots: List[List[int]] = []  # [offset, bytes] of each slot made
        self.carve = 0  # where the next slot is made
        self.sent = 0

    def claim(self, n: int) -> int:
        """A free slot of ``n`` bytes or more, now given (-1 if none)."""
        back, given = self.back, self.given
        best, size = -1, 0
        for k, (off, m) in enumerate(self.slots):
            if m >= n and given[k] == back[k] and (best < 0 or m < size):
                best, size = k, m
        if best < 0:
            size = -(-n // PAGE) * PAGE
            if len(self.slots) >= BULK_SLOTS or self.carve + size > self.size:
                if size > self.size or any(given[k] != back[k] for k in range(len(self.slots))):
                    return -1
                self.slots, self.carve = [], 0  # every slot is back: carve anew
            best = len(self.slots)
            self.slots.append([self.carve, size])
            self.carve += size
        given[best] += 1
        return best

    def close(self, remove: bool = False) -> None:
        if self.map.addr:
            self.mv.release()
            self.back = None
            self.map.close()


GLANCE_YIELD = 8  # a glance yields its core this seldom
GLANCE_PREEMPTED = 1e-3  # a gap this long between two looks: someone else had our core
GLANCE_CALM = 0.01  # then no glancing (nor spinning) for this long


def glance(transport: Any, stop: Callable[[], bool]) -> None:
    """A transport's ``glance(stop)`` where frames come by rings (``local``,
    ``mpi``): look at the rings until ``stop()`` says so, for the transport's
    ``spin_s`` at most, without a system call but a ``sched_yield`` every
    GLANCE_YIELD looks (a process waiting for this core runs first). The
    engine glances before a thread parks or a wait steps its loop: the
    answer is often a few microseconds away, and the transport's own spin
    makes a system call at every look, parking two switches and a pass of
    the engine's loop. Nothing without rings, nor while the transport was
    recently preempted (its ``calm_until``).

    Example:
        >>> class T:
        ...     rins, calm_until, spin_s, spins_preempted = [1], 0.0, 1e-3, 0
        ...     def _rings(self): self.looks = getattr(self, "looks", 0) + 1
        >>> t = T()
        >>> glance(t, lambda: t.looks == 3)
        >>> t.looks
        3
    """
    if not transport.rins:
        return
    clock = time.perf_counter
    now = last = clock()
    if now < transport.calm_until:
        return
    end = now + transport.spin_s
    rings = transport._rings
    yield_ = os.sched_yield
    looks = 0
    while True:
        rings()
        if stop():
            return
        looks += 1
        if looks % GLANCE_YIELD == 0:
            yield_()
        t = clock()
        if t - last > GLANCE_PREEMPTED:
            transport.calm_until = t + GLANCE_CALM
            transport.spins_preempted += 1
            return
        if t > end:
            return
        last = t


def bulk_counts(sent: int, got: int, rings: Any) -> Dict[str, int]:
    """A transport's bulk-area counts for ``mf.stats()``: frames it ``sent``
    and ``got`` with buffers in a bulk area, and the buffers still in use
    in the areas of the ``rings`` it reads.

    Example:
        >>> bulk_counts(2, 3, [None])
        {'bulk_sent': 2, 'bulk_received': 3, 'bulk_buffers_held': 0}
    """
    held = sum(r.bulk.live for r in rings if r is not None and r.bulk is not None)
    return {"bulk_sent": sent, "bulk_received": got, "bulk_buffers_held": held}


_exporters: dict = {}  # length -> the class of a bulk buffer of that length


def _exporter(n: int) -> Any:
    """The class of a bulk buffer of ``n`` bytes: a ctypes array (which
    exports its memory to numpy with no copy) that gives its slot back when
    it goes. Every array and memoryview made on it refers to it, so it goes
    with the last of them."""
    t = _exporters.get(n)
    if t is None:
        if len(_exporters) >= 256:
            _exporters.clear()
        t = _exporters[n] = type("BulkBuffer", (ctypes.c_ubyte * n,),
                                 {"__slots__": ("k", "area"), "__del__": _give_back})
    return t


def _give_back(x: Any) -> None:
    area = getattr(x, "area", None)
    if area is not None:
        area.release(x.k)
