"""ShmBarrier: a barrier in shared memory, in every layout, between forked processes."""

import ctypes
import os
import random
import signal

import numpy as np
import pytest

from macroflow.spmd import shmbarrier
from macroflow.spmd.memory import shared_zeros
from macroflow.spmd.shmbarrier import LAYOUTS, ShmBarrier

pytestmark = pytest.mark.timeout(60)


def _die_with_parent():
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: never outlive the test


def in_ranks(n, body):
    """Run ``body(rank)`` in n processes: rank 0 here, ranks 1..n-1 forked.

    Returns the children's exit codes (0: body returned). A child that is
    still running when rank 0 fails is killed, so none outlives the test.
    """
    pids = []
    try:
        for rank in range(1, n):
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    _die_with_parent()
                    body(rank)
                    code = 0
                except BaseException:
                    import traceback
                    traceback.print_exc()
                finally:
                    os._exit(code)
            pids.append(pid)
        body(0)
        return [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
    finally:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass


def wait(b, e):
    while not b.complete(e):
        os.sched_yield()  # more processes than cores: let the others arrive


def make(n, layout):
    return shared_zeros(ShmBarrier.nbytes(n, layout), np.uint8)


# -- sizes and bad input

def test_nbytes_of_each_layout():
    L = ShmBarrier.LINE
    assert L == 128
    assert [ShmBarrier.nbytes(1, x) for x in LAYOUTS] == [L, 16, L + 16]
    assert [ShmBarrier.nbytes(8, x) for x in LAYOUTS] == [8 * L, 128, L + 128]
    assert ShmBarrier.nbytes(3) == ShmBarrier.nbytes(3, "padded")


@pytest.mark.parametrize("n, layout, err, words", [
    (0, "padded", ValueError, "must be >= 1, got 0"),
    (True, "padded", TypeError, "must be an int, not bool"),
    (2.0, "padded", TypeError, "must be an int, not float"),
    (2, "tree", ValueError, "padded, packed, central; got 'tree'"),
])
def test_nbytes_refuses_bad_sizes_and_layouts(n, layout, err, words):
    with pytest.raises(err, match=words):
        ShmBarrier.nbytes(n, layout)


def test_the_constructor_names_what_is_wrong_with_its_arguments():
    ok = bytearray(ShmBarrier.nbytes(2))
    with pytest.raises(TypeError, match="buf must be a buffer .* not int"):
        ShmBarrier(5, 2, 0)
    with pytest.raises(ValueError, match="read-only"):
        ShmBarrier(bytes(len(ok)), 2, 0)
    with pytest.raises(ValueError, match=r"has 255 bytes; a padded barrier of 2 ranks needs "
                                         r"ShmBarrier.nbytes\(2, 'padded'\) = 256"):
        ShmBarrier(bytearray(255), 2, 0)
    with pytest.raises(ValueError, match="C-contiguous"):
        ShmBarrier(np.zeros((2, 512), np.uint8)[:, ::2], 2, 0)
    with pytest.raises(ValueError, match="8-byte aligned"):
        ShmBarrier(np.zeros(300, np.uint8)[1:], 2, 0)
    with pytest.raises(ValueError, match=r"rank must be in 0..1, got 2"):
        ShmBarrier(ok, 2, 2)
    with pytest.raises(ValueError, match=r"rank must be in 0..1, got -1"):
        ShmBarrier(ok, 2, -1)
    with pytest.raises(TypeError, match="rank must be an int"):
        ShmBarrier(ok, 2, "0")
    with pytest.raises(ValueError, match="layout must be one of"):
        ShmBarrier(ok, 2, 0, "Padded")


def test_a_cpu_without_total_store_order_is_refused_with_the_reason(monkeypatch):
    monkeypatch.setattr(shmbarrier.platform, "machine", lambda: "aarch64")
    with pytest.raises(RuntimeError, match="total store order .* this one is aarch64"):
        ShmBarrier(bytearray(ShmBarrier.nbytes(1)), 1, 0)
    assert shmbarrier.problem("x86_64") is None and shmbarrier.problem("AMD64") is None


# -- in one process: the epochs

@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_barrier_completes_when_the_last_rank_arrives_and_stays_complete(layout):
    n = 3
    buf = make(n, layout)
    bs = [ShmBarrier(buf, n, r, layout) for r in range(n)]
    for epoch in (1, 2, 3):
        for b in bs[:-1]:
            assert b.arrive() == epoch
            assert not any(x.complete(epoch) for x in bs)
        assert bs[-1].arrive() == epoch
        assert all(x.complete(epoch) for x in bs)
        assert all(x.complete(epoch - 1) for x in bs)  # an earlier one stays complete
        assert not bs[0].complete(epoch + 1)
    assert [b.epoch for b in bs] == [3, 3, 3]
    assert bs[1].statistics() == {"layout": layout, "n": 3, "rank": 1, "epoch": 3,
                                  "completed": 3, "entered": [3, 3, 3]}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_new_barrier_over_used_memory_goes_on_from_its_epochs(layout):
    buf = make(2, layout)
    a0, a1 = ShmBarrier(buf, 2, 0, layout), ShmBarrier(buf, 2, 1, layout)
    for _ in range(2):
        a0.arrive(), a1.arrive()
    b0 = ShmBarrier(buf, 2, 0, layout)  # rank 0 makes its side again (the lock is kept)
    assert b0.epoch == 2 and b0.complete(2) and not b0.complete(3)
    assert b0.arrive() == 3 and a1.arrive() == 3 and b0.complete(3)


def test_the_padded_layout_puts_each_counter_in_its_own_line_and_packed_in_one():
    for layout, stride in (("padded", ShmBarrier.LINE), ("packed", 8)):
        buf = make(4, layout)
        b = ShmBarrier(buf, 4, 2, layout)
        b.arrive()
        assert np.flatnonzero(buf).tolist() == [2 * stride]  # rank 2's counter, and only it


# -- sleeping

def test_sleepers_are_the_ranks_flagged_for_that_epoch_or_a_later_one():
    n = 4
    buf = make(n, "padded")
    bs = [ShmBarrier(buf, n, r) for r in range(n)]
    for b in bs[:3]:
        b.arrive()
    bs[2].sleep_flag(1)
    bs[0].sleep_flag(1)
    assert bs[3].sleepers(1) == [0, 2]
    bs[3].arrive()
    assert bs[3].sleepers(2) == []
    for b in bs:
        b.arrive()
    bs[0].sleep_flag(2)
    # rank 0 entered barrier 1 too, and may still wait for it
    assert bs[1].sleepers(2) == [0] and bs[1].sleepers(1) == [0, 2]


@pytest.mark.parametrize("epoch", [0, 2, "1", True])
def test_sleep_flag_is_only_for_a_barrier_this_rank_entered(epoch):
    b = ShmBarrier(bytearray(ShmBarrier.nbytes(2)), 2, 0)
    b.arrive()
    with pytest.raises(ValueError, match=r"a barrier this rank entered, 1..1"):
        b.sleep_flag(epoch)


# -- central: rank 0 sets up the lock

def test_a_central_barrier_made_by_another_rank_first_works_once_rank_0_has_made_its_own():
    buf = make(2, "central")
    b1 = ShmBarrier(buf, 2, 1, "central")
    b0 = ShmBarrier(buf, 2, 0, "central")
    assert b1.arrive() == 1 and b0.arrive() == 1 and b1.complete(1)


def test_a_central_arrival_without_rank_0_fails_after_the_timeout(monkeypatch):
    monkeypatch.setattr(shmbarrier, "READY_TIMEOUT", 0.05)
    b1 = ShmBarrier(make(2, "central"), 2, 1, "central")
    with pytest.raises(RuntimeError, match="lock rank 0 has not set up after 0.05 s"):
        b1.arrive()
    assert b1.epoch == 0  # it did not enter


# -- between processes

@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("n", [2, 5])
def test_nobody_passes_a_barrier_before_everyone_arrived(layout, n):
    rounds = 300
    buf = make(n, layout)
    # log[r] = the last round rank r arrived at, written before it arrives;
    # bad[r] counts what rank r saw that a barrier forbids
    log, bad, passed = shared_zeros(n, np.int64), shared_zeros(n, np.int64), \
        shared_zeros(n, np.int64)

    def body(rank):
        b = ShmBarrier(buf, n, rank, layout)
        rnd = random.Random(rank)
        for k in range(1, rounds + 1):
            if rnd.random() < 0.3:  # stagger the arrivals
                for _ in range(rnd.randrange(2000)):
                    pass
            log[rank] = k
            if b.arrive() != k:
                bad[rank] += 1
            wait(b, k)
            seen = log.tolist()
            # everyone arrived at k; nobody can be past k + 1 (they would wait for us)
            if min(seen) < k or max(seen) > k + 1:
                bad[rank] += 1
            passed[rank] = k

    codes = in_ranks(n, body)
    assert codes == [0] * (n - 1)
    assert bad.tolist() == [0] * n
    assert passed.tolist() == [rounds] * n


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_rank_that_completes_a_barrier_finds_every_sleeper_to_wake(layout):
    """Ranks 1..n-1 flag that they sleep and block on a pipe; rank 0 arrives
    only once they all have, so it must find them all in sleepers() and wake
    them, round after round."""
    n, rounds = 3, 40
    buf = make(n, layout)
    pipes = [os.pipe() for _ in range(n)]
    listed = shared_zeros((rounds, n), np.int64)
    blocked = shared_zeros((rounds, n), np.int64)

    def body(rank):
        b = ShmBarrier(buf, n, rank, layout)
        for k in range(1, rounds + 1):
            if rank == 0:
                while len(b.sleepers(k)) < n - 1:
                    os.sched_yield()
                e = b.arrive()
                assert b.complete(e)
                for r in b.sleepers(e):
                    listed[k - 1, r] = 1
                    os.write(pipes[r][1], b"w")
            else:
                e = b.arrive()
                b.sleep_flag(e)
                if not b.complete(e):
                    blocked[k - 1, rank] = 1
                    # really asleep until woken; a wake may be stale: rank 0
                    # wakes every flagged rank, also one that saw the barrier
                    # complete and did not sleep, and its byte waits here
                    while not b.complete(e):
                        os.read(pipes[rank][0], 1)
                assert b.complete(e)

    try:
        assert in_ranks(n, body) == [0] * (n - 1)
    finally:
        for r, w in pipes:
            os.close(r)
            os.close(w)
    # every rank that slept was found and woken (one that saw the barrier
    # complete after flagging did not sleep, and may have flagged the next one
    # before rank 0 looked: it need not be listed)
    assert (listed.T[1:] >= blocked.T[1:]).all()
    assert blocked.sum() > 0  # the hand-shake was exercised


def test_data_written_before_arriving_is_seen_after_the_barrier():
    n, rounds = 2, 500
    buf = make(n, "padded")
    data = shared_zeros((n, 64), np.int64)  # each rank's 512 bytes, rewritten every round
    bad = shared_zeros(n, np.int64)

    def body(rank):
        b = ShmBarrier(buf, n, rank)
        other = 1 - rank
        for k in range(1, rounds + 1):
            data[rank] = k
            wait(b, b.arrive())
            got = data[other]
            if got.min() < k:
                bad[rank] += 1
            wait(b, b.arrive())  # nobody rewrites before the other has read

    assert in_ranks(n, body) == [0]
    assert bad.tolist() == [0, 0]


def test_central_arrivals_at_the_same_time_are_all_counted():
    # the counter's increments race unless the lock orders them
    n, each = 3, 30000
    buf = make(n, "central")
    ShmBarrier(buf, n, 0, "central")  # sets up the lock before the others start
    ready = shared_zeros(n, np.int64)

    def body(rank):
        b = ShmBarrier(buf, n, rank, "central")
        ready[rank] = 1
        while ready.min() == 0:  # start together
            pass
        for _ in range(each):
            b.arrive()

    assert in_ranks(n, body) == [0] * (n - 1)
    b = ShmBarrier(buf, n, 0, "central")
    assert b.complete(each) and b.statistics()["entered"] == [each] * n
