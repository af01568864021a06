"""One-sided copies to and from another process's memory (macroflow.spmd.memory),
through each path: the same process, a shared memfd, process_vm_readv/writev."""

import gc
import os
import pickle
import select
import signal
import struct
import time

import numpy as np
import pytest

from macroflow.spmd import memory
from macroflow.spmd.memory import (Access, Region, access, capabilities, describe, shared_empty,
                                   shared_full, shared_zeros)
from macroflow.transport.local import node_key

SIZES = [0, 1, 8, 4096 + 3, 1 << 20]
CAPS = capabilities()
needs_vm = pytest.mark.skipif(not CAPS["process_vm"], reason=f"process_vm_readv: {CAPS['process_vm_error']}")
needs_fd = pytest.mark.skipif(not CAPS["proc_fd"], reason=f"/proc/<pid>/fd mapping: {CAPS['proc_fd_error']}")


def _send(fd, obj):
    data = pickle.dumps(obj)
    os.write(fd, struct.pack("<Q", len(data)))
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _recv(fd):
    def exactly(n):
        got = bytearray()
        while len(got) < n:
            part = os.read(fd, n - len(got))
            if not part:
                return None
            got += part
        return bytes(got)
    head = exactly(8)
    if head is None:
        return None
    return pickle.loads(exactly(struct.unpack("<Q", head)[0]))


def _reap(pid, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    return os.waitpid(pid, 0)[1]


def _patterned(n, seed=1):
    return (np.arange(n, dtype=np.uint64) * 2654435761 + seed).astype(np.uint8)


class Owner:
    """A forked process that makes buffers (``make()`` runs there) and answers:
    ("bytes", name) -> their bytes now; ("regions",) -> their Regions; ("exit",)."""

    def __init__(self, make):
        to_child, self._w = os.pipe()
        self._r, from_child = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:
            code = 1
            try:
                os.close(self._w)
                os.close(self._r)
                bufs = make()
                regions = {k: describe(v) for k, v in bufs.items()}
                _send(from_child, regions)
                while True:
                    msg = _recv(to_child)
                    if msg is None or msg[0] == "exit":
                        break
                    if msg[0] == "bytes":
                        _send(from_child, bytes(memoryview(bufs[msg[1]]).cast("B")))
                    elif msg[0] == "free":  # drop a buffer, make a shared one (size, fill) instead
                        del bufs[msg[1]]
                        gc.collect()
                        bufs[msg[1]] = shared_full(msg[2], msg[3], np.uint8)
                        _send(from_child, describe(bufs[msg[1]]))
                code = 0
            finally:
                os._exit(code)
        os.close(to_child)
        os.close(from_child)
        self.regions = _recv(self._r)
        assert self.regions is not None, "the owner died while starting"
        self.status = None

    def ask(self, *msg):
        _send(self._w, msg)
        return _recv(self._r)

    def exit(self):
        """Ends the owner without reaping it (it stays a zombie until close())."""
        if self._w >= 0:
            watch = os.pidfd_open(self.pid)
            try:
                os.close(self._w)
                self._w = -1
                # readable once it has exited, reaped or not
                assert select.select([watch], [], [], 20.0)[0], "the owner did not exit"
            finally:
                os.close(watch)
            os.close(self._r)
            self._r = -1

    def close(self):
        self.exit()
        if self.status is None:
            self.status = _reap(self.pid)
        return self.status

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        status = self.close()
        if exc[0] is None:
            assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"owner ended with {status}"


def _make(shared):
    def make():
        new = shared_empty if shared else np.empty
        bufs = {}
        for n in SIZES:
            a = new(n, np.uint8)
            a[:] = _patterned(n)
            bufs[n] = a
        return bufs
    return make


def _ranges(n):
    """(offset, length) pairs: whole, head, tail, middle, single bytes, empty."""
    out = {(0, n), (0, 0), (n, 0)}
    if n >= 1:
        out |= {(0, 1), (n - 1, 1)}
    if n >= 8:
        out |= {(3, n - 5), (n // 2, n - n // 2), (1, 7)}
    return sorted(out)


# --- shared arrays --------------------------------------------------------------------------

def test_shared_empty_shapes_and_dtypes():
    a = shared_empty((3, 4), "int32")
    assert a.shape == (3, 4) and a.dtype == np.int32 and a.flags.c_contiguous and a.flags.writeable
    assert shared_zeros(5).tolist() == [0.0] * 5
    assert shared_full((2, 2), 7, "int8").tolist() == [[7, 7], [7, 7]]
    for shape in (0, (0,), (3, 0), (0, 5)):
        z = shared_empty(shape)
        assert z.size == 0 and describe(z).nbytes == 0 and describe(z).shm is None
    assert shared_empty(()).shape == ()  # one element, no dimensions


def test_shared_empty_bad_input():
    with pytest.raises(ValueError, match="negative"):
        shared_empty((2, -1))
    with pytest.raises(TypeError, match="shape must be"):
        shared_empty("3")
    # as numpy refuses them (a dict and an empty list's 0-d array, a bool's 1 element, were taken)
    for shape in ({}, {2: 3}, {2}, True, np.bool_(False)):
        with pytest.raises(TypeError, match="shape must be an int or a sequence of ints"):
            shared_empty(shape)
    assert shared_empty([]).shape == np.empty([]).shape == ()  # (numpy's own meaning)
    with pytest.raises(TypeError, match="Python objects"):
        shared_empty(3, object)


@pytest.mark.timeout(30)
def test_shared_empty_is_shared_with_a_forked_child():
    a = shared_zeros(1000, "int64")
    pid = os.fork()
    if pid == 0:
        try:
            a[:] = np.arange(1000)
        finally:
            os._exit(0)
    assert _reap(pid) == 0
    assert a.tolist() == list(range(1000))


def _fd_count():
    # the descriptors of shared memory this process holds (memfds named so):
    # counting every descriptor would count those an earlier test's threads
    # close meanwhile (a computation's sockets, an MPI job's pipes)
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if "memfd:macroflow-shared" in os.readlink(f"/proc/self/fd/{fd}"):
                n += 1
        except OSError:  # the listing's own descriptor, closed by now
            pass
    return n


def test_mapping_released_with_its_last_view():
    gc.collect()
    before = _fd_count()
    a = shared_zeros((100, 10))
    view = a[5:7]
    address = describe(a).address
    assert _fd_count() == before + 1
    del a
    gc.collect()
    assert _fd_count() == before + 1, "a view still uses the memory"
    assert address in memory._live
    view[:] = 1.0  # and the memory is still there
    del view
    gc.collect()
    assert _fd_count() == before
    assert address not in memory._live
    many = [shared_empty(10) for _ in range(50)]
    assert _fd_count() == before + 50
    del many
    gc.collect()
    assert _fd_count() == before


# --- describe and Region ----------------------------------------------------------------------

def test_describe_numpy_and_buffers():
    a = np.arange(10, dtype=np.float64)
    r = describe(a)
    assert (r.node, r.pid, r.address, r.nbytes, r.shm, r.readonly) == \
        (node_key(), os.getpid(), a.ctypes.data, 80, None, False)
    assert describe(a[2:]).address == a.ctypes.data + 16
    assert describe(b"abc").readonly and describe(b"abc").nbytes == 3
    assert describe(bytearray(5)).nbytes == 5
    assert describe(memoryview(a).cast("B")[8:16]).address == a.ctypes.data + 8
    with pytest.raises(TypeError, match="needs a buffer"):
        describe(3)


def test_describe_shared_views():
    a = shared_zeros((10, 10), "int32")
    whole = describe(a)
    fd, off, size = whole.shm
    assert (off, size) == (0, 400) and whole.shm_id == os.fstat(fd).st_ino
    assert os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:")
    row = describe(a[3])
    assert row.shm == (fd, 120, 400) and row.address == whole.address + 120
    b = shared_zeros(10, "int32")
    assert describe(b).shm[0] != fd
    # memory around, not inside, a shared mapping has no shm
    assert describe(np.zeros(400, np.uint8)).shm is None


def test_describe_non_contiguous_is_refused():
    a = np.zeros((4, 4))
    with pytest.raises(ValueError, match=r"C-contiguous.*shape \(4, 2\)"):
        describe(a[:, :2])
    with pytest.raises(ValueError, match="C-contiguous"):
        describe(a.T)
    with pytest.raises(ValueError, match="C-contiguous"):
        describe(memoryview(bytearray(8))[::2])


def test_region_pickles_and_compares():
    a = shared_zeros(10)
    r = describe(a[2:])
    back = pickle.loads(pickle.dumps(r))
    assert back == r and hash(back) == hash(r) and back is not r
    assert back.shm == r.shm and back.shm_id == r.shm_id
    assert "shm=" in repr(r) and f"pid={os.getpid()}" in repr(r)
    assert r != describe(a)
    assert not hasattr(r, "__dict__")


# --- the same process -----------------------------------------------------------------------

@pytest.mark.parametrize("n", SIZES)
def test_same_process_read_and_write(n):
    src = _patterned(n)
    r = describe(src)
    acc = access()
    for off, length in _ranges(n):
        out = np.full(length, 0xEE, np.uint8)
        assert acc.read(r, off, out) is True
        assert np.array_equal(out, src[off:off + length])
    for off, length in _ranges(n):
        data = _patterned(length, seed=off + 7)
        assert acc.write(r, off, data) is True
        assert np.array_equal(src[off:off + length], data)
    if n >= 8:
        assert acc.write(r, 0, b"ABCDEFGH") and bytes(src[:8]) == b"ABCDEFGH"  # read-only source


def test_read_into_any_writable_buffer():
    src = np.arange(8, dtype=np.float64)
    r = describe(src)
    out = np.zeros((2, 2))  # 32 bytes, two dimensions
    assert access().read(r, 16, out) and out.tolist() == [[2.0, 3.0], [4.0, 5.0]]
    b = bytearray(8)
    assert access().read(r, 8, b) and struct.unpack("d", b) == (1.0,)


def test_bounds_and_bad_buffers():
    r = describe(bytearray(10))
    acc = access()
    with pytest.raises(ValueError, match="read of 4 bytes at offset 8 .* 10 bytes"):
        acc.read(r, 8, bytearray(4))
    with pytest.raises(ValueError, match="offset -1"):
        acc.read(r, -1, bytearray(1))
    with pytest.raises(ValueError, match="write of 11 bytes at offset 0"):
        acc.write(r, 0, bytes(11))
    with pytest.raises(ValueError, match="offset 11"):
        acc.write(r, 11, b"")
    with pytest.raises(TypeError):
        acc.read(r, 1.5, bytearray(1))
    with pytest.raises(ValueError, match="writable"):
        acc.read(r, 0, b"abc")
    with pytest.raises(ValueError, match="C-contiguous"):
        acc.read(r, 0, np.zeros((2, 2), np.uint8)[:, 0])
    with pytest.raises(ValueError, match="C-contiguous"):
        acc.write(r, 0, np.zeros((2, 2), np.uint8)[:, 0])
    with pytest.raises(TypeError, match="needs a buffer"):
        acc.read(r, 0, [1, 2])
    with pytest.raises(ValueError, match="read-only"):
        acc.write(describe(b"immutable"), 0, b"x")


def test_another_node_is_not_reached():
    r = describe(bytearray(b"abcd"))
    elsewhere = Region("otherhost~1", r.pid, r.address, r.nbytes)
    out = bytearray(4)
    assert access().read(elsewhere, 0, out) is False and out == bytearray(4)
    assert access().write(elsewhere, 0, b"zzzz") is False
    with pytest.raises(ValueError, match="outside"):  # bounds are checked first all the same
        access().read(elsewhere, 2, out)


# --- other processes --------------------------------------------------------------------------

def _round_trip(owner, acc):
    for n, r in owner.regions.items():
        assert r.pid == owner.pid and r.nbytes == n
        expect = np.frombuffer(owner.ask("bytes", n), np.uint8).copy()
        for off, length in _ranges(n):
            out = np.full(length, 0xEE, np.uint8)
            assert acc.read(r, off, out) is True
            assert np.array_equal(out, expect[off:off + length]), (n, off, length)
        for off, length in _ranges(n):
            data = _patterned(length, seed=off + 11)
            assert acc.write(r, off, data) is True
            expect[off:off + length] = data
        assert owner.ask("bytes", n) == expect.tobytes()


@needs_fd
@pytest.mark.timeout(60)
def test_shared_memory_path():
    acc = Access()
    with Owner(_make(shared=True)) as owner:
        assert all(r.shm is not None for n, r in owner.regions.items() if n)
        _round_trip(owner, acc)
        mapped = [n for n in SIZES if n]
        assert acc.statistics()["mappings"] == len(mapped)  # one mapping per memfd, kept
        _round_trip(owner, acc)
        assert acc.statistics()["mappings"] == len(mapped)


@needs_vm
@pytest.mark.timeout(60)
def test_process_vm_path():
    acc = Access()
    with Owner(_make(shared=False)) as owner:
        assert all(r.shm is None for r in owner.regions.values())
        _round_trip(owner, acc)
        assert acc.statistics()["mappings"] == 0


@needs_vm
@pytest.mark.timeout(60)
def test_wrong_address_raises():
    acc = Access()
    with Owner(lambda: {"a": np.zeros(16, np.uint8)}) as owner:
        r = owner.regions["a"]
        bogus = Region(r.node, r.pid, 4096, 64)  # nothing is mapped at page 1
        with pytest.raises(ValueError, match=f"process {r.pid} has no memory at 0x1000"):
            acc.read(bogus, 0, bytearray(8))
        with pytest.raises(ValueError, match="no memory"):
            acc.write(bogus, 8, b"12345678")


@needs_fd
@pytest.mark.timeout(60)
def test_cached_mapping_is_not_reused_for_another_memfd():
    """The owner frees an array and makes one of the same size: it likely gets the
    same descriptor number, but a peer must not read the old memory."""
    acc = Access()
    with Owner(lambda: {"a": shared_full(64, 1, np.uint8)}) as owner:
        old = owner.regions["a"]
        out = bytearray(64)
        assert acc.read(old, 0, out) and out == b"\x01" * 64
        new = owner.ask("free", "a", 64, 2)
        assert new.shm_id != old.shm_id
        assert acc.read(new, 0, out) and out == b"\x02" * 64
        assert acc.write(new, 0, b"\x03" * 64) and owner.ask("bytes", "a") == b"\x03" * 64


@needs_fd
@pytest.mark.timeout(60)
def test_mappings_are_bounded():
    acc = Access(max_mappings=2)
    with Owner(lambda: {i: shared_full(8, i, np.uint8) for i in range(4)}) as owner:
        for _ in range(2):
            for i, r in owner.regions.items():
                out = bytearray(8)
                assert acc.read(r, 0, out) and out == bytes([i]) * 8
                assert acc.statistics()["mappings"] <= 2
    with pytest.raises(ValueError, match="max_mappings"):
        Access(max_mappings=0)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("shared", [True, False], ids=["shm", "process_vm"])
@pytest.mark.parametrize("reaped", [True, False], ids=["reaped", "zombie"])
def test_dead_owner_is_false(shared, reaped, monkeypatch):
    # the owner is looked at every _Watch.EVERY seconds (a system call per get
    # would cost a small get a fifth of its time): here, at every read
    monkeypatch.setattr(memory._Watch, "EVERY", 0.0)
    acc = Access()
    owner = Owner(lambda: {"a": (shared_full if shared else np.full)(32, 5, np.uint8)})
    try:
        r = owner.regions["a"]
        out = bytearray(32)
        reachable = CAPS["proc_fd"] if shared else CAPS["process_vm"]
        assert acc.read(r, 0, out) is reachable  # a shared mapping is now cached
        owner.close() if reaped else owner.exit()
        assert acc.read(r, 0, out) is False
        assert acc.write(r, 0, bytes(32)) is False
        assert acc.read(r, 8, bytearray(8)) is False
    finally:
        owner.close()


@pytest.mark.timeout(60)
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to become another user")
def test_no_permission_is_false_and_remembered():
    """A process of another user may neither map our memfds nor use process_vm on us."""
    shared = shared_full(16, 9, np.uint8)
    private = np.full(16, 9, np.uint8)
    regions = (describe(shared), describe(private))
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            os.setgid(65534)
            os.setuid(65534)
            acc = Access()
            got = [acc.read(reg, 0, bytearray(16)) for reg in regions for _ in range(2)]
            got.append(acc.write(regions[1], 0, b"x"))
            _send(w, (got, acc.statistics()))
        finally:
            os._exit(0)
    os.close(w)
    got, stats = _recv(r)
    os.close(r)
    assert _reap(pid) == 0
    assert got == [False] * 5
    assert stats["pids_without_fd"] == 1
    assert stats["pids_without_process_vm"] == (1 if CAPS["process_vm"] else 0)
    assert shared.tolist() == [9] * 16 and private.tolist() == [9] * 16


@pytest.mark.timeout(30)
def test_forked_child_gets_its_own_access():
    parent = access()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            child = access()
            _send(w, (child is not parent, child.pid == os.getpid(), child is access()))
        finally:
            os._exit(0)
    os.close(w)
    assert _recv(r) == (True, True, True)
    os.close(r)
    assert _reap(pid) == 0


def test_capabilities():
    caps = capabilities()
    assert set(caps) == {"process_vm", "process_vm_error", "proc_fd", "proc_fd_error", "ptrace_scope"}
    assert (caps["process_vm_error"] is None) == caps["process_vm"]
    assert (caps["proc_fd_error"] is None) == caps["proc_fd"]
    assert capabilities() == caps  # measured once


def test_shared_memory_larger_than_can_be_mapped_is_refused_clearly():
    # an OverflowError of a C long from inside, or a bare OSError of mmap
    with pytest.raises(ValueError, match=r"shared_empty: shape \(10+,\) of float64 is 8"
                                         r"0+ bytes, more than any process can map"):
        shared_empty(10 ** 30)
    with pytest.raises(MemoryError, match=r"shared_empty: cannot map 8000000000000000 bytes "
                                          r"\(shape \(1000000000000000,\) of float64\)"):
        memory.shared_zeros(10 ** 15)
    # one a lazy mapping would have taken: written to past the host's memory,
    # the process died of SIGBUS
    with pytest.raises(MemoryError, match=r"cannot map 80000000000000 bytes \(shape "
                                          r"\(10000000000000,\) of float64\): more than this "
                                          r"host's memory \(\d+ bytes\)"):
        memory.shared_zeros(10 ** 13)
