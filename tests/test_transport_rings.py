"""Shared-memory rings between contexts on one host: order with the socket,
full rings, sleeping readers, peers that end, and the setting that turns
them off."""

import contextlib
import os
import runpy
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tarfile
import threading
import time
import zipfile

import greenlet
import hypothesis
import hypothesis.strategies as st
import numpy as np
import pytest

import macroflow as mf
from macroflow.core.context import Worker, current_engine
from macroflow.launch import rings_setting
from macroflow.transport import local, ring
from macroflow.transport.local import LocalTransport
from macroflow.transport.ring import Ring

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(ring.problem() is not None, reason="no rings on this CPU")]


def _pair(ring_bytes=local.RING_BYTES, bulk_bytes=local.BULK_BYTES):
    """Two transports in this process whose rings are in use both ways."""
    a, b = socket.socketpair()
    ta = LocalTransport(0, {1: a}, rings=True, ring_bytes=ring_bytes, bulk_bytes=bulk_bytes)
    tb = LocalTransport(1, {0: b}, rings=True, ring_bytes=ring_bytes, bulk_bytes=bulk_bytes)
    got_a, got_b = [], []
    ta.attach(lambda src, bufs, load: got_a.append((src, [bytes(x) for x in bufs], load)),
              lambda p, h: got_a.append(("lost", p, h)))
    tb.attach(lambda src, bufs, load: got_b.append((src, [bytes(x) for x in bufs], load)),
              lambda p, h: got_b.append(("lost", p, h)))
    # each reads the other's offer, and switches at its first send
    ta.poll(1.0)
    tb.poll(1.0)
    ta.send(1, [b"hello"], 0)
    tb.send(0, [b"hello"], 0)
    while len(got_a) < 1 or len(got_b) < 1:
        ta.poll(0.1)
        tb.poll(0.1)
    assert ta.conns[1].rout is not None and tb.conns[0].rout is not None
    assert ta.rins and tb.rins
    del got_a[:], got_b[:]
    return ta, tb, got_a, got_b


def _count_socket_writes(monkeypatch, t):
    writes = []
    send_whole = t._send_whole
    monkeypatch.setattr(t, "_send_whole", lambda c, data: writes.append(len(data)) or
                        send_whole(c, data))
    return writes


def test_ring_entries_wrap_and_a_full_ring_refuses_without_writing():
    r = Ring.create(256)
    w = Ring.open(os.getpid(), r.host.fd, r.offset, 256, ident=1)
    try:
        sent, out = [], []
        for i in range(40):
            frame = bytes([i]) * (i % 50)
            while not w.put(frame, i):
                got = r.take()  # the reader frees room
                assert got, "a full ring with nothing in it"
                out += got
            sent.append((frame, i))
        assert w.pos > 256  # it wrapped
        out += r.take()
        assert [(bytes(b), load) for b, load in out] == sent
        with pytest.raises(ValueError, match="power of two"):
            r.host.ring(100)
    finally:
        r.close()
        w.close()


def test_small_frames_take_the_ring_and_make_no_socket_write(monkeypatch):
    ta, tb, _, got_b = _pair()
    try:
        writes = _count_socket_writes(monkeypatch, ta)
        for i in range(100):
            ta.send(1, [b"m%d" % i], i)
        for i in range(100, 200):
            ta.queue(1, [b"m%d" % i], i)
        ta.flush()
        while len(got_b) < 200:
            tb.poll(1.0)
        assert writes == []
        assert [g[1] for g in got_b] == [[b"m%d" % i] for i in range(200)]
        assert [g[2] for g in got_b] == list(range(200))
    finally:
        ta.close()
        tb.close()


@pytest.mark.parametrize("bulk", [local.BULK_BYTES, 0], ids=["bulk", "no-bulk"])
def test_frames_of_buffers_up_to_the_ring_limit_take_the_ring_and_one_over_takes_the_socket(
        monkeypatch, bulk):
    # (or the bulk area beside the ring, when there is one)
    ta, tb, _, got_b = _pair(bulk_bytes=bulk)
    try:
        socket_frames = []
        sock_send = ta._sock_send
        monkeypatch.setattr(ta, "_sock_send", lambda c, dest, parts, load: socket_frames.append(
            len(parts)) or sock_send(c, dest, parts, load))
        pokes = _count_socket_writes(monkeypatch, ta)
        sizes = [70_000, 100_000, local.RING_FRAME_MAX - 200, 10, 65_536]
        sent = []
        for i, n in enumerate(sizes):
            parts = [b"head%d" % i, bytearray(os.urandom(n)), memoryview(os.urandom(i + 1))]
            ta.send(1, parts, i)
            sent.append([bytes(p) for p in parts])
        while len(got_b) < len(sent):
            tb.poll(1.0)
        assert socket_frames == [] and pokes == []
        assert [g[1] for g in got_b] == sent
        over = [b"over", os.urandom(local.RING_FRAME_MAX)]
        ta.send(1, over, 9)
        while len(got_b) < len(sent) + 1:
            tb.poll(1.0)
        assert got_b[-1][1] == over
        if bulk:
            assert socket_frames == [] and ta.conns[1].rout.bulk.sent == 1
            assert tb.rins[0].rin.bulk.taken == 1
        else:
            assert socket_frames == [2] and ta.conns[1].rout.bulk is None
    finally:
        ta.close()
        tb.close()


def test_frames_of_many_buffers_wrap_a_small_ring_in_order():
    # copied in buffer by buffer: an entry that would cross the ring's end
    # starts again at its beginning, whatever its buffers' sizes
    ta, tb, _, got_b = _pair(ring_bytes=1 << 14)
    try:
        rng = __import__("random").Random(3)
        sent = [[b"h%d" % i] + [os.urandom(rng.randrange(0, 2000))
                                for _ in range(rng.randrange(1, 5))] for i in range(300)]
        reader = threading.Thread(target=lambda: [tb.poll(0.1) for _ in iter(
            lambda: len(got_b) < len(sent), False)])
        reader.start()  # the writer waits for room, the reader frees it
        for i, parts in enumerate(sent):
            ta.send(1, parts, i)
        reader.join(30)
        assert not reader.is_alive()
        assert [g[1] for g in got_b] == sent
        assert [g[2] for g in got_b] == list(range(300))
        assert ta.conns[1].rout.pos > 10 * (1 << 14)  # it went round many times
    finally:
        ta.close()
        tb.close()


@pytest.mark.parametrize("bulk", [1 << 20, 0], ids=["bulk", "no-bulk"])
def test_large_and_many_buffer_frames_keep_their_place_among_ring_frames(bulk):
    # large: by the bulk area while it has room (1 MiB: not for all), else the socket
    ta, tb, _, got_b = _pair(ring_bytes=1 << 16, bulk_bytes=bulk)
    try:
        sent = []
        for i in range(120):
            if i % 7 == 0:
                parts = [b"big%d" % i, os.urandom(local.RING_FRAME_MAX + 1000 * i)]  # socket
            elif i % 5 == 0:
                parts = [b"many%d" % i, os.urandom(100 + i), os.urandom(i)]  # MANY in the ring
            else:
                parts = [b"one%d" % i]
            ta.send(1, parts, i)
            sent.append(parts)
            if i % 10 == 0:
                tb.poll(0)  # the reader keeps up now and then, mid-stream
        while len(got_b) < len(sent):
            tb.poll(1.0)
        assert [g[1] for g in got_b] == sent
        assert [g[2] for g in got_b] == list(range(120))
    finally:
        ta.close()
        tb.close()


def test_a_writer_whose_ring_is_full_waits_for_the_reader_and_loses_nothing():
    ta, tb, got_a, got_b = _pair(ring_bytes=4096)
    done = threading.Event()

    def reader():
        while not done.is_set() or tb.rins[0].rin.pending():
            tb.poll(0.01)

    th = threading.Thread(target=reader)
    th.start()
    try:
        for i in range(3000):  # ~60 times the ring
            ta.send(1, [b"%05d" % i + b"." * 70], i)
    finally:
        done.set()
        th.join()
    try:
        tb.poll(0)
        assert [g[1][0][:5] for g in got_b] == [b"%05d" % i for i in range(3000)]
    finally:
        ta.close()
        tb.close()


def test_a_sleeping_reader_is_woken_by_a_ring_frame():
    ta, tb, _, got_b = _pair()
    woke = []
    th = threading.Thread(target=lambda: woke.append(tb.poll(30.0)))
    th.start()
    try:
        # the reader flags NAP before it sleeps; wait for the flag, then write
        nap = tb.host.words
        while not nap[ring.NAP] and th.is_alive():
            pass
        ta.send(1, [b"wake up"], 0)
        th.join(20.0)
        assert woke == [True] and got_b == [(0, [b"wake up"], 0)]
        assert nap[ring.NAP] == 0  # awake: writers no longer poke
    finally:
        th.join()
        ta.close()
        tb.close()


def test_what_a_peer_wrote_before_it_ended_arrives_before_it_is_lost():
    ta, tb, got_a, got_b = _pair()
    for i in range(50):
        ta.send(1, [b"last%d" % i], 0)
    ta.close()
    try:
        for _ in range(20):
            tb.poll(0.5)
            if got_b and got_b[-1][0] == "lost":
                break
        assert got_b[:-1] == [(0, [b"last%d" % i], 0) for i in range(50)]
        assert got_b[-1] == ("lost", 0, "connection closed")
        assert tb.rins == []
    finally:
        tb.close()


def test_a_frame_that_starts_like_a_control_frame_but_is_not_one_is_delivered():
    ta, tb, _, got_b = _pair()
    try:
        odd = local._CTL + b"X"  # a ring hand-shake op that does not exist
        ta.send(1, [odd, b"payload" * 20000], 0)  # a socket frame of two buffers
        ta.send(1, [b"after"], 1)
        while len(got_b) < 2:
            tb.poll(1.0)
        assert got_b[0][1][0] == odd and got_b[1][1] == [b"after"]
    finally:
        ta.close()
        tb.close()


def test_the_setting_turns_rings_off_and_names_a_bad_value(monkeypatch):
    monkeypatch.delenv("MACROFLOW_RINGS", raising=False)
    assert rings_setting() is True
    monkeypatch.setenv("MACROFLOW_RINGS", "0")
    assert rings_setting() is False
    monkeypatch.setenv("MACROFLOW_RINGS", "yes")
    with pytest.raises(ValueError, match="MACROFLOW_RINGS.*'yes'"):
        rings_setting()


@mf.persistent
class _Probe:
    def rings(self):
        t = current_engine().transport
        return len(t.rins), sum(c.rout is not None for c in t.conns.values())

    def null(self, i):
        return i


def _socket_writes_of_calls(n):
    """The frames context 0 writes to a socket while it makes n calls (after
    the first few, which may still find the rings being set up)."""
    p = _Probe.create(on=1)
    for i in range(20):
        p.null(i).result()
    rings_1 = p.rings().result()
    t0 = current_engine().transport
    writes = []
    send_whole = t0._send_whole
    # a poke (to a peer that had gone to sleep) carries no frame
    t0._send_whole = lambda c, data: (data != local._WAKE and writes.append(len(data))) or \
        send_whole(c, data)
    try:
        for i in range(n):
            assert p.null(i).result() == i
    finally:
        del t0._send_whole
    return rings_1, len(writes)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("setting", ["1", "0"])
def test_calls_between_contexts_use_the_rings_unless_turned_off(monkeypatch, setting):
    monkeypatch.setenv("MACROFLOW_RINGS", setting)
    rings, writes = mf.run(_socket_writes_of_calls, 100, contexts=2, transport="local")
    if setting == "1":
        assert rings == (1, 1) and writes == 0
    else:
        assert rings == (0, 0) and writes >= 100  # each call (and a release)


@mf.persistent
class _Victim:
    def pid(self):
        return os.getpid()

    def wait(self):
        return 1


def _kill_then_call():
    v = _Victim.create(on=1)
    os.kill(v.pid().result(), signal.SIGKILL)
    futs = [v.wait() for _ in range(50)]  # into its ring, never read
    lost = 0
    for f in futs:
        try:
            f.result(timeout=30)
        except mf.ContextLost:
            lost += 1
    return lost


@pytest.mark.timeout(120)
def test_a_context_killed_while_frames_wait_in_its_ring_fails_its_futures():
    assert mf.run(_kill_then_call, contexts=2, transport="local") == 50


def test_a_reader_that_signals_arrivals_is_poked_for_every_frame_it_has_not_seen(monkeypatch):
    # a context in user code is told of frames by SIGIO: the poke a writer
    # sends clears NAP, and the reader's next look must flag it again, or
    # frames after the first raise no signal (served late, by the fallback)
    signals = []
    old = signal.signal(signal.SIGIO, lambda *a: signals.append(1))
    ta, tb, _, got_b = _pair()
    try:
        writes = _count_socket_writes(monkeypatch, ta)
        tb.signal_arrivals(True)
        for i in range(5):
            ta.send(1, [b"req%d" % i], 0)
            tb.poll(0)  # what the handler does: serve what came
            assert got_b[-1] == (0, [b"req%d" % i], 0)
        assert writes == [len(local._WAKE)] * 5
        tb.signal_arrivals(False)
    finally:
        ta.close()
        tb.close()
        signal.signal(signal.SIGIO, old)


@pytest.mark.timeout(30)
def test_a_frame_too_large_to_fit_a_small_ring_at_every_position_travels_on_the_socket():
    # 3000 bytes fit a ring of 4096 only where the ring's end does not fall
    # inside them: wherever it does, it would wait for room for ever
    ta, tb, _, got_b = _pair(ring_bytes=4096)
    try:
        sent = []
        for i, n in enumerate([1000, 3000, 2100, 3000, 5000, 2040, 2050, 3000, 10]):
            parts = [b"%d" % i * n] if i % 2 else [b"h%d" % i, b"%d" % i * n]  # one buffer, MANY
            ta.send(1, parts, i)
            sent.append(parts)
            while len(got_b) < len(sent):
                tb.poll(1.0)
        assert [g[1] for g in got_b] == sent
        assert [g[2] for g in got_b] == list(range(len(sent)))
    finally:
        ta.close()
        tb.close()


def test_a_large_frame_started_while_a_marked_frame_is_delivered_arrives_whole(monkeypatch):
    # the socket is read (its parse delivers the frame of the ring's first
    # MARK) while a second MARK waits in the ring for a large frame that has
    # only begun to arrive: reading the socket again from inside that parse
    # started the large buffer behind its back, and the stream was lost
    monkeypatch.setattr(local, "_STALL", 0.05)  # the wait for the rest of a large buffer
    ta, tb, _, got_b = _pair()
    try:
        c = ta.conns[1]
        first = [b"first" * 20]
        large = [b"head", bytes(range(256)) * 1200]  # received in place (> _BIG)
        wire1 = local._HDR1.pack(1, 0, len(first[0])) + first[0]
        wire2 = local._HDR.pack(2, 0) + struct.pack("<2Q", *map(len, large)) + b"".join(large)
        cut = len(wire2) // 3  # more than the first read takes (a 16 KiB buffer)
        for _ in range(2):
            assert c.rout.put(b"", 0, ring.MARK)  # as ta's sends of these frames do
        c.sock.sendall(wire1 + wire2[:cut])
        tb._read(tb.conns[0])  # what poll does when epoll says the socket is readable
        c.sock.sendall(wire2[cut:])
        ta.send(1, [b"after"], 0)
        for _ in range(100):  # (a lost stream never delivers the rest)
            if len(got_b) == 3:
                break
            tb.poll(0.05)
        assert [g[1] for g in got_b] == [first, large, [b"after"]]
    finally:
        ta.close()
        tb.close()


def test_a_peer_lost_while_its_ring_is_read_does_not_hide_the_next_peers_frames():
    # context 1 reads the rings of 0 and 2; 0 wrote a MARK and ended before
    # its large frame: reading for it finds the end, and the connection
    # leaves the list of rings being gone through. 2's frame, in the next
    # ring, must still be found (2 does not poke: 1 was awake)
    a0, a1 = socket.socketpair()
    c1, c2 = socket.socketpair()
    t0 = LocalTransport(0, {1: a0}, rings=True)
    t1 = LocalTransport(1, {0: a1, 2: c1}, rings=True)
    t2 = LocalTransport(2, {1: c2}, rings=True)
    got = []
    try:
        for t in (t0, t1, t2):
            t.attach(lambda src, bufs, load: got.append((src, [bytes(b) for b in bufs])),
                     lambda p, h: got.append(("lost", p)))
        for t in (t0, t2, t1):
            t.poll(0.1)  # the offers
        for t in (t0, t2):  # each switches to its ring at its first send; 0's is read first
            t.send(1, [b"hello"], 0)
            t1.poll(0.1)
        assert [c.peer for c in t1.rins] == [0, 2] and len(got) == 2
        del got[:]
        assert t0.conns[1].rout.put(b"", 0, ring.MARK)
        t0.close()
        t2.send(1, [b"from 2"], 0)
        for _ in range(20):
            if len(got) == 2:
                break
            t1.poll(0.05)
        assert got == [("lost", 0), (2, [b"from 2"])]
    finally:
        t0.close()
        t1.close()
        t2.close()


def _ring_maps():
    with open("/proc/self/maps") as f:
        return sum("macroflow-rings" in line for line in f)


def test_the_rings_of_a_lost_peer_are_unmapped_and_their_pages_given_back():
    # a context that talks with contexts added and removed while it runs
    # would otherwise keep, for each, its own ring (1 MiB once filled) and a
    # mapping that keeps the other's whole memfd alive
    before = _ring_maps()
    ta, tb, got_a, got_b = _pair(ring_bytes=1 << 16)
    try:
        for i in range(100):  # both rings go round (their pages are touched)
            ta.send(1, [b"a" * 1000], i)
            tb.send(0, [b"b" * 1000], i)
            ta.poll(0)
            tb.poll(0)
        mine = tb.host.rings[0]
        assert mine.words[ring.TAIL] > 1 << 16
        assert os.fstat(tb.host.fd).st_blocks * 512 > 1 << 16  # its pages, in tb's memfd
        ta.close()
        for _ in range(20):
            if got_b and got_b[-1][0] == "lost":
                break
            tb.poll(0.05)
        assert got_b[-1] == ("lost", 0, "connection closed")
        tb.poll(0)
        # only tb's first page is left (BELL and NAP)
        assert _ring_maps() - before == 1
        assert tb.host.rings == [] and tb.mapped == []
        assert os.fstat(tb.host.fd).st_blocks * 512 <= ring.PAGE
    finally:
        ta.close()
        tb.close()
    assert _ring_maps() == before


# -- the bulk area beside each ring ----------------------------------------------

def _hold(t):
    """Make ``t`` keep the buffers it is handed as they are (not copied)."""
    held = []
    t.attach(lambda src, bufs, load: held.append((load, bufs)), lambda p, h: held.append(h))
    return held


def test_large_buffers_held_by_the_receiver_stay_whole_and_when_the_area_is_full_go_by_socket(
        monkeypatch):
    ta, tb, _, _ = _pair(bulk_bytes=1 << 20)
    held = _hold(tb)
    try:
        socket_frames = []
        sock_send = ta._sock_send
        monkeypatch.setattr(ta, "_sock_send", lambda c, dest, parts, load: socket_frames.append(
            load) or sock_send(c, dest, parts, load))
        n = 300_000  # three fit in 1 MiB of slots
        sent = [bytes([i]) * n for i in range(6)]
        for i, data in enumerate(sent):
            ta.send(1, [b"head%d" % i, data], i)
        while len(held) < len(sent):
            tb.poll(1.0)
        out = ta.conns[1].rout.bulk
        assert out.sent == 3 and socket_frames == [3, 4, 5]
        assert [load for load, _ in held] == list(range(6))
        # what came by the area is made on it, not copied: the sender's next
        # frames did not touch it while it was held
        assert [bytes(b[1]) for _, b in held] == sent
        assert [type(b[1]).__name__ for _, b in held[:3]] == ["ndarray"] * 3
        area = tb.rins[0].rin.bulk
        assert area.live == 3 and area.taken == 3
        del held[:1]  # one slot is given back: the next large frame takes it
        assert area.live == 2
        ta.send(1, [b"again", b"x" * n], 6)
        while len(held) < 6:
            tb.poll(1.0)
        assert out.sent == 4 and socket_frames == [3, 4, 5]
        assert bytes(held[-1][1][1]) == b"x" * n and bytes(held[0][1][1]) == sent[1]
    finally:
        ta.close()
        tb.close()


def test_an_array_on_the_bulk_area_outlives_the_transport_and_its_mapping_goes_with_it():
    before = _ring_maps()
    ta, tb, _, _ = _pair()
    held = _hold(tb)
    try:
        ta.send(1, [b"h", os.urandom(10)[:1] * 500_000], 0)
        while not held:
            tb.poll(1.0)
        arr = held.pop()[1][1]
        first = bytes(arr[:10])
    finally:
        ta.close()
        tb.close()
    arr[:10] = 7  # still mapped, and writable
    assert bytes(arr[10:20]) == first and arr.sum() == 7 * 10 + (500_000 - 10) * first[0]
    assert _ring_maps() - before == 1  # the area alone
    del arr
    assert _ring_maps() == before


def test_a_bulk_area_refuses_a_descriptor_outside_it_and_a_ring_without_one_a_bulk_entry():
    h = ring.RingHost()
    try:
        r = h.ring(4096, bulk=1 << 16)
        with pytest.raises(ValueError, match="no bulk buffer of 4096 bytes at 65000"):
            r.bulk.take(0, 65_000, 4096)
        with pytest.raises(ValueError, match="slot 64"):
            r.bulk.take(ring.BULK_SLOTS, 0, 16)
        with pytest.raises(ValueError, match="multiple of"):
            h.ring(4096, bulk=1000)
        plain = h.ring(4096)
        w = Ring.open(os.getpid(), h.fd, plain.offset, 4096, ident=1)
        assert w.bulk is None and w.bulk_body([memoryview(b"h"), memoryview(b"x" * 9000)], 0,
                                              1, 4096) is None
        w.put(ring._FRAME.pack(2, 0) + ring.BULK_DESC.pack(0, 0, 0, 8), 0, ring.BULK)
        with pytest.raises(ValueError, match="without a bulk area"):
            plain.read_bulk(ring.DATA)
        w.close()
    finally:
        h.close()


def test_the_bulk_writer_uses_the_smallest_free_slot_and_carves_anew_once_all_are_back():
    h = ring.RingHost()
    try:
        r = h.ring(4096, bulk=1 << 20)
        writer = Ring.open(os.getpid(), h.fd, r.offset, 4096, ident=1)
        w = writer.bulk
        a, b = w.claim(500_000), w.claim(100_000)
        assert (a, b) == (0, 1) and w.claim(500_000) == -1  # no room left for another
        r.bulk.back[a] += 1
        assert w.claim(50_000) == a  # the only free one (too big, but it fits)
        r.bulk.back[a] += 1
        r.bulk.back[b] += 1
        assert w.claim(50_000) == b  # the smallest free one that fits
        r.bulk.back[b] += 1
        assert w.claim(900_000) == 0 and w.slots == [[0, 901_120]]  # all back: carved anew
        writer.close()
    finally:
        h.close()


@mf.persistent
class _Big:
    def make(self, n, v):
        return np.full(n, v)

    def total(self, a):
        return float(a.sum())

    def bulk(self):
        t = current_engine().transport
        return sum(c.rout.bulk.sent for c in t.conns.values()
                   if c.rout is not None and c.rout.bulk is not None)


def _big_both_ways():
    b = _Big.create(on=1)
    arrs = [b.make(1 << 19, float(i)).result() for i in range(4)]  # 4 MiB each, kept
    sums = [b.total(a).result() for a in arrs]
    return arrs, sums, b.bulk().result()


@pytest.mark.timeout(120)
def test_large_arrays_cross_by_the_bulk_area_and_a_kept_result_outlives_the_computation():
    arrs, sums, bulk = mf.run(_big_both_ways, contexts=2, transport="local")
    assert bulk == 4
    assert sums == [float(i) * (1 << 19) for i in range(4)]
    assert [float(a[-1]) for a in arrs] == [0.0, 1.0, 2.0, 3.0]
    arrs[0][:] = 5.0  # the session is closed; the arrays are still the user's
    assert float(arrs[0].sum()) == 5.0 * (1 << 19)


@pytest.mark.parametrize("make", ["local", "mpi"])
def test_the_spin_grows_to_cover_a_short_wait_and_shrinks_after_a_long_one(make):
    if make == "local":
        t = LocalTransport(0, {}, spin_us=50)
    else:
        M = pytest.importorskip("macroflow.transport.mpi")
        if M.available() is not None:
            pytest.skip(M.available())
        t = M.MpiTransport(M.mpi().COMM_SELF.Dup(), 50)
    try:
        assert t.spin_cur == t.spin_s == 50e-6 and t.spin_max == 20 * 50e-6
        t._adapt(200e-6, True)  # a frame 200 us after the wait began: spin that long, and more
        assert t.spin_cur == pytest.approx(300e-6)
        t._adapt(100e-6, True)  # a shorter wait does not shrink it
        assert t.spin_cur == pytest.approx(300e-6)
        t._adapt(900e-6, True)  # never beyond spin_max
        assert t.spin_cur == pytest.approx(t.spin_max)
        t._adapt(0.5, True)  # a long wait halves it
        assert t.spin_cur == pytest.approx(t.spin_max / 2)
        t._adapt(1e-4, False)  # so does a wait that ended with nothing
        assert t.spin_cur == pytest.approx(t.spin_max / 4)
        for _ in range(10):
            t._adapt(1.0, True)
        assert t.spin_cur == pytest.approx(t.spin_s)  # never below the setting
    finally:
        t.close()


@mf.persistent
class _Slow:
    def work(self, us):
        end = time.perf_counter() + us / 1e6
        while time.perf_counter() < end:
            pass
        return us


def _pokes():
    return current_engine().transport.pokes


def test_a_caller_whose_replies_take_a_little_longer_than_the_spin_stops_needing_a_wake_up():
    # Each reply comes about 300 us after its call, longer than the 50 us spin:
    # without the spin's growth the caller sleeps every time and every reply
    # pokes its socket; with it, the caller soon spins for the whole wait.
    with mf.init(contexts=2, transport="local", spin_us=50):
        s = _Slow.create(on=1)
        s.work(1).result(30)
        n = 200
        t = current_engine().transport
        before = mf.remote_action(1, _pokes).wait(30)
        calmed = t.spins_preempted
        for _ in range(n):
            assert s.work(300).result(30) == 300
        pokes = mf.remote_action(1, _pokes).wait(30) - before
        calmed = t.spins_preempted - calmed
        assert t.spin_s < t.spin_cur <= t.spin_max
    if pokes >= n // 4 and calmed >= n // 8:
        # a spin found preempted is calmed, and sleeps, by design: with
        # another program on these cores there is nothing to measure here
        pytest.skip(f"the caller's spin was preempted {calmed} times in {n} calls")
    assert pokes < n // 4, f"{pokes} of {n} replies had to wake the caller ({calmed} preempted)"


class _Glancer:
    """What ring.glance needs of a transport."""

    def __init__(self, rins=(1,), calm_until=0.0, spin_s=2e-3):
        self.rins, self.calm_until, self.spin_s = list(rins), calm_until, spin_s
        self.spins_preempted = 0
        self.looks = 0

    def _rings(self):
        self.looks += 1
        return False


def test_a_glance_looks_until_told_and_no_longer_than_the_spin():
    import time
    from macroflow.transport.ring import glance
    t = _Glancer()
    glance(t, lambda: t.looks == 5)
    assert t.looks == 5
    t = _Glancer(spin_s=2e-3)
    start = time.perf_counter()
    glance(t, lambda: False)  # nothing comes: it gives up after spin_s
    # (or sooner, having found itself preempted on a loaded machine)
    assert t.spins_preempted == 1 or (t.looks > 1 and time.perf_counter() - start >= 2e-3)
    t = _Glancer(rins=())  # no rings: nothing to look at
    glance(t, lambda: False)
    assert t.looks == 0
    t = _Glancer(calm_until=time.perf_counter() + 60)  # preempted lately: no glance
    glance(t, lambda: False)
    assert t.looks == 0


def test_a_glance_that_was_preempted_stops_and_calms_the_spin(monkeypatch):
    from macroflow.transport import ring
    clock = iter([0.0, 0.5])  # the first look ends 0.5 s after it began

    monkeypatch.setattr(ring.time, "perf_counter", lambda: next(clock))
    t = _Glancer(spin_s=10.0)
    ring.glance(t, lambda: False)
    assert t.looks == 1 and t.spins_preempted == 1
    assert t.calm_until == 0.5 + ring.GLANCE_CALM


def _patient_glances():
    """Make the glance of this context's main thread wait as long as it
    takes, so that every answer is caught by a glance and no wait of the
    main thread steps the engine's loop."""
    eng = current_engine()
    t = eng.transport

    def patient(stop):  # (the sockets too: a ring is set up by frames on them)
        if isinstance(greenlet.getcurrent(), Worker):
            return  # a method's thread parks: the main thread is the one that waits
        while not stop():
            t.flush()
            t.poll(0)

    eng.glance = patient


def test_releases_go_out_when_every_answer_is_caught_by_a_glance():
    # A wait whose answer a glance catches returns without a step of the
    # engine's loop; the releases of dropped futures must still go out.
    with mf.init(contexts=2, transport="local"):
        _patient_glances()
        s = _Slow.create(on=1)
        for _ in range(300):
            assert s.work(0).result() == 0  # (a wait with no timeout glances)
        held = mf.stats()[1]["values_held"]
    assert held < 100, f"context 1 still holds {held} values of 300 dropped futures"


@mf.persistent
class _TimesOut:
    def wait_on(self, slow):
        f = slow.work(2e6)
        start = time.monotonic()
        with pytest.raises(mf.TimeoutError):
            f.result(0.05)
        return time.monotonic() - start  # how long the 0.05 s wait took


def test_a_timer_fires_when_every_answer_is_caught_by_a_glance():
    # A thread of context 0 waits with a timeout while the main thread's
    # calls are all answered within glances: the timer still fires.
    with mf.init(contexts=3, transport="local"):
        _patient_glances()
        s = _Slow.create(on=1)
        w = _TimesOut.create(on=0).wait_on(_Slow.create(on=2))
        end = time.monotonic() + 1.0
        while time.monotonic() < end:
            assert s.work(0).result() == 0
        took = w.result(30)
    assert took < 0.5, f"a 0.05 s timeout fired after {took:.3f} s"


# ---------------------------------------------------------------- the compiled core
# Ring's common steps (put, send1, drain) run in C where macroflow.transport._cring
# was built, and in Python (ring._PyCore) where not: both must read and write
# the same entries, each the other's.

CORES = [pytest.param((ring.Ring, ring.Ring), id="ring-ring"),
         pytest.param((ring.PyRing, ring.PyRing), id="py-py"),
         pytest.param((ring.Ring, ring.PyRing), id="ring-reads-py"),
         pytest.param((ring.PyRing, ring.Ring), id="py-reads-ring")]


@contextlib.contextmanager
def _open_pair(classes, cap):
    """A ring of ``cap`` bytes: its host, its reader and its writer, of the
    two classes; closed at the end."""
    reader_class, writer_class = classes
    host = ring.RingHost(reader_class)
    r = host.ring(cap)
    w = writer_class.open(os.getpid(), host.fd, r.offset, cap, ident=1)
    try:
        yield host, r, w
    finally:
        w.close()
        host.close()


def test_the_compiled_core_is_built_here_unless_switched_off():
    # CI installs with a compiler and Cython: the rings run the compiled core
    # (MACROFLOW_COMPILED=0 runs the pure-Python one, as a machine without them does)
    if os.environ.get("MACROFLOW_COMPILED") == "0":
        assert not ring.COMPILED and ring.Ring is ring.PyRing
    else:
        assert ring.COMPILED, "macroflow.transport._cring was not built"
        assert ring.Ring.__bases__[0].__module__ == "macroflow.transport._cring"
    assert ring.PyRing.__bases__ == (ring._PyCore,)


@pytest.mark.parametrize("classes", CORES)
@hypothesis.settings(max_examples=60, deadline=None)
@hypothesis.given(ops=st.lists(st.tuples(st.sampled_from([0, 1, 7, 8, 9, 40, 100, 120]),
                                         st.booleans()), min_size=1, max_size=300))
def test_either_core_reads_what_either_wrote_across_wraps_and_a_full_ring(classes, ops):
    # ops: (frame size, whether the reader drains after it); a small ring, so
    # that frames wrap at every position and the writer finds it full
    sent, got = [], []

    def deliver(p, bufs, load):
        got.append((bytes(bufs[0]), load, p))

    with _open_pair(classes, 256) as (host, r, w):
        for i, (n, drain) in enumerate(ops):
            data = bytes([i % 251]) * n
            k = w.send1(data, i)
            assert k in (0, 1)
            if k == 1:
                sent.append((data, i))
            else:  # no room (a WRAP included): nothing written
                need = 8 + ((n + 7) & -8)
                end = 256 - (w.pos & 255)
                assert w.pos + need + (end if need > end else 0) - r.pos > 256
            if drain or k == 0:
                st_ = r.drain(deliver, 5)
                assert st_ & 15 == ring.EMPTY
                assert r.words[ring.HEAD] == r.pos == w.pos
        r.drain(deliver, 5)
        assert [(d, load) for d, load, _ in got] == sent
        assert {p for _, _, p in got} <= {5}


@pytest.mark.parametrize("classes", CORES)
def test_drain_stops_at_an_entry_of_another_kind_and_leaves_it_there(classes):
    with _open_pair(classes, 4096) as (host, r, w):
        w.put(b"a", 1)
        w.put(b"", 0, ring.MARK)
        w.put(b"b", 2)
        got = []
        st = r.drain(lambda p, bufs, load: got.append(bytes(bufs[0])), 0)
        assert (st >> 4, st & 15) == (1, -ring.MARK) and got == [b"a"]
        # the MARK is at pos, unread; the room before it is the writer's again
        assert ring.ENTRY.unpack_from(r.mm, ring.DATA + (r.pos & r.mask))[0] == ring.MARK
        assert r.words[ring.HEAD] == r.pos == 16
        r.pos += 8  # the caller steps over it
        st = r.drain(lambda p, bufs, load: got.append(bytes(bufs[0])), 0)
        assert (st >> 4, st & 15) == (1, ring.EMPTY) and got == [b"a", b"b"]


@pytest.mark.parametrize("classes", CORES)
def test_drain_stops_after_the_frame_that_holds_its_peer(classes):
    held = set()
    got = []

    def deliver(p, bufs, load):
        got.append(bytes(bufs[0]))
        if bufs[0] == b"2":
            held.add(p)  # as a frame whose large buffers are still on their way

    with _open_pair(classes, 4096) as (host, r, w):
        for x in (b"1", b"2", b"3"):
            w.put(x, 0)
        st = r.drain(deliver, 9, held)
        assert (st >> 4, st & 15) == (2, ring.HELD) and got == [b"1", b"2"]
        held.clear()
        st = r.drain(deliver, 9, held)
        assert (st >> 4, st & 15) == (1, ring.EMPTY) and got == [b"1", b"2", b"3"]


@pytest.mark.parametrize("classes", CORES)
def test_send1_says_when_the_reader_may_be_asleep(classes):
    with _open_pair(classes, 64) as (host, r, w):
        assert w.send1(b"x" * 8, 0) == 1
        host.words[ring.NAP] = 1  # the reader's flag: it sleeps
        assert w.send1(b"y" * 8, 0) == 2
        assert host.words[ring.NAP] == 1  # (the transport clears it, and wakes the reader)
        assert w.send1(b"z" * 40, 0) == 0  # full: nothing written
        got = []
        r.drain(lambda p, bufs, load: got.append(bytes(bufs[0])), 0)
        assert got == [b"x" * 8, b"y" * 8]


@pytest.mark.parametrize("classes", CORES)
def test_an_error_in_delivery_leaves_the_ring_past_the_frame_delivered(classes):
    with _open_pair(classes, 4096) as (host, r, w):
        for x in (b"1", b"2"):
            w.put(x, 0)

        def deliver(p, bufs, load):
            raise KeyError(bytes(bufs[0]))

        with pytest.raises(KeyError, match="1"):
            r.drain(deliver, 0)
        got = []
        st = r.drain(lambda p, bufs, load: got.append(bytes(bufs[0])), 0)
        assert st >> 4 == 1 and got == [b"2"]  # "1" is not delivered twice


@pytest.mark.skipif(not ring.COMPILED, reason="the compiled core was not built")
def test_the_compiled_core_refuses_a_closed_ring_rather_than_touch_its_memory():
    with _open_pair((ring.Ring, ring.Ring), 4096) as (host, r, w):
        pass
    with pytest.raises(ValueError, match="the ring is closed"):
        ring._Core.put(w, b"x", 0)
    with pytest.raises(ValueError, match="the ring is closed"):
        ring._Core.drain(r, lambda *a: None, 0)


@pytest.mark.timeout(120)
def test_the_pure_python_core_runs_a_computation_and_a_bad_setting_is_named(tmp_path):
    script = tmp_path / "prog.py"
    script.write_text(
        "import numpy as np\n"
        "import macroflow as mf\n"
        "from macroflow.transport import ring\n"
        "@mf.persistent\n"
        "class P:\n"
        "    def echo(self, x): return x\n"
        "def main():\n"
        "    p = P.create()\n"
        "    assert [p.echo(i).result() for i in range(500)] == list(range(500))\n"
        "    a = np.arange(100_000.0)\n"
        "    assert (p.echo(a).result() == a).all()\n"
        "    print('compiled', ring.COMPILED, sum(mf.gather([p.echo(i) for i in range(2000)])))\n"
        "mf.run(main, contexts=2, transport='local')\n")
    env = dict(os.environ, MACROFLOW_COMPILED="0")
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env,
                       timeout=100)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["compiled", "False", str(sum(range(2000)))]
    env["MACROFLOW_COMPILED"] = "yes"
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env,
                       timeout=100)
    assert p.returncode != 0
    assert ("ValueError: the MACROFLOW_COMPILED environment variable must be 0 (the rings' "
            "steps in Python) or 1 (compiled, which must have been built); got 'yes'") \
        in p.stderr, p.stderr
    assert "Traceback" in p.stderr and "import macroflow" not in p.stderr  # (refused at start)
    # importing is not starting: `macroflow info` (and a program's imports) say it, not fail
    p = subprocess.run([sys.executable, "-m", "macroflow", "info"], capture_output=True,
                       text=True, env=env, timeout=100)
    assert p.returncode == 0, p.stderr
    assert "rings        refused at start: the MACROFLOW_COMPILED environment variable" \
        in p.stdout, p.stdout


@pytest.mark.timeout(180)
def test_without_a_c_compiler_the_build_warns_and_goes_on(tmp_path, monkeypatch, capfd):
    # what `pip install` runs (setup.py's build_ext) on a machine without a
    # compiler: the compiled modules are skipped with a warning, and the
    # install goes on
    pytest.importorskip("Cython")
    from setuptools import Distribution
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    monkeypatch.chdir(root)
    ns = runpy.run_path(os.path.join(root, "setup.py"), run_name="macroflow_setup")
    exts = ns["_extensions"]()
    assert [e.name for e in exts] == ["macroflow.transport._cring"]
    dist = Distribution({"name": "macroflow", "ext_modules": exts,
                         "cmdclass": {"build_ext": ns["optional_build_ext"]}})
    cmd = dist.get_command_obj("build_ext")
    cmd.build_lib, cmd.build_temp = str(tmp_path / "lib"), str(tmp_path / "tmp")
    monkeypatch.setenv("CC", "/bin/false")
    monkeypatch.setenv("LDSHARED", "/bin/false")
    dist.run_command("build_ext")  # no error
    err = capfd.readouterr().err
    assert "WARNING: macroflow.transport._cring not built" in err
    assert "macroflow runs its pure-Python code" in err
    assert not list(tmp_path.rglob("*.so"))


@pytest.mark.timeout(300)
def test_a_wheel_built_from_the_sdist_has_the_compiled_core(tmp_path):
    # the release path (python -m build, or pip from an sdist): the sdist
    # lacked the .pyx, and its wheels never had the compiled core
    pytest.importorskip("build")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.run([sys.executable, "-m", "build", "--sdist", "--outdir", str(tmp_path), root],
                       capture_output=True, text=True, timeout=250)
    if p.returncode != 0 and "Could not find a version" in p.stdout + p.stderr:
        pytest.skip("the package index cannot be reached for the build's requirements")
    assert p.returncode == 0, p.stdout + p.stderr
    sdist, = tmp_path.glob("macroflow-*.tar.gz")
    names = tarfile.open(sdist).getnames()
    assert any(n.endswith("src/macroflow/transport/_cring.pyx") for n in names)
    assert not any(n.endswith("_cring.c") for n in names)  # (generated at the build)
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w",
                        str(tmp_path / "w"), str(sdist)], capture_output=True, text=True,
                       timeout=250)
    assert p.returncode == 0, p.stdout + p.stderr
    wheel, = (tmp_path / "w").glob("macroflow-*.whl")
    inside = zipfile.ZipFile(wheel).namelist()
    assert any(n.startswith("macroflow/transport/_cring.") and n.endswith(".so") for n in inside)
    assert not any(n.endswith((".pyx", ".c")) for n in inside)


@pytest.mark.timeout(120)
def test_requiring_the_compiled_core_where_it_was_not_built_says_so(tmp_path):
    src = os.path.join(os.path.dirname(os.path.abspath(ring.__file__)), "..", "..")
    copy = tmp_path / "src"
    shutil.copytree(src, copy, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    env = dict(os.environ, PYTHONPATH=str(copy), MACROFLOW_COMPILED="1")
    p = subprocess.run([sys.executable, "-c", "import macroflow as mf; "
                        "mf.run(print, contexts=1, transport='inproc')"],
                       capture_output=True, text=True, env=env, timeout=100)
    assert p.returncode != 0
    assert ("ValueError: MACROFLOW_COMPILED=1, but the rings' compiled core "
            "(macroflow.transport._cring) was not built here") in p.stderr, p.stderr
    env.pop("MACROFLOW_COMPILED")
    p = subprocess.run([sys.executable, "-c", "import macroflow.transport.ring as r; "
                        "print(r.COMPILED)"], capture_output=True, text=True, env=env, timeout=100)
    assert p.stdout.split() == ["False"], p.stderr  # (the Python steps, unasked)
