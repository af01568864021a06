"""Guards whose predicate raises: the guarded call fails with that exception,
the object and its other calls go on. Guards used where they cannot work are
refused when the class is decorated."""

import pytest

import macroflow as mf

pytestmark = pytest.mark.timeout(60)


@mf.persistent
class Door:
    def __init__(self):
        self.mode = "closed"
        self.entered = 0

    def set_mode(self, mode):
        self.mode = mode

    def is_open(self):
        if self.mode not in ("open", "closed"):
            raise ValueError(f"unknown mode {self.mode!r}")
        return self.mode == "open"

    @mf.guard(lambda self: self.is_open())
    def enter(self):
        self.entered += 1
        return "in"

    def count(self):
        return self.entered


@mf.persistent
class Table:
    def __init__(self):
        self.rows = {"a": 1}

    @mf.guard(lambda self, key: key in self.rows)
    def lookup(self, key):
        return self.rows[key]

    def add(self, key, value):
        self.rows[key] = value


def test_guard_that_raises_at_once_fails_its_call(run):
    def main():
        door = Door.create(on=1)
        door.set_mode("ajar")
        with pytest.raises(ValueError, match="unknown mode 'ajar'") as info:
            door.enter().result()
        cause = info.value.__cause__
        assert isinstance(cause, mf.RemoteTraceback)
        assert "is_open" in cause.text  # the predicate's traceback
        if hasattr(info.value, "add_note"):  # (3.11 on) and what raised it
            assert info.value.__notes__ == ["raised by the guard of Door.enter()"]
        door.set_mode("open")
        return door.enter().result(), door.count().result()

    assert run(main, contexts=2) == ("in", 1)  # the failed call never ran the method


def test_guard_that_raises_later_fails_the_waiting_call(run):
    def main():
        door = Door.create(on=1)
        waiting = door.enter()  # closed: the guard is false, the call waits
        door.set_mode("ajar")  # the next look at the guard raises
        with pytest.raises(ValueError, match="ajar"):
            waiting.result()
        door.set_mode("open")
        return door.enter().result(), door.count().result()

    assert run(main, contexts=2) == ("in", 1)


def test_only_the_call_whose_guard_raised_fails(run):
    def main():
        t = Table.create(on=1)
        later = t.lookup("b")  # waits for "b"
        bad = t.lookup(["not", "hashable"])  # its guard raises TypeError
        first = t.lookup("a")
        t.add("b", 2)
        with pytest.raises(TypeError, match="unhashable"):
            bad.result()
        return first.result(), later.result()

    assert run(main, contexts=2) == (1, 2)


def test_guard_error_flows_through_arcs(run):
    @mf.regular
    class Echo:
        def echo(self, x):
            return x

    def main():
        door = Door.create(on=1)
        door.set_mode("ajar")
        downstream = Echo.create(on=2).echo(door.enter())  # an arc from the failed call
        with pytest.raises(ValueError, match="ajar"):
            downstream.result()
        return True

    assert run(main, contexts=3)


# -- misuse, refused at decoration --------------------------------------------
def test_guard_on_a_regular_method_is_refused():
    with pytest.raises(TypeError, match=r"Oracle\.never has a guard, but @mf\.regular objects "
                                        r"are stateless .* make .*Oracle @mf\.persistent"):
        @mf.regular
        class Oracle:
            @mf.guard(lambda self: False)
            def never(self):
                return "ran"


def test_guard_on_an_inherited_static_method_of_a_regular_class_is_refused():
    class Base:
        @mf.guard(lambda self: False)
        @staticmethod
        def never():
            return "ran"

    with pytest.raises(TypeError, match=r"Sub\.never \(inherited from .*Base\) has a guard"):
        @mf.regular
        class Sub(Base):
            pass


def test_overridden_guarded_method_does_not_count():
    class Base:
        @mf.guard(lambda self: False)
        def m(self):
            return "base"

    @mf.regular
    class Sub(Base):
        def m(self):
            return "sub"

    assert mf.run(lambda: Sub().m().result(), contexts=2, transport="inproc") == "sub"


@pytest.mark.parametrize("kind", ["persistent", "regular"])
def test_bare_guard_without_a_predicate_is_refused(kind):
    with pytest.raises(TypeError, match=r"G\.take is not a method: @mf\.guard was used without "
                                        r"a predicate.*write @mf\.guard\(lambda self: <condition>\) "
                                        r"above def take\(self, \.\.\.\)"):
        @getattr(mf, kind)
        class G:
            @mf.guard
            def take(self):
                return "took"


@pytest.mark.parametrize("thing", [5, None, "method", int])
def test_guard_decorating_what_is_not_a_method_is_refused(thing):
    with pytest.raises(TypeError, match=r"mf\.guard\(predicate\) decorates a method of a "
                                        r"@mf\.persistent class.*; got "):
        mf.guard(lambda self: True)(thing)


def test_guards_on_persistent_methods_of_every_kind_are_accepted():
    @mf.persistent
    class Fine:
        @mf.guard(lambda self: True)
        def m(self):
            return "m"

        @mf.guard(lambda self: True)
        @staticmethod
        def s():
            return "s"

    assert mf.run(lambda: mf.gather([Fine.create().m(), Fine.create().s()]),
                  contexts=2, transport="inproc") == ["m", "s"]


def test_a_guard_that_cannot_take_the_methods_arguments_is_refused_at_decoration():
    # (each call failed, with a TypeError of a <lambda>)
    with pytest.raises(TypeError, match=r"the guard of .*_Queue.pop\(self\) takes \(self, n\), "
                                        r"which cannot take the method's arguments"):
        @mf.persistent
        class _Queue:
            @mf.guard(lambda self, n: n > 0)  # takes an argument pop() does not
            def pop(self):
                return 1
    with pytest.raises(TypeError, match=r"put\(self, a, b=2\) takes \(self, a\)"):
        class _Put:
            @mf.guard(lambda self, a: a > 0)  # a call put(1, 2) would not fit
            def put(self, a, b=2):
                return a
    fits = [lambda self, a, b=2: a, lambda self, *args, **kw: True, lambda self, a, *rest: a,
            lambda self: True]
    for predicate in fits:  # accepted
        class _Fits:
            @mf.guard(predicate)
            def put(self, a, b=2):
                return a

        @mf.persistent
        class _Static:
            @mf.guard(lambda self, a: a > 0)  # the self of a static method's guard is the object's
            @staticmethod
            def put(a):
                return a


_NOT_READY = ValueError("not ready")


def _raises_the_same(self):
    raise _NOT_READY  # the same exception object at every look


@mf.persistent
class _SameError:
    @mf.guard(_raises_the_same)
    def m(self):
        return 1


def test_a_guard_that_raises_one_exception_object_again_gets_one_note(run):
    def main():
        g = _SameError.create(on=1)
        notes = []
        for _ in range(3):
            with pytest.raises(ValueError) as info:
                g.m().result(30)
            notes.append(getattr(info.value, "__notes__", None))
        return notes, getattr(_NOT_READY, "__notes__", None)

    notes, here = run(main, contexts=2)
    if hasattr(_NOT_READY, "add_note"):
        assert notes == [["raised by the guard of _SameError.m()"]] * 3


@mf.persistent
class _Other:
    def ok(self):
        return True


@mf.persistent
class _WaitsInGuard:
    def __init__(self, other):
        self.other, self.me, self.ran = other, None, 0

    def set_me(self, me):
        self.me = me

    @mf.guard(lambda self: self.other.ok().result(30))  # waits: refused when evaluated
    def g(self, i):
        self.ran += 1
        return i

    @mf.guard(lambda self: self.me.mine().result(30))  # waits for its own object
    def h(self):
        return "h"

    def mine(self):
        return True

    def count(self):
        return self.ran


def test_a_guard_that_waits_fails_its_call_and_the_object_goes_on(run):
    # a guard is evaluated while its object looks for its next call: a wait
    # there let the object look again with the guard half evaluated (its
    # engine then failed on its queue) or stepped the engine inside the guard
    def main():
        w = _WaitsInGuard.create(_Other.create(on=2), on=1)
        w.set_me(w)
        calls = [w.g(i) for i in range(3)] + [w.h()]
        errors = []
        for f in calls:
            with pytest.raises(mf.DeadlockError) as info:
                f.result(30)
            errors.append(str(info.value))
        return errors, w.count().result(30), w.mine().result(30)

    errors, ran, alive = run(main, contexts=3)
    assert [e.split(" waits")[0] for e in errors] == \
        ["the guard of _WaitsInGuard.g()"] * 3 + ["the guard of _WaitsInGuard.h()"]
    assert "must not wait" in errors[0] and "_Other.ok" in errors[0]
    assert (ran, alive) == (0, True)


def _exits(self):
    import sys
    sys.exit(3)


@mf.persistent
class ExitingGuard:
    @mf.guard(_exits)
    def enter(self):
        return "in"

    def other(self):
        return "other"


def test_sys_exit_in_a_guard_fails_its_call_not_the_caller(run):
    def main():
        g = ExitingGuard.create(on=1)
        with pytest.raises(mf.MacroflowError, match=r"guard of ExitingGuard.enter\(\) on "
                                                    r"context 1 called sys.exit\(3\)"):
            g.enter().result(timeout=10)
        return g.other().result(timeout=10)

    assert run(main, contexts=2) == "other"


@pytest.mark.parametrize("body, match", [
    ("@mf.guard(lambda self: self.a)\n    @mf.guard(lambda self: self.b)\n    def m(self): pass",
     r"T.m has two guards"),
    ("@mf.guard(lambda: True)\n    def m(self): pass",
     r"the predicate is called with the object.*its signature is \(\)"),
    ("@mf.guard(lambda self: False)\n    def __init__(self): pass",
     r"T.__init__ has a guard, but a constructor runs once"),
    ("@mf.guard(lambda self: False)\n    def _hidden(self): pass",
     r"T._hidden has a guard, but only public methods are called through a handle"),
    # (its coroutine was true and never run: the guard always held)
    ("@mf.guard(_never_async)\n    def m(self): pass",
     r"mf.guard\(_never_async\): the predicate is an async function"),
])
def test_guards_that_could_never_work_are_refused_when_the_class_is_made(body, match):
    src = f"@mf.persistent\nclass T:\n    {body}\n"
    with pytest.raises(TypeError, match=match):
        exec(src, {"mf": mf, "_never_async": _never_async})


async def _never_async(self):
    return False


@mf.persistent
class AwaitingGuard:
    @mf.guard(lambda self: _never_async(self))  # a plain function that returns a coroutine
    def enter(self):
        return "in"

    def other(self):
        return "other"


def test_a_guard_that_returns_a_coroutine_fails_its_call(run):
    # (the coroutine was true: the call ran although the guard said False)
    def main():
        g = AwaitingGuard.create(on=1)
        with pytest.raises(TypeError, match=r"the guard of AwaitingGuard.enter\(\) returned "
                                            r"coroutine .* a guard cannot wait for"):
            g.enter().result(timeout=10)
        return g.other().result(timeout=10)

    assert run(main, contexts=2) == "other"


def _put(self, x):
    self.items.append(x)
    return len(self.items)


@mf.persistent
class Unbounded:
    def __init__(self):
        self.items = []

    put = _put


@mf.persistent
class Bounded:
    def __init__(self):
        self.items = []

    put = mf.guard(lambda self, x: len(self.items) < 1)(_put)

    def take(self):
        return self.items.pop()


def test_a_guard_is_on_its_class_only_not_on_the_function_it_shares(run):
    def main():
        u, b = Unbounded.create(on=1), Bounded.create(on=1)
        free = mf.gather([u.put(i) for i in range(3)], timeout=10)
        first, second = b.put(1), b.put(2)  # the second waits for a take
        first.result(timeout=10)
        held = second.done()
        b.take().result(timeout=10)
        return free, held, second.result(timeout=10)

    assert run(main, contexts=2) == ([1, 2, 3], False, 1)
    assert not hasattr(_put, "__mf_guard__")


class _Wrap:
    def __init__(self, f):
        self.f = f


@mf.persistent
class Mailbox:
    def __init__(self):
        self.item = None

    def put(self, w):
        self.item = w

    @mf.guard(lambda self: self.item is not None)
    def get(self):
        return self.item


@mf.persistent
class WaitsForItself:
    def work(self, mb):
        return mb.get().result().f.result()  # its own future, handed back through the mailbox


def test_a_method_that_waits_for_its_own_future_is_told_so(run):
    # (a DeadlockError that named the call "a method")
    def main():
        mb = Mailbox.create(on=1)
        f = WaitsForItself.create(on=2 % mf.num_contexts()).work(mb)
        mb.put(_Wrap(f))
        with pytest.raises(mf.DeadlockError, match=r"WaitsForItself.work waits for its own "
                                                   r"result \(its future came back to it\)"):
            f.result(timeout=30)

    run(main, contexts=3)
