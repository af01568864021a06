"""Several protocols in one context (MultiTransport): the best shared protocol
carries every frame to a peer, frames are counted per protocol, descriptors
are learnt while running, and a peer no protocol reaches is reported lost."""

import socket
import threading

import pytest

import macroflow as mf

from macroflow.transport import multi
from macroflow.transport.local import LocalTransport
from macroflow.transport.multi import MultiTransport

pytestmark = pytest.mark.timeout(60)


class AltTransport(LocalTransport):
    """The local transport under another protocol name: a second protocol."""

    name = "alt"

    def address(self):
        return ("alt", f"alt-{self.ctx}")

    def reaches(self, address):
        return address.startswith("alt-")


class World:
    """Context 0 speaks local to 1 and alt to 2; 1 and 2 share nothing."""

    def __init__(self, directory=None):
        a01, a10 = socket.socketpair()
        a02, a20 = socket.socketpair()
        self.zero = MultiTransport(0, [LocalTransport(0, {1: a01}), AltTransport(0, {2: a02})],
                                   directory or {})
        self.one = LocalTransport(1, {0: a10})
        self.two = AltTransport(2, {0: a20})
        self.got = {0: [], 1: [], 2: []}
        self.lost = []
        self.zero.attach(lambda s, b, l: self.got[0].append((s, bytes(b[0]))),
                         lambda p, how: self.lost.append((p, how)))
        self.one.attach(lambda s, b, l: self.got[1].append((s, bytes(b[0]))), None)
        self.two.attach(lambda s, b, l: self.got[2].append((s, bytes(b[0]))), None)

    def pump(self, until, rounds=2000):
        for _ in range(rounds):
            if until():
                return
            self.zero.poll(0.001)
            self.one.poll(0)
            self.two.poll(0)
        raise AssertionError(f"not reached; got {self.got}")

    def close(self):
        for t in (self.zero, self.one, self.two):
            t.close()


@pytest.fixture
def world():
    w = World()
    yield w
    w.close()


def test_each_peer_gets_its_frames_by_the_protocol_it_shares(world):
    for i in range(5):
        world.zero.send(1, [f"to-one-{i}".encode()], 0)
        world.zero.queue(2, [f"to-two-{i}".encode()], 0)
    world.zero.flush()
    world.pump(lambda: len(world.got[1]) == 5 and len(world.got[2]) == 5)
    assert [m for _, m in world.got[1]] == [f"to-one-{i}".encode() for i in range(5)]
    assert [m for _, m in world.got[2]] == [f"to-two-{i}".encode() for i in range(5)]
    counts = world.zero.counters()
    assert counts["local"]["messages_sent"] == 5 and counts["alt"]["messages_sent"] == 5


def test_frames_from_both_protocols_arrive_through_one_poll(world):
    world.one.send(0, [b"from-one"], 0)
    world.two.send(0, [b"from-two"], 0)
    world.pump(lambda: len(world.got[0]) == 2)
    assert sorted(world.got[0]) == [(1, b"from-one"), (2, b"from-two")]
    counts = world.zero.counters()
    assert counts["local"]["messages_received"] == 1
    assert counts["alt"]["messages_received"] == 1


def test_a_blocking_poll_wakes_for_either_protocol(world):
    def later():
        world.two.send(0, [b"wake"], 0)

    t = threading.Thread(target=later)
    t.start()
    assert world.zero.poll(30.0) is True  # sleeps on both descriptors at once
    t.join()
    assert world.got[0] == [(2, b"wake")]


def test_the_preferred_protocol_wins_when_both_reach(monkeypatch):
    # context 3 offers both; local comes first in context 0's modules
    a03, a30 = socket.socketpair()
    b03, b30 = socket.socketpair()
    zero = MultiTransport(0, [LocalTransport(0, {3: a03}), AltTransport(0, {3: b03})])
    three_l, three_a = LocalTransport(3, {0: a30}), AltTransport(3, {0: b30})
    try:
        got = []
        zero.attach(None, None)
        three_l.attach(lambda s, b, l: got.append("local"), None)
        three_a.attach(lambda s, b, l: got.append("alt"), None)
        zero.send(3, [b"x"], 0)
        while not got:
            three_l.poll(0.01)
            three_a.poll(0)
        assert got == ["local"] and zero.route[3].name == "local"
    finally:
        for t in (zero, three_l, three_a):
            t.close()


def test_a_descriptor_announced_by_a_peer_is_learnt_before_anything_after_it(world):
    # context 2 tells 0 how to reach context 7 (alt only), then sends a frame
    frame = multi._CONTROL + __import__("pickle").dumps(("learn", (7, (("alt", "alt-7"),))))
    world.two.send(0, [frame], 0)
    world.two.send(0, [b"after"], 0)
    world.pump(lambda: world.got[0])
    assert world.got[0] == [(2, b"after")]  # the control frame never reached the engine
    assert world.zero.directory[7] == (("alt", "alt-7"),)


def test_announce_sends_a_descriptor_the_peer_applies():
    a, b = socket.socketpair()
    zero = MultiTransport(0, [LocalTransport(0, {1: a})])
    one = MultiTransport(1, [LocalTransport(1, {0: b})])
    got = []
    zero.attach(None, None)
    one.attach(lambda s, bufs, l: got.append(bytes(bufs[0])), None)
    try:
        zero.announce(1, 5, [("tcp", "198.18.0.2:4000")])
        zero.send(1, [b"next"], 0)
        while not got:
            one.poll(0.01)
        assert one.directory[5] == (("tcp", "198.18.0.2:4000"),)
        assert got == [b"next"]
    finally:
        zero.close()
        one.close()


def test_a_peer_no_protocol_reaches_is_reported_lost(world, monkeypatch):
    monkeypatch.setattr(multi, "ROUTE_WAIT", 0.05)
    world.zero.learn(9, [("tcp", "198.18.0.9:1")])
    with pytest.raises(ConnectionError, match="no protocol of this context"):
        world.zero.send(9, [b"x"], 0)
    assert world.lost == [(9, "no protocol of this context (local, alt) reaches it: "
                              "it offers ['tcp']")]


def test_a_peer_never_described_is_reported_lost_after_the_wait(world, monkeypatch):
    monkeypatch.setattr(multi, "ROUTE_WAIT", 0.05)
    with pytest.raises(ConnectionError, match="no descriptor of it arrived"):
        world.zero.send(11, [b"x"], 0)
    assert [p for p, _ in world.lost] == [11]


def test_losing_a_peer_names_the_protocol(world):
    world.zero.send(2, [b"x"], 0)  # routes 2 by alt
    world.two.close()
    for _ in range(200):
        if world.lost:
            break
        world.zero.poll(0.01)
    assert world.lost[0][0] == 2 and world.lost[0][1].endswith("(alt)")


def test_bad_construction_is_refused():
    with pytest.raises(ValueError, match="at least one protocol module"):
        MultiTransport(0, [])
    a, b = socket.socketpair()
    t1, t2 = LocalTransport(0, {1: a}), LocalTransport(0, {2: b})
    try:
        with pytest.raises(ValueError, match="one module per protocol"):
            MultiTransport(0, [t1, t2])
    finally:
        t1.close()
        t2.close()


def test_a_blocking_poll_returns_when_a_peer_is_lost_without_a_frame(world):
    # the engine learns of lost peers only when poll returns: it must not sleep on
    t = threading.Thread(target=world.two.close)
    t.start()
    assert world.zero.poll(30.0) is False  # nothing delivered, but it came back
    t.join()
    for _ in range(100):
        if world.lost:
            break
        world.zero.poll(0.01)
    assert [p for p, _ in world.lost] == [2]


class _Unreported(AltTransport):
    """A module whose poll delivers a frame and says it got nothing."""

    def poll(self, timeout):
        LocalTransport.poll(self, timeout)
        return False


def test_a_frame_a_module_delivers_without_saying_so_is_not_slept_on():
    a02, a20 = socket.socketpair()
    zero = MultiTransport(0, [_Unreported(0, {2: a02})], {})
    two = AltTransport(2, {0: a20})
    got = []
    zero.attach(lambda s, b, l: got.append((s, bytes(b[0]))), None)
    try:
        two.send(0, [b"here"], 0)
        # delivered by the first look; sleeping 30 s on the descriptor would
        # leave it in the engine's inbox until the next frame came
        assert zero.poll(30.0) is True
        assert got == [(2, b"here")]
    finally:
        zero.close()
        two.close()


class _Counting(AltTransport):
    """A module that counts its polls and the timeouts it was given."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.polls = []

    def poll(self, timeout):
        self.polls.append(timeout)
        return LocalTransport.poll(self, timeout)


def test_one_module_is_left_to_wait_by_itself():
    # a computation of one protocol (tcp): each poll is one poll of the
    # module, with the engine's timeout, and a frame or a lost peer brings it back
    a02, a20 = socket.socketpair()
    zero = MultiTransport(0, [_Counting(0, {2: a02})], {2: (("alt", "alt-2"),)})
    two = AltTransport(2, {0: a20})
    got, lost = [], []
    zero.attach(lambda s, b, l: got.append((s, bytes(b[0]))), lambda p, how: lost.append(p))
    try:
        t = threading.Timer(0.05, lambda: two.send(0, [b"later"], 0))
        t.start()
        assert zero.poll(30.0) is True  # woken by the frame, not by the timeout
        t.join()
        assert got == [(2, b"later")]
        assert zero.modules[0].polls == [30.0]
        assert zero.counters()["alt"]["messages_received"] == 1
        # with the frame's header, as the engine and the sender count it
        assert zero.counters()["alt"]["bytes_received"] == 16 + len(b"later")
        t = threading.Thread(target=two.close)
        t.start()
        zero.poll(30.0)  # returns although nothing was delivered
        t.join()
        for _ in range(100):
            if lost:
                break
            zero.poll(0.01)
        assert lost == [2]
    finally:
        zero.close()
        two.close()


def test_a_stalled_handshake_is_closed_while_another_protocol_keeps_the_context_asleep():
    # A stranger that connects to the tcp module and sends nothing wakes no
    # descriptor: the poll slept the whole timeout the engine gave it (for
    # ever in a wait), and the stranger held its place in the lobby
    import time
    from macroflow.transport.tcp import TcpTransport
    from transport_harness import SECRET
    tcp = TcpTransport(0, SECRET, "c0ffee00", handshake_timeout=0.3)
    zero = MultiTransport(0, [LocalTransport(0, {}), tcp])
    zero.attach(lambda s, b, l: None, None)
    host, port = tcp.address()[1].rsplit(":", 1)
    stranger = socket.create_connection((host, int(port)), timeout=30)
    try:
        while not tcp.shaking:
            zero.poll(0.01)
        start = time.monotonic()
        while tcp.shaking:
            zero.poll(5.0)  # comes back, before its timeout, to close it
        took = time.monotonic() - start
        assert took < 2.0 and tcp.handshakes_failed == 1 and tcp.incoming == 0
        stranger.settimeout(30)
        while stranger.recv(4096):  # its challenge, then the end: closed by the context
            pass
        assert zero.next_due() is None
    finally:
        stranger.close()
        zero.close()


@mf.persistent
class _Nop:
    def nop(self, x=None):
        return x


@pytest.mark.timeout(60)
def test_the_bytes_counted_per_protocol_add_up_to_the_context_totals():
    # on tcp each frame's 16-byte header was left out of the protocol's
    # bytes_received (not of its bytes_sent, nor of the totals)
    def main():
        p = _Nop.create(on=1)
        for i in range(10):
            p.nop(i)
        p.nop(b"x" * 100_000).result()
        return mf.stats()

    st = mf.run(main, contexts=2, transport="tcp")
    for c in (0, 1):
        for key in ("bytes_received", "bytes_sent", "messages_received", "messages_sent"):
            assert sum(p[key] for p in st[c]["protocols"].values()) == st[c][key], (c, key, st[c])
