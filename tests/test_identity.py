"""References belong to their computation: handles, futures and global pointers
kept from one computation fail clearly in the next one, or after it ended."""

import asyncio
import pickle

import pytest

import macroflow as mf
from common import Gate
from macroflow.core.context import current_engine

pytestmark = pytest.mark.timeout(60)


@mf.persistent
class Cell:
    def __init__(self, tag="cell"):
        self.tag = tag

    def get(self):
        return self.tag

    def use(self, handle):
        return handle.get().result()

    def unpickle_and_use(self, blob):
        return pickle.loads(blob).get().result()


@mf.regular
class Echo:
    def echo(self, x):
        return x


def _computation():
    return current_engine().computation


def _stale_message(err, old, new):
    text = str(err)
    assert isinstance(err, mf.StaleReference) and isinstance(err, ValueError), repr(err)
    assert f"computation {old}" in text, text
    assert (f"running computation {new}" in text) if new else ("has ended" in text), text
    assert err.computation == old and err.running == new


def test_every_context_knows_its_computation(run):
    def main():
        h = Cell.create(on=1)
        return _computation(), mf.info(h).computation, Echo.create(on=1).echo(1).result()

    a, b, _ = run(main)
    assert a == b and len(a) == 8
    assert run(_computation) != a  # each computation has its own id


def test_persistent_handle_from_another_computation(run):
    kept = {}

    def first():
        kept["h"] = Cell.create("old", on=1)
        kept["comp"] = _computation()
        return kept["h"].get().result()

    def second():
        Cell.create("new", on=1)  # same id as the old object in this fresh computation
        with pytest.raises(mf.StaleReference) as direct:
            kept["h"].get()
        with pytest.raises(mf.StaleReference):
            mf.info(kept["h"])
        with pytest.raises(mf.StaleReference):
            mf.destroy(kept["h"])
        # passed to a call, it is refused where the call is made
        with pytest.raises(mf.StaleReference) as passed:
            Cell.create(on=2).use(kept["h"])
        return direct.value, passed.value, _computation()

    assert run(first) == "old"
    direct, remote, now = run(second)
    _stale_message(direct, kept["comp"], now)
    _stale_message(remote, kept["comp"], now)
    # and after the end, with no computation running
    with pytest.raises(mf.StaleReference) as after:
        kept["h"].get()
    _stale_message(after.value, kept["comp"], None)


def test_pickled_handle_keeps_its_computation(run):
    kept = {}

    def first():
        h = Cell.create(on=1)
        kept["blob"], kept["comp"] = pickle.dumps(h), _computation()
        return pickle.loads(kept["blob"]).get().result()  # fine in its own computation

    def second():
        return Cell.create(on=1).unpickle_and_use(kept["blob"]).exception(), _computation()

    assert run(first) == "cell"
    err, now = run(second)
    _stale_message(err, kept["comp"], now)


def test_regular_handles_belong_to_their_computation(run):
    kept = {}
    free = Echo()  # made while no computation runs: belongs to none

    def first():
        kept["h"], kept["pinned"], kept["comp"] = Echo(), Echo.create(on=1), _computation()
        return free.echo(1).result()

    def second():
        with pytest.raises(mf.StaleReference) as unbound:
            kept["h"].echo(1)
        with pytest.raises(mf.StaleReference):
            kept["pinned"].echo(1)
        with pytest.raises(mf.StaleReference):
            mf.info(kept["h"])
        return unbound.value, free.echo(2).result(), _computation()

    assert run(first) == 1
    err, ok, now = run(second)
    _stale_message(err, kept["comp"], now)
    assert ok == 2
    with pytest.raises(RuntimeError, match="not running"):
        free.echo(3)  # belongs to none, and none runs: the usual error


def test_future_after_its_computation_ended(run):
    kept = {}

    def main():
        gate = Gate.create(on=1)
        kept["pending"] = gate.wait("never")  # its guard never holds
        kept["done"] = Echo().echo(5)
        kept["done"].result()
        kept["comp"] = _computation()
        return True

    run(main)
    with pytest.raises(mf.StaleReference) as waited:
        kept["pending"].result()
    _stale_message(waited.value, kept["comp"], None)
    with pytest.raises(mf.StaleReference):
        kept["pending"].exception(timeout=1)
    with pytest.raises(mf.StaleReference):
        kept["pending"].add_done_callback(lambda f: None)
    with pytest.raises(mf.StaleReference):
        pickle.dumps(kept["pending"])
    assert kept["done"].result() == 5  # a value that arrived stays


def test_future_in_another_computation(run):
    kept = {}

    def first():
        kept["f"] = Echo().echo("old")
        kept["unasked"] = Echo.create(on=1).echo("unasked")
        kept["comp"] = _computation()
        return kept["f"].result()

    def second():
        errors = []
        for use in (lambda: Echo().echo(kept["f"]),             # an arc, even with its value here
                    lambda: Echo().echo([kept["unasked"]]),     # an arc inside a list
                    lambda: Echo().echo(Holder(kept["unasked"])),  # pickled inside a value
                    lambda: mf.gather([kept["unasked"]]),
                    lambda: mf.wait([kept["unasked"]]),
                    lambda: kept["unasked"].result()):
            with pytest.raises(mf.StaleReference) as e:
                use()
            errors.append(e.value)
        return errors, _computation()

    assert run(first) == "old"
    errors, now = run(second)
    for err in errors:
        _stale_message(err, kept["comp"], now)


class Holder:
    def __init__(self, f):
        self.f = f


def test_global_pointer_from_another_computation(run):
    kept = {}

    def first():
        h = Cell.create(on=1)
        kept["obj"], kept["exp"] = mf.info(h).gptr, mf.export([0])
        kept["comp"] = _computation()
        assert kept["obj"].computation == kept["exp"].computation == kept["comp"]
        assert pickle.loads(pickle.dumps(kept["obj"])) == kept["obj"]
        return True

    def second():
        errors = []
        for use in (lambda: mf.rsr(kept["obj"], print, "never"),
                    lambda: mf.rsr(kept["exp"], print, "never"),
                    lambda: mf.unexport(kept["exp"])):
            with pytest.raises(mf.StaleReference) as e:
                use()
            errors.append(e.value)
        g = mf.info(Cell.create(on=1)).gptr
        assert g != kept["obj"]  # the same context and id, another computation
        return errors, _computation()

    run(first)
    errors, now = run(second)
    for err in errors:
        _stale_message(err, kept["comp"], now)


def test_awaiting_a_future_of_an_ended_computation(transport):
    with mf.init(contexts=2, transport=transport) as s:
        f = Gate.create(on=1).wait("never")

    async def amain():
        return await f

    with pytest.raises(mf.StaleReference) as e:
        asyncio.run(amain())
    _stale_message(e.value, s.computation, None)


def test_gather_and_wait_on_futures_of_an_ended_computation_name_it(transport):
    kept = []

    def main():
        kept.append(Echo().echo(3))  # never asked for while the computation ran

    mf.run(main, contexts=2, transport=transport)
    for op in (lambda: mf.gather(kept), lambda: mf.wait(kept)):
        with pytest.raises(mf.StaleReference, match="which has ended"):
            op()


def test_futures_with_their_values_here_keep_them_after_their_computation(transport):
    # result() returned their values; gather and wait raised StaleReference,
    # and wait(FIRST_COMPLETED) and as_completed only inside a computation
    kept = []

    def main():
        kept.extend([Echo().echo(2), Echo().echo(3)])
        return mf.gather(kept)

    def every_way():
        return (mf.gather(kept), mf.wait(kept) == (kept, []),
                mf.wait(kept, return_when=mf.FIRST_COMPLETED) == (kept, []),
                [f.result() for f in mf.as_completed(kept)])

    mf.run(main, contexts=2, transport=transport)
    want = ([2, 3], True, True, [2, 3])
    assert mf.run(every_way, contexts=2, transport=transport) == want  # in another
    assert every_way() == want  # and with none running


def test_a_handle_of_another_computation_is_refused_as_an_argument(transport):
    kept = []

    def first():
        kept.append(Cell.create(on=1))

    mf.run(first, contexts=2, transport=transport)

    def second():
        e = Echo()
        for arg in (kept[0], [kept[0]], {"h": kept[0]}):
            with pytest.raises(mf.StaleReference, match="belongs to computation"):
                e.echo(arg)
        return e.echo(1).result()

    assert mf.run(second, contexts=2, transport=transport) == 1
