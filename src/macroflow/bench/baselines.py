"""Hand-coded baselines for macroflow's benchmarks.

Each baseline uses the transport macroflow itself uses -- an AF_UNIX stream
socketpair between a parent and an ``os.fork()``-ed child on one host -- but
with none of the runtime in between, so the numbers are a floor that
macroflow's own overhead is measured against.  This module deliberately
imports nothing from macroflow's runtime but its fork (which keeps a Ctrl-C
that comes as a child is made: see :func:`fork_child`).

Run ``python -m macroflow.bench.baselines`` for a summary table.
"""
import contextlib
import ctypes
import os
import pickle
import select
import signal
import socket
import struct
import sys
import time
import traceback

import numpy as np

MODES = ("blocking", "busypoll", "pollsleep")
#: the call every hand-coded round trip sends, and the reply it expects
CALL = ("call", 17, "method", (1,), {})
REPLY = ("result", 17, 1)
_LEN = struct.Struct("<Q")
_OOB_HDR = struct.Struct("<QQ")  # in-band pickle length, number of raw buffers
_SOCKBUF = 4 * 2**20


def _die_with_parent(ppid):
    # A benchmark child spinning on a socket must never outlive a killed parent.
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass
    if os.getppid() != ppid:  # parent died before prctl took effect
        os._exit(1)


def fork_child() -> int:
    """``os.fork()`` for a benchmark's hand-coded process, through the
    runtime's fork: a Ctrl-C as it forks is raised in the parent once the fork
    has returned, the child killed (Python drops what a fork hook raises: the
    benchmark ran on), and the child ignores Ctrl-C, which is its parent's to
    handle.

    Example:
        >>> pid = fork_child()
        >>> if pid == 0:
        ...     os._exit(0)
        >>> os.waitpid(pid, 0)[1]
        0
    """
    from macroflow.core.threads import fork
    return fork(interrupted=_kill_and_reap)


def _kill_and_reap(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)


@contextlib.contextmanager
def _forked(child_fn):
    """Fork a child running ``child_fn(sock)``; yield ``(sock, fork_ns)``.

    The child is always reaped: waited for on success, killed on any failure.
    A non-zero child exit becomes a RuntimeError in the parent.
    """
    psock, csock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    ppid = os.getpid()
    fork_ns = time.perf_counter_ns()
    pid = fork_child()
    if pid == 0:
        code = 1
        try:
            psock.close()
            _die_with_parent(ppid)
            child_fn(csock)
            code = 0
        except KeyboardInterrupt:
            code = 130  # (Ctrl-C at the terminal: the parent says so, once)
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stderr.flush()
            os._exit(code)
    csock.close()
    try:
        yield psock, fork_ns
    except BaseException as exc:
        psock.close()
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        if isinstance(exc, KeyboardInterrupt):
            raise
        # EOF from a dead child is only a symptom; surface the child's failure.
        if os.WIFEXITED(status) and os.WEXITSTATUS(status) != 0:
            raise RuntimeError(f"baseline child exited with {os.WEXITSTATUS(status)}") from exc
        raise
    psock.close()  # EOF lets a child still blocked in recv finish
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"baseline child exited with status {os.waitstatus_to_exitcode(status)}")


class _Conn:
    """Length-prefixed pickle frames over a stream socket with a chosen wait strategy.

    Reads land in one reusable buffer, so a small frame usually costs one
    recv syscall; bytes past the current frame are kept for the next call.
    """

    def __init__(self, sock, mode, spin_us=20):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.sock, self.mode, self.spin_ns = sock, mode, spin_us * 1000
        sock.setblocking(mode == "blocking")
        self.poller = select.poll()
        self.poller.register(sock, select.POLLIN)
        self.buf = bytearray(1 << 16)
        self.lo = self.hi = 0

    def send(self, obj):
        data = pickle.dumps(obj, protocol=5)
        view = memoryview(_LEN.pack(len(data)) + data)
        while view:
            try:
                view = view[self.sock.send(view):]
            except BlockingIOError:  # only with large payloads on non-blocking sockets
                select.select([], [self.sock], [])

    def recv(self):
        while True:
            avail, need = self.hi - self.lo, _LEN.size
            if avail >= need:
                need += _LEN.unpack_from(self.buf, self.lo)[0]
                if avail >= need:
                    start, self.lo = self.lo + _LEN.size, self.lo + need
                    return pickle.loads(memoryview(self.buf)[start:self.lo])
            self._fill(need)

    def _fill(self, need):
        # Move the partial frame to the front so it can complete in place.
        if self.lo:
            self.buf[: self.hi - self.lo] = self.buf[self.lo:self.hi]
            self.hi -= self.lo
            self.lo = 0
        if need > len(self.buf):
            self.buf.extend(bytes(need - len(self.buf)))
        view = memoryview(self.buf)[self.hi:]
        spin_until = None
        while True:
            try:
                n = self.sock.recv_into(view)
            except BlockingIOError:
                if self.mode == "pollsleep":
                    now = time.perf_counter_ns()
                    if spin_until is None:
                        spin_until = now + self.spin_ns
                    elif now >= spin_until:
                        self.poller.poll()  # POLLHUP also wakes us if the peer dies
                        spin_until = None
                continue
            if n == 0:
                raise EOFError("peer closed the connection")
            self.hi += n
            return


def _stats(samples_ns):
    us = np.asarray(samples_ns, dtype=np.float64) / 1e3
    return {"median_us": float(np.median(us)), "mean_us": float(us.mean()),
            "p10_us": float(np.percentile(us, 10)), "p90_us": float(np.percentile(us, 90))}


def pingpong(mode, iters=2000, warmup=200, payload=None, spin_us=20):
    """Round-trip time of a pickled RPC call/reply between two forked processes.

    Pickling, framing and unpickling on both sides are inside the timed
    region, as they would be for any real RPC.  ``payload``, if given, is
    sent as the call's single argument instead of ``1``.

    >>> r = pingpong("blocking", iters=200)
    >>> r["mode"], r["iters"], r["median_us"] > 0
    ('blocking', 200, True)
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    total = warmup + iters
    call = CALL if payload is None else CALL[:3] + ((payload,), {})

    def child(sock):
        conn = _Conn(sock, mode, spin_us)
        for _ in range(total):
            msg = conn.recv()
            conn.send(("result", msg[1], 1))

    with _forked(child) as (sock, _):
        conn = _Conn(sock, mode, spin_us)
        samples = round_trips(conn.send, conn.recv, call, total, warmup)
    return {**_stats(samples), "iters": iters, "mode": mode}


def round_trips(send, recv, call, total, warmup):
    """Time ``total`` call/reply round trips (ns) with ``send(call)`` and
    ``recv()``; the first ``warmup`` are dropped, and a reply other than
    :data:`REPLY` is an error.

    >>> box = []
    >>> samples = round_trips(box.append, lambda: REPLY, CALL, 5, 2)
    >>> len(samples), len(box), min(samples) >= 0
    (3, 5, True)
    """
    samples = []
    for i in range(total):
        t0 = time.perf_counter_ns()
        send(call)
        reply = recv()
        t1 = time.perf_counter_ns()
        if reply != REPLY:
            raise RuntimeError(f"unexpected reply {reply!r}")
        if i >= warmup:
            samples.append(t1 - t0)
    return samples


_BOX = 1 << 16  # bytes of one mailbox: a sequence counter, a length, the frame


class _Mailbox:
    """One direction of a shared-memory mailbox: the writer puts a pickled
    frame and then bumps a sequence counter; the reader spins on the counter.

    The counter and the length are aligned 8-byte words written through
    numpy, one store each; on x86 (total store order) the frame's bytes are
    visible before the counter that announces them.
    """

    def __init__(self, mm, offset, sock):
        self.sock = sock  # the other end closes it when it ends: then stop spinning
        self.words = np.frombuffer(mm, dtype=np.int64, count=2, offset=offset)
        self.data = memoryview(mm)[offset + 16:offset + _BOX]
        self.seen = 0

    def put(self, obj):
        frame = pickle.dumps(obj, protocol=5)
        if len(frame) > len(self.data):
            raise ValueError(f"a frame of {len(frame)} bytes does not fit a {_BOX}-byte mailbox")
        self.data[:len(frame)] = frame
        self.words[1] = len(frame)
        self.words[0] += 1

    def take(self):
        words, seen = self.words, self.seen + 1
        spins = 0
        while words[0] != seen:
            spins += 1
            if spins & 0xFFFF == 0 and select.select([self.sock], [], [], 0)[0]:
                raise EOFError("the other end of the mailbox ended")
        self.seen = seen
        return pickle.loads(self.data[:int(words[1])])


def mailbox(iters=2000, warmup=200):
    """Round-trip time of the same pickled call and reply as :func:`pingpong`,
    through a mailbox in shared memory that both ends spin on (no system call).

    >>> r = mailbox(iters=200)
    >>> r["iters"], r["median_us"] > 0
    (200, True)
    """
    import mmap
    total = warmup + iters
    mm = mmap.mmap(-1, 2 * _BOX)  # MAP_SHARED: the forked child sees the same pages

    def child(sock):
        inbox, outbox = _Mailbox(mm, 0, sock), _Mailbox(mm, _BOX, sock)
        sock.sendall(b"r")  # ready: the parent may start its clock
        for _ in range(total):
            msg = inbox.take()
            outbox.put(("result", msg[1], 1))

    with _forked(child) as (sock, _):
        outbox, inbox = _Mailbox(mm, 0, sock), _Mailbox(mm, _BOX, sock)
        _recv_into_exact(sock, bytearray(1))
        samples = round_trips(outbox.put, inbox.take, CALL, total, warmup)
    return {**_stats(samples), "iters": iters, "mode": "mailbox"}


def _recv_into_exact(sock, buf):
    view, got = memoryview(buf), 0
    while got < len(view):
        n = sock.recv_into(view[got:], len(view) - got, socket.MSG_WAITALL)
        if n == 0:
            raise EOFError("peer closed the connection")
        got += n
    return buf


def _send_oob(sock, obj):
    raws = []
    inband = pickle.dumps(obj, protocol=5, buffer_callback=lambda b: raws.append(b.raw()))
    header = _OOB_HDR.pack(len(inband), len(raws)) + struct.pack(
        f"<{len(raws)}Q", *(r.nbytes for r in raws))
    parts = [memoryview(header), memoryview(inband), *raws]
    while parts:  # sendmsg may stop short; resume mid-part without copying
        sent = sock.sendmsg(parts)
        while parts and sent >= parts[0].nbytes:
            sent -= parts.pop(0).nbytes
        if sent:
            parts[0] = parts[0][sent:]


def _recv_oob(sock, pool):
    # Buffers come from ``pool`` and are reused: the result is valid only
    # until the next receive, which is the best case a runtime could hope for.
    inlen, nbufs = _OOB_HDR.unpack(_recv_into_exact(sock, bytearray(_OOB_HDR.size)))
    lens = struct.unpack(f"<{nbufs}Q", _recv_into_exact(sock, bytearray(8 * nbufs)))
    inband = _recv_into_exact(sock, bytearray(inlen))
    bufs = []
    for key in enumerate(lens):
        if key not in pool:
            pool[key] = bytearray(key[1])
        bufs.append(_recv_into_exact(sock, pool[key]))
    return pickle.loads(inband, buffers=bufs)


def _big_buffers(sock):
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, _SOCKBUF)
        except OSError:
            pass


def _check_same(got, expected, who):
    if not (got.dtype == expected.dtype and got.shape == expected.shape
            and got[0] == expected[0] and got[-1] == expected[-1]
            and np.array_equal(got, expected)):
        raise RuntimeError(f"bandwidth: {who} received corrupted data")


def bandwidth(nbytes=16 * 2**20, iters=20, warmup=3, _corrupt_for_test=False):
    """Send a uint8 array to a forked child and back, pickle-5 out-of-band, zero-copy.

    ``mb_per_s`` counts both directions: ``2 * nbytes / round_trip``.  The
    first (warm-up) round trip is checked byte for byte on both sides.

    >>> r = bandwidth(2**20, iters=5)
    >>> r["nbytes"], r["verified"], r["mb_per_s"] > 0
    (1048576.0, 1.0, True)
    """
    warmup = max(1, warmup)  # the integrity check lives in the first round trip
    total = warmup + iters
    expected = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    arr = expected.copy()

    def child(sock):
        _big_buffers(sock)
        pool = {}
        for i in range(total):
            got = _recv_oob(sock, pool)
            if i == 0:
                _check_same(got, expected, "child")  # ``expected`` is the pre-fork copy
            _send_oob(sock, got)

    samples = []
    with _forked(child) as (sock, _):
        _big_buffers(sock)
        sndbuf = sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
        if _corrupt_for_test:
            arr[nbytes // 2] ^= 0xFF  # diverges from the child's copy of ``expected``
        pool = {}
        for i in range(total):
            t0 = time.perf_counter_ns()
            _send_oob(sock, arr)
            back = _recv_oob(sock, pool)
            t1 = time.perf_counter_ns()
            if i == 0:
                _check_same(back, arr, "parent")
            if i >= warmup:
                samples.append(t1 - t0)
    med = float(np.median(samples)) / 1e3
    return {"median_us": med, "mb_per_s": 2 * nbytes / med, "nbytes": float(nbytes),
            "iters": float(iters), "verified": 1.0, "sndbuf": float(sndbuf)}


def fork_roundtrip_startup(runs=5):
    """Time from ``os.fork()`` until the new child has answered one pickled ping.

    This is the startup cost of a raw forked worker (it grows with the
    parent's memory size, since fork copies page tables).

    >>> r = fork_roundtrip_startup()
    >>> r["runs"], r["median_us"] > 0
    (5.0, True)
    """
    def child(sock):
        conn = _Conn(sock, "blocking")
        conn.send(("result", conn.recv()[1], 1))

    samples = []
    for _ in range(runs):
        with _forked(child) as (sock, fork_ns):
            conn = _Conn(sock, "blocking")
            conn.send(CALL)
            conn.recv()
            samples.append(time.perf_counter_ns() - fork_ns)
    us = np.asarray(samples, dtype=np.float64) / 1e3
    return {"median_us": float(np.median(us)), "min_us": float(us.min()),
            "max_us": float(us.max()), "runs": float(runs)}


def main(json_path=None, quick=False):
    """Print every baseline as a small table: ``python -m macroflow.bench.baselines``;
    with ``json_path``, also write every figure there (``macroflow bench
    baselines --json FILE``); ``quick``: a tenth of the round trips and a
    1 MiB bandwidth array (a smoke run).

    Example:
        >>> main(quick=True)  # doctest: +ELLIPSIS
        baseline ...
        pingpong blocking ...
    """
    n = 200 if quick else 2000
    res = {"pingpong": {}, "quick": quick}
    print(f"{'baseline':<26}{'median_us':>11}{'p10_us':>10}{'p90_us':>10}  extra")
    for mode in MODES:
        r = res["pingpong"][mode] = pingpong(mode, iters=n, warmup=n // 10)
        print(f"{'pingpong ' + mode:<26}{r['median_us']:>11.1f}"
              f"{r['p10_us']:>10.1f}{r['p90_us']:>10.1f}  mean {r['mean_us']:.1f}")
    r = res["mailbox"] = mailbox(iters=n, warmup=n // 10)
    print(f"{'mailbox (shared memory)':<26}{r['median_us']:>11.1f}"
          f"{r['p10_us']:>10.1f}{r['p90_us']:>10.1f}  mean {r['mean_us']:.1f}")
    r = res["bandwidth"] = bandwidth(nbytes=2**20) if quick else bandwidth()
    print(f"{'bandwidth %d MiB' % (r['nbytes'] // 2**20):<26}{r['median_us']:>11.1f}"
          f"{'':>20}  {r['mb_per_s']:.0f} MB/s (sndbuf {r['sndbuf']:.0f})")
    r = res["fork_startup"] = fork_roundtrip_startup()
    print(f"{'fork to first reply':<26}{r['median_us']:>11.1f}"
          f"{r['min_us']:>10.1f}{r['max_us']:>10.1f}  (min/max of {r['runs']:.0f})")
    if json_path:
        import json
        with open(json_path, "w") as f:
            json.dump(res, f, indent=1, sort_keys=True)
        print(f"\nwrote {json_path}")


if __name__ == "__main__":
    main(quick="--quick" in sys.argv[1:])
