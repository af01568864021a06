"""Method names and kinds: handles reserve no name; static, class and coroutine
methods; futures awaited from asyncio on the caller's side. On every transport."""

import asyncio
import time

import pytest

import macroflow as mf
from common import Gate, Log

pytestmark = pytest.mark.timeout(60)

# Every name a handle used to have for itself, and a few more a runtime might want.
NAMES = ["context", "destroy", "args", "kwargs", "on", "oid", "created", "gptr", "cls", "info", "id"]


def _named(name):
    def method(self, x=None):
        return (name, x)
    method.__name__ = name
    return method


@mf.persistent
class Shadowy:
    """A persistent class whose methods have the names above."""

    def __init__(self):
        self.destroyed_by_user = False

    def destroy(self):
        self.destroyed_by_user = True
        return "user destroy"

    def alive(self):
        return self.destroyed_by_user


for _n in NAMES:
    if _n != "destroy":
        setattr(Shadowy, _n, _named(_n))


@mf.regular
class ShadowyR:
    pass


for _n in NAMES:
    setattr(ShadowyR, _n, _named(_n))


@mf.persistent
class Keeper:
    def __init__(self):
        self.h = None

    def keep(self, h):
        self.h = h

    def info_of_kept(self):
        i = mf.info(self.h)
        return i.kind, i.context, i.id, i.created, i.gptr.context

    def call_kept(self):
        return self.h.alive().result()


def test_user_methods_may_have_any_public_name(run):
    def main():
        p, r = Shadowy.create(on=1), ShadowyR()
        got_p = mf.gather([getattr(p, n)(1) for n in NAMES if n != "destroy"])
        got_r = mf.gather([getattr(r, n)(2) for n in NAMES])
        return got_p, got_r, p.destroy().result(), p.alive().result()

    got_p, got_r, destroyed, alive = run(main)
    assert got_p == [(n, 1) for n in NAMES if n != "destroy"]
    assert got_r == [(n, 2) for n in NAMES]
    assert destroyed == "user destroy" and alive is True  # the user's destroy ran; the object lives


def test_handles_have_no_public_attributes_of_their_own():
    for cls in (mf.PersistentHandle, mf.RegularHandle):
        assert [n for n in dir(cls) if not n.startswith("_")] == []


def test_private_names_are_not_remote_methods(run):
    def main():
        p = Shadowy.create(on=1)
        with pytest.raises(AttributeError, match="only public methods"):
            p._secret
        return hasattr(p, "_repr_html_"), hasattr(ShadowyR(), "_ipython_display_")

    assert run(main) == (False, False)


def test_destroy_function(run):
    def main():
        p = Shadowy.create(on=1)
        p.alive()
        assert mf.destroy(p).result() is None
        err = p.alive().exception()
        with pytest.raises(TypeError, match="regular class"):
            mf.destroy(ShadowyR())
        with pytest.raises(TypeError, match="persistent object; got int"):
            mf.destroy(3)
        return err

    err = run(main)
    assert isinstance(err, mf.ObjectDestroyed) and "destroyed" in str(err)


def test_info_of_a_persistent_handle(run):
    def main():
        p = Shadowy.create(on=2)
        i = mf.info(p)
        with pytest.raises(AttributeError):
            i.context = 0  # frozen
        k = Keeper.create(on=1)
        k.keep(p)
        remote = k.info_of_kept().result()
        return (i.kind, i.cls, i.context, i.id, i.created.result(), i.gptr.context, i.gptr.kind,
                i.gptr.ident == i.id, i.computation == mf.info(k).computation, remote)

    kind, cls, ctx, oid, created, gctx, gkind, same, same_comp, remote = run(main)
    assert (kind, cls, ctx, created, gctx, gkind, same, same_comp) == \
        ("persistent", Shadowy, 2, None, 2, "object", True, True)
    # a copy sent elsewhere knows everything but the constructor's future
    assert remote == ("persistent", 2, oid, None, 2)


def test_info_of_regular_handles(run):
    def main():
        pinned, free = mf.info(ShadowyR.create(on=1)), mf.info(ShadowyR())
        return [(i.kind, i.cls, i.context, i.id, i.created, i.gptr) for i in (pinned, free)]

    assert run(main) == [("regular", ShadowyR, 1, None, None, None),
                         ("regular", ShadowyR, None, None, None, None)]


def test_info_needs_a_handle():
    with pytest.raises(TypeError, match="takes a handle"):
        mf.info(Shadowy)


def test_reserved_class_names_are_refused_with_the_reason():
    with pytest.raises(TypeError, match=r"Bad defines 'create', a name @mf.regular reserves: "
                                        r"Cls.create\(...\) is how objects"):
        @mf.regular
        class Bad:
            @staticmethod
            def create():
                pass

    class Base:
        def create(self):
            pass

    with pytest.raises(TypeError, match=r"defines 'create' \(inherited from .*Base\)"):
        @mf.persistent
        class Child(Base):
            pass


@mf.persistent
class Sub(Keeper):
    """A persistent class derived from a persistent class: its create is not a user's."""


def test_a_parallel_class_may_derive_from_another(run):
    assert run(lambda: Sub.create(on=1).info_of_kept().exception() is not None)


# -- static and class methods ---------------------------------------------------
@mf.persistent
class Tools:
    def __init__(self):
        self.is_open = False

    @staticmethod
    def add(a, b=10):
        return a + b

    @classmethod
    def name(cls, suffix):
        return cls.__name__ + suffix

    def open(self):
        self.is_open = True

    @mf.guard(lambda self: self.is_open)  # a guard outside the staticmethod
    @staticmethod
    def gated(x):
        return x


@mf.regular
class RTools:
    @staticmethod
    def mul(a, b):
        return a * b

    @classmethod
    def name(cls):
        return cls.__name__


def test_static_and_class_methods(run):
    def main():
        t, r = Tools.create(on=1), RTools()
        return mf.gather([t.add(1), t.add(1, 2), t.name("!"), r.mul(6, 7), r.name(),
                          RTools.create(on=2).mul(2, 3)])

    assert run(main) == [11, 3, "Tools!", 42, "RTools", 6]


def test_static_and_class_method_arity_is_checked_at_the_call_site(run):
    def main():
        t, r = Tools.create(on=1), RTools()
        with pytest.raises(mf.CallError, match=r"Tools.add\(\)"):
            t.add(1, 2, 3)
        with pytest.raises(mf.CallError, match=r"Tools.add\(\)"):
            t.add()
        with pytest.raises(mf.CallError, match=r"Tools.name\(\)"):
            t.name()
        with pytest.raises(mf.CallError, match=r"RTools.name\(\)"):
            r.name(1)
        with pytest.raises(mf.CallError, match=r"RTools.mul\(\)"):
            r.mul(1, 2, 3)
        return t.add(a=1, b=1).result()

    assert run(main) == 2


def test_guard_on_a_static_method(run):
    def main():
        t = Tools.create(on=1)
        f = t.gated("through")
        assert not mf.wait([f], timeout=0.05)[0]  # held by its guard
        t.open()
        return f.result()

    assert run(main) == "through"


# -- coroutine methods ------------------------------------------------------------
@mf.persistent
class Async:
    def __init__(self, helper=None):
        self.helper = helper
        self.n = 0

    async def double(self, x):
        return 2 * x

    async def through(self, gate, x):
        # awaits a call on another object: parks; the context serves the rest
        got = await gate.wait(x)
        self.n += 1
        return got

    async def chain(self, x):
        async def inner(y):
            return await self.helper.mul(y, 3)
        return await inner(x) + await self.helper.mul(x, 1)

    async def fails(self):
        await self.helper.mul(1, 1)
        raise KeyError("inside")

    async def sleeps(self):
        await asyncio.sleep(0)

    async def answers_early(self, gate):
        mf.rtf("early")
        await gate.wait()
        self.n += 1

    async def elaborates(self, x):
        return self.helper.mul(x, x)  # a future: elaboration

    def count(self):
        return self.n

    @staticmethod
    async def static_double(x):
        return 2 * x


@mf.regular
class AsyncR:
    async def square(self, helper, x):
        return await helper.mul(x, x)


def test_coroutine_methods_run(run):
    def main():
        a = Async.create(RTools(), on=1)
        return mf.gather([a.double(21), a.chain(2), a.static_double(4), a.elaborates(5),
                          AsyncR().square(RTools(), 9)])

    assert run(main) == [42, 8, 8, 25, 81]


def test_coroutine_method_waits_without_stalling_its_context(run):
    def main():
        gate = Gate.create(on=1)
        a = Async.create(on=1)  # same context as the gate
        fs = [a.through(gate, i) for i in range(3)]
        assert not mf.wait(fs, timeout=0.05)[0]
        gate.open()  # runs on context 1 while a's method is parked there
        return mf.gather(fs), a.count().result()

    assert run(main, contexts=2) == ([0, 1, 2], 3)


def test_coroutine_method_errors(run):
    def main():
        a = Async.create(RTools(), on=1)
        return a.fails().exception(), a.sleeps().exception(), a.double(1).result()

    err, sleep_err, after = run(main)
    assert isinstance(err, KeyError) and "inside" in str(err)
    assert isinstance(sleep_err, RuntimeError)
    assert "can await only macroflow futures" in str(sleep_err)
    assert after == 2  # the object goes on serving


def test_rtf_in_a_coroutine_method(run):
    def main():
        gate = Gate.create(on=2)
        a = Async.create(on=1)
        early = a.answers_early(gate).result()
        gate.open()
        return early, a.count().result()

    assert run(main) == ("early", 1)


# -- awaiting futures from asyncio on the caller's side -----------------------------
def test_await_futures_from_asyncio(transport):
    async def amain():
        a = Async.create(RTools(), on=1)
        first = await a.double(5)
        both = await asyncio.gather(a.double(1), RTools().mul(3, 4))
        done = a.double(7)
        done.result()
        again = await done  # already here
        try:
            await a.fails()
        except KeyError as e:
            err = str(e)
        return first, both, again, err

    with mf.init(contexts=2, transport=transport):
        assert asyncio.run(amain()) == (10, [2, 12], 14, "'inside'")


def test_awaiting_lets_other_asyncio_tasks_run(transport):
    # The gate opens only from another asyncio task: an await that blocked the
    # event loop could never finish.
    async def amain():
        gate = Gate.create(on=1)
        ticks = []

        async def opener():
            for i in range(5):
                ticks.append(i)
                await asyncio.sleep(0)
            gate.open()

        task = asyncio.create_task(opener())
        got = await gate.wait("through")
        await task
        return got, ticks

    with mf.init(contexts=2, transport=transport):
        assert asyncio.run(amain()) == ("through", [0, 1, 2, 3, 4])


def test_awaiting_serves_calls_placed_on_context_0(transport):
    async def amain():
        local = RTools.create(on=0)  # runs only when context 0's engine is driven
        return await asyncio.gather(*[local.mul(i, i) for i in range(4)])

    with mf.init(contexts=2, transport=transport):
        assert asyncio.run(amain()) == [0, 1, 4, 9]


@mf.regular
class _Napper:
    def nap(self, s):
        time.sleep(s)  # computes, as far as its context is concerned
        return s


def test_awaiting_regular_calls_does_not_starve_the_loop(transport):
    # context 0 ran the regular calls placed there, one after another, in a
    # turn of the loop: a 0.1 s ticker went 2 s without a tick, and a Ctrl-C
    # waited for every queued call
    if transport == "inproc":
        pytest.skip("inproc: every context runs in the loop's thread")

    async def amain():
        ticks = []

        async def ticker():
            while True:
                ticks.append(time.monotonic())
                await asyncio.sleep(0.05)

        task = asyncio.create_task(ticker())
        got = await asyncio.gather(*[_Napper().nap(0.2) for _ in range(30)])
        task.cancel()
        gaps = [b - a for a, b in zip(ticks, ticks[1:])]
        return len(got), max(gaps)

    with mf.init(contexts=3, transport=transport):
        n, gap = asyncio.run(amain())
    assert n == 30 and gap < 0.5, gap


def test_cancelled_await_leaves_the_future_usable(transport):
    async def amain():
        gate = Gate.create(on=1)
        f = gate.wait("later")
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(f, timeout=0.05)
        gate.open()
        return await f

    with mf.init(contexts=2, transport=transport):
        assert asyncio.run(amain()) == "later"


def test_asyncio_wait_sees_macroflow_futures_finish(transport):
    # asyncio.wait adds its own done callbacks, which ran only when the
    # engine stepped, and nothing stepped it: it waited to its timeout and
    # then raised AttributeError (no remove_done_callback)
    async def amain():
        gate = Gate.create(on=1)
        quick, slow = RTools().mul(3, 4), gate.wait("later")
        done, pending = await asyncio.wait([quick, slow], timeout=30,
                                           return_when=asyncio.FIRST_COMPLETED)
        first = (done == {quick}, pending == {slow})
        done, pending = await asyncio.wait([slow], timeout=0.05)  # times out
        timed_out = (done, pending == {slow})
        gate.open()
        done, _ = await asyncio.wait([quick, slow], timeout=30)
        return first, timed_out, sorted(str(f.result()) for f in done)

    with mf.init(contexts=2, transport=transport):
        first, timed_out, values = asyncio.run(amain())
    assert first == (True, True)
    assert timed_out == (set(), True)
    assert values == ["12", "later"]


@mf.persistent
class Cleans:
    def __init__(self, log):
        self.log = log

    async def __mf_destroy__(self):
        await self.log.add("cleaned")  # a coroutine hook runs to its end


@pytest.mark.timeout(60)
def test_a_coroutine_destroy_hook_is_awaited(run):
    def main():
        log = Log.create(on=1)
        c = Cleans.create(log, on=2)
        mf.destroy(c).result()
        return log.get().result()

    assert run(main, contexts=3) == ["cleaned"]


@mf.persistent
class Sleepy:
    async def nap(self):
        await asyncio.sleep(0.01)  # needs an event loop: a context runs none


def test_asyncio_code_inside_a_coroutine_method_gets_macroflow_s_explanation(run):
    def main():
        with pytest.raises(RuntimeError, match="can await only macroflow futures"):
            Sleepy.create(on=1).nap().result(timeout=10)
        return True

    assert run(main, contexts=2)


def test_a_class_of_another_kind_than_its_base_is_refused_naming_the_base():
    @mf.persistent
    class Base:
        pass

    with pytest.raises(TypeError, match="Child derives from .*Base, which is @mf.persistent: a "
                                        "class and its bases are of one kind"):
        @mf.regular
        class Child(Base):
            pass

    with pytest.raises(TypeError, match=r"Again is already @persistent"):
        @mf.regular
        @mf.persistent
        class Again:
            pass


@pytest.mark.parametrize("kind", [mf.persistent, mf.regular])
def test_an_async_constructor_is_refused_at_decoration(kind):
    # (it was accepted, and the object was made without running it: a
    # coroutine that was never awaited)
    with pytest.raises(TypeError, match=r"Later.__init__ is async def: a constructor cannot wait"):
        @kind
        class Later:
            async def __init__(self):
                self.ready = True


@mf.regular
class _NoInit:
    def where(self):
        return mf.context_id()


def test_a_class_without_a_constructor_takes_no_arguments(run):
    # R(on=1) was accepted and on= ignored (object.__init__ takes anything)
    def main():
        with pytest.raises(mf.CallError, match=r"_NoInit\(\): got an unexpected keyword "
                                               r"argument 'on'; to place the object, "
                                               r"_NoInit.create\(..., on=...\)"):
            _NoInit(on=1)
        with pytest.raises(mf.CallError, match=r"_NoInit\(\): too many positional arguments"):
            _NoInit(1)
        return _NoInit.create(on=1).where().result(30)

    assert run(main, contexts=2) == 1


@mf.persistent
class _Probed:
    limit = 3

    @property
    def size(self):
        return 1

    def get(self):
        return 1


def test_probing_a_handle_for_what_is_not_a_method_answers_as_for_any_object(run):
    # hasattr and getattr with a default raised CallError (a TypeError)
    def main():
        p = _Probed.create(on=1)
        with pytest.raises(mf.CallError, match=r"'size' is a property, and a handle reaches its "
                                               r"object only through methods") as info:
            p.size
        assert isinstance(info.value, AttributeError)
        return (hasattr(p, "get"), hasattr(p, "missing"), hasattr(p, "size"),
                getattr(p, "limit", None), p.get().result(30))

    assert run(main, contexts=2) == (True, False, False, None, 1)


@mf.persistent
class _Keywords:
    def f(self, on, timeout=None):
        return on


def test_an_unknown_keyword_is_named_before_a_missing_argument(run):
    # (bind named the missing 'on' first; Python names the unknown keyword)
    def main():
        k = _Keywords.create(on=1)
        with pytest.raises(mf.CallError, match=r"_Keywords.f\(\): got an unexpected keyword "
                                               r"argument 'nope'"):
            k.f(nope=1)
        with pytest.raises(mf.CallError, match=r"missing a required argument: 'on'"):
            k.f(timeout=2)
        return k.f(on=5).result(30)

    assert run(main, contexts=2) == 5


def test_what_a_call_must_look_like_is_found_for_builtin_classes_too():
    # (a collection of a builtin class failed: a builtin takes no attributes,
    # where the answer was kept)
    from macroflow.objects.methods import constructor_info, method_info
    method_info(dict, "keys").check((), {})
    constructor_info(dict).check((), {"a": 1})
    assert method_info(dict, "keys") is not method_info(dict, "keys")  # found anew each time
