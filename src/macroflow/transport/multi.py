"""Several protocols in one program (Nexus): one transport made of protocol modules.

A context that can be reached in more than one way (by the ``local`` path from
contexts of its own host, by ``tcp`` from workers that joined from other hosts,
by ``mpi`` from ranks of its MPI job) holds one module per protocol, in order
of preference, behind this one :class:`~macroflow.transport.base.Transport`.

Every context has a descriptor list, ``((protocol, address), ...)``, as a
global pointer carries it. To send to a context, the first module (in
preference order) whose protocol is on the receiver's list and that can reach
the address there (``module.reaches(address)``: the local path only reaches
its own host and computation) carries every frame to it from then on, so
frames keep their order per pair. Frames are counted per protocol, so a
program can see which path its messages took (``mf.stats()``).

Descriptors are learnt with :meth:`MultiTransport.learn`, or from another
context's :meth:`MultiTransport.announce` (context 0 tells every context about
one that joins), which the receiving transport applies as soon as it reads it,
before the engine sees anything after it. A frame for a context not known yet
waits, the transport making progress meanwhile, until its descriptor arrives;
after ``ROUTE_WAIT`` seconds the context is reported lost.
"""

from __future__ import annotations

import os
import pickle
import select
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from .base import Transport

#: seconds a frame for a context with no known descriptor waits for one
ROUTE_WAIT = 10.0
# first byte of the transport's own frames (engine frames start with a pickle's
# 0x80 or a struct's "V"/"W")
_CONTROL = b"\x00"
_CONTROL_BYTE = _CONTROL[0]
#: ids from here up are guests: a worker asking to join, before it has context ids
GUEST_BASE = 1 << 31
_PREEMPTED = 0.001


class MultiTransport(Transport):
    """Protocol modules of one context, used by the best one each peer shares.

    ``modules`` in order of preference; ``directory`` maps context ids to their
    descriptor lists (more are learnt while running).

    Example:
        >>> import socket
        >>> from macroflow.transport.local import LocalTransport
        >>> a, b = socket.socketpair()
        >>> ta = MultiTransport(0, [LocalTransport(0, {1: a})], {1: (("local", "x"),)})
        >>> tb = LocalTransport(1, {0: b})
        >>> got = []
        >>> ta.attach(None, None); tb.attach(lambda s, bufs, l: got.append(bytes(bufs[0])), None)
        >>> ta.send(1, [b"hi"], 0) > 0, tb.poll(1.0), got
        (True, True, [b'hi'])
        >>> ta.counters()["local"]["messages_sent"]
        1
        >>> ta.close(); tb.close()
    """

    name = "multi"

    def __init__(self, ctx: int, modules: Sequence[Transport],
                 directory: Optional[Dict[int, Tuple[Tuple[str, str], ...]]] = None,
                 spin_us: float = 0.0) -> None:
        super().__init__()
        if not modules:
            raise ValueError("MultiTransport needs at least one protocol module")
        names = [m.name for m in modules]
        if len(set(names)) != len(names):
            raise ValueError(f"one module per protocol; got {names}")
        self.ctx = ctx
        self.modules: List[Transport] = list(modules)
        self.byname = {m.name: m for m in modules}
        self.directory: Dict[int, Tuple[Tuple[str, str], ...]] = dict(directory or {})
        self.route: Dict[int, Transport] = {}
        self.control: Dict[str, Callable[[int, object], None]] = {}  # kind -> handler
        self.news = False  # a peer was lost during this poll
        self.delivered = False  # a frame was delivered during this poll
        self.spin_s = spin_us / 1e6
        self.counts: Dict[str, Dict[str, int]] = {
            m.name: {"messages_sent": 0, "bytes_sent": 0,
                     "messages_received": 0, "bytes_received": 0} for m in modules}
        self.ep = select.epoll()
        self.byfd: Dict[int, Transport] = {}
        self.blind: List[Transport] = []  # modules with no descriptor to sleep on
        # the only module, when there is one: poll leaves the waiting to it
        self.single: Optional[Transport] = modules[0] if len(modules) == 1 else None
        # modules with deadlines that no descriptor announces (tcp's handshakes)
        self.timed = [m for m in modules
                      if getattr(type(m), "next_due", Transport.next_due) is not Transport.next_due]
        for m in modules:
            fd = m.fileno()
            if fd is None:
                self.blind.append(m)
            else:
                self.byfd[fd] = m
                self.ep.register(fd, select.EPOLLIN)

    def settle(self, timeout: float) -> None:
        """Each module's ``settle`` (see :meth:`TcpTransport.settle`)."""
        deadline = time.monotonic() + timeout
        for m in self.modules:
            m.settle(max(0.0, deadline - time.monotonic()))

    # -- wiring ------------------------------------------------------------
    def attach(self, deliver, lost, landing=None) -> None:
        super().attach(deliver, lost, landing)
        for m in self.modules:
            m.attach(self._delivered_by(m), self._lost_by(m), landing)

    def _delivered_by(self, m: Transport):
        counts = self.counts[m.name]

        def deliver(src: int, bufs: List[object], load: int) -> None:
            b0 = memoryview(bufs[0])
            if b0.nbytes and b0[0] == _CONTROL_BYTE:  # the transport's own: never the engine's
                kind, payload = pickle.loads(b0[1:])
                if kind == "learn":
                    self.learn(*payload)
                else:
                    handler = self.control.get(kind)
                    if handler is not None:
                        handler(src, payload)
                return
            if src >= GUEST_BASE:
                return  # a guest (a worker asking to join) is not a context: nothing for the engine
            # (the engine's messages alone, as its totals count them, so that
            # the protocols' counts add up to those)
            counts["messages_received"] += 1
            # with the frame's header, as the engine counts it and as the
            # sender's module counted it (its send's return)
            if len(bufs) == 1:  # the commonest frame: no generator to sum over
                counts["bytes_received"] += 16 + b0.nbytes
            else:
                counts["bytes_received"] += 8 + 8 * len(bufs) + sum(memoryview(b).nbytes
                                                                     for b in bufs)
            if self.deliver is not None:
                # even if the module's poll says it got nothing (a frame read
                # while it admitted a connection): poll must not sleep on it
                self.delivered = True
                self.deliver(src, bufs, load)
        return deliver

    def _lost_by(self, m: Transport):
        def lost(peer: int, how: str) -> None:
            # a module that carries nothing to this peer losing it says nothing
            # about the peer (a tcp worker may also have been reachable locally)
            self.news = True  # poll goes back to the engine with it
            if peer < GUEST_BASE and self.route.get(peer, m) is m and self.lost is not None:
                self.lost(peer, f"{how} ({m.name})" if len(self.modules) > 1 else how)
        return lost

    def learn(self, ctx: int, protocols: Sequence[Tuple[str, str]]) -> None:
        """Context ``ctx`` can be reached by ``protocols`` ((name, address) pairs)."""
        self.directory[ctx] = tuple((str(p), str(a)) for p, a in protocols)
        for p, addr in self.directory[ctx]:
            m = self.byname.get(p)
            learn = getattr(m, "learn", None) or getattr(m, "add_peer", None)
            # news of a context this module has already lost comes late (it
            # was sent before the end was seen): there is nothing to reach
            if learn is not None and ctx not in getattr(m, "gone", ()):
                learn(ctx, addr)

    def announce(self, dest: int, ctx: int, protocols: Sequence[Tuple[str, str]]) -> None:
        """Tell context ``dest`` how to reach context ``ctx``; it learns it as soon
        as the frame arrives, even in the middle of a send of its own."""
        self.send_control(dest, "learn", (ctx, tuple(protocols)))

    def send_control(self, dest: int, kind: str, payload: object) -> None:
        """Send a frame of the transports' own to ``dest``, for the handler
        registered there in ``control[kind]`` (called with (src, payload)
        as soon as the frame is read)."""
        # (not counted: a protocol's counts are of the engine's messages)
        m = self.route.get(dest) or self._module_for(dest)
        m.send(dest, [_CONTROL + pickle.dumps((kind, payload))], 0)

    def adopt(self, peer: int, sock: object) -> None:
        """A socket connected to context ``peer`` (one added while running), for
        the local path; without one, the peer connects by its other protocols."""
        local = self.byname.get("local")
        if local is not None:
            local.adopt(peer, sock)  # type: ignore[attr-defined]
        else:
            sock.close()  # type: ignore[attr-defined]

    def choose(self, dest: int) -> Optional[Transport]:
        """The module frames to ``dest`` go by, or None if no shared protocol is known."""
        m = self.route.get(dest)
        if m is not None:
            return m
        offered = dict(self.directory.get(dest, ()))
        for m in self.modules:
            addr = offered.get(m.name)
            if addr is not None and getattr(m, "reaches", _reaches_all)(addr) \
                    or dest in (m.peers() or ()):  # connected already (before the fork)
                self.route[dest] = m
                return m
        for m in self.modules:  # not described here, but a module knows where it is
            if dest in getattr(m, "directory", ()):
                self.route[dest] = m
                return m
        return None

    def _module_for(self, dest: int) -> Transport:
        m = self.choose(dest)
        if m is not None:
            return m
        deadline = time.monotonic() + ROUTE_WAIT
        while m is None:
            if time.monotonic() > deadline:
                how = (f"no protocol of this context ({', '.join(self.byname)}) reaches it: it "
                       f"offers {[p for p, _ in self.directory[dest]]}") if dest in self.directory \
                    else f"no descriptor of it arrived within {ROUTE_WAIT:g} s"
                if self.lost is not None:
                    self.lost(dest, how)
                raise ConnectionError(f"context {dest}: {how}")
            self.poll(0.01)  # the descriptor may be on its way
            m = self.choose(dest)
        return m

    def next_due(self) -> Optional[float]:
        """The soonest of the modules' :meth:`~macroflow.transport.base.Transport.next_due`
        (when a handshake under way may stall, on tcp); None if none is due.

        Example:
            >>> from macroflow.transport.local import LocalTransport
            >>> t = MultiTransport(0, [LocalTransport(0, {})])
            >>> t.next_due() is None
            True
            >>> t.close()
        """
        due = None
        for m in self.timed:
            d = m.next_due()
            if d is not None and (due is None or d < due):
                due = d
        return due

    # -- the Transport interface --------------------------------------------
    def send(self, dest: int, parts: Sequence[object], load: int) -> int:
        m = self.route.get(dest) or self._module_for(dest)
        n = m.send(dest, parts, load)
        c = self.counts[m.name]
        c["messages_sent"] += 1
        c["bytes_sent"] += n
        return n

    def queue(self, dest: int, parts: Sequence[object], load: int) -> int:
        m = self.route.get(dest) or self._module_for(dest)
        n = m.queue(dest, parts, load)
        c = self.counts[m.name]
        c["messages_sent"] += 1
        c["bytes_sent"] += n
        return n

    def flush(self) -> None:
        for m in self.modules:
            m.flush()

    def poll(self, timeout: Optional[float]) -> bool:
        got = False
        self.news = self.delivered = False
        if self.single is not None:
            # one protocol (every context of a tcp computation, say): its own
            # poll spins and sleeps as this one would, without a second epoll
            # and a second pass over the module at every message
            got = self.single.poll(timeout)
            return got or self.delivered or self.news
        for m in self.modules:
            got = m.poll(0) or got
        if got or self.news or self.delivered or timeout == 0:
            return got or self.delivered
        deadline = None if timeout is None else time.monotonic() + timeout
        events: Any = None  # what the spin found, read at once (not asked for again)
        if self.spin_s > 0.0:
            poll, blind = self.ep.poll, self.blind
            end = time.perf_counter() + self.spin_s
            last = time.perf_counter()
            while True:
                os.sched_yield()
                events = poll(0)
                if events:
                    break
                if blind:
                    for m in blind:
                        got = m.poll(0) or got
                    if got or self.delivered:
                        return True
                t = time.perf_counter()
                if t > end or t - last > _PREEMPTED:
                    break
                last = t
        stall = None
        while True:
            if not events:
                wait = -1.0 if deadline is None else max(0.0, deadline - time.monotonic())
                if self.blind:  # no descriptor to sleep on: look at them every millisecond
                    wait = 0.001 if wait < 0 else min(wait, 0.001)
                # a connection that stalls in its handshake makes no descriptor
                # readable: wake up to close it, or it holds its place in the
                # lobby (and the lobby's cap keeps real peers out) until
                # something else wakes this context
                stall = self.next_due() if self.timed else None
                if stall is not None:
                    left = max(0.0, stall - time.monotonic()) + 1e-3
                    wait = left if wait < 0 else min(wait, left)
                try:
                    events = self.ep.poll(wait)
                except InterruptedError:
                    events = []
            for fd, _ev in events:
                got = self.byfd[fd].poll(0) or got
            for m in self.blind:
                got = m.poll(0) or got
            if stall is not None and time.monotonic() >= stall:
                for m in self.timed:
                    got = m.poll(0) or got  # times the stalled handshakes out
                # and returns, as a lone tcp module's poll does: a connection
                # of ours that stalled is a lost peer, news for the engine
                return got or self.delivered
            # an event that delivered nothing (a peer lost, a handshake step) is
            # news for the engine too: go back to it
            if got or self.delivered or events or \
                    (deadline is not None and time.monotonic() >= deadline):
                return got or self.delivered
            events = None

    def close(self) -> None:
        for m in self.modules:
            m.close()
        self.ep.close()

    def fileno(self) -> Optional[int]:
        return None if self.blind else self.ep.fileno()

    def signal_arrivals(self, on: bool, again: bool = False) -> bool:
        """As :meth:`LocalTransport.signal_arrivals`, on every module; False
        (and nothing changed) if one of them cannot signal arrivals."""
        fns = [getattr(m, "signal_arrivals", None) for m in self.modules]
        if any(f is None for f in fns):
            return False
        ok = True
        for f in fns:
            ok = f(on, again) and ok
        return ok

    def peers(self) -> Optional[List[int]]:
        out: set = set()
        for m in self.modules:
            p = m.peers()
            if p is None:
                return None
            out.update(p)
        return sorted(out)

    def address(self) -> Tuple[str, str]:
        return self.modules[0].address()

    def addresses(self) -> Tuple[Tuple[str, str], ...]:
        """Every (protocol, address) this context can be reached by, best first."""
        return tuple(m.address() for m in self.modules)

    def counters(self) -> Dict[str, Dict[str, int]]:
        """Messages and bytes sent and received, per protocol."""
        return {name: dict(c) for name, c in self.counts.items()}

    def bulk_counts(self) -> Dict[str, int]:
        """The bulk-area counts of the protocols that have them, added up."""
        out = {"bulk_sent": 0, "bulk_received": 0, "bulk_buffers_held": 0}
        for m in self.modules:
            counts = getattr(m, "bulk_counts", None)
            if counts is not None:
                for k, v in counts().items():
                    out[k] += v
        return out


def _reaches_all(_address: str) -> bool:
    return True
