"""Distributed collections (pC++'s model): placement, apply, element calls,
map_blocks, pointers read with get, travel into SPMD functions, and errors.

Each test groups its checks in one computation per transport (starting one
costs more than the checks)."""

import re
import pickle

import numpy as np
import pytest

import macroflow as mf
from common import Gate
from macroflow.spmd.collection import _indices, _position

pytestmark = pytest.mark.timeout(120)


# -- element classes (module level: they travel by reference)
class Cell:
    def __init__(self, index, start=0.0, n=3):
        self.index = index
        self.data = np.full(n, start + (index if isinstance(index, int) else sum(index)))
        self.log = []

    def where(self):
        return self.index, mf.context_id()

    def step(self, dt):
        self.data += dt
        return float(self.data.sum())

    def record(self, x):
        self.log.append(x)
        return list(self.log)

    def times(self, x):
        return self.index * x

    def through(self, gate):
        return gate.wait(self.index).result()  # parks: the host's context serves meanwhile

    def replace(self):
        self.data = self.data * 10  # a new array: a pointer asked before names the old one

    def fail_on(self, *bad):
        if self.index in bad:
            raise ValueError(f"no good at {self.index}")
        return self.index

    def missing_key(self):
        return {}["nope"]

    def peek(self, coll, j):
        return coll[j].times(1).result()  # waits for another element

    def ask(self, coll, j):
        return coll[j].ask(coll, self.index).result()  # which asks this one back: a cycle


class Broken:
    def __init__(self, index):
        if index == 2:
            raise RuntimeError("cannot build this one")


@mf.regular
class NotAnElement:
    def f(self):
        return 1


@mf.persistent
class User:
    """Receives a collection in a call and uses it from its own context."""

    def total(self, coll):
        return sum(coll.apply("step", 0.0).result())


# -- layout, in this process
@pytest.mark.parametrize("distribution", ["block", "cyclic"])
def test_every_index_has_exactly_the_owner_that_holds_it(distribution):
    for n in range(1, 20):
        for P in range(1, 7):
            held = [k for p in range(P) for k in _indices(p, n, P, distribution)]
            assert sorted(held) == list(range(n))
            for p in range(P):
                assert all(_position(k, n, P, distribution) == p
                           for k in _indices(p, n, P, distribution))
            sizes = [len(_indices(p, n, P, distribution)) for p in range(P)]
            assert max(sizes) - min(sizes) <= 1


# -- placement, apply, element calls, map_blocks
def placement_and_operations():
    out = {}
    block = mf.Collection(Cell, 7, 100.0)
    cyclic = mf.Collection(Cell, 7, 100.0, distribution="cyclic")
    grid = mf.Collection(Cell, (2, 3))
    out["block_owner"] = [block.owner(i) for i in range(7)]
    out["cyclic_owner"] = [cyclic.owner(i) for i in range(7)]
    out["grid_owner"] = [grid.owner((i, j)) for i in range(2) for j in range(3)]
    # where each element really lives, said by the element itself, in index order
    out["block_where"] = block.apply("where").result()
    out["cyclic_where"] = cyclic.apply("where").result()
    out["grid_where"] = grid.apply("where").result()
    out["apply"] = cyclic.apply("step", 1.0).result()
    out["apply_fn"] = cyclic.apply(lambda el, k: el.index * k, k=2).result()
    out["apply_arc"] = block.apply("times", cyclic[6].times(10)).result()  # a future argument
    # element calls: the calls of one caller run in the order issued
    for x in "abc":
        cyclic[4].record(x)
    out["record"] = cyclic[4].record("d").result()
    out["grid_call"] = grid[1, 2].where().result()
    out["map_blocks"] = cyclic.map_blocks(np.sum).result()
    out["map_blocks_attr"] = cyclic.map_blocks(len, attr="log").result()
    out["map_blocks_args"] = grid.map_blocks(np.add, 1.0).result()
    # fewer elements than contexts, on chosen contexts
    few = mf.Collection(Cell, 2, distribution="cyclic")
    out["few"] = few.apply("where").result()
    picked = mf.Collection(Cell, 4, contexts=[2, 1])
    out["picked"] = (picked.contexts, picked.apply("where").result())
    out["first_two"] = mf.Collection(Cell, 3, contexts=2).apply("where").result()
    # a collection travels as a value: to a method on another context, and back
    out["in_method"] = User.create(on=1).total(cyclic).result()
    out["same"] = pickle.loads(pickle.dumps(cyclic)) == cyclic
    out["len_shape"] = (len(grid), grid.shape, grid.distribution, len(list(grid)))
    return out


def test_elements_live_where_the_distribution_says_and_operations_run_there(run):
    out = run(placement_and_operations, contexts=3)
    assert out["block_owner"] == [0, 0, 0, 1, 1, 2, 2]
    assert out["cyclic_owner"] == [0, 1, 2, 0, 1, 2, 0]
    assert out["grid_owner"] == [0, 0, 1, 1, 2, 2]
    assert out["block_where"] == list(zip(range(7), out["block_owner"]))
    assert out["cyclic_where"] == list(zip(range(7), out["cyclic_owner"]))
    grid_indices = [(i, j) for i in range(2) for j in range(3)]
    assert out["grid_where"] == list(zip(grid_indices, out["grid_owner"]))
    assert out["apply"] == [3 * (101.0 + i) for i in range(7)]
    assert out["apply_fn"] == [2 * i for i in range(7)]
    assert out["apply_arc"] == [60 * i for i in range(7)]
    assert out["record"] == ["a", "b", "c", "d"]
    assert out["grid_call"] == ((1, 2), 2)
    assert out["map_blocks"] == [3 * (101.0 + i) for i in range(7)]
    assert out["map_blocks_attr"] == [4 if i == 4 else 0 for i in range(7)]
    assert [a.tolist() for a in out["map_blocks_args"]] == \
        [[1.0 + i + j] * 3 for i in range(2) for j in range(3)]
    assert out["few"] == [(0, 0), (1, 1)]
    assert out["picked"] == ((2, 1), [(0, 2), (1, 2), (2, 1), (3, 1)])
    assert out["first_two"] == [(0, 0), (1, 0), (2, 1)]
    assert out["in_method"] == sum(3 * (101.0 + i) for i in range(7))
    assert out["same"]
    assert out["len_shape"] == (6, (2, 3), "block", 6)


def apply_does_not_wait():
    coll = mf.Collection(Cell, 4, distribution="cyclic")
    gate = Gate.create(on=1)
    f = coll.apply("through", gate)  # every element waits for the gate
    issued = f.done()
    gate.open()
    return issued, f.result()


def test_apply_returns_its_future_before_any_element_has_run(run):
    assert run(apply_does_not_wait, contexts=3) == (False, [0, 1, 2, 3])


# -- into an SPMD function: local elements, pointers and get
def spmd_with_a_collection(coll):
    me, n = mf.rank(), mf.size()
    out = {"local": [(i, el.index) for i, el in coll.local()]}
    for _, el in coll.local():
        el.data[:] = 10 * el.index  # changed in place: pointers stay good
    mf.barrier()
    # read an element of the next context, whose code takes no part
    theirs = [i for i in range(len(coll)) if coll.owner(i) == (me + 1) % n]
    gp = coll.pointer(theirs[0])
    out["got"] = mf.get(gp).wait().tolist()
    out["again_same"] = coll.pointer(theirs[0]) == gp
    out["part"] = mf.get(coll.pointer(theirs[-1])[1:]).wait().tolist()
    mf.barrier()
    out["received_equal"] = coll == mf.broadcast(coll)
    return out


def pointers_after_a_replace():
    coll = mf.Collection(Cell, 2)
    old = coll.pointer(1)
    coll[1].replace().result()
    new = coll.pointer(1)
    try:
        mf.get(old)
        stale = None
    except ValueError as e:
        stale = str(e)
    return mf.get(new).wait().tolist(), new == old, stale


def test_a_collection_travels_into_spmd_functions_and_pointers_read_elements(run):
    def main():
        coll = mf.Collection(Cell, 5, distribution="cyclic")
        return mf.spmd(spmd_with_a_collection, coll), pointers_after_a_replace()

    res, replaced = run(main, contexts=3)
    assert [r["local"] for r in res] == [[(0, 0), (3, 3)], [(1, 1), (4, 4)], [(2, 2)]]
    assert [r["got"] for r in res] == [[10.0] * 3, [20.0] * 3, [0.0] * 3]
    assert [r["part"] for r in res] == [[40.0] * 2, [20.0] * 2, [30.0] * 2]
    assert all(r["again_same"] and r["received_equal"] for r in res)
    values, same, stale = replaced
    assert values == [10.0] * 3 and not same
    assert "unregistered" in stale


# -- errors
def failing_elements():
    out = {}
    coll = mf.Collection(Cell, 6, distribution="cyclic")
    for name, f in [("apply", coll.apply("fail_on", 4)), ("call", coll[3].fail_on(3)),
                    ("map", coll.map_blocks(lambda a: 1 / 0 if a[0] == 5 else 0)),
                    ("two", coll.apply("fail_on", 0, 3)), ("key", coll[1].missing_key())]:
        e = f.exception()
        out[name] = (type(e).__name__, str(e), getattr(e, "__notes__", []))
    try:
        mf.Collection(Broken, 4)
    except RuntimeError as e:
        out["ctor"] = str(e)
    out["after"] = coll.apply("where").result()  # the collection goes on
    return out


def test_a_failing_element_fails_the_future_naming_its_index(run):
    out = run(failing_elements, contexts=2)
    assert out["apply"][:2] == ("ValueError", "Cell element 4, fail_on(): no good at 4")
    assert out["call"][:2] == ("ValueError", "Cell element 3, fail_on(): no good at 3")
    assert out["map"][0] == "ZeroDivisionError" and "Cell element 5" in out["map"][1]
    # 0 and 3 live on different contexts: one of them is reported, naming its index
    assert out["two"][1] in ("Cell element 0, fail_on(): no good at 0",
                             "Cell element 3, fail_on(): no good at 3")
    # a KeyError's message is its key: the element is named in a note
    assert out["key"][:2] == ("KeyError", "'nope'")
    assert out["key"][2] == ["raised by Cell element 1, missing_key()"]
    assert out["ctor"] == "Broken element 2, constructor: cannot build this one"
    assert out["after"] == [(i, i % 2) for i in range(6)]


def test_every_failing_element_of_a_context_is_named():
    def main():
        coll = mf.Collection(Cell, 4, contexts=1)
        return coll.apply("fail_on", 1, 2, 3).exception()

    e = mf.run(main, contexts=2, transport="inproc")
    assert str(e) == "Cell element 1, fail_on(): no good at 1"
    assert e.__notes__ == ["fail_on() raised in 2 other element(s) of this context too: 2, 3"]


def element_deadlocks():
    one = mf.Collection(Cell, 2, contexts=1)  # both elements on context 0
    two = mf.Collection(Cell, 2)  # one on each context
    out = {}
    for name, f in [("apply", lambda: one.apply("peek", one, 1)),
                    ("call", lambda: one[0].peek(one, 1)),
                    ("cycle", lambda: two[0].ask(two, 1))]:
        e = f().exception()
        out[name] = (type(e).__name__, str(e))
    return out


def test_a_deadlock_between_elements_names_their_class_method_and_index(run):
    out = run(element_deadlocks, contexts=2)
    assert out["apply"][0] == out["call"][0] == out["cycle"][0] == "DeadlockError"
    assert "Cell.peek waits on a call to its own object (Cell.times)" in out["apply"][1]
    assert "Cell.peek of element 0 waits on a call to its own object (Cell.times)" in out["call"][1]
    cycle = out["cycle"][1]
    assert "wait cycle: " in cycle
    assert "Cell.ask of element 0 (context 0)" in cycle and "Cell.ask of element 1 (context 1)" in cycle
    assert not any("_Host" in text for _, text in out.values())


def bad_arguments():
    coll = mf.Collection(Cell, (2, 3))
    line = mf.Collection(Cell, 4)
    attempts = {
        "shape0": lambda: mf.Collection(Cell, 0),
        "shape_neg": lambda: mf.Collection(Cell, (2, -1)),
        "shape_float": lambda: mf.Collection(Cell, 2.5),
        "shape_empty": lambda: mf.Collection(Cell, ()),
        "distribution": lambda: mf.Collection(Cell, 4, distribution="diagonal"),
        "contexts_many": lambda: mf.Collection(Cell, 4, contexts=5),
        "contexts_ids": lambda: mf.Collection(Cell, 4, contexts=[0, 7]),
        "contexts_dup": lambda: mf.Collection(Cell, 4, contexts=[1, 1]),
        "not_class": lambda: mf.Collection(len, 4),
        "regular": lambda: mf.Collection(NotAnElement, 4),
        "ctor_args": lambda: mf.Collection(Cell, 4, 1.0, 3, "extra"),
        "index_range": lambda: line[4],
        "index_negative": lambda: line.owner(-1),
        "index_int_for_2d": lambda: coll[1],
        "index_tuple_len": lambda: coll[1, 2, 3],
        "index_range_2d": lambda: coll[2, 0],
        "index_type": lambda: line["a"],
        "no_method": lambda: line.apply("fly"),
        "wrong_args": lambda: line[0].step(),
        "no_element_method": lambda: line[0].fly,
        "method_type": lambda: line.apply(3),
        "map_fn": lambda: line.map_blocks("sum"),
        "no_attr": lambda: line.pointer(1, "nothing"),
        "not_array": lambda: line.pointer(1, "log"),
    }
    out = {}
    for name, attempt in attempts.items():
        try:
            attempt()
            out[name] = None
        except Exception as e:
            out[name] = (type(e).__name__, str(e))
    return out, line


def test_bad_arguments_are_refused_with_what_is_allowed():
    out, line = mf.run(bad_arguments, contexts=3, transport="inproc")
    expect = {
        "shape0": ("ValueError", "shape must be an int >= 1"),
        "shape_neg": ("ValueError", "got (2, -1)"),
        "shape_float": ("TypeError", "got 2.5"),
        "shape_empty": ("ValueError", "non-empty tuple"),
        "distribution": ("ValueError", "'block', 'cyclic'; got 'diagonal'"),
        "contexts_many": ("ValueError", "give 1..3"),
        "contexts_ids": ("ValueError", "([0, 1, 2])"),
        "contexts_dup": ("ValueError", "distinct"),
        "not_class": ("TypeError", "must be a class"),
        "regular": ("TypeError", "@mf.regular"),
        "ctor_args": ("CallError", "Cell(index, *ctor_args)"),
        "index_range": ("IndexError", "from 0 to its dimension - 1, as in 3"),
        "index_negative": ("IndexError", "index -1 is outside"),
        "index_int_for_2d": ("IndexError", "a tuple of 2 ints; got 1"),
        "index_tuple_len": ("IndexError", "the 3-tuple (1, 2, 3)"),
        "index_range_2d": ("IndexError", "as in (1, 2)"),
        "index_type": ("TypeError", "made of ints; got 'a'"),
        "no_method": ("NoSuchMethod", "Cell has no method 'fly'"),
        "wrong_args": ("CallError", "Cell.step()"),
        "no_element_method": ("NoSuchMethod", "Cell has no method 'fly'"),
        "method_type": ("TypeError", "a method name (str) or a function"),
        "map_fn": ("TypeError", "fn must be callable"),
        "no_attr": ("AttributeError", "Cell element 1, pointer to .nothing: the element has no "
                                      "attribute 'nothing'"),
        "not_array": ("TypeError", "attribute 'log' holds a list"),
    }
    for name, (kind, text) in expect.items():
        assert out[name] is not None, f"{name}: not refused"
        assert out[name][0] == kind and text in out[name][1], (name, out[name])
    # the computation has ended: its collection names nothing
    with pytest.raises(mf.StaleReference):
        line.apply("where")
    with pytest.raises(mf.StaleReference):
        mf.run(line.local, contexts=1, transport="inproc")


class _Heavy:
    def __init__(self, index):
        self.data = np.ones(5_000_000)  # 40 MB

    def total(self):
        return float(self.data.sum())


class _Meter:
    def __init__(self, index):
        pass

    def rss(self):
        import psutil
        return psutil.Process().memory_info().rss


def test_a_destroyed_collection_frees_its_elements_everywhere(run, transport):
    # nothing destroyed one: 15 collections of 20 MB a context took 300 MB
    def main():
        meter = mf.Collection(_Meter, 2, contexts=[1, 2])
        start = meter.apply("rss").result(30)
        for i in range(5):
            c = mf.Collection(_Heavy, 2, contexts=[1, 2])
            gp = c.pointer(1)
            assert c.apply("total").result(30) == [5e6, 5e6]
            assert (c.destroy() if i % 2 else mf.destroy(c)).result(30) is None
        grown = [b - a for a, b in zip(start, meter.apply("rss").result(30))]
        with pytest.raises(mf.ObjectDestroyed):
            c.apply("total").result(30)
        with pytest.raises(mf.ObjectDestroyed):
            c[0].total().result(30)
        with pytest.raises(ValueError, match="was unregistered"):
            mf.get(gp).wait(30)
        return grown

    grown = run(main, contexts=3)
    if transport != "inproc":  # (one process: the meter sees everyone's memory)
        assert max(grown) < 100e6, grown


def test_a_destroyed_collection_is_named_as_such(run):
    # (the error named the internal host class and an id: "_Host 0.2 was destroyed")
    def main():
        c = mf.Collection(_Meter, 4)
        c.destroy().result(30)
        return [str(f.exception(30)) for f in (c.apply("rss"), c[3].rss())]

    whats = []
    for said in run(main, contexts=2):
        # (then "... [0, 2] here) 0.67 was destroyed": an id of ours after its own name)
        m = re.fullmatch(r"the Collection of _Meter \(its elements \[\d, \d\] here\) was "
                         r"destroyed; (.*) cannot run", said)
        assert m, said
        whats.append(m.group(1))
    # the call named as the element class's (was "apply()" and "call()", the host's methods)
    assert whats == ["_Meter.rss", "_Meter.rss of element 3"], whats


def _scaled(el, k):
    return el.index * k


def test_a_collection_on_a_removed_context_names_its_element_class(run, transport):
    # (apply and map_blocks named the hosts' method: "_Host.apply: its object
    # was on context 1, which was removed")
    if transport == "mpi":
        pytest.skip("an MPI rank cannot leave a running job")

    def main():
        c = mf.Collection(Cell, 3, contexts=3)
        mf.remove_context(1)
        return [str(f.exception(30)) for f in (c.apply("where"), c.apply(_scaled, 2),
                                               c.map_blocks(np.sum), c[1].where())]

    said = run(main, contexts=3)
    tail = ": its object was on context 1, which was removed"
    assert said == ["Cell.where" + tail, "_scaled on Cell elements" + tail,
                    "map_blocks(sum) on Cell elements" + tail, "Cell.where" + tail], said


@pytest.mark.timeout(60)
def test_a_collection_of_a_builtin_type_takes_its_index_as_the_argument(run):
    # float(index): float's __init__ is object's, its __new__ takes the index
    def main():
        return mf.Collection(float, 3).apply("is_integer").result(timeout=10), \
            mf.Collection(int, 2, contexts=2).apply("bit_length").result(timeout=10)

    assert run(main, contexts=2) == ([True, True, True], [0, 1])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", ["local", "inproc", "tcp"])
def test_destroying_a_collection_after_one_of_its_contexts_was_removed_ends_the_rest(transport):
    # the elements of the removed context went with it: destroy ends the
    # others, and is done (it failed naming the private _Host class)
    class El:
        def __init__(self, i):
            self.i = i

        def get(self):
            return self.i

    def main():
        coll = mf.Collection(El, 6)
        mf.remove_context(1)
        assert coll.destroy().result(timeout=10) is None
        objects = [mf.stats()[c]["objects"] for c in (0, 2)]
        with pytest.raises(mf.ObjectDestroyed):
            coll.apply("get").result(timeout=10)
        return objects

    assert mf.run(main, contexts=3, transport=transport) == [0, 0]
