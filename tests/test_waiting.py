"""Waiting for the first of several futures: mf.as_completed and mf.wait's
return_when. A Gate holds one call until main opens it, so the order in which
calls finish is set by the test, not by timing."""

import concurrent.futures
import os
import time

import pytest

import macroflow as mf

pytestmark = pytest.mark.timeout(60)


@mf.persistent
class Gate:
    def __init__(self):
        self.opened = False

    def open(self):
        self.opened = True

    @mf.guard(lambda self: self.opened)
    def through(self, x):
        return x


@mf.persistent
class Quick:
    def echo(self, x):
        return x

    def fail(self, text):
        raise KeyError(text)

    def first_of(self, gate, quick):
        # from a method's lightweight thread: the order calls finish in
        fs = [gate.through("slow"), quick.echo("fast")]
        order = []
        for f in mf.as_completed(fs, timeout=30):
            order.append(f.result())
            if len(order) == 1:
                gate.open()
        return order

    def wait_first(self, gate, quick):
        slow, fast = gate.through("slow"), quick.echo("fast")
        done, pending = mf.wait([slow, fast], timeout=30, return_when=mf.FIRST_COMPLETED)
        gate.open()
        return [f.result() for f in done], len(pending), slow.result()


def test_as_completed_yields_in_the_order_calls_finish(run):
    def main():
        gate, quick = Gate.create(on=1), Quick.create(on=2)
        fs = [gate.through("slow"), quick.echo("fast")]
        order = []
        for f in mf.as_completed(fs, timeout=30):
            order.append(f.result())
            if len(order) == 1:
                gate.open()  # only once the fast one came
        return order

    assert run(main, contexts=3) == ["fast", "slow"]


def test_as_completed_gives_the_done_ones_first_in_order_and_each_future_once(run):
    def main():
        quick = Quick.create(on=1)
        a, b = quick.echo("a"), quick.echo("b")
        mf.wait([a, b])
        gate = Gate.create(on=1)
        c = gate.through("c")
        it = mf.as_completed([b, c, a, b, a])
        head = [next(it).result(), next(it).result()]
        gate.open()
        return head + [f.result() for f in it]

    assert run(main, contexts=2) == ["b", "a", "c"]


def test_as_completed_yields_a_failed_call_whose_result_raises(run):
    def main():
        quick = Quick.create(on=1)
        got = []
        for f in mf.as_completed([quick.fail("boom"), quick.echo(1)], timeout=30):
            got.append(type(f.exception()).__name__ if f.exception() else f.result())
        return sorted(map(str, got))

    assert run(main, contexts=2) == ["1", "KeyError"]


def test_as_completed_times_out_naming_what_is_left_and_leaves_no_callback(run):
    def main():
        gate, quick = Gate.create(on=1), Quick.create(on=1)
        held = gate.through("held")
        it = mf.as_completed([held, quick.echo(1)], timeout=0.3)
        first = next(it).result()
        with pytest.raises(mf.TimeoutError, match=r"1 of 2 futures not ready after 0.3 s"):
            next(it)
        left_over = list(held._callbacks)
        gate.open()
        return first, held.result(timeout=30), left_over

    assert run(main, contexts=2) == (1, "held", [])


def test_leaving_as_completed_early_detaches_it(run):
    def main():
        gate, quick = Gate.create(on=1), Quick.create(on=1)
        held = gate.through("held")
        it = mf.as_completed([quick.echo(1), held])
        first = next(it).result()
        it.close()
        left_over = list(held._callbacks)
        gate.open()
        return first, left_over, held.result(timeout=30)

    assert run(main, contexts=2) == (1, [], "held")


def test_wait_first_completed_returns_with_the_first(run):
    def main():
        gate, quick = Gate.create(on=1), Quick.create(on=2)
        slow, fast = gate.through("slow"), quick.echo("fast")
        done, pending = mf.wait([slow, fast], timeout=30, return_when=mf.FIRST_COMPLETED)
        out = ([f.result() for f in done], pending == [slow])
        gate.open()
        return out, slow.result(timeout=30)

    assert run(main, contexts=3) == ((["fast"], True), "slow")


def test_wait_first_exception_returns_at_a_failure_else_waits_for_all(run):
    def main():
        gate, quick = Gate.create(on=1), Quick.create(on=2)
        slow, bad = gate.through("slow"), quick.fail("x")
        done, pending = mf.wait([slow, bad], timeout=30, return_when=mf.FIRST_EXCEPTION)
        first = (done == [bad], pending == [slow])
        gate.open()
        # no failure: every future, as ALL_COMPLETED
        fs = [quick.echo(i) for i in range(5)] + [slow]
        done, pending = mf.wait(fs, timeout=30, return_when=concurrent.futures.FIRST_EXCEPTION)
        return first, len(done), pending

    assert run(main, contexts=3) == ((True, True), 6, [])


def test_wait_first_completed_times_out_with_nothing_done(run):
    def main():
        gate = Gate.create(on=1)
        held = gate.through(1)
        done, pending = mf.wait([held], timeout=0.2, return_when=mf.FIRST_COMPLETED)
        gate.open()
        return done, pending == [held], list(held._callbacks), held.result(timeout=30)

    assert run(main, contexts=2) == ([], True, [], 1)


def test_first_of_several_from_a_methods_thread(run):
    def main():
        gate, quick, host = Gate.create(on=1), Quick.create(on=2), Quick.create(on=1)
        order = host.first_of(gate, quick).result(timeout=30)
        gate2 = Gate.create(on=1)
        return order, host.wait_first(gate2, quick).result(timeout=30)

    assert run(main, contexts=3) == (["fast", "slow"], (["fast"], 1, "slow"))


def test_bad_arguments_are_refused_at_the_call(run):
    def main():
        f = Quick.create(on=1).echo(1)
        with pytest.raises(ValueError, match="return_when must be mf.FIRST_COMPLETED"):
            mf.wait([f], return_when="FIRST")
        with pytest.raises(TypeError, match=r"mf.as_completed\(\) waits for macroflow futures; item 1 is 2"):
            mf.as_completed([f, 2])  # at the call, not at the first next()
        with pytest.raises(TypeError, match="not one Future"):
            mf.as_completed(f)
        with pytest.raises(ValueError, match="timeout must be a number of seconds"):
            mf.as_completed([f], timeout=-1)
        return list(mf.as_completed([])), mf.wait([], return_when=mf.FIRST_COMPLETED)

    assert run(main, contexts=2) == ([], ([], []))


@mf.persistent
class Mortal:
    def die(self):
        os._exit(3)


@pytest.mark.parametrize("transport", ["local"])
def test_a_lost_context_ends_as_completed_with_its_futures_failed(run):
    def main():
        quick, mortal = Quick.create(on=1), Mortal.create(on=2)
        got = []
        for f in mf.as_completed([mortal.die(), quick.echo("ok")], timeout=30):
            got.append(type(f.exception()).__name__ if f.exception() else f.result())
        return sorted(got)

    assert run(main, contexts=3) == ["ContextLost", "ok"]


@mf.persistent
class Selfish:
    def one(self):
        return 1

    def own_first(self, me, quick):
        got = []
        try:
            for f in mf.as_completed([me.one(), quick.echo("other")]):
                got.append(f.result())
        except mf.DeadlockError as e:
            got.append("own object" in str(e))
        return got


def test_a_method_waiting_only_for_calls_to_its_own_object_is_refused(run):
    def main():
        me, quick = Selfish.create(on=1), Quick.create(on=2)
        return me.own_first(me, quick).result(timeout=30)

    # the other call comes; then only a call that can never start is left
    assert run(main, contexts=3) == ["other", True]


@mf.regular
class Sim:
    def nap(self, s):
        time.sleep(s)  # computes, as far as its context is concerned
        return s


def test_without_a_timeout_context_0_holds_back_no_answer(run, transport):
    # context 0 ran a regular call placed there while main waited, and held
    # every other answer until it returned (1.07 s for answers of 0.05 s)
    if transport == "inproc":
        pytest.skip("inproc: every context runs in main's thread")

    def main():
        t0 = time.perf_counter()
        fs = [Sim().nap(1.5)] + [Sim().nap(0.0) for _ in range(5)]
        first = None
        for f in mf.as_completed(fs):
            if first is None:
                first = time.perf_counter() - t0
        t1 = time.perf_counter()
        fs = [Sim().nap(1.5)] + [Sim().nap(0.0) for _ in range(5)]
        done, _ = mf.wait(fs, return_when=mf.FIRST_COMPLETED)
        waited = time.perf_counter() - t1
        mf.wait(fs)
        return first, waited, len(done)

    first, waited, done = run(main, contexts=3)
    assert first < 1.0 and waited < 1.0 and 1 <= done < 6, (first, waited, done)


def test_a_timeout_given_as_a_fraction_is_said_as_a_number(run):
    from fractions import Fraction

    def main():
        gate = Gate.create(on=1)
        held = gate.through(1)
        errors = []
        for wait in (lambda: list(mf.as_completed([held], timeout=Fraction(1, 20))),
                     lambda: mf.gather([held], timeout=Fraction(1, 20))):
            with pytest.raises(mf.TimeoutError, match="after 0.05 s") as e:
                wait()
            errors.append(type(e.value).__name__)
        gate.open()
        return errors, held.result(timeout=30)

    assert run(main, contexts=2) == (["TimeoutError", "TimeoutError"], 1)


POLLS_MAX = 100_000  # a poll that never looks would spin for ever: bounded here


def test_a_loop_of_zero_timeout_polls_gets_the_values(run):
    # (a wait of 0 s returned before the engine looked at all: a loop of
    # f.result(timeout=0) or mf.wait(fs, timeout=0) never got anything)
    def main():
        f = Quick.create(on=1).echo(42)
        polls = 0
        while polls < POLLS_MAX:
            try:
                got = f.result(timeout=0)
                break
            except mf.TimeoutError:
                polls += 1
        else:
            got = None
        q = Quick.create(on=1)
        fs = [q.echo(i) for i in range(4)]
        waits = 0
        while waits < POLLS_MAX and mf.wait(fs, timeout=0)[1]:
            waits += 1
        return got, polls < POLLS_MAX, [f.result() for f in fs], waits < POLLS_MAX

    assert run(main, contexts=2) == (42, True, [0, 1, 2, 3], True)


@mf.persistent
class Step:
    def run(self, x):
        if x == "fail":
            raise ValueError("failed on purpose")
        return x


def in_the_order_they_ended():
    """Calls to objects on this very context run one after the other, in the
    order they were made: the order as_completed gives them in, whatever the
    type of their results (a list, a tuple, an exception, an int)."""
    here = mf.context_id()
    a, b = Step.create(on=here), Step.create(on=here)
    out = []
    for rnd in range(2):
        if rnd:  # results asked for at once: the site's are then sent unasked
            for _ in range(4):
                a.run(0).result(timeout=30)
        fs = [a.run([1]), b.run(7), a.run("fail"), b.run((2,)), a.run({"k": 3}), b.run(None)]
        out.append([fs.index(f) for f in mf.as_completed(fs, timeout=30)])
        done, _ = mf.wait(fs, timeout=30, return_when=mf.FIRST_COMPLETED)
        out.append(len(done) >= 1 and fs[0] in done)
    return out, fs[0].result(), type(fs[2].exception()).__name__, fs[3].result()


@mf.persistent
class Boss:
    def in_the_order_they_ended(self):
        return in_the_order_they_ended()


def test_results_of_calls_to_ones_own_context_come_in_the_order_the_calls_ended(run):
    # (a result that was not a number, string, bytes or None went to its
    # future by a message behind the calls queued there: as_completed gave
    # it after the ones that ended later)
    def main():
        return [Boss.create(on=1).in_the_order_they_ended().result(timeout=30),
                in_the_order_they_ended()]

    order = [0, 1, 2, 3, 4, 5]
    assert run(main, contexts=2) == [([order, True, order, True], [1], "ValueError", (2,))] * 2


@mf.persistent
class Nap:
    def nap(self, s, v):
        time.sleep(s)
        return v


def test_a_done_callback_that_waits_inside_mains_wait_for_the_first_gets_its_value(run):
    # main loops over as_completed; a callback added meanwhile waits for a
    # call on another context (callbacks "must not block", but this one may)
    def main():
        a, b = Nap.create(on=1), Nap.create(on=mf.num_contexts() - 1)
        f0, f1, f2 = a.nap(0.0, "f0"), a.nap(0.05, "f1"), b.nap(0.1, "f2")
        seen = []
        order = []
        for f in mf.as_completed([f0, f1], timeout=30):
            order.append(f.result())
            if f is f0:
                f1.add_done_callback(lambda fut: seen.append((fut.result(), f2.result(timeout=30))))
        return order, seen

    assert run(main, contexts=3) == (["f0", "f1"], [("f1", "f2")])


def test_a_first_completed_loop_over_calls_queued_on_its_own_context_takes_one_wait(run):
    # the context runs what was queued before the waiting thread became ready
    # before resuming it: one wait, not one per call (which cost n waits of
    # n futures each: 7.5 s for 4,000 calls)
    def main():
        here = mf.context_id()
        steps = [Step.create(on=here) for _ in range(4)]
        rest = [steps[i % 4].run(i) for i in range(400)]
        waits, got = 0, []
        while rest:
            done, rest = mf.wait(rest, timeout=30, return_when=mf.FIRST_COMPLETED)
            got += [f.result() for f in done]
            waits += 1
        return waits, sorted(got) == list(range(400))

    assert run(main, contexts=1) == (1, True)


@pytest.mark.timeout(60)
def test_a_wait_for_the_first_ends_with_the_first_on_every_transport(run):
    # inproc ran every call queued elsewhere before main heard of the first
    # (FIRST_COMPLETED: 2 done after 1.1 s), and as_completed then said
    # "2 of 2 futures not ready" with one of them done
    def main():
        s1, s2 = Sim.create(on=1), Sim.create(on=2)
        s1.nap(0).result(10)
        s2.nap(0).result(10)
        out = []
        done, left = mf.wait([s1.nap(0.1), s1.nap(1.0)], return_when=mf.FIRST_COMPLETED)
        out.append((sorted(f.result() for f in done), len(left)))
        mf.wait(left)
        got = []
        with pytest.raises(mf.TimeoutError) as e:
            for f in mf.as_completed([s1.nap(0.3), s2.nap(2.0)], timeout=1):
                got.append(f.result())
        out.append((got, str(e.value).split(" not ready")[0]))
        return out

    assert run(main, contexts=3) == [([0.1], 1), ([0.3], "1 of 2 futures")]


def test_waiting_for_another_librarys_future_names_it(run):
    # it said "item 0 is <Future at 0x... state=pending> (Future), not a Future"
    import concurrent.futures

    def main():
        with pytest.raises(TypeError) as e:
            mf.wait([concurrent.futures.Future()])
        return str(e.value)

    said = run(main)
    assert "(concurrent.futures._base.Future), not a macroflow Future" in said, said


def test_gather_and_wait_of_done_futures_only_read_from_another_thread(run):
    # (the guide: what only reads may be used from any thread; a wait that
    # would have to serve may not)
    import threading

    def main():
        q = Quick.create()
        fs = [q.echo(i) for i in range(3)]
        mf.wait(fs)
        out = {}

        def other():
            out["gather"] = mf.gather(fs)
            out["wait"] = len(mf.wait(fs)[0])
            try:
                mf.gather([q.echo(9)])
            except RuntimeError as e:
                out["pending"] = "a thread other than the one that started" in str(e)

        t = threading.Thread(target=other)
        t.start()
        t.join(30)
        return out

    assert run(main, contexts=2) == {"gather": [0, 1, 2], "wait": 3, "pending": True}
