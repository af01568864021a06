"""The local protocol module: framing, large frames, no deadlock on big crossings."""

import os
import socket

import numpy as np
import pytest

from macroflow.core import marshal
from macroflow.transport.local import LocalTransport

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
    finally:
        _, status = os.waitpid(pid, 0)
        ta.close()
    assert os.WEXITSTATUS(status) == 0


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
