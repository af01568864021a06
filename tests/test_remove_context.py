"""Contexts retired while the program runs (mf.remove_context), on every
transport that can remove them."""

import gc
import os
import time

import psutil
import numpy as np
import pytest

import macroflow as mf

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def _not_on_mpi(request):
    if "transport" in request.fixturenames and request.getfixturevalue("transport") == "mpi":
        pytest.skip("an MPI rank cannot leave a running job (test_mpi_refuses_clearly)")


@mf.persistent
class Square:
    def of(self, x):
        return x * x

    def pid(self):
        return os.getpid()

    def slow(self, n):
        return sum(range(n))  # still running, or queued, when the removal starts

    def take(self, x):
        return x


@mf.regular
class Where:
    def here(self):
        return mf.context_id()


@mf.persistent
class Remover:
    def remove(self):
        mf.remove_context(2)


def test_values_it_held_survive_and_its_objects_fail_later_calls(run):
    def main():
        s, other = Square.create(on=1), Square.create(on=2)
        asked = s.of(7)
        asked.result()  # known here
        held = s.of(3)  # held by context 1 until someone asks
        mf.wait([held])
        mf.remove_context(1)
        out = {"asked": asked.result(), "held": held.result(),
               "as_argument": other.take(held).result()}
        with pytest.raises(mf.ObjectDestroyed, match="was on context 1, which was removed"):
            s.of(2).result()
        return out, [c.state for c in mf.contexts()]

    out, states = run(main, contexts=3)
    assert out == {"asked": 49, "held": 9, "as_argument": 9}
    assert states == ["running", "removed", "running"]


def test_a_value_passed_on_before_removal_reaches_its_consumer(run):
    def main():
        s, other = Square.create(on=1), Square.create(on=2)
        held = s.of(5)
        mf.wait([held])
        mf.remove_context(1)
        return other.take(held).result()  # context 2 asks context 1's heir

    assert run(main, contexts=3) == 25


def test_calls_it_had_finish_before_it_leaves(run):
    def main():
        s = Square.create(on=1)
        work = [s.slow(200_000 + i) for i in range(5)]  # sent before the removal
        mf.remove_context(1)
        return [f.result() for f in work]

    assert run(main, contexts=2) == [sum(range(200_000 + i)) for i in range(5)]


def test_new_work_goes_elsewhere(run):
    def main():
        mf.remove_context(1)
        regular = {Where().here().result() for _ in range(12)}
        persistent = {mf.info(Square.create()).context for _ in range(6)}
        return regular, persistent, sorted(mf.stats())

    regular, persistent, stats = run(main, contexts=3)
    assert 1 not in regular and 1 not in persistent
    assert stats == [0, 2]


def test_new_objects_are_not_placed_on_it_by_name(run):
    # before, the handle came back and its first call failed with
    # ObjectDestroyed, for an object that never was
    def main():
        mf.remove_context(1)
        with pytest.raises(ValueError, match=r"on=1: context 1 was removed"):
            Square.create(on=1)
        with pytest.raises(ValueError, match=r"on=1: context 1 was removed"):
            Where.create(on=1)
        return Square.create(on=2).of(3).result(30)

    assert run(main) == 9


def test_its_process_ends(run, transport):
    if transport == "inproc":
        pytest.skip("inproc: every context is this process")

    def main():
        pid = Square.create(on=1).pid().result()
        mf.remove_context(1)
        return pid

    pid = None

    def body():
        nonlocal pid
        pid = main()
        proc = psutil.Process(pid) if psutil.pid_exists(pid) else None
        if proc is not None:
            try:
                proc.wait(timeout=20)
            except psutil.NoSuchProcess:
                pass
        return psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE

    assert run(body, contexts=3) is False


def test_values_handed_over_are_released_at_the_heir(run):
    def main():
        s = Square.create(on=1)
        futs = [s.of(i) for i in range(10)]
        mf.wait(futs)
        mf.remove_context(1)
        held_by_0 = mf.stats()[0]["values_held"]
        del futs
        gc.collect()
        for _ in range(70):  # releases travel in batches: push one out
            Square.create(on=2).of(1).result()
        return held_by_0, mf.stats()[0]["values_held"]

    before, after = run(main, contexts=3)
    assert before >= 10 and after <= before - 10


@pytest.mark.parametrize("cid, match", [
    (0, "context 0 runs the program"),
    (5, "no running context 5"),
    ("1", "cid must be a context id"),
    (True, "cid must be a context id"),
])
def test_bad_ids_are_refused(run, cid, match):
    def main():
        # a context id of another type is a TypeError, as for on=
        with pytest.raises(TypeError if "context id" in match else ValueError, match=match):
            mf.remove_context(cid)
        return mf.num_contexts()

    assert run(main, contexts=2) == 2


def test_removing_twice_is_refused(run):
    def main():
        mf.remove_context(np.int64(1))  # a numpy integer is a context id too
        with pytest.raises(ValueError, match="removed already"):
            mf.remove_context(1)
        return {Where().here().result() for _ in range(6)}

    assert 1 not in run(main, contexts=3)


def test_only_main_can_remove_contexts(run):
    def main():
        with pytest.raises(RuntimeError, match="inside method Remover.remove on context 1: "):
            Remover.create(on=1).remove().result()
        return mf.num_contexts()

    assert run(main, contexts=3) == 3


def test_a_bad_timeout_is_refused(run):
    def main():
        with pytest.raises(ValueError, match="timeout must be a positive number"):
            mf.remove_context(1, timeout=-1)
        return True

    assert run(main, contexts=2)


def test_added_contexts_can_be_removed(run):
    def main():
        (new,) = mf.add_contexts(1)
        s = Square.create(on=new)
        f = s.of(6)
        mf.wait([f])
        mf.remove_context(new)
        return f.result(), [c.state for c in mf.contexts()]

    assert run(main, contexts=2) == (36, ["running", "running", "removed"])


@pytest.mark.skipif("mpi" not in __import__("conftest").TRANSPORTS, reason="no MPI here")
def test_mpi_refuses_clearly():
    def main():
        with pytest.raises(ValueError, match="the mpi transport cannot remove contexts"):
            mf.remove_context(1)
        return True

    assert mf.run(main, contexts=2, transport="mpi")


@mf.persistent
class Gatekeeper:
    def wait_for(self, path):
        while not os.path.exists(path):  # opened by main, after what it checks
            time.sleep(0.005)
        return True


@mf.persistent
class Caller:
    def call_late(self, keeper, other, path):
        keeper.wait_for(path).result()  # until context 1 has begun to retire
        try:
            return other.of(3).result()
        except mf.ObjectDestroyed as e:
            return str(e)


def test_a_call_that_comes_while_it_retires_fails_and_a_timeout_leaves_it_retiring(
        run, transport, tmp_path):
    if transport == "inproc":
        pytest.skip("inproc: the gate's wait would hold the one thread every context shares")
    gate = str(tmp_path / "gate")

    def main():
        caller, other = Caller.create(on=1), Square.create(on=1)
        late = caller.call_late(Gatekeeper.create(on=2), other, gate)
        with pytest.raises(mf.TimeoutError, match="goes on retiring"):
            mf.remove_context(1, timeout=0.3)  # call_late cannot end yet
        placed = {Where().here().result() for _ in range(6)}  # none on 1 meanwhile
        meanwhile = [c.state for c in mf.contexts()]
        open(gate, "w").close()
        mf.remove_context(1)
        return late.result(), placed, meanwhile

    late, placed, meanwhile = run(main, contexts=3)
    assert "reached context 1 as it was being removed" in late, late
    assert 1 not in placed
    assert meanwhile == ["running", "retiring", "running"]


@mf.persistent
class Spinner:
    def pid(self):
        return os.getpid()

    def spin(self):
        while True:
            sum(range(1000))


def test_a_context_that_dies_while_it_retires_is_reported_lost(run, transport):
    if transport == "inproc":
        pytest.skip("inproc: a context cannot be killed apart from the program")
    import signal
    import threading

    def main():
        s = Spinner.create(on=1)
        pid = s.pid().result()
        f = s.spin()  # never ends: the removal waits for it
        threading.Timer(0.2, os.kill, (pid, signal.SIGKILL)).start()
        with pytest.raises(mf.ContextLost, match="SIGKILL"):
            mf.remove_context(1, timeout=30)
        with pytest.raises(mf.ContextLost):
            f.result(timeout=30)
        return [c.state for c in mf.contexts()]

    assert run(main, contexts=2) == ["running", "lost"]


def test_a_timeout_that_is_not_a_number_is_a_type_error(run):
    def main():
        with pytest.raises(TypeError, match="timeout must be a positive number of seconds; "
                                            "got 'x'"):
            mf.remove_context(1, timeout="x")
        return mf.num_contexts()

    assert run(main, contexts=2) == 2


@mf.persistent
class Gate:
    def __init__(self):
        self.open = False

    @mf.guard(lambda self: self.open)
    def through(self, x):
        return x

    def opening(self):
        self.open = True


def test_a_call_waiting_for_its_guard_fails_and_the_removal_ends(run):
    # No call can reach a context being removed, so none could make the guard
    # hold: the waiting call kept the context retiring for ever (every removal
    # timed out, and the call's future never came)
    def main():
        g = Gate.create(on=1)
        waiting = g.through(5)
        mf.remove_context(1, timeout=30)
        with pytest.raises(mf.ObjectDestroyed) as info:
            waiting.result(30)
        return str(info.value), [c.state for c in mf.contexts()]

    text, states = run(main, contexts=2)
    assert "Gate.through() was waiting for its guard when context 1 was removed" in text
    assert states == ["running", "removed"]


@mf.regular
class Stateless:
    def where(self, x):
        return x, mf.context_id()


def test_a_stateless_handle_pinned_to_a_removed_context_runs_where_its_work_went(run):
    # (it failed with ContextLost: the context was not lost, it was removed,
    # and a stateless call may run anywhere)
    def main():
        pinned = Stateless.create(on=1)
        assert pinned.where(1).result(30) == (1, 1)
        mf.remove_context(1, timeout=30)
        return pinned.where(2).result(30)

    assert run(main, contexts=3) == (2, 0)  # context 0 is the heir


@mf.persistent
class _Computes:
    def until_told(self, path):
        # pure Python, no wait: the context serves only what needs no user code
        while not os.path.exists(path):
            pass
        return "done"


@pytest.mark.parametrize("transport", ["local", "tcp"])
def test_removing_an_idle_context_does_not_wait_for_a_method_computing_elsewhere(transport,
                                                                                  tmp_path):
    # every context acks the removal; one whose method computed acked only
    # when the method ended, so the idle context's removal timed out,
    # blaming the idle context
    flag = tmp_path / "flag"

    def main():
        busy = _Computes.create(on=2)
        f = busy.until_told(str(flag))
        mf.remove_context(1, timeout=20)  # (the method computes until the flag is made)
        states = [c.state for c in mf.contexts()]
        flag.write_text("go")
        return states, f.result(20)

    states, done = mf.run(main, contexts=3, transport=transport)
    assert states == ["running", "removed", "running"] and done == "done"


@mf.regular
class Table:
    def __init__(self, w):
        self.w = w

    def at(self, i):
        return float(self.w[i]), mf.context_id()


def test_a_pinned_handle_with_large_constructor_arguments_goes_on_at_the_heir(run):
    # its arguments went to context 1 once; after the removal its calls run
    # where 1's work went, which never had them: sent whole there
    def main():
        t = Table.create(np.arange(8192.0), on=1)
        before = t.at(5).result(30)
        mf.remove_context(1, timeout=30)
        after = mf.gather([t.at(i) for i in (1, 2, 3)], timeout=30)
        return before, [v for v, _ in after], {c for _, c in after} - {1} == {c for _, c in after}

    assert run(main, contexts=3) == ((5.0, 1), [1.0, 2.0, 3.0], True)


@mf.persistent
class Driver:
    def fan(self, n):
        w = Where()
        return sorted(set(mf.gather([w.here() for _ in range(n)], timeout=30)))

    def read(self, values):
        return values  # (arcs: their values were asked of their home, here)

    def pinned(self, handle):
        return handle.here().result(30)

    def make(self, n):
        return [mf.info(Square.create()).context for _ in range(n)]


def test_a_context_added_after_a_removal_never_uses_the_removed_one(run):
    # a context added later learns which ones left before it came: it places
    # nothing there, and what they held it asks of their heir
    def main():
        s = Square.create(on=2)
        held = [s.of(i) for i in range(5)]
        mf.wait(held)
        pinned = Where.create(on=2)
        mf.remove_context(2)
        (new,) = mf.add_contexts(1)
        d = Driver.create(on=new)
        return (d.fan(12).result(30), d.read(held).result(30), d.pinned(pinned).result(30),
                set(d.make(6).result(30)))

    fan, values, pinned_ran_on, placed = run(main, contexts=3)
    assert 2 not in fan and set(fan) <= {1, 3}
    assert values == [0, 1, 4, 9, 16]
    assert pinned_ran_on == 0  # where context 2's work went
    assert placed <= {1, 3}


def test_a_context_added_after_a_loss_never_uses_the_lost_one(run, transport):
    if transport == "inproc":
        pytest.skip("inproc: a context cannot be killed apart from the program")
    import signal

    def main():
        victim = Square.create(on=1)
        os.kill(victim.pid().result(30), signal.SIGKILL)
        with pytest.raises(mf.ContextLost):
            victim.of(1).result(30)
        (new,) = mf.add_contexts(1)
        return Driver.create(on=new).fan(12).result(30)

    assert set(run(main, contexts=3)) <= {2, 3}


def test_the_ctrl_c_message_counts_the_contexts_it_stopped_not_those_removed(transport, capsys):
    if transport == "mpi":
        pytest.skip("an MPI rank cannot leave a running job")

    def main():
        for _ in range(2):
            (new,) = mf.add_contexts(1)
            mf.remove_context(new)
        assert mf.num_contexts() == 4  # ids 2 and 3 are not given out again
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        mf.run(main, contexts=2, transport=transport)
    assert "interrupted (Ctrl-C); all 2 contexts were stopped" in capsys.readouterr().err


def _register_rank():
    return mf.register(np.full(3, float(mf.rank())))


def test_memory_of_a_removed_context_is_not_read_after_it_left(run):
    # on inproc (one process) a get of it still returned its data; on the
    # other transports it failed with ContextLost, as a call to it does
    def main():
        ptrs = mf.spmd(_register_rank)
        mf.remove_context(1)
        h = mf.get(ptrs[1])
        with pytest.raises(mf.ContextLost, match="context 1 was lost: removed"):
            h.wait(timeout=10)
        with pytest.raises(mf.ContextLost, match="context 1 was lost: removed"):
            mf.put(ptrs[1], np.zeros(3)).wait(timeout=10)
        return mf.get(ptrs[0]).wait(timeout=10).tolist()

    assert run(main, contexts=2) == [0.0, 0.0, 0.0]
