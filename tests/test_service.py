"""A context serves what needs no user code while one of its methods computes.

The busy methods here compute until a gate (a pipe made before the contexts
are forked) is opened, and the test opens it only after what it checks has
happened: had the context not served while busy, the check would wait for
a method that never ends, and fail on its timeout. Nothing depends on timing.

Most tests run on the ``local`` transport only: with ``inproc`` every context
shares one thread, so nothing can ask a context anything while it computes.
"""

import gc
import multiprocessing
import os
import select
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import macroflow as mf
from macroflow.core import context as core

MECHANISMS = ["signal", "thread", "timer"]
ENDED = []  # set in context 1 when a busy method ends


def gate_open(fd):
    if isinstance(fd, str):  # a path: processes that were not forked share it
        return os.path.exists(fd)
    return bool(select.select([fd], [], [], 0)[0])


@pytest.fixture
def gate():
    """A pipe: (read end, function that opens the gate)."""
    r, w = os.pipe()
    yield r, lambda: os.write(w, b"x")
    os.close(r)
    os.close(w)


@mf.persistent
class Busy:
    def compute(self, kind, gate):
        n = 0
        if kind == "python":
            # pure Python; the gate (a system call) is looked at every 10 ms
            look = time.monotonic()  # no system call: the vDSO clock
            while True:
                for i in range(2_000):
                    n += i
                if time.monotonic() >= look:
                    if gate_open(gate):
                        break
                    look = time.monotonic() + 0.01
        elif kind == "syscalls":
            # Python with a system call about every millisecond: a thread
            # waiting for the interpreter may never get it
            while True:
                for i in range(20_000):
                    n += i
                if gate_open(gate):
                    break
        elif kind == "numpy":
            a = np.ones(100_000)
            while not gate_open(gate):
                a = np.sqrt(a * a + 1.0)
        elif kind == "sleep":
            while not gate_open(gate):
                time.sleep(0.01)
        elif kind == "poll":  # no service mechanism: the loop serves itself
            while not gate_open(gate):
                for i in range(1000):
                    n += i
                mf.poll()
        ENDED.append(True)
        return "ended"

    def after(self, i):
        return i

    def forever(self, kind):
        if kind == "python":
            while True:
                sum(range(1000))
        time.sleep(3600)


@mf.persistent
class Holder:
    def __init__(self):
        self.items = []
        self.ready = False

    def value(self, x):
        return x

    def take(self, x):
        return x

    def append(self, x):
        self.items.append((x, bool(ENDED)))
        return len(self.items)

    def contents(self):
        return list(self.items)

    @mf.guard(lambda self: self.ready)
    def when_ready(self):
        return "ready"


def lazy(h):
    """Keep Holder.value's futures lazy (their values stay where computed until
    asked for): a future passed to another call before being asked resets
    what the call site learned."""
    h.take(h.value(0)).result()


def put(target, x):
    target.append(x)


def set_ready(holder):
    holder.ready = True


def count_values(target, reply):
    mf.rsr(reply, put, len(core.current_engine().slots), thread="now")


def wait_for(box, n=1, timeout=30):
    """Serve this context (mf.poll) until ``box`` holds ``n`` items."""
    deadline = time.monotonic() + timeout
    while len(box) < n:
        assert time.monotonic() < deadline, "nothing came"
        mf.poll()
    return box


# -- values, forwards, releases, remote service requests -----------------------
@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["python", "sleep"])
def test_a_busy_context_serves_on_every_transport(transport, tmp_path, kind):
    # the default mechanism, with the transport's own way to signal arrivals
    # (MPI: the wake-up socket peers on this host write to with each frame)
    if transport == "inproc":
        pytest.skip("inproc: every context shares one thread")
    gate = str(tmp_path / "gate")

    def main():
        h, b = Holder.create(on=1), Busy.create(on=1)
        lazy(h)
        f = h.value(5)
        busy = b.compute(kind, gate)
        got = f.result(timeout=30)
        open(gate, "w").close()
        ended = busy.result(timeout=30)
        return got, mf.stats()[1]["served_while_busy"], ended

    got, served, ended = mf.run(main, contexts=2, transport=transport)
    assert (got, ended) == (5, "ended") and served >= 1


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mechanism", ["signal", "timer"])
def test_a_method_making_frequent_system_calls_is_served(monkeypatch, gate, mechanism):
    # A thread that waits for the interpreter does not get it from a method that
    # makes a system call every millisecond or so: the signal mechanism must
    # start its signals without one. Five in a row, each in a new computation
    # (once in four, a watcher thread alone was not served before the timeout).
    monkeypatch.setenv("MACROFLOW_SERVICE", mechanism)
    r, open_gate = gate

    def main():
        h, b = Holder.create(on=1), Busy.create(on=1)
        lazy(h)
        f = h.value(7)
        busy = b.compute("syscalls", r)
        got = f.result(timeout=20)
        open_gate()
        return got, busy.result(timeout=20)

    for _ in range(5):
        assert mf.run(main, contexts=2, transport="local") == (7, "ended")
        os.read(r, 1)  # close the gate again


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["python", "numpy", "sleep"])
@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_a_busy_context_serves_a_value_it_holds(monkeypatch, gate, mechanism, kind):
    monkeypatch.setenv("MACROFLOW_SERVICE", mechanism)
    r, open_gate = gate

    def main():
        h, b = Holder.create(on=1), Busy.create(on=1)
        lazy(h)
        f = h.value(42)  # runs, and is held, before compute starts
        busy = b.compute(kind, r)
        got = f.result(timeout=30)  # compute ends only once the gate opens
        open_gate()
        return got, busy.result(timeout=30)

    assert mf.run(main, contexts=2, transport="local") == (42, "ended")


@pytest.mark.timeout(90)
@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_a_context_busy_twice_is_served_both_times(monkeypatch, gate, mechanism):
    # The service outlives a busy period: its watcher once died at the idle
    # sample after the first, and a second busy period was served by nobody.
    monkeypatch.setenv("MACROFLOW_SERVICE", mechanism)
    r, open_gate = gate

    def main():
        h, b = Holder.create(on=1), Busy.create(on=1)
        got = []
        for i in range(2):
            lazy(h)
            f = h.value(10 + i)
            busy = b.compute("sleep", r)
            got.append(f.result(timeout=20))
            open_gate()
            got.append(busy.result(timeout=20))
            os.read(r, 1)  # close the gate again
            time.sleep(0.2)  # idle: the watcher samples an idle context between the two
        return got

    assert mf.run(main, contexts=2, transport="local") == [10, "ended", 11, "ended"]


@pytest.mark.timeout(60)
def test_mf_poll_serves_where_no_mechanism_does(monkeypatch, gate):
    monkeypatch.setenv("MACROFLOW_SERVICE", "poll")
    r, open_gate = gate

    def main():
        h, b = Holder.create(on=1), Busy.create(on=1)
        lazy(h)
        f = h.value(7)
        busy = b.compute("poll", r)
        got = f.result(timeout=30)
        open_gate()
        return got, busy.result(timeout=30), mf.stats()[1]["served_while_busy"]

    got, ended, served = mf.run(main, contexts=2, transport="local")
    assert (got, ended) == (7, "ended") and served >= 1


@pytest.mark.timeout(60)
def test_an_arc_is_forwarded_by_a_busy_context(gate):
    r, open_gate = gate

    def main():
        h, b, consumer = Holder.create(on=1), Busy.create(on=1), Holder.create(on=2)
        lazy(h)
        f = h.value(5)
        busy = b.compute("python", r)
        g = consumer.take(f)  # context 2 pulls f's value from context 1
        got = g.result(timeout=30)
        open_gate()
        return got, busy.result(timeout=30)

    assert mf.run(main, contexts=3, transport="local") == (5, "ended")


@pytest.mark.timeout(60)
def test_releases_and_now_requests_are_served_while_busy(gate):
    r, open_gate = gate

    def main():
        box = []
        reply = mf.export(box)
        h, b = Holder.create(on=1), Busy.create(on=1)
        lazy(h)
        dropped = [h.value(i) for i in range(200)]
        probe = h.value(-1)
        busy = b.compute("python", r)
        mf.rsr(mf.info(h).gptr, count_values, reply, thread="now")
        before = wait_for(box, 1)[0]
        del dropped
        gc.collect()
        assert probe.result(timeout=30) == -1  # waiting sends the releases out
        mf.rsr(mf.info(h).gptr, count_values, reply, thread="now")
        after = wait_for(box, 2)[1]
        open_gate()
        assert busy.result(timeout=30) == "ended"
        # each request counted once (the loop's look at the object after a
        # request served while busy was counted as a request too)
        assert mf.stats(timeout=30)[1]["rsr_executed"] == 2
        return before, after

    before, after = mf.run(main, contexts=2, transport="local")
    assert after <= before - 200


@mf.persistent
class Maker:
    def make(self, mb):
        return np.ones(mb << 20, dtype=np.uint8)


@mf.persistent
class DropsThenComputes:
    def run(self, maker, gate):
        arrays = [maker.make(32) for _ in range(4)]
        assert sum(int(a.result()[0]) for a in arrays) == 4
        del arrays  # their values are freed at the maker while this computes
        gc.collect()
        return Busy.compute(self, "python", gate)


def _rss_mb(pid):
    import psutil
    return psutil.Process(pid).memory_info().rss >> 20


@pytest.mark.timeout(60)
def test_large_values_dropped_by_a_busy_method_are_freed_while_it_computes(gate):
    # before, their release waited in the method's context until the method
    # ended: the maker held 128 MB for as long as the method computed
    r, open_gate = gate

    def main():
        maker = Maker.create(on=2)
        pid = mf.contexts()[2].pid
        busy = DropsThenComputes.create(on=1).run(maker, r)
        deadline = time.monotonic() + 30
        peak = _rss_mb(pid)
        while time.monotonic() < deadline:
            now = _rss_mb(pid)
            peak = max(peak, now)
            if peak - now >= 96:
                break
            time.sleep(0.01)  # (a look at the maker's memory, not a wait on macroflow)
        freed = peak - now >= 96
        open_gate()
        return freed, peak, busy.result(timeout=30)

    freed, peak, ended = mf.run(main, contexts=3, transport="local")
    assert ended == "ended" and peak >= 128
    assert freed


@mf.persistent
class _Sink:
    def m(self, i):
        return bytes(1000)

    def nslots(self):
        return len(core.current_engine().slots)


@mf.persistent
class _Dropper:
    def __init__(self, sink):
        self.sink = sink

    def fire(self, n, seconds):
        for i in range(n):
            self.sink.m(i)  # its future dropped at once
        gc.collect()
        end = time.monotonic() + seconds
        while time.monotonic() < end:  # computes: its releases leave meanwhile
            sum(range(1000))
        return "fired"


@pytest.mark.timeout(60)
def test_a_release_served_before_its_call_is_taken_still_frees_the_value(gate):
    # context 2 computes, its calls queued behind; the releases of their
    # futures, served while it computes, came before the calls were taken,
    # and were dropped: the 100 values stayed on context 2 for good
    r, open_gate = gate

    def main():
        sink, busy = _Sink.create(on=2), Busy.create(on=2)
        before = sink.nslots().result(timeout=30)
        blocked = busy.compute("python", r)
        assert _Dropper.create(sink, on=1).fire(100, 0.5).result(timeout=30) == "fired"
        open_gate()
        assert blocked.result(timeout=30) == "ended"
        for _ in range(3):  # anything still in flight has come and gone
            sink.nslots().result(timeout=30)
        return before, sink.nslots().result(timeout=30)

    before, after = mf.run(main, contexts=3, transport="local")
    assert after < before + 20, (before, after)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mechanism,kind", [("signal", "python"), ("poll", "poll")])
def test_a_now_request_that_opens_a_guard_lets_the_call_run_after_the_method(
        monkeypatch, gate, mechanism, kind):
    monkeypatch.setenv("MACROFLOW_SERVICE", mechanism)  # poll: served by the method's mf.poll()
    r, open_gate = gate

    def main():
        h, b = Holder.create(on=1), Busy.create(on=1)
        waiting = h.when_ready()  # queued: its guard does not hold
        busy = b.compute(kind, r)
        box = []
        mf.rsr(mf.info(h).gptr, set_ready, thread="now")
        mf.rsr(mf.info(h).gptr, count_values, mf.export(box), thread="now")
        wait_for(box)  # both ran, while compute runs
        open_gate()
        return busy.result(timeout=30), waiting.result(timeout=30)

    assert mf.run(main, contexts=2, transport="local") == ("ended", "ready")


def try_to_wait(target, future, reply):
    try:
        future.result()
        outcome = "waited"
    except mf.DeadlockError as e:
        outcome = str(e)
    mf.rsr(reply, put, outcome, thread="now")


@pytest.mark.timeout(60)
def test_a_now_request_cannot_wait(gate):
    r, open_gate = gate

    def main():
        h, b = Holder.create(on=1), Busy.create(on=1)
        busy = b.compute("python", r)
        box = []
        mf.rsr(mf.info(h).gptr, try_to_wait, busy, mf.export(box), thread="now")
        wait_for(box)
        open_gate()
        return box[0], busy.result(timeout=30)

    outcome, ended = mf.run(main, contexts=2, transport="local")
    assert ended == "ended" and "cannot wait" in outcome and "thread='new'" in outcome


def test_now_requests_run_in_order_with_calls(run):
    def main():
        h = Holder.create(on=1)
        mf.rsr(mf.info(h).gptr, lambda holder, x: holder.items.append(x), 5, thread="now")
        h.append(6)
        return h.contents().result(), mf.stats()[1]["rsr_executed"]

    items, executed = run(main, contexts=2)
    assert items == [5, (6, False)] and executed == 1


def test_an_unknown_rsr_thread_names_the_choices():
    with mf.init(contexts=1, transport="inproc"):
        with pytest.raises(ValueError, match="'inline', 'new' or 'now'"):
            mf.rsr(mf.export([]), put, 1, thread="later")


@pytest.mark.timeout(60)
def test_a_registered_opcode_is_served_while_busy(gate):
    # the hook for one-sided operations: an opcode and its handler
    op = 240
    seen_r, seen_w = os.pipe()
    core.register(op, lambda eng, src, msg: os.write(msg[1], b"!"), served_while_busy=True)
    r, open_gate = gate

    def main():
        b = Busy.create(on=1)
        busy = b.compute("python", r)
        core.current_engine().post(1, (op, seen_w))
        ready = select.select([seen_r], [], [], 30)[0]
        open_gate()
        return bool(ready) and os.read(seen_r, 1), busy.result(timeout=30)

    try:
        assert mf.run(main, contexts=2, transport="local") == (b"!", "ended")
    finally:
        core.unregister(op)
        os.close(seen_r)
        os.close(seen_w)


@mf.persistent
class TakesSigio:
    def compute(self, gate):
        got = []
        signal.signal(signal.SIGIO, lambda *a: got.append(1))
        while not gate_open(gate):
            sum(range(2000))
        return "ended"


@pytest.mark.timeout(60)
def test_a_method_that_takes_sigio_is_still_served(gate):
    r, open_gate = gate

    def main():
        h, b = Holder.create(on=1), TakesSigio.create(on=1)
        lazy(h)
        f = h.value(11)
        busy = b.compute(r)
        got = f.result(timeout=30)  # by the watcher thread, which serves every 50 ms
        open_gate()
        return got, busy.result(timeout=30)

    assert mf.run(main, contexts=2, transport="local") == (11, "ended")


# -- what stays queued -------------------------------------------------------------
@pytest.mark.timeout(60)
@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_calls_wait_for_the_method_and_run_in_order(monkeypatch, gate, mechanism):
    monkeypatch.setenv("MACROFLOW_SERVICE", mechanism)
    r, open_gate = gate

    def main():
        h, b = Holder.create(on=1), Busy.create(on=1)
        lazy(h)
        f = h.value(1)
        busy = b.compute("python", r)
        appended = [h.append(i) for i in range(50)]
        later = [b.after(i) for i in range(50)]
        assert f.result(timeout=30) == 1  # compute is running
        open_gate()
        return (busy.result(timeout=30), [a.result(timeout=30) for a in appended],
                [x.result(timeout=30) for x in later], h.contents().result(timeout=30))

    ended, appended, later, items = mf.run(main, contexts=2, transport="local")
    assert ended == "ended"
    assert appended == list(range(1, 51)) and later == list(range(50))
    assert items == [(i, True) for i in range(50)]  # each ran after compute had ended


# -- contention --------------------------------------------------------------------
@mf.persistent
class Chatty:
    def run(self, peer, n):
        got = []
        for i in range(n):
            f = peer.value(i)  # into the engine and back, while requests come
            if i % 10 == 0:
                got.append(f.result())
            sum(range(300))
        return got


def bombard(target, i):
    target.append(i)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_no_deadlock_when_the_service_and_the_engine_contend(monkeypatch, mechanism):
    monkeypatch.setenv("MACROFLOW_SERVICE", mechanism)

    def main():
        h, c, peer = Holder.create(on=1), Chatty.create(on=1), Holder.create(on=2)
        lazy(h)
        held = [h.value(i) for i in range(300)]
        running = c.run(peer, 2000)
        consumer = Holder.create(on=2)
        pulled = [consumer.take(f) for f in held[:100]]  # forwards from context 2
        for i in range(300):
            mf.rsr(mf.info(h).gptr, bombard, i, thread="now")
        got = [f.result(timeout=60) for f in held[100:]]  # value requests
        del held
        return (running.result(timeout=60), got, [p.result(timeout=60) for p in pulled],
                len(h.contents().result(timeout=60)))

    chatty, got, pulled, items = mf.run(main, contexts=3, transport="local")
    assert chatty == list(range(0, 2000, 10))
    assert got == list(range(100, 300)) and pulled == list(range(100))
    assert items == 300


# -- interrupts and shutdown ---------------------------------------------------------
@mf.persistent
class Interrupted:
    def spin(self, kind, started):
        os.write(started, b"s")
        if kind == "python":
            while True:
                pass
        time.sleep(3600)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["python", "sleep"])
def test_ctrl_c_interrupts_a_method_computing_on_context_0(kind):
    r, w = os.pipe()

    def interrupt_once_started():
        select.select([r], [], [], 30)
        os.kill(os.getpid(), signal.SIGINT)

    def main():
        t = threading.Thread(target=interrupt_once_started)
        t.start()
        try:
            Interrupted.create(on=0).spin(kind, w).result()
        finally:
            t.join()

    try:
        with pytest.raises(KeyboardInterrupt):
            mf.run(main, contexts=2, transport="local")
    finally:
        os.close(r)
        os.close(w)


SCRIPT = """
import os, select, signal, sys, threading, time
import macroflow as mf

@mf.persistent
class Spin:
    def spin(self, started):
        os.write(started, b"s")
        while True:
            pass

def main():
    r, w = os.pipe()
    def interrupt():
        select.select([r], [], [], 30)
        os.kill(os.getpid(), signal.SIGINT)
    threading.Thread(target=interrupt, daemon=True).start()
    from macroflow.core.context import current_engine
    print(type(current_engine().service).__name__, current_engine().service.name, flush=True)
    Spin.create(on=0).spin(w).result()

try:
    mf.run(main, contexts=2)
except KeyboardInterrupt:
    print("interrupted", flush=True)
"""


@pytest.mark.timeout(120)
def test_ctrl_c_interrupts_context_0_where_signals_serve_too():
    # a fresh interpreter: context 0 takes SIGIO, and is interrupted to serve
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), MACROFLOW_SERVICE="signal")
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(SCRIPT)], capture_output=True,
                         text=True, timeout=100, env=env)
    assert out.stdout.split("\n")[:2] == ["ServiceSignal signal", "interrupted"], out.stderr


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["python", "sleep"])
def test_the_computation_ends_while_a_context_computes(kind):
    def main():
        h, b = Holder.create(on=1), Busy.create(on=1)
        lazy(h)
        f = h.value(9)
        b.forever(kind)
        return f.result(timeout=30)  # served while forever runs; then main returns

    assert mf.run(main, contexts=2, transport="local") == 9


# -- methods that fork or use threads ------------------------------------------------
@mf.persistent
class Forking:
    def fork_and_wait(self, gate):
        pid = os.fork()
        if pid == 0:
            select.select([gate], [], [], 30)
            os._exit(7)
        _, status = os.waitpid(pid, 0)
        return os.WEXITSTATUS(status)

    def threads(self, gate):
        out = [0] * 3

        def work(k):
            select.select([gate], [], [], 30)
            out[k] = sum(range(100_000 * (k + 1)))

        ts = [threading.Thread(target=work, args=(k,)) for k in range(3)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        return out

    def pool(self):
        with multiprocessing.get_context("fork").Pool(2) as p:
            return p.map(abs, range(-4, 4))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("what", ["fork_and_wait", "threads"])
def test_a_method_that_forks_or_uses_threads_is_unharmed(gate, what):
    r, open_gate = gate

    def main():
        h, f = Holder.create(on=1), Forking.create(on=1)
        lazy(h)
        held = h.value(3)
        running = getattr(f, what)(r)
        got = held.result(timeout=30)  # served while the method waits for its child or threads
        open_gate()
        return got, running.result(timeout=30), f.pool().result(timeout=30)

    got, result, pooled = mf.run(main, contexts=2, transport="local")
    assert got == 3 and pooled == [4, 3, 2, 1, 0, 1, 2, 3]
    assert result == (7 if what == "fork_and_wait" else [sum(range(100_000 * (k + 1))) for k in range(3)])


# -- mf.poll and settings ----------------------------------------------------------
@mf.persistent
class Poller:
    def loop(self, n):
        return [mf.poll() for _ in range(n)]


def test_mf_poll_is_a_quick_look_when_nothing_is_pending(run):
    def main():
        return mf.poll(), Poller.create(on=1).loop(100).result()

    first, polls = run(main, contexts=2)
    # the only request that context 1 may see meanwhile is main's for loop's result
    assert first == 0 and len(polls) == 100 and sum(polls) <= 1 and polls.count(0) >= 99


def test_a_bad_service_setting_is_refused_before_anything_starts(monkeypatch):
    monkeypatch.setenv("MACROFLOW_SERVICE", "pigeon")
    with pytest.raises(ValueError, match="MACROFLOW_SERVICE environment variable must be one of "
                                         "signal, thread, timer, poll; got 'pigeon'"):
        mf.init(contexts=2)


def test_the_inproc_transport_needs_no_service():
    with mf.init(contexts=2, transport="inproc"):
        assert core.current_engine().service is None


# -- the benchmark ---------------------------------------------------------------------
@pytest.mark.timeout(300)
def test_quick_service_bench_writes_every_figure(tmp_path, capsys):
    import json

    import macroflow.bench as bench
    from macroflow.bench import service

    out = tmp_path / "service.json"
    assert bench.main("service", json_path=str(out), quick=True) == 0
    printed = capsys.readouterr().out
    for title in ("Service latency", "Computation slowed", "Cost of serving", "Null call", "Bars"):
        assert title in printed
    res = json.loads(out.read_text())
    for m in service.MECHANISMS:
        for k in service.KINDS:
            assert res["latency_ms"][m][k] > 0, (m, k)
        assert res["null_call_us"][m] > 0
        for k in ("python", "numpy"):
            assert m == service.REFERENCE or res["cost"][m][k]["requests"] > 0, (m, k)
            for label in ("quiet", "quiet_cpu", "requests", "requests_cpu"):
                assert m == service.REFERENCE and label.startswith("requests") or \
                    isinstance(res["slowdown"][m][k][label], float), (m, k, label)
    # with a mechanism, the requests were served while the method ran (the
    # last one may come as it ends); without, the first waited for its end
    for r in res["runs"]:
        if r["requests"] and r["mechanism"] != service.REFERENCE:
            assert r["served_while_busy"] >= r["n_requests"] - 1 > 0, r
        elif r["requests"]:
            assert r["n_requests"] == 1 and r["served_while_busy"] == 0, r
    assert [b["pass"] for b in res["bars"]] == [
        b["value"] is not None and b["value"] < b["limit"] for b in res["bars"]]
    # the saved run is printed again from its file, as the other suites' are
    # (it started a new full run)
    r = subprocess.run([sys.executable, "-m", "macroflow.bench.service", str(out)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert [t in r.stdout for t in ("Service latency", "Null call", "Bars")] == [True] * 3
    assert "round 1/" not in r.stdout + r.stderr


class _FakeTransport:
    def signal_arrivals(self, on, again=False):
        return True


class _FakeEngine:
    id, user, epoch, serving, closed, service_cpu, undetached = 1, False, 0, 0, False, 0.0, ()
    transport = _FakeTransport()

    def serve_arrived(self):
        return 0


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", ["poll", "signal"])
def test_user_code_and_engine_code_switch_the_service_however_they_end(kind):
    # Service.run_user brackets a method (enter ... leave), run_engine brackets
    # the engine's work for user code (leave ... enter); ServiceSignal has
    # both inline, and both must leave the flags as the bracket says, on
    # return and on an exception alike
    from macroflow.core.threads import Service, ServiceSignal
    eng = _FakeEngine()
    svc = Service(eng) if kind == "poll" else ServiceSignal(eng, look=0.001)
    try:
        seen = []

        def engine_work(x):
            seen.append(("engine", eng.user))
            return x + 1

        def method(x):
            seen.append(("user", eng.user))
            return svc.run_engine(engine_work, x)

        assert svc.run_user(method, (1,), None) == 2
        assert seen == [("user", True), ("engine", False)] and eng.user is False
        epoch = eng.epoch

        def failing_engine():
            raise ValueError("engine")

        def method_failing():
            with pytest.raises(ValueError, match="engine"):
                svc.run_engine(failing_engine)
            seen.append(("back in user code", eng.user))
            raise KeyError("user")

        with pytest.raises(KeyError):
            svc.run_user(method_failing, (), None)
        assert seen[-1] == ("back in user code", True) and eng.user is False
        assert eng.epoch == epoch + 2  # entered twice: the method, and back from the engine
        assert svc.run_user(lambda a, b=0: a + b, (1,), {"b": 2}) == 3
    finally:
        svc.stop()


@mf.persistent
class SlowToDestroy:
    def __init__(self, gate):
        self.gate = gate

    def __mf_destroy__(self):
        while not gate_open(self.gate):
            sum(range(1000))


@pytest.mark.timeout(120)
def test_a_context_running_a_destroy_hook_serves_as_during_a_method(transport, tmp_path):
    if transport == "inproc":
        pytest.skip("inproc: every context shares one thread")
    gate = str(tmp_path / "gate")

    def main():
        h = Holder.create(on=1)
        lazy(h)
        f = h.value(5)
        gone = mf.destroy(SlowToDestroy.create(gate, on=1))
        got = f.result(timeout=30)  # the hook computes until the gate opens
        open(gate, "w").close()
        gone.result(timeout=30)
        return got, mf.stats()[1]["served_while_busy"]

    got, served = mf.run(main, contexts=2, transport=transport)
    assert got == 5 and served >= 1
