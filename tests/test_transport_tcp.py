"""The tcp protocol module: admission (the handshake, what it refuses), TLS,
connecting on demand and at the same moment, a directory that grows.

The conformance suite (test_transport_conformance.py) checks the framing on
tcp and tcp-tls; here, raw sockets play the part of peers that misbehave, and
speak the handshake described in macroflow/transport/tcp.py themselves.
"""

import hashlib
import hmac
import logging
import os
import select
import signal
import socket
import ssl
import stat
import struct

import numpy as np
import pytest

import macroflow as mf
from macroflow.transport import tcp
from macroflow.transport.tcp import TcpTransport, load_secret, parse_address
from transport_harness import SECRET, Ends, Worker, tcp_ends, tls_contexts

pytestmark = pytest.mark.timeout(60)

HS = struct.Struct("<4sBH")
HELLO, CHALLENGE, PROOF, REFUSE, DONE = 1, 2, 3, 4, 5
VERSION = tuple(int(x) for x in mf.__version__.split(".")[:2])


@pytest.fixture
def make():
    """``make(n, **kw)``: n TCP ends that know each other's addresses, not connected."""
    made = []

    def _make(n=2, **kw):
        ends = tcp_ends(n, **kw)
        e = Ends("tcp", ends, reports_lost=True, has_fileno=True, backlog=lambda t, d: False)
        made.append(e)
        return e

    yield _make
    for e in made:
        e.close()


# -- speaking the handshake by hand ---------------------------------------------------
def message(kind, body=b""):
    return HS.pack(b"MFt1", kind, len(body)) + body


def hello_body(me, target, computation, version=VERSION, address=b""):
    comp = computation.encode()
    return (struct.pack("<HHII32s", *version, me, target, os.urandom(32))
            + bytes([len(comp)]) + comp + bytes([len(address)]) + address)


def challenge_body(version=VERSION):
    return struct.pack("<HH32s", *version, os.urandom(32))


def mac(secret, role, hello, challenge):
    data = (b"macroflow-tcp " + role + struct.pack("<HH", len(hello), len(challenge))
            + hello + challenge)
    return hmac.new(secret.encode(), data, hashlib.sha256).digest()


def recv_exact(sock, n):
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise EOFError(f"closed after {len(data)} of {n} bytes")
        data += chunk
    return data


def read_message(sock):
    magic, kind, n = HS.unpack(recv_exact(sock, HS.size))
    assert magic == b"MFt1"
    return kind, recv_exact(sock, n)


def raw_client(t):
    """A plain socket connected to transport ``t``'s listening address."""
    host, port = parse_address(t.address()[1])
    s = socket.create_connection((host, port), timeout=30)
    return s


def serve_until(t, cond, timeout=30.0):
    """Poll ``t`` (in this thread) until ``cond()``; AssertionError after ``timeout`` s."""
    import time
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        t.poll(0.01)


def readable(sock):
    return bool(select.select([sock], [], [], 0)[0])


def closed_by_peer(sock):
    """True once the other end has closed ``sock`` (whatever it sent first is read)."""
    if not readable(sock):
        return False
    try:
        return sock.recv(65536, socket.MSG_PEEK) == b""
    except ConnectionResetError:
        return True


def drain_until_closed(t, sock):
    """Poll ``t`` until it has closed ``sock``; returns what ``t`` sent on it."""
    got = b""
    while True:
        serve_until(t, lambda: readable(sock))
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return got
        if not chunk:
            return got
        got += chunk


def still_works(e, a, b):
    """Ends a and b of ``e`` exchange a frame each way (the transport is unharmed)."""
    n = len(e.got[b]), len(e.got[a])
    w = e.background(a, lambda: e.ends[a].send(b, [b"still there"], 7))
    e.pump(lambda: w.done and len(e.got[b]) > n[0])
    w.result(timeout=10)
    e.ends[b].send(a, [b"and back"], 8)
    e.pump(lambda: len(e.got[a]) > n[1])
    assert bytes(e.got[b][-1][1][0]) == b"still there" and bytes(e.got[a][-1][1][0]) == b"and back"


def connected(e):
    """Connect end 0 to end 1 of ``e``; returns end 1's connections to end 0."""
    still_works(e, 0, 1)
    return list(e.ends[1].links[0])


def unharmed(e, links):
    """The connection of :func:`connected` is still the one, open, and carries frames."""
    still_works(e, 0, 1)
    assert e.ends[1].links[0] == links and not any(c.closed for c in links)
    assert e.lost[0] == [] and e.lost[1] == []


# -- connecting ---------------------------------------------------------------------
def test_connection_is_made_on_first_send_and_used_both_ways(make):
    e = make(2)
    a, b = e.ends[0], e.ends[1]
    assert a.peers() == [] and b.peers() == []
    w = e.background(0, lambda: a.send(1, [b"ping"], 3))
    e.pump(lambda: w.done and e.got[1])
    w.result(timeout=10)
    assert [(s, bytes(f[0]), load) for s, f, load in e.got[1]] == [(0, b"ping", 3)]
    b.send(0, [b"pong"], 4)  # on the connection a made: b needs no handshake of its own
    e.pump(lambda: e.got[0])
    assert [(s, bytes(f[0]), load) for s, f, load in e.got[0]] == [(1, b"pong", 4)]
    assert len(a.links[1]) == 1 and len(b.links[0]) == 1
    assert a.shaking == {} and b.shaking == {}


def test_both_ends_connecting_at_once_keep_order_per_pair_and_lose_nothing(make):
    e = make(2)
    a, b = e.ends[0], e.ends[1]
    a.connect(1, wait=False)
    b.connect(0, wait=False)  # before either has seen the other's connection
    e.pump(lambda: a.peers() == [1] and b.peers() == [0] and not a.shaking and not b.shaking)
    # two connections, both admitted; each end sends on the first it completed
    assert len(a.links[1]) == 2 and len(b.links[0]) == 2
    assert a.conns[1] in a.links[1] and b.conns[0] in b.links[0]
    for i in range(300):
        a.send(1, [b"a%d" % i, os.urandom(i * 37)], i)
        b.queue(0, [b"b%d" % i], i)
        if i % 7 == 0:
            b.flush()
            e.pump(lambda: True)
    b.flush()
    e.pump(lambda: len(e.got[0]) == 300 and len(e.got[1]) == 300)
    assert [bytes(f[0]) for _, f, _ in e.got[1]] == [b"a%d" % i for i in range(300)]
    assert [len(f[1]) for _, f, _ in e.got[1]] == [i * 37 for i in range(300)]
    assert [bytes(f[0]) for _, f, _ in e.got[0]] == [b"b%d" % i for i in range(300)]
    # the peer is lost once, when both its connections have closed
    e.disappear(1)
    e.pump(lambda: e.lost[0])
    with pytest.raises(ConnectionError):
        for _ in range(3):
            a.send(1, [b"late"], 0)
    e.pump(lambda: True)
    assert [p for p, _ in e.lost[0]] == [1]


def test_sends_started_at_the_same_moment_by_two_threads_both_arrive_in_order(make):
    e = make(2)

    def talk(me, other):
        t = e.ends[me]
        for i in range(200):
            t.send(other, [b"%d:%d" % (me, i)], i)
        while len(e.got[me]) < 200:
            t.poll(1.0)

    w0 = e.background(0, lambda: talk(0, 1))
    w1 = e.background(1, lambda: talk(1, 0))
    w0.result(timeout=50)
    w1.result(timeout=50)
    for me, other in ((0, 1), (1, 0)):
        assert [bytes(f[0]) for _, f, _ in e.got[me]] == [b"%d:%d" % (other, i) for i in range(200)]
        assert 1 <= len(e.ends[me].links[other]) <= 2


def test_a_peer_added_while_running_is_reached_and_learns_who_called(make):
    e = make(2)
    late = TcpTransport(2, SECRET, e.ends[0].computation)
    try:
        got = []
        late.attach(lambda src, bufs, load: got.append((src, bytes(bufs[0]))), None)
        with pytest.raises(KeyError):
            e.ends[0].directory[2]
        e.ends[0].add_peer(2, late.address()[1])  # context 0 only: 2 does not know 0 yet
        w = e.background(0, lambda: e.ends[0].send(2, [b"welcome"], 0))
        serve_until(late, lambda: got and w.done)
        w.result(timeout=10)
        assert got == [(0, b"welcome")]
        assert late.directory == {0: e.ends[0].address()[1]}  # from the HELLO
        late.send(0, [b"thanks"], 0)
        e.pump(lambda: e.got[0])
        assert [(s, bytes(f[0])) for s, f, _ in e.got[0]] == [(2, b"thanks")]
    finally:
        late.close()


def test_connecting_to_a_context_that_is_gone_reports_it_lost_once(make):
    e = make(3)
    e.disappear(2)  # its address is in the directory, nothing listens there
    with pytest.raises(ConnectionError, match="cannot connect"):
        e.ends[0].send(2, [b"x"], 0)
    with pytest.raises(ConnectionError):
        e.ends[0].queue(2, [b"y"], 0)
    assert len(e.lost[0]) == 1 and e.lost[0][0][0] == 2
    assert "refused" in e.lost[0][0][1]


def test_a_context_with_no_known_address_is_reported_lost(make):
    e = make(2)
    with pytest.raises(ConnectionError, match="no address is known"):
        e.ends[0].send(9, [b"x"], 0)
    assert e.lost[0] == [(9, "no address is known for it (add_peer was not called for it)")]
    with pytest.raises(ValueError, match="not reused"):
        e.ends[0].add_peer(9, "127.0.0.1:1")


def test_a_connection_whose_host_stops_answering_is_a_lost_peer(make):
    # keepalive (or a route that goes) ends a TCP connection with ETIMEDOUT or
    # EHOSTUNREACH on the next receive: the peer is lost, poll does not raise
    import errno

    class Unanswered:
        def __init__(self, sock):
            self.sock = sock

        def recv_into(self, *args):
            raise OSError(errno.ETIMEDOUT, "Connection timed out")

        def __getattr__(self, name):
            return getattr(self.sock, name)

    e = make(2)
    links = connected(e)
    links[0].sock = Unanswered(links[0].sock)
    e.ends[0].send(1, [b"wake up"], 0)
    e.pump(lambda: e.lost[1])
    assert e.lost[1] == [(0, "connection closed")] and e.ends[1].peers() == []


# -- what the acceptor refuses --------------------------------------------------------
def test_a_connector_with_the_wrong_secret_is_refused_and_logged(make, caplog):
    e = make(2)
    t = e.ends[1]
    links = connected(e)
    raw = raw_client(t)
    hello = hello_body(0, 1, t.computation)
    raw.sendall(message(HELLO, hello))
    serve_until(t, lambda: readable(raw))
    kind, challenge = read_message(raw)
    assert kind == CHALLENGE
    raw.sendall(message(PROOF, mac("not the secret at all!", b"connector", hello, challenge)))
    sent = drain_until_closed(t, raw)
    assert sent == message(REFUSE, bytes([1]))
    assert "authentication failed" in caplog.text and t.handshakes_failed == 1
    assert t.peers() == [0] and len(e.got[1]) == 1  # nothing from the impostor
    unharmed(e, links)


def test_a_replayed_proof_does_not_authenticate(make, caplog):
    # a proof seen on one connection is worth nothing on another: the nonces differ
    e = make(2)
    t = e.ends[1]
    raw = raw_client(t)
    hello = hello_body(0, 1, t.computation)
    raw.sendall(message(HELLO, hello))
    serve_until(t, lambda: readable(raw))
    _, old_challenge = read_message(raw)
    proof = mac(SECRET, b"connector", hello, old_challenge)
    raw.close()
    again = raw_client(t)
    again.sendall(message(HELLO, hello) + message(PROOF, proof))
    assert drain_until_closed(t, again).endswith(message(REFUSE, bytes([1])))
    assert "authentication failed" in caplog.text


@pytest.mark.parametrize("junk, why", [
    (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", "garbage"),
    (HS.pack(b"MFt1", HELLO, 60000) + b"x" * 100, "oversize handshake message: 60000 bytes"),
    (message(PROOF, b"p" * 32), "garbage: a message of kind 3 where a HELLO was due"),
    (message(HELLO, b"short"), "garbage: a HELLO of 5 bytes"),
])
def test_garbage_and_oversize_messages_are_closed_and_logged(make, caplog, junk, why):
    e = make(2)
    t = e.ends[1]
    links = connected(e)
    raw = raw_client(t)
    raw.sendall(junk)
    sent = drain_until_closed(t, raw)
    assert sent.startswith(HS.pack(b"MFt1", CHALLENGE, 36))  # its challenge, nothing more
    assert len(sent) == HS.size + 36
    assert why in caplog.text
    assert [r.levelno for r in caplog.records if r.name == "macroflow.tcp"] == [logging.WARNING]
    unharmed(e, links)


def test_a_stalled_handshake_is_closed_and_does_not_hold_up_the_others(make, caplog):
    e = make(3, handshake_timeout=0.5)
    t = e.ends[1]
    links = connected(e)
    raw = raw_client(t)
    raw.sendall(HS.pack(b"MFt1", HELLO, 80)[:5])  # half a header, then nothing
    serve_until(t, lambda: readable(raw))
    assert read_message(raw)[0] == CHALLENGE
    # meanwhile: frames on a connection, and a whole handshake of a good peer
    unharmed(e, links)
    w = e.background(2, lambda: e.ends[2].send(1, [b"newcomer"], 0))
    e.pump(lambda: w.done and any(src == 2 for src, _, _ in e.got[1]))
    assert t.incoming == 1 and sorted(t.peers()) == [0, 2]
    while not closed_by_peer(raw):
        t.poll(None)  # returns by itself when a handshake is due to time out
    assert "stalled in the handshake for more than 0.5 s" in caplog.text
    assert t.incoming == 0 and t.shaking == {}


def test_an_authenticated_connector_is_not_timed_out_before_it_confirms(make):
    # The connector starts sending frames once it has sent DONE: an acceptor
    # that gave up after proving itself would leave it with a connection only
    # it believes in. A connector busy elsewhere may be slow to confirm.
    import time
    e = make(2, handshake_timeout=0.3)
    t = e.ends[1]
    raw = raw_client(t)
    hello = hello_body(0, 1, t.computation)
    raw.sendall(message(HELLO, hello))
    serve_until(t, lambda: readable(raw))
    _, challenge = read_message(raw)
    raw.sendall(message(PROOF, mac(SECRET, b"connector", hello, challenge)))
    serve_until(t, lambda: readable(raw))
    assert read_message(raw) == (PROOF, mac(SECRET, b"acceptor", hello, challenge))
    busy_until = time.monotonic() + 1.0  # more than three handshake timeouts
    while time.monotonic() < busy_until:
        t.poll(0.05)
    assert not closed_by_peer(raw) and t.incoming == 0 and len(t.shaking) == 1
    raw.sendall(message(DONE) + struct.pack("<IIQ", 1, 42, 5) + b"frame")
    serve_until(t, lambda: e.got[1])
    assert [(src, bytes(b[0]), load) for src, b, load in e.got[1]] == [(0, b"frame", 42)]
    assert t.peers() == [0] and t.shaking == {}


def test_a_handshake_finished_within_one_poll_reports_the_frame_behind_it(make):
    # A connector that keeps up with every step (the acceptor was preempted
    # between them) lets the acceptor accept, admit and read the frame behind
    # DONE in one poll. That poll must say it delivered: a caller that sleeps
    # on False left the frame in the engine's inbox until another came.
    e = make(2)
    t = e.ends[1]
    raw = raw_client(t)
    hello = hello_body(0, 1, t.computation)
    raw.sendall(message(HELLO, hello))
    seen = {}
    put = t._put

    def answer_at_once(shake, kind, body=b""):
        put(shake, kind, body)
        if kind == CHALLENGE:
            seen["challenge"] = read_message(raw)[1]
            raw.sendall(message(PROOF, mac(SECRET, b"connector", hello, seen["challenge"])))
        elif kind == PROOF:
            assert read_message(raw) == (PROOF, mac(SECRET, b"acceptor", hello, seen["challenge"]))
            raw.sendall(message(DONE) + struct.pack("<IIQ", 1, 42, 5) + b"frame")

    t._put = answer_at_once
    assert select.select([t.tcp], [], [], 30)[0]  # the connection waits to be accepted
    assert t.poll(0) is True
    assert [(src, bytes(b[0]), load) for src, b, load in e.got[1]] == [(0, b"frame", 42)]
    assert t.peers() == [0] and t.shaking == {}
    raw.close()


def test_a_connection_started_unasked_that_the_peer_gave_up_on_is_made_again(make):
    # connect(wait=False), then this end computes: the peer times the
    # handshake out; that is no reason to call the peer lost
    e = make(2, handshake_timeout=0.3)
    a, b = e.ends[0], e.ends[1]
    a.connect(1, wait=False)
    serve_until(b, lambda: b.handshakes_failed == 1)  # a never answered
    w = e.background(0, lambda: a.send(1, [b"after all"], 0))
    e.pump(lambda: w.done and e.got[1])
    w.result(timeout=10)
    assert [bytes(f[0]) for _, f, _ in e.got[1]] == [b"after all"]
    assert e.lost[0] == [] and a.peers() == [1]


def test_connections_beyond_max_handshakes_wait_in_the_backlog(make):
    e = make(2, max_handshakes=2, handshake_timeout=0.5)
    t = e.ends[1]
    raws = [raw_client(t) for _ in range(3)]
    serve_until(t, lambda: sum(readable(r) for r in raws) == 2)  # two challenges
    for _ in range(20):
        t.poll(0.001)
    assert t.incoming == 2 and sum(readable(r) for r in raws) == 2
    waiting = [r for r in raws if not readable(r)][0]
    serve_until(t, lambda: readable(waiting))  # the first two timed out: its turn
    assert read_message(waiting)[0] == CHALLENGE


def test_a_connector_of_another_computation_or_for_another_context_is_refused(make, caplog):
    e = make(2)
    t = e.ends[1]
    links = connected(e)
    for hello, code, why in ((hello_body(0, 1, "other"), 3, "belongs to computation 'other'"),
                             (hello_body(0, 5, t.computation), 2, "it wanted context 5"),
                             (hello_body(1, 1, t.computation), 4, "this context's own id")):
        raw = raw_client(t)
        raw.sendall(message(HELLO, hello))
        serve_until(t, lambda: readable(raw))
        _, challenge = read_message(raw)
        raw.sendall(message(PROOF, mac(SECRET, b"connector", hello, challenge)))
        assert drain_until_closed(t, raw) == message(REFUSE, bytes([code]))
        assert why in caplog.text
    unharmed(e, links)


def test_a_connector_of_another_version_is_refused_naming_both_versions(make, caplog):
    e = make(2)
    t = e.ends[1]
    raw = raw_client(t)
    hello = hello_body(0, 1, t.computation, version=(9, 7))
    raw.sendall(message(HELLO, hello))
    serve_until(t, lambda: readable(raw))
    _, challenge = read_message(raw)
    raw.sendall(message(PROOF, mac(SECRET, b"connector", hello, challenge)))
    sent = drain_until_closed(t, raw)
    # it proves itself first, so that the connector can trust what it says next
    assert sent == message(PROOF, mac(SECRET, b"acceptor", hello, challenge))
    mine = "%d.%d" % VERSION
    assert f"context 0 runs macroflow 9.7 and context 1 runs {mine}" in caplog.text
    assert any(r.levelno == logging.ERROR for r in caplog.records)
    assert t.peers() == []


# -- what the connector refuses ---------------------------------------------------------
def fake_acceptor(secret, version=VERSION):
    """A listening socket, and a function that plays the acceptor's part on
    the next connection with ``secret``; it returns the socket."""
    ls = socket.create_server(("127.0.0.1", 0))
    ls.settimeout(30)

    def play():
        s, _ = ls.accept()
        s.settimeout(30)
        challenge = challenge_body(version)
        s.sendall(message(CHALLENGE, challenge))
        kind, hello = read_message(s)
        assert kind == HELLO
        kind, _proof = read_message(s)
        assert kind == PROOF
        s.sendall(message(PROOF, mac(secret, b"acceptor", hello, challenge)))
        return s

    return ls, play


def _connect_to_fake(make, caplog, secret, version=VERSION):
    e = make(2)
    t = e.ends[0]
    ls, play = fake_acceptor(secret, version)
    t.add_peer(5, "127.0.0.1:%d" % ls.getsockname()[1])
    w = e.background(0, lambda: t.send(5, [b"for your eyes only"], 0))
    s = play()
    with pytest.raises(ConnectionError) as info:
        w.result(timeout=30)
    s.settimeout(5)
    assert s.recv(100) == b""  # it closed the connection, and sent no frame
    s.close()
    ls.close()
    assert [p for p, _ in e.lost[0]] == [5]
    return str(info.value), e.lost[0][0][1]


def test_an_acceptor_that_does_not_know_the_secret_gets_no_frame(make, caplog):
    err, how = _connect_to_fake(make, caplog, "an impostor's guess at the secret")
    assert "did not prove that it knows the secret" in err and how in err
    assert "did not prove" in caplog.text


def test_an_acceptor_of_another_version_is_named_with_both_versions(make, caplog):
    err, _ = _connect_to_fake(make, caplog, SECRET, version=(3, 14))
    mine = "%d.%d" % VERSION
    assert f"context 5 runs macroflow 3.14 and context 0 runs {mine}" in err
    assert "same major.minor version" in err


def test_ends_with_different_secrets_refuse_each_other_with_a_clear_error(make, caplog):
    e = make(2)
    other = TcpTransport(7, "another secret, sixteen+ bytes", e.ends[0].computation)
    try:
        e.ends[0].add_peer(7, other.address()[1])
        w = e.background(0, lambda: e.ends[0].send(7, [b"x"], 0))
        serve_until(other, lambda: w.done)
        with pytest.raises(ConnectionError, match="does not know this context's secret"):
            w.result(timeout=10)
        assert "authentication failed" in caplog.text
    finally:
        other.close()


def test_a_stale_address_reaches_a_context_that_says_so(make):
    e = make(2)
    e.ends[0].add_peer(4, e.ends[1].address()[1])  # context 1 listens there, not 4
    w = e.background(0, lambda: e.ends[0].send(4, [b"x"], 0))
    e.pump(lambda: w.done, ends=[1])
    with pytest.raises(ConnectionError, match="not the context this address was given for"):
        w.result(timeout=10)


# -- TLS -------------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_tls_carries_frames_and_large_buffers(make):
    e = make(2, tls=True)
    big = np.random.default_rng(3).random(2 * 2**20)  # 16 MB
    w = e.background(0, lambda: e.ends[0].send(1, [b"head", big], 1))
    e.pump(lambda: w.done and e.got[1])
    w.result(timeout=10)
    (_, bufs, load), = e.got[1]
    assert load == 1 and np.array_equal(np.frombuffer(bufs[1], np.float64), big)
    assert isinstance(e.ends[0].conns[1].sock, tcp._TlsSocket)
    e.ends[1].send(0, [b"back"], 2)
    e.pump(lambda: e.got[0])


def test_a_plain_connector_cannot_talk_to_a_tls_context(make, caplog):
    e = make(2, tls=True)
    t = e.ends[1]
    links = connected(e)
    raw = raw_client(t)
    raw.sendall(message(HELLO, hello_body(0, 1, t.computation)))
    drain_until_closed(t, raw)
    assert "TLS handshake failed" in caplog.text
    assert t.peers() == [0] and t.handshakes_failed == 1
    unharmed(e, links)


def test_a_tls_context_that_does_not_trust_the_certificate_refuses_it(make, caplog):
    e = make(2, tls=True)
    server, _ = tls_contexts()
    stranger = TcpTransport(3, SECRET, e.ends[0].computation, server_ssl=server,
                            client_ssl=ssl.create_default_context())  # system CAs only
    try:
        stranger.add_peer(1, e.ends[1].address()[1])
        w = Worker(lambda: stranger.send(1, [b"x"], 0))
        e.pump(lambda: w.done, ends=[1])
        with pytest.raises(ConnectionError, match="certificate verify failed"):
            w.result(timeout=10)
    finally:
        stranger.close()


# -- settings ---------------------------------------------------------------------
def test_bad_settings_are_refused_with_what_is_allowed():
    with pytest.raises(ValueError, match="at least 16 bytes"):
        TcpTransport(0, "short", "c")
    with pytest.raises(ValueError, match="both server_ssl and client_ssl"):
        TcpTransport(0, SECRET, "c", server_ssl=ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER))
    with pytest.raises(ValueError, match="handshake_timeout must be a number of seconds > 0"):
        TcpTransport(0, SECRET, "c", handshake_timeout=0)
    with pytest.raises(ValueError, match="port from 0 to 65535"):
        TcpTransport(0, SECRET, "c", port=70000)
    with pytest.raises(OSError, match="cannot listen on 192.0.2.1:0"):
        TcpTransport(0, SECRET, "c", host="192.0.2.1")  # not an address of this host
    t = TcpTransport(0, SECRET, "c", host="0.0.0.0")
    try:
        assert t.address()[1].split(":")[0] == socket.gethostname()
        with pytest.raises(ValueError, match="an int from 0"):
            t.add_peer(-1, "h:1")
    finally:
        t.close()
    t = TcpTransport(0, SECRET, "c", advertise="node7.cluster")
    assert t.address()[1].startswith("node7.cluster:")
    t.close()


def test_secret_from_a_file_or_the_environment(tmp_path, caplog):
    f = tmp_path / "secret"
    f.write_text("  a secret kept in a file, 32 chars\n")
    f.chmod(0o600)
    assert load_secret(str(f), environ={}) == "a secret kept in a file, 32 chars"
    assert load_secret(environ={"MACROFLOW_SECRET_FILE": str(f)}) == "a secret kept in a file, 32 chars"
    assert caplog.text == ""
    f.chmod(0o644)
    load_secret(str(f), environ={})
    assert "may be read by other users" in caplog.text
    with pytest.raises(ValueError, match="cannot read the secret from"):
        load_secret(str(tmp_path / "missing"), environ={})
    f.write_text("tiny")
    with pytest.raises(ValueError, match="holds a secret of 4 characters"):
        load_secret(str(f), environ={})
    made = {load_secret(environ={}) for _ in range(3)}
    assert len(made) == 3 and all(len(s) == 64 and int(s, 16) >= 0 for s in made)
    assert stat.S_IMODE(f.stat().st_mode) == 0o644  # it never changes the file


# -- the launcher ------------------------------------------------------------------
@mf.persistent
class Where:
    def pid(self):
        return os.getpid()


def test_a_killed_context_leaves_no_listening_socket_behind():
    # each forked context keeps only its own listening socket: once it is gone,
    # nobody accepts connections at its address
    with mf.init(contexts=3, transport="tcp") as s:
        t = s.engine.transport
        pid = Where.create(on=2).pid().result()
        host, port = parse_address(t.byname["tcp"].directory[2])
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(mf.ContextLost):
            Where.create(on=2).pid().result(timeout=30)
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((host, port), timeout=10).close()
        assert Where.create(on=1).pid().result() != pid


def _slow_init(cid):
    import time
    time.sleep(1.5)


@pytest.mark.timeout(60)
def test_an_added_context_answers_its_handshakes_before_a_long_init(monkeypatch, caplog):
    # It connected, then ran its init without answering: past the handshake
    # timeout context 0 closed the connection, said it had stalled, and Ctrl-C
    # there waited for the init. (A timeout of 1 s, not 10, and an init of 1.5.)
    from macroflow.transport import tcp
    original = tcp.TcpTransport.__init__

    def short(self, *args, **kw):
        kw["handshake_timeout"] = 1.0
        original(self, *args, **kw)

    monkeypatch.setattr(tcp.TcpTransport, "__init__", short)

    def main():
        return mf.add_contexts(1, init=_slow_init), [c.state for c in mf.contexts()]

    with caplog.at_level(logging.INFO, logger="macroflow"):
        assert mf.run(main, contexts=2, transport="tcp") == ([2], ["running"] * 3)
    assert not [r for r in caplog.records if "stalled in the handshake" in r.getMessage()]
