"""One-sided access to another process's memory on this host, without its CPU.

A context registers a buffer; a peer that wants to read or write it does the
copy itself, the way the T3D's network did DMA into a remote node's memory
while that node's processor went on computing. :func:`describe` turns a buffer
into a :class:`Region`, the small picklable record a peer needs, and
:meth:`Access.read` / :meth:`Access.write` copy through the cheapest way this
process has to reach it:

1. the same process: a ``memmove``;
2. memory made by :func:`shared_empty` (a ``memfd`` mapped shared): the peer
   opens ``/proc/<pid>/fd/<fd>`` and maps the same pages once, then copies
   with numpy;
3. any other memory of a process on this node: ``process_vm_readv`` /
   ``process_vm_writev``, which need the right to ptrace the owner (same user
   and, under Yama's ``ptrace_scope`` 1, an ancestor of it).

When none works (another node, no permission, the owner is gone) the calls
return False and the caller asks the owner to do the copy.
"""

from __future__ import annotations

import bisect
import ctypes
import errno
import fcntl
import mmap
import operator
import os
import select
import threading
import time
import weakref
from collections import OrderedDict
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from ..transport.local import node_key

__all__ = ["shared_empty", "shared_zeros", "shared_full", "Region", "describe", "Access", "access",
           "capabilities"]

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                       ctypes.c_long]
_libc.mmap.restype = ctypes.c_void_p
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.munmap.restype = ctypes.c_int
_MAP_FAILED = ctypes.c_void_p(-1).value


class _IoVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


_IOV_P = ctypes.POINTER(_IoVec)
_vm_read = getattr(_libc, "process_vm_readv", None)
_vm_write = getattr(_libc, "process_vm_writev", None)
for _fn in (_vm_read, _vm_write):
    if _fn is not None:
        _fn.argtypes = [ctypes.c_int, _IOV_P, ctypes.c_ulong, _IOV_P, ctypes.c_ulong, ctypes.c_ulong]
        _fn.restype = ctypes.c_ssize_t

_memmove = ctypes.memmove
_char_at = ctypes.c_char.from_buffer
_addressof = ctypes.addressof
_get_errno = ctypes.get_errno
_index = operator.index
_frombuffer = np.frombuffer
_u8 = np.uint8
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


class _Mapping:
    """Owns one ``mmap`` made here: numpy arrays over it keep it as their base,
    so it is unmapped (and its memfd closed) only when the last view is gone."""

    __slots__ = ("address", "size", "fd", "__array_interface__", "__weakref__")

    def __init__(self, address: int, size: int, fd: int):
        self.address, self.size, self.fd = address, size, fd
        self.__array_interface__ = {"data": (address, False), "shape": (size,), "typestr": "|u1",
                                    "version": 3}

    def __del__(self):
        # unregistered before unmapped, so no lookup ever finds an address range
        # that another mapping may already occupy
        try:
            if self.fd >= 0:
                _live.pop(self.address, None)
            _libc.munmap(self.address, self.size)
            if self.fd >= 0:
                os.close(self.fd)
        except Exception:  # interpreter teardown: the process unmaps everything anyway
            pass


def _map(fd: int, size: int) -> int:
    address = _libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
    if address is None or address == _MAP_FAILED:
        e = _get_errno()
        raise OSError(e, f"mmap of {size} bytes failed: {os.strerror(e)}")
    return address


# This process's live shared_empty mappings: start -> (end, fd, size, inode).
# _starts holds their starts sorted; it is replaced, never changed in place, and
# may still hold starts of mappings that are gone (a _Mapping's __del__ only
# pops _live, because it can run in the middle of anything, even this module's
# own code during a garbage collection): lookups skip those.
_live: Dict[int, Tuple[int, int, int, int]] = {}
_starts: List[int] = []
_starts_lock = threading.Lock()


def _register(start: int, info: Tuple[int, int, int, int]) -> None:
    global _starts
    with _starts_lock:
        _live[start] = info
        _starts = sorted({s for s in _starts if s in _live} | {start})


def _find(address: int, nbytes: int) -> Optional[Tuple[Tuple[int, int, int], int]]:
    """The ((fd, offset, size), inode) of the mapping holding [address, address+nbytes), if any."""
    starts = _starts
    i = bisect.bisect_right(starts, address)
    while i > 0:
        i -= 1
        start = starts[i]
        info = _live.get(start)
        if info is None:
            continue  # gone: the live mapping holding address, if any, starts further left
        end, fd, size, ino = info
        if address + nbytes <= end:
            return (fd, address - start, size), ino
        return None
    return None


def _check_shape(shape: Any) -> Tuple[Tuple[int, ...], int]:
    wrong = f"shape must be an int or a sequence of ints, not {shape!r}"
    # (as numpy's: not a bool, nor a dict or a set, whose order is no shape's)
    if isinstance(shape, (bool, np.bool_, dict, set, frozenset, str, bytes)):
        raise TypeError(wrong)
    if isinstance(shape, (int, np.integer)):
        shape = (shape,)
    try:
        shape = tuple(_index(s) for s in shape)
    except TypeError:
        raise TypeError(wrong) from None
    if any(s < 0 for s in shape):
        raise ValueError(f"shape {shape} has a negative dimension; dimensions must be >= 0")
    count = 1
    for s in shape:
        count *= s
    return shape, count


def _host_memory() -> int:
    """This host's physical memory in bytes (0 if it cannot be told).

    Example:
        >>> _host_memory() > 0
        True
    """
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0


def shared_empty(shape: Any, dtype: Any = float) -> np.ndarray:
    """A new C-ordered array whose memory other processes on this host can map.

    The memory is a ``memfd`` mapped shared; the descriptor stays open in this
    process while the array or any view of it lives, so a peer given its
    :class:`Region` maps the same pages (through ``/proc/<pid>/fd``) and reads
    and writes it without this process doing anything. A process forked after
    it was made shares it too. A zero-size array is an ordinary empty array
    (there is nothing to share).

    Args:
        shape: an int or a tuple of ints.
        dtype: anything ``numpy.dtype`` accepts.

    Raises:
        MemoryError: it is larger than this host's memory, or cannot be mapped.

    Example:
        >>> import macroflow as mf
        >>> from macroflow.spmd.memory import describe
        >>> a = mf.shared_empty((2, 3), dtype="int32")
        >>> a[:] = 7
        >>> a.shape, a.dtype.name, int(a.sum()), describe(a).shm is not None
        ((2, 3), 'int32', 42, True)
        >>> mf.shared_empty(0).size
        0
    """
    shape, count = _check_shape(shape)
    dtype = np.dtype(dtype)
    if dtype.hasobject:
        raise TypeError(f"dtype {dtype} holds Python objects, which cannot live in shared memory; "
                        "use a numeric or fixed-size dtype")
    nbytes = count * dtype.itemsize
    if nbytes == 0:
        return np.empty(shape, dtype)
    if nbytes >= 2 ** 63:
        raise ValueError(f"shared_empty: shape {shape} of {dtype} is {nbytes} bytes, more than "
                         f"any process can map")
    ram = _host_memory()
    if ram and nbytes > ram:
        # mapped lazily, it was made; a process writing past what the host
        # has would have died of SIGBUS, not had a MemoryError (numpy's
        # np.zeros refuses such a size at once)
        raise MemoryError(f"shared_empty: cannot map {nbytes} bytes (shape {shape} of {dtype}): "
                          f"more than this host's memory ({ram} bytes)")
    fd = os.memfd_create("macroflow-shared", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, nbytes)
        # a peer that mapped it can never be caught out by the file shrinking under it
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
        ino = os.fstat(fd).st_ino
        address = _map(fd, nbytes)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.ENOMEM, errno.ENOSPC, errno.EFBIG):
            raise MemoryError(f"shared_empty: cannot map {nbytes} bytes (shape {shape} of "
                              f"{dtype}): {os.strerror(e.errno)}") from e
        raise
    except BaseException:
        os.close(fd)
        raise
    owner = _Mapping(address, nbytes, fd)
    _register(address, (address + nbytes, fd, nbytes, ino))
    return np.ndarray(shape, dtype, buffer=np.asarray(owner))


def shared_zeros(shape: Any, dtype: Any = float) -> np.ndarray:
    """:func:`shared_empty`, filled with zeros (a new memfd is zeros already).

    Example:
        >>> import macroflow as mf
        >>> mf.shared_zeros(3).tolist()
        [0.0, 0.0, 0.0]
    """
    return shared_empty(shape, dtype)


def shared_full(shape: Any, fill: Any, dtype: Any = None) -> np.ndarray:
    """:func:`shared_empty`, every element set to ``fill`` (dtype: fill's, by default).

    Example:
        >>> import macroflow as mf
        >>> mf.shared_full((2,), 5, "int64").tolist(), mf.shared_full(2, 1.5).dtype.name
        ([5, 5], 'float64')
    """
    if dtype is None:
        dtype = np.asarray(fill).dtype
    a = shared_empty(shape, dtype)
    a.fill(fill)
    return a


class Region:
    """What a peer needs to reach a buffer registered in some process.

    Attributes:
        node: the owner's :func:`macroflow.transport.local.node_key`; only
            processes with the same one can reach the memory directly.
        pid: the owner's process id.
        address: where the first byte is in the owner.
        nbytes: how many bytes.
        shm: ``(fd, offset, size)`` when the bytes lie inside one mapping made
            by :func:`shared_empty`: the owner's descriptor of its memfd, where
            the first byte is in it, and its size; else None.
        shm_id: that memfd's inode number (0 without shm): a peer's cached
            mapping is reused only for the same memfd, even when the owner
            closed the descriptor and reused its number.
        readonly: the buffer was read-only; writing to it is refused.
        window: the owner attached the buffer to its transport's one-sided
            window (MPI under mpiexec): peers of that window read it there.

    Example:
        >>> import pickle
        >>> r = describe(bytearray(b"hello"))
        >>> r.nbytes, r.shm, pickle.loads(pickle.dumps(r)) == r
        (5, None, True)
    """

    __slots__ = ("node", "pid", "address", "nbytes", "shm", "shm_id", "readonly", "window")

    def __init__(self, node: str, pid: int, address: int, nbytes: int,
                 shm: Optional[Tuple[int, int, int]] = None, shm_id: int = 0, readonly: bool = False,
                 window: bool = False):
        self.node, self.pid, self.address, self.nbytes = node, pid, address, nbytes
        self.shm, self.shm_id, self.readonly, self.window = shm, shm_id, readonly, window

    def _fields(self) -> tuple:
        return (self.node, self.pid, self.address, self.nbytes, self.shm, self.shm_id, self.readonly,
                self.window)

    def __reduce__(self):
        return Region, self._fields()

    def __eq__(self, other: object) -> bool:
        return type(other) is Region and self._fields() == other._fields()

    def __hash__(self) -> int:
        return hash(self._fields())

    def __repr__(self) -> str:
        shm = f", shm={self.shm}" if self.shm is not None else ""
        ro = ", readonly=True" if self.readonly else ""
        return (f"Region(node={self.node!r}, pid={self.pid}, address={self.address:#x}, "
                f"nbytes={self.nbytes}{shm}{ro})")


def _contiguous(m: memoryview, what: str, obj: Any) -> None:
    if not m.c_contiguous:
        desc = (f"a non-contiguous {type(obj).__name__} of shape {m.shape} and strides {m.strides}")
        raise ValueError(f"{what} needs a C-contiguous buffer, got {desc}; "
                         "use a contiguous copy (numpy.ascontiguousarray) instead")


def _buffer(obj: Any, what: str) -> memoryview:
    try:
        return memoryview(obj)
    except TypeError:
        raise TypeError(f"{what} needs a buffer (a numpy array, bytearray, bytes, memoryview...), "
                        f"not {type(obj).__name__}") from None


def _address(m: memoryview) -> int:
    """Where a non-empty C-contiguous buffer starts (kept valid by holding m)."""
    if not m.readonly:
        return _addressof(_char_at(m))
    return _frombuffer(m, _u8).__array_interface__["data"][0]


def describe(buffer: Any) -> Region:
    """The :class:`Region` of a C-contiguous buffer of this process.

    The buffer must stay alive, and where it is, for as long as peers use the
    region: this only describes it.

    Args:
        buffer: a numpy array or anything with the buffer protocol.

    Raises:
        ValueError: the buffer is not C-contiguous.
        TypeError: it is not a buffer.

    Example:
        >>> a = shared_zeros(100, "uint8")
        >>> r = describe(a[10:20])
        >>> r.nbytes, r.shm[1:], r.pid == os.getpid()
        (10, (10, 100), True)
    """
    m = _buffer(buffer, "describe()")
    _contiguous(m, "describe()", buffer)
    nbytes = m.nbytes
    address = _address(m) if nbytes else 0
    found = _find(address, nbytes) if nbytes else None
    shm, ino = found if found is not None else (None, 0)
    return Region(node_key(), os.getpid(), address, nbytes, shm, ino, m.readonly)


class _Watch:
    """Tells whether one process is still alive (a pidfd: immune to pid reuse)."""

    __slots__ = ("fd", "poll", "next_look", "dead", "__weakref__")

    #: seconds between two looks at the process (a look is a system call,
    #: which would cost a small get a fifth of its time)
    EVERY = 0.005

    def __init__(self, pid: int):
        self.fd = os.pidfd_open(pid)
        self.poll = select.poll()
        self.poll.register(self.fd, select.POLLIN)
        self.next_look = 0.0
        self.dead = False

    def gone(self) -> bool:
        now = time.monotonic()
        if now >= self.next_look and not self.dead:
            self.next_look = now + self.EVERY
            self.dead = bool(self.poll.poll(0))
        return self.dead

    def __del__(self):
        try:
            os.close(self.fd)
        except Exception:
            pass


def _span(buf: Any, what: str, region: Region, offset: Any,
          writable: bool) -> Tuple[memoryview, int, int]:
    """The checks read() and write() share: ``buf`` as a contiguous
    memoryview (writable, to copy into), its size in bytes, and ``offset``,
    which with that size must lie inside ``region``."""
    try:
        m = memoryview(buf)
    except TypeError:
        m = _buffer(buf, f"{what}()")
    if writable and m.readonly:
        raise ValueError(f"{what}() needs a writable buffer to copy into, got a read-only "
                         f"{type(buf).__name__}")
    if not m.c_contiguous:
        _contiguous(m, f"{what}()", buf)
    n = m.nbytes
    offset = _index(offset)
    if offset < 0 or offset + n > region.nbytes:
        raise ValueError(f"{what} of {n} bytes at offset {offset} is outside the region of "
                         f"{region.nbytes} bytes (need 0 <= offset and offset + size <= "
                         f"{region.nbytes})")
    return m, n, offset


class Access:
    """Reads and writes other processes' registered memory, doing the copy here.

    Use one per process (:func:`access`); an Access made before a fork must not
    be used in the child.

    Args:
        max_mappings: how many peers' shared mappings to keep mapped (least
            recently used go first).

    Example:
        >>> src = bytearray(b"0123456789")
        >>> r, out, acc = describe(src), bytearray(4), access()
        >>> acc.read(r, 3, out), bytes(out)
        (True, b'3456')
        >>> acc.write(r, 0, b"ab"), bytes(src)
        (True, b'ab23456789')
    """

    def __init__(self, max_mappings: int = 64):
        if _index(max_mappings) < 1:
            raise ValueError(f"max_mappings must be >= 1, got {max_mappings}")
        self.pid = os.getpid()
        self.node = node_key()
        self.max_mappings = max_mappings
        # (pid, fd, size, inode) -> (uint8 array over the mapping, _Watch of its owner)
        self._maps: "OrderedDict[tuple, Tuple[np.ndarray, _Watch]]" = OrderedDict()
        self._watches: "weakref.WeakValueDictionary[int, _Watch]" = weakref.WeakValueDictionary()
        self._no_vm: set = set()  # pids process_vm_*v was refused for (EPERM)
        self._vm_missing = _vm_read is None or _vm_write is None  # or ENOSYS seen
        self._no_fd: set = set()  # pids whose /proc/<pid>/fd we may not open
        self._iovs: list = []  # spare (local, remote, &local, &remote) iovecs

    def statistics(self) -> Dict[str, int]:
        """Counts of what this Access holds and has learnt.

        Example:
            >>> sorted(Access().statistics())
            ['mappings', 'pids_without_fd', 'pids_without_process_vm']
        """
        return {"mappings": len(self._maps), "pids_without_process_vm": len(self._no_vm),
                "pids_without_fd": len(self._no_fd)}

    def read(self, region: Region, offset: int, out: Any) -> bool:
        """Copy the region's bytes ``[offset, offset + out's size)`` into ``out``.

        Args:
            region: what :func:`describe` made in the owner.
            offset: in bytes, from the region's first byte.
            out: a writable C-contiguous buffer; its size in bytes is how many
                bytes are copied.

        Returns:
            True when copied; False when this process cannot reach the memory
            (another node, no permission, the owner is gone): ask the owner.

        Raises:
            ValueError: the range is outside the region, ``out`` is read-only
                or not contiguous, or the owner has no memory at the region's
                address (a wrong or stale region).

        Example:
            >>> a = shared_full(4, 2.5)
            >>> out = np.empty(2)
            >>> access().read(describe(a), 16, out), out.tolist()
            (True, [2.5, 2.5])
        """
        m, n, offset = _span(out, "read", region, offset, writable=True)
        if region.node != self.node:
            return False
        if n == 0:
            return True
        pid = region.pid
        if pid == self.pid:
            _memmove(_addressof(_char_at(m)), region.address + offset, n)
            return True
        if region.shm is not None and pid not in self._no_fd:
            peer = self._mapped(region)
            if peer is not None:
                if peer is False:
                    return False
                start = region.shm[1] + offset
                _frombuffer(m, _u8)[:] = peer[start:start + n]
                return True
        return self._vm(_vm_read, region, offset, _addressof(_char_at(m)), n)

    def source(self, region: Region, offset: int, n: int) -> Optional[Tuple[np.ndarray, Any]]:
        """The region's bytes ``[offset, offset + n)`` as a uint8 array on a
        shared mapping of the owner's memory, and the watch that tells when
        the owner has gone (``watch.gone()``); None where there is no such
        mapping (the owner is this process, on another node or gone; the
        memory is not shared; the range is outside the region): use
        :meth:`read`, which also says what is wrong.

        Example:
            >>> a = shared_full(4, 2.5)
            >>> access().source(describe(a), 0, 8) is None   # this process's own memory
            True
        """
        pid = region.pid
        if (region.shm is None or pid == self.pid or region.node != self.node
                or pid in self._no_fd or offset < 0 or offset + n > region.nbytes):
            return None
        peer = self._mapped(region)
        if peer is None or peer is False:
            return None
        watch = self._watches.get(pid)
        if watch is None:
            return None
        start = region.shm[1] + offset
        return peer[start:start + n], watch

    def view(self, region: Region) -> Optional[np.ndarray]:
        """The region's bytes as a writable uint8 array in this process, for
        memory that several processes use in place (a barrier's counters):
        the owner's own buffer, or a shared mapping of it; None where it can
        only be copied (process_vm) or not reached.

        Example:
            >>> a = shared_zeros(4, np.int64)
            >>> v = access().view(describe(a))
            >>> v[8] = 1
            >>> a.tolist()
            [0, 1, 0, 0]
        """
        if region.readonly:
            return None
        if region.pid == os.getpid():
            if region.nbytes == 0:
                return np.empty(0, np.uint8)
            return np.ctypeslib.as_array((ctypes.c_uint8 * region.nbytes).from_address(
                region.address))
        if region.shm is None or region.node != self.node:
            return None
        mapped = self._mapped(region)
        if mapped is None or mapped is False:
            return None
        start = region.shm[1]
        return mapped[start:start + region.nbytes]

    def write(self, region: Region, offset: int, data: Any) -> bool:
        """Copy ``data`` into the region's bytes ``[offset, offset + data's size)``.

        Args:
            region: what :func:`describe` made in the owner (not read-only).
            offset: in bytes, from the region's first byte.
            data: a C-contiguous buffer; all its bytes are written.

        Returns:
            True when written; False when this process cannot reach the memory
            (another node, no permission, the owner is gone): ask the owner.

        Raises:
            ValueError: the range is outside the region, the region is
                read-only, ``data`` is not contiguous, or the owner has no
                memory at the region's address.

        Example:
            >>> a = shared_zeros(3, "int16")
            >>> access().write(describe(a), 2, np.array([9], "int16")), a.tolist()
            (True, [0, 9, 0])
        """
        m, n, offset = _span(data, "write", region, offset, writable=False)
        if region.readonly:
            raise ValueError(f"{region!r} describes a read-only buffer; it cannot be written")
        if region.node != self.node:
            return False
        if n == 0:
            return True
        pid = region.pid
        if pid == self.pid:
            _memmove(region.address + offset, _address(m), n)
            return True
        if region.shm is not None and pid not in self._no_fd:
            peer = self._mapped(region)
            if peer is not None:
                if peer is False:
                    return False
                start = region.shm[1] + offset
                peer[start:start + n] = _frombuffer(m, _u8)
                return True
        return self._vm(_vm_write, region, offset, _address(m), n)

    def _mapped(self, region: Region) -> Any:
        """The owner's shared mapping as a uint8 array; False: the owner is gone;
        None: it cannot be mapped from here (try process_vm)."""
        pid = region.pid
        fd, _, size = region.shm
        key = (pid, fd, size, region.shm_id)
        hit = self._maps.get(key)
        if hit is not None:
            if hit[1].gone():
                self._maps.pop(key, None)
                if self._watches.get(pid) is hit[1]:
                    del self._watches[pid]
                return False
            self._maps.move_to_end(key)
            return hit[0]
        return self._map_peer(region, key)

    def _map_peer(self, region: Region, key: tuple) -> Any:
        pid, fd, size, ino = key
        watch = self._watches.get(pid)
        if watch is None:
            try:
                watch = _Watch(pid)
            except ProcessLookupError:
                return False
            except OSError:
                return None  # no pidfd here (old kernel, out of descriptors)
            self._watches[pid] = watch
        try:
            local = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
        except OSError as e:
            if e.errno in (errno.EACCES, errno.EPERM):
                self._no_fd.add(pid)
            elif watch.gone():
                return False
            return None
        try:
            st = os.fstat(local)
            if st.st_ino != region.shm_id or st.st_size < size:
                return None  # that descriptor is now something else: the memory was freed
            try:
                address = _map(local, size)
            except OSError:
                return None
        finally:
            os.close(local)
        if watch.gone():  # it may have been another process by that pid when we opened
            _libc.munmap(address, size)
            return False
        view = np.asarray(_Mapping(address, size, -1))
        maps = self._maps
        maps[key] = (view, watch)
        while len(maps) > self.max_mappings:
            maps.popitem(last=False)  # unmapped as soon as no copy in progress uses it
        return view

    def _vm(self, fn: Any, region: Region, offset: int, address: int, n: int) -> bool:
        pid = region.pid
        if self._vm_missing or pid in self._no_vm:
            return False
        iovs = self._iovs
        try:
            local, remote, plocal, premote = iovs.pop()
        except IndexError:  # first use, or a copy started by a signal handler during another
            local, remote = _IoVec(), _IoVec()
            plocal, premote = ctypes.pointer(local), ctypes.pointer(remote)
        try:
            where = region.address + offset
            done = 0
            while done < n:
                local.iov_base = address + done
                remote.iov_base = where + done
                local.iov_len = remote.iov_len = n - done
                got = fn(pid, plocal, 1, premote, 1, 0)
                if got > 0:
                    done += got
                    continue
                e = _get_errno() if got < 0 else errno.EFAULT
                if e == errno.EINTR:
                    continue
                if e == errno.EPERM:
                    self._no_vm.add(pid)
                    return False
                if e == errno.ENOSYS:
                    self._vm_missing = True
                    return False
                if e == errno.ESRCH:
                    return False
                if e == errno.EFAULT:
                    raise ValueError(f"process {pid} has no memory at {where + done:#x} "
                                     f"(bytes {offset + done}..{offset + n} of {region!r}): "
                                     "the region is wrong or its buffer was freed")
                raise OSError(e, f"copying {n} bytes of {region!r}: {os.strerror(e)}")
            return True
        finally:
            iovs.append((local, remote, plocal, premote))


_access: Optional[Access] = None


def access() -> Access:
    """This process's :class:`Access` (a forked child gets its own).

    Example:
        >>> access() is access(), access().pid == os.getpid()
        (True, True)
    """
    global _access
    a = _access
    if a is None:
        a = _access = Access()
    return a


def _after_fork_child() -> None:
    global _access, _starts_lock
    _access = None
    _starts_lock = threading.Lock()  # another thread may have held it at the fork


os.register_at_fork(after_in_child=_after_fork_child)

_capabilities: Optional[Dict[str, Any]] = None


def _ptrace_scope() -> Optional[int]:
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def capabilities() -> Dict[str, Any]:
    """Which of the cross-process paths work here, found once by trying them on a child.

    Returns:
        ``process_vm``: process_vm_readv reads a child's memory;
        ``proc_fd``: a child's memfd can be mapped through ``/proc/<pid>/fd``;
        ``process_vm_error`` / ``proc_fd_error``: why not (None when it works);
        ``ptrace_scope``: Yama's setting (None without Yama): at 1, contexts
        that are siblings, not parent and child, cannot use either path.

    Example:
        >>> sorted(capabilities())
        ['proc_fd', 'proc_fd_error', 'process_vm', 'process_vm_error', 'ptrace_scope']
    """
    global _capabilities
    if _capabilities is None:
        _capabilities = _probe()
    return dict(_capabilities)


def _probe() -> Dict[str, Any]:
    marker = bytearray(b"before-fork-mark")
    shm = shared_full(16, ord("s"), "uint8")
    fd = describe(shm).shm[0]
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(w)
            os.read(r, 1)  # returns at EOF, when the parent is done
        finally:
            os._exit(0)
    vm_error = fd_error = None
    try:
        os.close(r)
        expect = bytes(marker)
        marker[:] = b"changed-in-child"[::-1]  # a real remote read sees the old bytes
        if _vm_read is None:
            vm_error = "process_vm_readv is not in this C library"
        else:
            got = bytearray(len(expect))
            local, remote = _IoVec(_address(memoryview(got)), len(got)), \
                _IoVec(_address(memoryview(marker)), len(got))
            n = _vm_read(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
            if n < 0:
                vm_error = f"process_vm_readv: {os.strerror(_get_errno())}"
            elif bytes(got) != expect:
                vm_error = f"process_vm_readv read {bytes(got)!r}, expected {expect!r}"
        shm[:] = ord("t")
        try:
            local_fd = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
        except OSError as e:
            fd_error = f"open /proc/<pid>/fd/<fd>: {e.strerror}"
        else:
            try:
                with mmap.mmap(local_fd, 16) as mm:
                    if mm[:] != b"t" * 16:
                        fd_error = f"the mapping holds {mm[:]!r}, expected {b't' * 16!r}"
            except OSError as e:
                fd_error = f"mmap of /proc/<pid>/fd/<fd>: {e.strerror}"
            finally:
                os.close(local_fd)
    finally:
        os.close(w)
        os.waitpid(pid, 0)
    return {"process_vm": vm_error is None, "process_vm_error": vm_error,
            "proc_fd": fd_error is None, "proc_fd_error": fd_error, "ptrace_scope": _ptrace_scope()}
