"""The ``local`` protocol module: contexts are processes on this host.

Every pair of contexts shares one AF_UNIX stream socket (a full mesh of
socketpairs made before the processes fork), so a frame costs one ``sendmsg``
on the sender and one or two ``recv_into`` on the receiver.

Wire format of a frame: ``<II`` (number of buffers, sender's load), one ``<Q``
length per buffer, then the buffers back to back. Large buffers are received
straight into their own ``bytearray`` (no copy through the read buffer), so a
numpy array comes out of the pickle on top of the bytes the kernel wrote.

Waiting: a context that just did something polls for ``spin_us`` before it
sleeps in epoll, because waking a sleeping process on the other core costs
~30 us here, more than all the Python work of a call (see docs/benchmarks.md).
"""

from __future__ import annotations

import errno
import os
import select
import socket
import struct
import sys
import time
from collections import deque
from typing import Dict, List, Optional, Sequence

import numpy as _np

from .base import Transport

_HDR = struct.Struct("<II")
_HDR1 = struct.Struct("<IIQ")  # the common frame: one buffer
_RBUF = 256 * 1024
_BIG = _RBUF // 2  # buffers larger than this are received in place
_SOCKBUF = 4 * 1024 * 1024
_IOV_MAX = 512
_SMALL = 64 * 1024  # frames up to this size are joined and sent with one send()
_POOL_MIN = 1 << 20  # buffers from this size on are pooled
_STALL = 2.0  # seconds a peer may pause in the middle of a large buffer
_PREEMPTED = 1e-3  # a gap this long between two polls: someone else had our core
_CALM = 0.01  # then sleep instead of spinning for this long


def tune(sock: socket.socket) -> None:
    """Make a socket non-blocking with large kernel buffers (best effort)."""
    sock.setblocking(False)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, _SOCKBUF)
        except OSError:
            pass


class BufferPool:
    """Large receive buffers, reused once nothing refers to them any more.

    Fresh memory costs the kernel a page fault and a zeroing per page (about
    1 ms per 16 MB here); a buffer whose arrays the user has dropped costs
    nothing. A buffer is free when the pool holds the only reference to it.

    Example:
        >>> pool = BufferPool(limit=64 << 20)
        >>> a = pool.get(3 << 20); a.nbytes
        3145728
        >>> del a
        >>> pool.get(3 << 20).base is pool.bufs[0]
        True
    """

    def __init__(self, limit: int = 256 << 20):
        self.limit = limit
        self.bufs: List[_np.ndarray] = []
        self.held = 0
        self.reused = 0

    def get(self, n: int) -> "_np.ndarray":
        if n >= _POOL_MIN:
            for b in self.bufs:
                # references: the list, the loop variable, getrefcount's argument
                if n <= b.nbytes <= 2 * n and sys.getrefcount(b) <= 3:
                    self.reused += 1
                    return b[:n]
            size = -(-n // _POOL_MIN) * _POOL_MIN
            if self.held + size <= self.limit:
                b = _np.empty(size, dtype=_np.uint8)
                self.bufs.append(b)
                self.held += size
                return b[:n]
        # numpy does not zero what it allocates, and asks for huge pages
        return _np.empty(n, dtype=_np.uint8)


def _small_frame(parts: Sequence[object], load: int) -> Optional[bytes]:
    """The whole frame as one bytes object, if it is small enough to copy."""
    if len(parts) == 1:
        d = parts[0]
        if len(d) > _SMALL:  # type: ignore[arg-type]
            return None
        return _HDR1.pack(1, load, len(d)) + d  # type: ignore[arg-type, operator]
    views = [_view(p) for p in parts]
    lens = [v.nbytes for v in views]
    if sum(lens) > _SMALL:
        return None
    return b"".join([_HDR.pack(len(views), load), struct.pack(f"<{len(views)}Q", *lens), *views])


def _view(p: object) -> memoryview:
    if isinstance(p, __import__("pickle").PickleBuffer):
        return p.raw()
    m = memoryview(p)  # type: ignore[arg-type]
    return m if m.format == "B" and m.ndim == 1 else m.cast("B")


class _Conn:
    __slots__ = ("peer", "sock", "fd", "rbuf", "rmv", "rs", "re", "state", "nbufs",
                 "load", "lens", "idx", "bufs", "big", "bigmv", "bigpos", "outq", "closed", "wbuf")

    def __init__(self, peer: int, sock: socket.socket):
        self.peer = peer
        self.sock = sock
        self.fd = sock.fileno()
        self.rbuf = bytearray(_RBUF)
        self.rmv = memoryview(self.rbuf)
        self.rs = self.re = 0
        self.state = 0
        self.nbufs = self.load = self.idx = 0
        self.lens: Sequence[int] = ()
        self.bufs: List[object] = []
        self.big: Optional[_np.ndarray] = None
        self.bigmv: Optional[memoryview] = None
        self.bigpos = 0
        self.outq: deque = deque()
        self.closed = False
        self.wbuf = bytearray()  # small frames queued for one write at flush()


class LocalTransport(Transport):
    """Frames over a mesh of AF_UNIX socketpairs between forked processes.

    Example (two ends in one process, for illustration):
        >>> import socket
        >>> a, b = socket.socketpair()
        >>> ta, tb = LocalTransport(0, {1: a}), LocalTransport(1, {0: b})
        >>> got = []
        >>> tb.attach(lambda src, bufs, load: got.append((src, bytes(bufs[0]))), None)
        >>> ta.send(1, [b"hello"], 0) > 5
        True
        >>> tb.poll(1.0); got
        True
        [(0, b'hello')]
        >>> ta.close(); tb.close()
    """

    name = "local"

    def __init__(self, ctx: int, socks: Dict[int, socket.socket], spin_us: float = 0.0):
        super().__init__()
        self.ctx = ctx
        self.spin_s = spin_us / 1e6
        self.conns: Dict[int, _Conn] = {}
        self.byfd: Dict[int, _Conn] = {}
        self.pending: List[_Conn] = []  # connections with queued frames
        self.pool = BufferPool()
        self.calm_until = 0.0  # no spinning before this time (we were preempted)
        self.spins_preempted = 0
        self.ep = select.epoll()
        for peer, s in socks.items():
            tune(s)
            c = _Conn(peer, s)
            self.conns[peer] = c
            self.byfd[c.fd] = c
            self.ep.register(c.fd, select.EPOLLIN)

    def address(self):
        return ("local", f"{os.uname().nodename}:{os.getpid()}")

    # -- sending ---------------------------------------------------------
    def queue(self, dest: int, parts: Sequence[object], load: int) -> int:
        c = self.conns.get(dest)
        if c is None or c.closed:
            raise ConnectionError(f"no connection to context {dest}")
        frame = _small_frame(parts, load)
        if frame is None:
            return self.send(dest, parts, load)
        if not c.wbuf:
            self.pending.append(c)
        c.wbuf += frame
        return len(frame)

    def flush(self) -> None:
        pending, self.pending = self.pending, []
        for c in pending:
            self._flush_conn(c)

    def _flush_conn(self, c: _Conn) -> None:
        if not c.wbuf or c.closed:
            return
        data, c.wbuf = c.wbuf, bytearray()
        self._send_whole(c, data)

    def _send_whole(self, c: _Conn, data) -> bool:
        """Send one buffer, finishing it in _drain if the kernel takes part of it;
        False if the connection failed (it is closed and reported)."""
        try:
            n = c.sock.send(data)
        except BlockingIOError:
            n = 0
        except OSError as e:
            self._close(c, f"send failed: {e}")
            return False
        if n < len(data):
            c.outq.append(memoryview(data)[n:])
            self._drain(c)
        return True

    def send(self, dest: int, parts: Sequence[object], load: int) -> int:
        c = self.conns.get(dest)
        if c is None or c.closed:
            raise ConnectionError(f"no connection to context {dest}")
        if c.wbuf:
            self._flush_conn(c)  # keep the order of queued frames
        if not c.outq:
            # fast path: a small frame goes out as one bytes object in one send
            frame = _small_frame(parts, load)
            if frame is not None:
                if not self._send_whole(c, frame):
                    raise ConnectionError(f"context {dest}: send failed")
                return len(frame)
        views = [_view(p) for p in parts]
        head = _HDR.pack(len(views), load) + struct.pack(f"<{len(views)}Q", *[v.nbytes for v in views])
        total = len(head) + sum(v.nbytes for v in views)
        if c.outq:
            c.outq.append(memoryview(head))
            c.outq.extend(views)
            self._drain(c)
            return total
        vec = [head, *views]
        try:
            n = c.sock.sendmsg(vec) if len(vec) <= _IOV_MAX else 0
        except BlockingIOError:
            n = 0
        except OSError as e:
            self._close(c, f"send failed: {e}")
            raise ConnectionError(f"context {dest}: {e}") from None
        if n < total:
            for v in vec:
                v = memoryview(v) if not isinstance(v, memoryview) else v
                if n >= v.nbytes:
                    n -= v.nbytes
                    continue
                c.outq.append(v[n:])
                n = 0
            self._drain(c)
        return total

    def _drain(self, c: _Conn) -> None:
        # The frame did not fit in the kernel buffer. Finish it now, reading
        # everything that arrives meanwhile, so that two contexts sending large
        # frames to each other cannot deadlock.
        self.ep.modify(c.fd, select.EPOLLIN | select.EPOLLOUT)
        try:
            while c.outq and not c.closed:
                for fd, ev in self.ep.poll(1.0):
                    d = self.byfd.get(fd)
                    if d is None:
                        continue
                    if ev & (select.EPOLLIN | select.EPOLLHUP | select.EPOLLERR):
                        self._read(d)
                    if d is c and ev & select.EPOLLOUT:
                        self._write(c)
        finally:
            if not c.closed:
                self.ep.modify(c.fd, select.EPOLLIN)

    def _write(self, c: _Conn) -> None:
        while c.outq:
            batch = list(c.outq)[:_IOV_MAX]
            try:
                n = c.sock.sendmsg(batch)
            except BlockingIOError:
                return
            except OSError as e:
                self._close(c, f"send failed: {e}")
                return
            while n and c.outq:
                v = c.outq[0]
                if n >= v.nbytes:
                    n -= v.nbytes
                    c.outq.popleft()
                else:
                    c.outq[0] = v[n:]
                    n = 0

    # -- receiving -------------------------------------------------------
    def poll(self, timeout: Optional[float]) -> bool:
        events = self.ep.poll(0)
        if not events and timeout != 0:
            if self.spin_s > 0.0:
                events = self._spin()
            if not events:
                try:
                    events = self.ep.poll(-1 if timeout is None else timeout)
                except InterruptedError:
                    events = []
        got = False
        for fd, _ev in events:
            c = self.byfd.get(fd)
            if c is not None:
                got = self._read(c) or got
        return got

    def _spin(self) -> list:
        # Poll for spin_s before sleeping: waking a sleeping process costs more
        # than a call. But spinning is only a win while this context has a core
        # to itself: a gap between two polls means we were preempted (more
        # runnable processes than cores), and then we stop spinning for a while.
        now = time.perf_counter()
        if now < self.calm_until:
            return []
        deadline = now + self.spin_s
        poll = self.ep.poll
        clock = time.perf_counter
        yield_ = os.sched_yield
        events: list = []
        last = now
        while not events:
            yield_()  # lets a process waiting for this core run first
            events = poll(0)
            t = clock()
            if t - last > _PREEMPTED:
                self.calm_until = t + _CALM
                self.spins_preempted += 1
                break
            if t > deadline:
                break
            last = t
        return events

    def _read(self, c: _Conn) -> bool:
        got = False
        sock = c.sock
        while True:
            try:
                if c.big is not None:
                    n = self._recv_rest(c)
                    if n:
                        if c.bigpos == c.big.nbytes:
                            c.bufs.append(c.big)
                            c.big = c.bigmv = None
                            c.idx += 1
                            got = self._parse(c) or got
                        continue
                else:
                    if c.re == _RBUF:
                        self._compact(c)
                    want = _RBUF - c.re
                    n = sock.recv_into(c.rmv[c.re:])
                    if n:
                        c.re += n
                        got = self._parse(c) or got
                        if n < want:
                            return got
                        continue
            except BlockingIOError:
                return got
            except InterruptedError:
                continue
            except OSError as e:
                if e.errno in (errno.ECONNRESET, errno.EPIPE):
                    n = 0
                else:
                    raise
            # n == 0: the peer closed its end
            self._close(c, "connection closed")
            return got

    def _recv_rest(self, c: _Conn) -> int:
        """Receive into the large buffer in progress; returns the bytes received
        (0: the peer closed), or raises BlockingIOError when none came."""
        # The rest of a large buffer is on its way: its sender does not return
        # from send() before the whole frame is written, whatever else happens,
        # so waiting for it in the kernel is safe and streams the bytes with far
        # fewer wake-ups than polling. A peer that stalls for _STALL seconds
        # sends us back to polling.
        sock = c.sock
        big, mv = c.big, c.bigmv
        sock.settimeout(_STALL)
        got = 0
        try:
            while c.bigpos < big.nbytes:  # type: ignore[union-attr]
                n = sock.recv_into(mv[c.bigpos:])  # type: ignore[index]
                if n == 0:
                    return got  # the peer closed: 0 if nothing came before
                c.bigpos += n
                got += n
        except socket.timeout:
            if got == 0:
                raise BlockingIOError from None
        finally:
            sock.setblocking(False)
        return got

    def _compact(self, c: _Conn) -> None:
        live = c.re - c.rs
        if c.rs:
            c.rbuf[:live] = c.rbuf[c.rs:c.re]
        c.rs, c.re = 0, live

    def _parse(self, c: _Conn) -> bool:
        got = False
        rbuf = c.rbuf
        deliver = self.deliver
        while True:
            avail = c.re - c.rs
            if c.state == 0 and avail >= 16:
                nb, load, n0 = _HDR1.unpack_from(rbuf, c.rs)
                if nb == 1:
                    if avail >= 16 + n0:  # fast path: a whole one-buffer frame
                        rs = c.rs + 16
                        c.rs = rs + n0
                        deliver(c.peer, [rbuf[rs:rs + n0]], load)  # type: ignore[misc]
                        got = True
                        continue
                elif nb <= 8 and avail >= 8 + 8 * nb:
                    lens = struct.unpack_from(f"<{nb}Q", rbuf, c.rs + 8)
                    pos = c.rs + 8 + 8 * nb
                    if avail >= pos - c.rs + sum(lens):  # fast path: a whole small frame
                        bufs = []
                        for n in lens:
                            bufs.append(rbuf[pos:pos + n])
                            pos += n
                        c.rs = pos
                        deliver(c.peer, bufs, load)  # type: ignore[misc]
                        got = True
                        continue
            if c.state == 0:
                if avail < 8:
                    break
                c.nbufs, c.load = _HDR.unpack_from(rbuf, c.rs)
                c.rs += 8
                c.state = 1
            elif c.state == 1:
                need = 8 * c.nbufs
                if avail < need:
                    break
                c.lens = struct.unpack_from(f"<{c.nbufs}Q", rbuf, c.rs)
                c.rs += need
                c.idx = 0
                c.bufs = []
                c.state = 2
            else:
                if c.idx == c.nbufs:
                    bufs, c.bufs = c.bufs, []
                    c.state = 0
                    self.deliver(c.peer, bufs, c.load)  # type: ignore[misc]
                    got = True
                    continue
                n = c.lens[c.idx]
                if n <= avail:
                    piece = c.rmv[c.rs:c.rs + n]
                    c.bufs.append(bytes(piece) if c.idx == 0 else bytearray(piece))
                    c.rs += n
                    c.idx += 1
                elif n > _BIG:
                    # the array the user gets is built on this very buffer
                    big = self.pool.get(n)
                    big[:avail] = c.rmv[c.rs:c.re]
                    c.rs = c.re = 0
                    c.big, c.bigmv, c.bigpos = big, memoryview(big), avail
                    break
                else:
                    break
        if c.rs == c.re:
            c.rs = c.re = 0
        elif _RBUF - c.re < _BIG:
            self._compact(c)
        return got

    def _close(self, c: _Conn, how: str) -> None:
        if c.closed:
            return
        c.closed = True
        c.outq.clear()
        try:
            self.ep.unregister(c.fd)
        except (OSError, ValueError):
            pass
        self.byfd.pop(c.fd, None)
        try:
            c.sock.close()
        except OSError:
            pass
        if self.lost is not None:
            self.lost(c.peer, how)

    def close(self) -> None:
        try:
            self.flush()
        except Exception:
            pass
        for c in list(self.conns.values()):
            c.closed = True
            try:
                c.sock.close()
            except OSError:
                pass
        self.byfd.clear()
        try:
            self.ep.close()
        except OSError:
            pass
