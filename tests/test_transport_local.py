"""The local protocol module: framing, large frames, no deadlock on big crossings."""

import os
import signal
import socket
import struct
import threading

import numpy as np
import pytest

import macroflow as mf
from macroflow.core import marshal
from macroflow.launch import new_computation_id
from macroflow.transport import local
from macroflow.transport.local import LocalTransport, Mesh

pytestmark = pytest.mark.timeout(60)


def _pair():
    a, b = socket.socketpair()
    ta, tb = LocalTransport(0, {1: a}), LocalTransport(1, {0: b})
    got_a, got_b = [], []
    ta.attach(lambda src, bufs, load: got_a.append((src, bufs, load)), lambda p, h: got_a.append(("lost", p, h)))
    tb.attach(lambda src, bufs, load: got_b.append((src, bufs, load)), lambda p, h: got_b.append(("lost", p, h)))
    return ta, tb, got_a, got_b


def test_frames_arrive_whole_and_in_order():
    ta, tb, _, got_b = _pair()
    try:
        for i in range(500):
            ta.send(1, [f"msg{i}".encode(), os.urandom(i)], i)
        while len(got_b) < 500:
            tb.poll(1.0)
        assert [bytes(b[1][0]) for b in got_b] == [f"msg{i}".encode() for i in range(500)]
        assert [len(b[1][1]) for b in got_b] == list(range(500))
        assert [b[2] for b in got_b] == list(range(500))
    finally:
        ta.close()
        tb.close()


def test_large_out_of_band_frame():
    ta, tb, _, got_b = _pair()
    try:
        arr = np.random.default_rng(1).random(3_000_000)
        data, bufs = marshal.dumps(arr)
        # larger than the socket buffers: the sender drains while the receiver is
        # not polling, so drive the receiver from the sender's drain by a child
        pid = os.fork()
        if pid == 0:
            try:
                ta.send(1, [data, *bufs], 0)
            finally:
                os._exit(0)
        ta.close()
        while not got_b:
            tb.poll(1.0)
        os.waitpid(pid, 0)
        src, parts, _ = got_b[0]
        back = marshal.loads(parts[0], parts[1:])
        assert np.array_equal(back, arr)
    finally:
        tb.close()


def test_two_contexts_sending_big_frames_to_each_other_do_not_deadlock():
    _cross_big_frames()


@pytest.mark.timeout(20)
def test_draining_context_does_not_wait_for_the_rest_of_a_big_buffer(monkeypatch):
    # Both ends drain a frame of their own and have part of the other's: one
    # that waited in the kernel for the rest would wait for a peer that waits
    # for it, until the stall limit (here far beyond the test's timeout).
    monkeypatch.setattr(local, "_STALL", 3600.0)
    _cross_big_frames()


def _cross_big_frames():
    a, b = socket.socketpair()
    big = os.urandom(20 * 2**20)
    pid = os.fork()
    if pid == 0:
        try:
            tb = LocalTransport(1, {0: b})
            got = []
            tb.attach(lambda s, bufs, l: got.append(bufs), None)
            tb.send(0, [b"x", big], 0)  # while the parent sends to us too
            while not got:
                tb.poll(1.0)
            os._exit(0 if bytes(got[0][1]) == big else 3)
        except BaseException:
            os._exit(4)
    ta = LocalTransport(0, {1: a})
    got = []
    ta.attach(lambda s, bufs, l: got.append(bufs), None)
    try:
        ta.send(1, [b"y", big], 0)
        while not got:
            ta.poll(1.0)
        assert bytes(got[0][1]) == big
    except BaseException:
        os.kill(pid, signal.SIGKILL)  # a failed or timed-out test leaves no child
        raise
    finally:
        _, status = os.waitpid(pid, 0)
        ta.close()
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


def test_peer_closing_is_reported():
    ta, tb, got_a, _ = _pair()
    tb.close()
    for _ in range(10):
        ta.poll(0.5)
        if got_a:
            break
    assert got_a == [("lost", 1, "connection closed")]
    with pytest.raises(ConnectionError):
        ta.send(1, [b"late"], 0)
    ta.close()


def _mesh_pair(size=3):
    """Contexts 1 and 2 of a mesh, in this process, with no connection yet."""
    mesh = Mesh(new_computation_id(), size)
    ts, got = {}, {}
    for c in (1, 2):
        ts[c] = LocalTransport(c, {}, mesh=mesh, listener=mesh.listen(c))
        got[c] = []
        ts[c].attach(lambda src, bufs, load, g=got[c]: g.append((src, bytes(bufs[0]))),
                     lambda p, h, g=got[c]: g.append(("lost", p, h)))
    return mesh, ts, got


def _poll_until(t, got, n):
    while len(got) < n:
        t.poll(1.0)


def test_connection_is_made_on_first_send_and_used_both_ways():
    _, ts, got = _mesh_pair()
    try:
        assert ts[1].conns == {} and ts[2].conns == {}
        ts[1].send(2, [b"ping"], 0)
        _poll_until(ts[2], got[2], 1)
        assert got[2] == [(1, b"ping")]
        ts[2].send(1, [b"pong"], 0)  # on the connection context 1 made: no second one
        _poll_until(ts[1], got[1], 1)
        assert got[1] == [(2, b"pong")]
        assert len(ts[1].links[2]) == 1 and len(ts[2].links[1]) == 1
    finally:
        ts[1].close()
        ts[2].close()


def test_both_ends_connecting_at_once_keep_order_per_direction():
    _, ts, got = _mesh_pair()
    try:
        ts[1].send(2, [b"a0"], 0)
        ts[2].send(1, [b"b0"], 0)  # before context 2 saw context 1's connection
        for i in range(1, 200):
            ts[1].send(2, [b"a%d" % i], 0)
            ts[2].send(1, [b"b%d" % i], 0)
            ts[1].poll(0)
            ts[2].poll(0)
        _poll_until(ts[1], got[1], 200)
        _poll_until(ts[2], got[2], 200)
        assert got[2] == [(1, b"a%d" % i) for i in range(200)]
        assert got[1] == [(2, b"b%d" % i) for i in range(200)]
        # two connections, each end sends on the one it made
        assert len(ts[1].links[2]) == 2 and len(ts[2].links[1]) == 2
        assert ts[1].conns[2] is ts[1].links[2][0]
    finally:
        ts[1].close()
        ts[2].close()


def test_peer_with_two_connections_is_reported_lost_once_after_its_frames():
    _, ts, got = _mesh_pair()
    ts[1].send(2, [b"a"], 0)
    ts[2].send(1, [b"b"], 0)  # two connections between 1 and 2
    for i in range(50):
        ts[2].queue(1, [b"late%d" % i], 0)
    ts[2].close()  # flushes its queued frames, then closes both connections
    try:
        # the connection context 1 made (nothing from 2 on it) ends first; context
        # 2's own connection is not even accepted yet: its frames still come first
        ts[1]._read(ts[1].conns[2])
        assert got[1][:-1] == [(2, b"b")] + [(2, b"late%d" % i) for i in range(50)]
        assert got[1][-1] == ("lost", 2, "connection closed")
        for _ in range(3):
            ts[1].poll(0.05)
        with pytest.raises(ConnectionError):
            ts[1].send(2, [b"again"], 0)  # no new connection to a lost peer
        assert [g for g in got[1] if g[0] == "lost"] == [("lost", 2, "connection closed")]
    finally:
        ts[1].close()


def test_connecting_to_a_peer_that_is_gone_reports_it_lost_once():
    mesh, ts, got = _mesh_pair()
    ts[2].close()  # it listened once, now nothing does
    try:
        with pytest.raises(ConnectionError):
            ts[1].send(2, [b"x"], 0)
        with pytest.raises(ConnectionError):
            ts[1].queue(2, [b"y"], 0)
        assert len(got[1]) == 1 and got[1][0][:2] == ("lost", 2)
    finally:
        ts[1].close()


def test_connecting_waits_for_a_peer_not_yet_listening():
    mesh = Mesh(new_computation_id(), 3)
    t1 = LocalTransport(1, {}, mesh=mesh, listener=mesh.listen(1))
    t1.attach(lambda *a: None, None)
    made = []
    # context 2 starts listening in another thread, whenever that thread runs
    th = threading.Thread(target=lambda: made.append(mesh.listen(2)))
    th.start()
    try:
        assert t1.send(2, [b"early"], 0) > 0
        th.join()
        t2 = LocalTransport(2, {}, mesh=mesh, listener=made[0])
        got = []
        t2.attach(lambda src, bufs, load: got.append((src, bytes(bufs[0]))), None)
        _poll_until(t2, got, 1)
        assert got == [(1, b"early")]
        t2.close()
    finally:
        th.join()
        t1.close()


def test_connection_without_the_secret_is_dropped():
    mesh, ts, got = _mesh_pair()
    raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        raw.connect(mesh.address(2))
        fake = Mesh(mesh.computation, 3)  # same names, another secret
        raw.sendall(fake.hello(1) + struct.pack("<IIQ", 1, 0, 4) + b"evil")
        raw.settimeout(10)
        ts[2].poll(1.0)  # accepts the connection and reads its hello
        assert raw.recv(1) == b""  # context 2 closed it
        assert got[2] == [] and ts[2].links == {}
    finally:
        raw.close()
        ts[1].close()
        ts[2].close()


def test_address_held_by_another_user_is_not_trusted(monkeypatch):
    # a context's name is free again once it has ended; a process of another
    # user listening there must not receive frames (they are pickles)
    _, ts, got = _mesh_pair()
    uid = os.geteuid()
    monkeypatch.setattr(local.os, "geteuid", lambda: uid + 1)
    try:
        with pytest.raises(ConnectionError, match="another user"):
            ts[1].send(2, [b"secret"], 0)
        assert got[1][0][:2] == ("lost", 2) and "another user" in got[1][0][2]
        ts[2].poll(0.1)
        assert got[2] == []
    finally:
        ts[1].close()
        ts[2].close()


def _rbuf_size(t, peer):
    return len(t.conns[peer].rbuf)


def test_read_buffer_stays_small_on_a_connection_of_small_frames():
    ta, tb, _, got_b = _pair()
    try:
        sizes = [(i * 97) % 12_000 for i in range(600)]
        for i, n in enumerate(sizes):
            parts = [bytes([i % 256]) * n] if i % 2 else [b"h%d" % i, os.urandom(n)]
            if i % 3:
                ta.queue(1, parts, i)  # joined with its neighbours into one write
            else:
                ta.send(1, parts, i)
            if i % 50 == 49:
                ta.flush()
                while len(got_b) <= i:
                    tb.poll(1.0)
        ta.flush()
        while len(got_b) < len(sizes):
            tb.poll(1.0)
        assert [b[2] for b in got_b] == list(range(len(sizes)))
        assert [len(b[1][-1]) for b in got_b] == sizes
        assert _rbuf_size(tb, 0) == local._RBUF_MIN
    finally:
        ta.close()
        tb.close()


def test_read_buffer_grows_for_a_frame_that_needs_it_and_the_connection_goes_on():
    ta, tb, _, got_b = _pair()
    want = [
        [os.urandom(200_000)],                    # one 200 KB buffer: received in place
        [b"h", os.urandom(100_000), os.urandom(100_000)],  # 100 KB buffers: through the read buffer
        [os.urandom(60_000)],
        [b"small"],
    ] + [[b"after%d" % i] for i in range(100)]
    done = threading.Event()

    def receive():
        while len(got_b) < len(want) and not done.is_set():
            tb.poll(0.2)

    th = threading.Thread(target=receive)
    th.start()
    try:
        for i, parts in enumerate(want):
            ta.send(1, parts, i)
        th.join(30)
    finally:
        done.set()
        th.join()
        ta.close()
        tb.close()
    assert [[bytes(p) for p in b[1]] for b in got_b] == want
    assert local._RBUF_MIN < len(tb.links[0][0].rbuf) <= local._RBUF


@mf.persistent
class _Echo:
    def echo(self, x):
        return x


def test_values_of_every_size_cross_between_contexts():
    # in-band pickles from a few bytes to past the largest read buffer, both ways,
    # back to back (so frames that need a larger buffer follow small ones)
    sizes = [10, 9_000, 17_000, 40_000, 70_000, 130_000, 140_000, 300_000, 5]

    def main():
        e = _Echo.create(on=1)
        vals = [bytes([n % 251]) * n for n in sizes] + [list(range(n // 8)) for n in sizes]
        return mf.gather([e.echo(v) for v in vals]) == vals

    assert mf.run(main, contexts=2, transport="local")
