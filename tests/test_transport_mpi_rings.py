"""Shared-memory rings between MPI ranks of one host: order with MPI, full
rings, sleeping readers, ranks that leave, and the setting that turns them off.

The conformance suite runs on them too (transport_harness's ``mpi-rings``).
Every test that starts ranks has a timeout; those under a real ``mpiexec``
run it as a subprocess with a timeout of its own.
"""

import ast
import glob
import os
import select

import pytest

import macroflow as mf
from macroflow.core.context import current_engine
from macroflow.transport import mpi as M
from macroflow.transport import ring

from conftest import MPI_MISSING
# what a job ended by a killed rank or MPI_Abort leaves in /dev/shm is removed
from test_transport_mpi import _no_mpich_segments_left, _no_mpich_segments_left_by_the_module  # noqa: F401,E501
from test_transport_mpi import _mpiexec

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(MPI_MISSING is not None, reason=str(MPI_MISSING)),
              pytest.mark.skipif(ring.problem() is not None, reason="no rings on this CPU")]


def _self_ring(name, ring_bytes=M.RING_BYTES, bulk_bytes=M.BULK_BYTES):
    """A transport on COMM_SELF that writes to itself through a ring: the rank
    stands in for a peer of its own host (as in test_transport_mpi)."""
    t = M.MpiTransport(M.mpi().COMM_SELF.Dup(), wake=(name, {0: "here"}), rings=True,
                       ring_bytes=ring_bytes, bulk_bytes=bulk_bytes)
    got = []
    t.attach(lambda src, bufs, load: got.append(([bytes(memoryview(b).cast("B")) for b in bufs],
                                                 load)),
             lambda peer, how: got.append(("lost", peer, how)))
    t.wakes = {0: M.Waker.address(name, 0)}
    t._offer_rings()
    while not t.rout_next:  # the offer travels by MPI
        t.poll(0.01)
    return t, got


def _frames(count, seed=0):
    """Small frames (ring), frames of several buffers (ring) and frames of
    more than 64 KiB (MPI, behind a MARK), interleaved."""
    out = []
    for i in range(count):
        if i % 7 == 3:
            out.append([b"big%d" % i, bytes([i % 251]) * (M.RING_FRAME_MAX + 1000 * (i % 5))])
        elif i % 5 == 1:
            out.append([b"many%d" % i, os.urandom(100 + i), os.urandom(i % 50)])
        else:
            out.append([b"one%d" % i + b"." * (i % 300)])
    return out


@pytest.mark.parametrize("bulk", [M.BULK_BYTES, 0], ids=["bulk", "no-bulk"])
def test_frames_of_mixed_sizes_keep_their_order_through_ring_and_mpi(bulk):
    # the large ones by the ring's bulk area, or by MPI when there is none
    t, got = _self_ring(f"mixed-{os.getpid()}", ring_bytes=1 << 16, bulk_bytes=bulk)
    try:
        frames = _frames(300)
        for i, parts in enumerate(frames):
            (t.send if i % 3 else t.queue)(0, parts, i)
            if i % 10 == 0:
                t.flush()
                t.poll(0)  # the reader keeps up now and then, mid-stream
        t.flush()
        while len(got) < len(frames):
            t.poll(1.0)
        assert [g[1] for g in got] == list(range(len(frames)))
        assert [g[0] for g in got] == frames
        big = sum(1 for f in frames if len(f) == 2)
        if bulk:
            assert t.ring_got == t.ring_sent == len(frames)
            assert t.rout[0].bulk.sent == big and t.rin[0].bulk.taken == big
        else:
            assert t.ring_got == t.ring_sent == len(frames) - big  # the others went by MPI
    finally:
        t.close()


def test_a_full_ring_waits_for_its_reader_and_loses_nothing():
    t, got = _self_ring(f"full-{os.getpid()}", ring_bytes=4096)
    try:
        for i in range(2000):  # ~40 times the ring: its writer reads it to make room
            t.queue(0, [b"%05d" % i + b"." * 70], i)  # (a send would look for frames too)
        t.flush()
        while len(got) < 2000:
            t.poll(1.0)
        assert [g[0][0][:5] for g in got] == [b"%05d" % i for i in range(2000)]
        assert t.ring_waits > 0 and t.ring_got == 2000
    finally:
        t.close()


def test_nap_says_a_ring_holds_frames_and_a_napping_reader_is_woken():
    t, got = _self_ring(f"nap-{os.getpid()}")
    try:
        t.send(0, [b"first"], 0)
        t.poll(1.0)
        assert got and t.nap(True) is False  # nothing waits: the watcher may sleep
        t.waker.drain()
        t.send(0, [b"second"], 1)  # NAP is flagged: the writer wakes the reader
        assert t.wakeups >= 1 and select.select([t.fileno()], [], [], 10)[0] == [t.fileno()]
        assert t.host.words[ring.NAP] == 0  # (the writer cleared it: one wake-up per nap)
        assert t.nap(True) is True  # and a frame waits in the ring
        t.nap(False)
        t.poll(1.0)
        assert [g[0] for g in got] == [[b"first"], [b"second"]]
    finally:
        t.close()


def test_frames_delivered_while_a_send_waits_make_the_next_poll_return_at_once():
    # a value taken as it is read completes its future there: the caller's
    # next poll must not sleep waiting for what has come already
    t, got = _self_ring(f"aside-{os.getpid()}")
    try:
        t.queue(0, [b"reply"], 0)
        t.flush()
        assert t._progress_aside() and got  # as a send does, every third, or waiting for room
        assert t.nap(True) is True
        t.nap(False)
        assert t.poll(5.0) is True
        assert t.poll(0) is False
    finally:
        t.close()


def test_an_offer_that_does_not_map_the_offered_ring_is_declined():
    t = M.MpiTransport(M.mpi().COMM_SELF.Dup(), wake=(f"decline-{os.getpid()}", {0: "here"}),
                       rings=True)
    try:
        t.wakes = {0: M.Waker.address(f"decline-{os.getpid()}", 0)}
        h = ring.RingHost()
        r = h.ring(4096)
        r.words[M._NONCE] = 1234
        # another number: the pid is another process (another pid namespace)
        t._offered(0, M._OFFER.pack(os.getpid(), h.fd, r.offset, 4096, 999))
        # no such process, or no such descriptor: MPI alone
        t._offered(0, M._OFFER.pack(2 ** 31 - 1, h.fd, r.offset, 4096, 1234))
        t._offered(0, M._OFFER.pack(os.getpid(), 1000, r.offset, 4096, 1234))
        assert t.rout_next == {} and t.mapped == []
        t._offered(0, M._OFFER.pack(os.getpid(), h.fd, r.offset, 4096, 1234))
        assert list(t.rout_next) == [0]
        h.close()
    finally:
        t.close()


def test_rings_are_off_where_the_cpu_lacks_total_store_order(monkeypatch):
    monkeypatch.setattr(ring, "problem", lambda machine=None: "no total store order")
    t = M.MpiTransport(M.mpi().COMM_SELF.Dup(), wake=(f"tso-{os.getpid()}", {0: "here"}),
                       rings=True)
    try:
        assert t.rings is False
        t.wakes = {0: M.Waker.address(f"tso-{os.getpid()}", 0)}
        t._offer_rings()
        assert t.host is None and not t.offers
    finally:
        t.close()


# -- between spawned ranks (transport_harness drives them) ---------------------------

def _build(n):
    """n ends whose rings to one another are mapped (the offers have come)."""
    from transport_harness import build_mpi_rings
    e = build_mpi_rings(n)
    for a in e.ids:
        for b in e.ids:
            if a != b:
                e.ends[a].send(b, [b"hello"], 0)
    e.pump(lambda: all(len(e.got[i]) == n - 1 for i in e.ids))
    for i in e.ids:
        del e.got[i][:]
    return e


@pytest.mark.timeout(180)
@pytest.mark.parametrize("n", [2, 3])
def test_mixed_sizes_keep_their_order_per_pair_between_ranks(n):
    e = _build(n)
    try:
        r, senders = e.ids[0], e.ids[1:]
        sent = {s: _frames(200, seed=s) for s in senders}
        workers = [e.background(s, lambda s=s: [e.ends[s].send(r, p, i)
                                                for i, p in enumerate(sent[s])])
                   for s in senders]
        e.pump(lambda: len(e.got[r]) == 200 * len(senders) and all(w.done for w in workers))
        for w in workers:
            w.result(timeout=10)
        for s in senders:
            mine = [(src, [bytes(b) for b in bufs], load) for src, bufs, load in e.got[r]
                    if src == s]
            assert [load for _, _, load in mine] == list(range(200))
            assert [bufs for _, bufs, _ in mine] == sent[s]
            ring_sent, _, _ = e.ends[s].ring_counts()
            assert ring_sent > 100  # the small ones went through the ring
        assert e.ends[r].ring_counts()[1] > 100 * len(senders)
    finally:
        e.close()


@pytest.mark.timeout(180)
def test_two_ranks_flooding_each_other_through_full_rings_both_finish():
    e = _build(2)
    try:
        a, b = e.ids
        n = 4000  # ~4 MB each way: four times a ring
        pad = b"." * 1000

        def flood(me, other, tag):
            # queued (a send would look for frames now and then): neither
            # reads but while it waits for room in the other's ring
            for i in range(n):
                e.ends[me].queue(other, [tag + b"%d" % i + pad], i)
            e.ends[me].flush()

        wa = e.background(a, lambda: flood(a, b, b"a"))
        wb = e.background(b, lambda: flood(b, a, b"b"))
        e.pump(lambda: wa.done and wb.done, timeout=150)
        wa.result(timeout=10)
        wb.result(timeout=10)
        e.pump(lambda: len(e.got[a]) == n and len(e.got[b]) == n)
        assert [bytes(bufs[0]) for _, bufs, _ in e.got[a]] == [b"b%d" % i + pad for i in range(n)]
        assert [bytes(bufs[0]) for _, bufs, _ in e.got[b]] == [b"a%d" % i + pad for i in range(n)]
        counts = [e.ends[end].ring_counts() for end in (a, b)]
        assert all(sent == n and got == n for sent, got, _ in counts)
        # a ring filled: its writer read its own meanwhile (which let the other go on)
        assert sum(waits for _, _, waits in counts) > 0
    finally:
        e.close()


@pytest.mark.timeout(120)
def test_what_a_leaving_ranks_ring_holds_arrives_before_it_is_reported_lost():
    e = _build(2)
    try:
        a, b = e.ids
        events = []
        e.ends[b].attach(lambda src, bufs, load: events.append(("frame", load)),
                         lambda peer, how: events.append(("lost", peer)))
        frames = _frames(60)
        for i, parts in enumerate(frames):
            e.ends[a].send(b, parts, i)
        assert e.ends[a].ring_counts()[0] > 0
        e.disappear(a)  # it says goodbye, and leaves
        e.pump(lambda: ("lost", a) in events, timeout=60)
        assert events == [("frame", i) for i in range(60)] + [("lost", a)]
    finally:
        e.close()


# -- computations ------------------------------------------------------------------------

@mf.persistent
class Counter:
    def ring_counts(self):
        t = current_engine().transport
        return t.ring_sent, t.ring_got

    def echo(self, x):
        return x


def _memfds():
    """The rings' memfds this process holds or maps."""
    held = [os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
            if os.path.exists(f"/proc/self/fd/{fd}")]
    with open("/proc/self/maps") as f:
        mapped = [line for line in f if "macroflow-rings" in line]
    return [h for h in held if "macroflow-rings" in h] + mapped


@pytest.mark.timeout(120)
def test_spawned_ranks_use_no_rings_and_leave_no_memfd_behind(monkeypatch):
    # rings are for the ranks of mpiexec (see the launcher: a spawned job's
    # disconnection could hang with them)
    monkeypatch.delenv("MACROFLOW_RINGS", raising=False)
    with mf.init(contexts=2, transport="mpi"):
        c = Counter.create(on=1)
        big = b"x" * (M.RING_FRAME_MAX * 2)
        for i in range(2000):
            x = big if i % 100 == 0 else i
            assert c.echo(x).result() == x  # (the timeout of the test if one hangs)
        sent, got = c.ring_counts().result(30)
        t = current_engine().transport
        assert (sent, got, t.ring_sent, t.ring_got) == (0, 0, 0, 0)
    assert _memfds() == []


COUNTING = """
    import macroflow as mf
    from macroflow.core.context import current_engine

    @mf.persistent
    class Counter:
        def ring_counts(self):
            t = current_engine().transport
            return t.ring_sent, t.ring_got

        def echo(self, x):
            return x

    def main():
        cs = [Counter.create(on=c) for c in (1, 2)]
        for i in range(100):
            assert [c.echo(i).result() for c in cs] == [i, i]
        t = current_engine().transport
        return [c.ring_counts().result() for c in cs], (t.ring_sent, t.ring_got)

    print("counts", repr(mf.run(main)))
"""


@pytest.mark.timeout(180)
@pytest.mark.parametrize("setting", ["1", "0"])
def test_mpiexec_ranks_of_one_host_use_rings_unless_turned_off(tmp_path, setting):
    before = set(glob.glob("/dev/shm/macroflow-mpi-*"))
    code, out, err = _mpiexec(tmp_path, 3, COUNTING, env={"MACROFLOW_RINGS": setting})
    assert code == 0, err
    line, = [l for l in out.splitlines() if l.startswith("counts")]
    counts, mine = ast.literal_eval(line[len("counts"):].strip())
    if setting == "1":
        assert all(sent >= 100 and got >= 100 for sent, got in counts)
        assert mine[0] >= 200 and mine[1] >= 200
    else:
        assert counts == [(0, 0), (0, 0)] and mine == (0, 0)
    assert set(glob.glob("/dev/shm/macroflow-mpi-*")) <= before  # nothing left behind


@pytest.mark.timeout(180)
def test_a_rank_killed_while_rings_carry_its_frames_ends_the_job(tmp_path):
    code, out, err = _mpiexec(tmp_path, 3, """
        import os, signal
        import macroflow as mf
        from macroflow.core.context import current_engine

        @mf.persistent
        class Victim:
            def echo(self, x):
                return x

            def die(self):
                os.kill(os.getpid(), signal.SIGKILL)

        def main():
            v = Victim.create(on=2)
            for i in range(200):
                assert v.echo(i).result() == i
            print("rings", current_engine().transport.ring_got, flush=True)
            v.die().result(60)

        mf.run(main)
        print("never")
    """)
    assert code != 0
    assert "never" not in out
    got = int([l for l in out.splitlines() if l.startswith("rings")][0].split()[1])
    assert got >= 200  # the replies came through the ring
    assert "BAD TERMINATION" in out  # MPI's process manager ended the job


@pytest.mark.timeout(120)
def test_a_bad_rings_setting_under_mpiexec_is_a_clear_error_printed_once(tmp_path):
    code, out, err = _mpiexec(tmp_path, 2, """
        import macroflow as mf
        print(mf.run(lambda: 1))
    """, env={"MACROFLOW_RINGS": "yes"})
    assert code != 0
    assert err.count("ValueError: the MACROFLOW_RINGS environment variable must be 0") == 1, err


def test_the_first_calls_of_a_job_wake_a_rank_that_sleeps_before_its_ring_is_taken(tmp_path):
    # A rank that sleeps while the ring it offered is not yet taken flags NAP,
    # so the peer that switches to the ring and writes there wakes it. It did
    # not: the job's first calls each waited a whole SLEEP_MAX (0.1 s; 0.2 s
    # for the first call of every job). Here SLEEP_MAX is a minute: a missed
    # wake-up shows as a job that does not end, not as a figure.
    code, out, err = _mpiexec(tmp_path, 2, """
        import time
        import macroflow as mf
        from macroflow.transport import mpi as M
        M.SLEEP_MAX = 60.0

        @mf.persistent
        class P:
            def ping(self):
                return mf.context_id()

        def main():
            t = time.monotonic()
            p = P.create(on=1)
            got = [p.ping().result(30) for _ in range(4)]
            print("pings", got, "in", "time" if time.monotonic() - t < 20 else "too long")

        mf.run(main)
    """, timeout=100)
    assert code == 0 and "pings [1, 1, 1, 1] in time" in out, (code, out, err)


@pytest.mark.timeout(180)
def test_ranks_whose_peers_all_write_by_ring_probe_mpi_only_when_poked(tmp_path):
    # With every peer on rings, MPI holds a message for a rank only if the
    # sender POKEd its ring after it: the rank probes MPI then (and once in
    # _QUIET_LOOK passes), not every 8th look of a spin and every 3rd send,
    # which made the null call on mpi 4-8% slower than on local. What still
    # travels by MPI (frames larger than a ring takes, their order among the
    # small ones, credits, goodbyes) arrives all the same.
    code, out, err = _mpiexec(tmp_path, 3, """
        import macroflow as mf
        from macroflow.core.context import current_engine
        from macroflow.transport import mpi as M

        # no probe unasked: what travels by MPI must be announced, or the
        # job hangs (and the test fails on its timeout)
        M._QUIET_LOOK = 10 ** 9

        def counts():
            t = current_engine().transport
            return t.quiet, t.probe_passes

        @mf.persistent
        class Echo:
            def echo(self, x):
                return x
            def counts(self):
                return counts()

        def main():
            es = [Echo.create(on=c) for c in (1, 2)]
            big = b"x" * (M.RING_FRAME_MAX * 2)  # by MPI, behind a MARK
            for i in range(300):
                x = big + bytes([i % 256]) if i % 50 == 7 else i
                assert [e.echo(x).result(30) for e in es] == [x, x], i
            before = [counts()] + [e.counts().result(30) for e in es]
            n = 3000
            for i in range(n):
                assert es[0].echo(i).result(30) == i
            after = [counts()] + [e.counts().result(30) for e in es]
            print("quiet", [q for q, _ in after])
            print("probes per call", max((a[1] - b[1]) / n for a, b in zip(after, before)))

        mf.run(main)
    """, timeout=150)
    assert code == 0, (out, err)
    assert "quiet [True, True, True]" in out, out
    per_call = float(out.split("probes per call")[1].split()[0])
    # none unasked; there were about 1.4 a call before (the spin's every
    # 8th look, every 3rd send)
    assert per_call < 0.01, out
