"""Marshalling: pickle 5 with out-of-band buffers, by-value for what can't be imported."""

import pickle
import sys
from fractions import Fraction

import numpy as np

from macroflow.core import marshal


def test_small_message_is_one_buffer():
    data, bufs = marshal.dumps(("call", 1, "m", (1, 2), {}))
    assert bufs == [] and marshal.loads(data) == ("call", 1, "m", (1, 2), {})


def test_large_array_goes_out_of_band_without_copy():
    a = np.arange(100_000, dtype=np.float64)
    data, bufs = marshal.dumps(a)
    assert len(bufs) == 1 and len(data) < 1000
    raw = bufs[0].raw()
    assert raw.nbytes == a.nbytes
    assert np.shares_memory(np.frombuffer(raw, dtype=np.float64), a)
    back = marshal.loads(data, [bytearray(raw)])
    assert np.array_equal(back, a) and back.flags.writeable


def test_small_arrays_stay_in_band():
    data, bufs = marshal.dumps(np.zeros(10))
    assert bufs == []


def test_byte_order_travels_with_the_array():
    a = np.arange(5, dtype=">i4")
    data, bufs = marshal.dumps(a)
    back = marshal.loads(data, [bytearray(b.raw()) for b in bufs])
    assert back.dtype == np.dtype(">i4") and back.tolist() == [0, 1, 2, 3, 4]


def test_lambda_and_local_class_go_by_value():
    k = 5

    class Local:
        def f(self):
            return k

    data, _ = marshal.dumps((lambda x: x + k, Local))
    f, cls = pickle.loads(data)
    assert f(1) == 6 and cls().f() == 5


def test_class_sent_twice_is_one_class_at_the_receiver():
    class Local:
        pass

    a = pickle.loads(marshal.dumps(Local)[0])
    b = pickle.loads(marshal.dumps(Local)[0])
    assert a is b


def test_reentrant_dumps():
    class Odd:
        def __reduce__(self):
            inner, _ = marshal.dumps([1, 2, 3])
            return (pickle.loads, (inner,))

    data, _ = marshal.dumps({"x": Odd()})
    assert marshal.loads(data) == {"x": [1, 2, 3]}


def test_buffer_nbytes():
    assert marshal.buffer_nbytes([b"ab", bytearray(3), memoryview(b"xyz")]) == 8


def test_encoder_starts_afresh_after_a_big_message():
    # clear_memo() is as slow as the largest memo ever held, so a big message
    # (a RELEASE of many futures) must not leave its memo to every later one
    enc = marshal._encoder
    small = enc.p
    marshal.dumps((0, (0, 1), "null", (1,)))
    assert enc.p is small
    marshal.dumps((3, [(0, i) for i in range(50000)]))
    assert enc.p is not small


def test_values_sent_by_value_are_not_kept_alive():
    import gc
    import weakref

    refs = []
    for k in range(50):
        f = (lambda k: lambda x: x + k)(k)  # a new function each time
        marshal.dumps(f)
        refs.append(weakref.ref(f))
    del f
    gc.collect()
    assert all(r() is None for r in refs)
    assert len(marshal._loaded_cache) <= marshal._LOADED_MAX


# -- futures inside containers are arcs, whatever the container --------------
import collections  # noqa: E402

import pytest  # noqa: E402

import macroflow as mf  # noqa: E402

Point = collections.namedtuple("Point", "x y")


class Bag(list):
    pass


class Table(dict):
    pass


@mf.regular
class Adder:
    def num(self, x):
        return x

    def total(self, box):
        def flat(x):
            if isinstance(x, dict):
                x = x.values()
            if isinstance(x, (list, tuple, set, frozenset, type({}.values()))):
                return sum(flat(v) for v in x)
            return x
        return type(box).__name__, flat(box)


@pytest.mark.timeout(60)
def test_futures_inside_namedtuples_subclasses_and_sets_are_arcs(run):
    def main():
        a = Adder.create(on=1)
        n = a.num
        boxes = [Point(n(1), n(2)), Bag([n(3), n(4)]), Table(a=n(5), b=n(6)),
                 collections.OrderedDict(a=n(7)), collections.defaultdict(int, a=n(8)),
                 {n(9), n(10)}, frozenset([n(11)]), [[(n(12),)]]]
        return mf.gather([a.total(b) for b in boxes])

    got = run(main, contexts=2)
    assert got == [("Point", 3), ("Bag", 7), ("Table", 11), ("OrderedDict", 7),
                   ("defaultdict", 8), ("set", 19), ("frozenset", 11), ("list", 12)]


@mf.regular
class Echo:
    def length(self, x, *rest):
        return len(x)


@pytest.mark.timeout(60)
def test_a_container_that_holds_itself_can_be_an_argument(run):
    def main():
        e = Echo.create(on=1)
        cyc = [1, 2]
        cyc.append(cyc)
        plain = e.length(cyc).result()
        with_arc = e.length(cyc, e.length([0])).result()  # searched while arcs are made
        deep = [e.length([1])]
        for _ in range(200):
            deep = [deep]
        with pytest.raises(mf.CallError, match="more than 50 containers deep"):
            e.length(deep)
        return plain, with_arc

    assert run(main, contexts=2) == (3, 3)


# -- a message the receiver cannot unpickle -----------------------------------------
def _explode():
    raise ValueError("cannot be rebuilt here")


class Unrebuildable:
    """Pickles fine; unpickling it raises (a class the receiver cannot import,
    or a ``__setstate__`` that fails, do the same)."""

    def __reduce__(self):
        return _explode, ()


def _unrebuildable_by_value():
    """As Unrebuildable, with a function made here, which travels by value on
    every transport (its rebuilding went wrong when salvaged: that call hung)."""
    def explode():
        raise ValueError("cannot be rebuilt here")

    class ByValue:
        def __reduce__(self):
            return explode, ()

    return ByValue()


@mf.persistent
class Keeper:
    def __init__(self, *args):
        self.n = len(args)

    def take(self, x):
        return x

    def make(self):
        return Unrebuildable()


@mf.regular
class Taker:
    def take(self, x):
        return x


@pytest.mark.timeout(60)
def test_a_call_the_receiver_cannot_unpickle_fails_its_future(run):
    def main():
        k = Keeper.create(on=1)
        out = {}
        for name, f in [("persistent", k.take(Unrebuildable())),
                        ("regular", Taker().take(Unrebuildable())),
                        ("consumer", k.take(k.take(Unrebuildable()))),
                        ("by value", k.take(_unrebuildable_by_value()))]:
            try:
                f.result(timeout=30)
                out[name] = "no error"
            except mf.CallError as e:
                out[name] = str(e)
        out["after"] = k.take(5).result(timeout=30)  # the object is unharmed
        broken = Keeper.create(Unrebuildable(), on=1)
        try:
            broken.take(1).result(timeout=30)
            out["create"] = "no error"
        except mf.ObjectDestroyed as e:  # as when a constructor raises
            out["create"] = str(e)
        return out

    out = run(main, contexts=2)
    for name in ("persistent", "regular", "consumer", "by value", "create"):
        assert "could not unpickle" in out[name] and "cannot be rebuilt here" in out[name], \
            (name, out[name])
    assert "arguments of take()" in out["persistent"]
    assert out["create"].startswith("Keeper could not be created")
    assert out["after"] == 5


@pytest.mark.timeout(60)
def test_a_class_the_receiver_cannot_rebuild_fails_the_call_not_the_context(run, transport):
    # a class made here travels by value; one whose rebuilding fails there (a
    # class attribute that cannot be rebuilt; another cloudpickle does the
    # same) fails the calls that need it, and the context goes on serving
    if transport == "inproc":
        pytest.skip("one process: nothing is unpickled")

    def main():
        @mf.persistent
        class Local:
            trap = Unrebuildable()

            def take(self, x):
                return x

        @mf.regular
        class LocalRegular:
            trap = Unrebuildable()

            def take(self, x):
                return x

        out = {}
        for name, call in (("persistent", lambda: Local.create(on=1).take(1)),
                           ("regular", lambda: LocalRegular().take(1))):
            try:
                out[name] = call().result(timeout=30)
            except (mf.CallError, mf.ObjectDestroyed) as e:
                out[name] = f"{type(e).__name__}: {e}"
        out["after"] = Keeper.create(on=1).take(5).result(timeout=30)
        return out

    out = run(main, contexts=2)
    assert out["persistent"] == (
        "ObjectDestroyed: NotDecoded could not be created, so take() cannot run: CallError: "
        "context 1 could not unpickle the class or the constructor's arguments, sent by "
        "context 0: ValueError: cannot be rebuilt here")
    assert out["regular"] == ("CallError: context 1 could not unpickle the class or the "
                              "arguments of take(), sent by context 0: ValueError: cannot be "
                              "rebuilt here")
    assert out["after"] == 5


LATE_MODULE = """
import macroflow as mf

@mf.regular
class LateRegular:
    def take(self, x):
        return x

@mf.persistent
class LatePersistent:
    def take(self, x):
        return x
"""


@pytest.mark.timeout(60)
def test_a_class_from_a_module_the_receiver_cannot_import_fails_each_call(run, transport,
                                                                          tmp_path):
    # (a regular call's target was cut to three items, and the receiving
    # context ended with an internal error; later calls name the class by
    # its number, and fail the same way)
    if transport == "inproc":
        pytest.skip("one process: nothing is unpickled")
    import importlib
    import os
    name = f"late_module_{os.getpid()}_{transport}"  # (a fresh one for each transport)

    def main():
        (tmp_path / f"{name}.py").write_text(LATE_MODULE)
        sys.path.insert(0, str(tmp_path))
        try:
            importlib.invalidate_caches()
            late = importlib.import_module(name)  # after the contexts started...
        finally:
            sys.path.remove(str(tmp_path))
        (tmp_path / f"{name}.py").unlink()  # ...which cannot import it

        def outcome(f):
            try:
                return f.result(timeout=30)
            except (mf.CallError, mf.ObjectDestroyed) as e:
                return f"{type(e).__name__}: {e}"

        r = late.LateRegular.create(on=1)
        out = [outcome(r.take(i)) for i in range(3)]
        out.append(outcome(late.LatePersistent.create(on=1).take(1)))
        out.append(Keeper.create(on=1).take(5).result(timeout=30))  # it serves on
        return out

    out = run(main, contexts=2)
    why = f"ModuleNotFoundError: No module named '{name}'"
    assert out[:3] == [f"CallError: context 1 could not unpickle the class or the arguments "
                       f"of take(), sent by context 0: {why}"] * 3
    assert out[3].startswith("ObjectDestroyed: ") and why in out[3], out[3]
    assert out[4] == 5


def test_plain_arrays_travel_as_bytes_dtype_and_shape():
    # a plain dtype is named, not pickled as an object: the message is smaller
    # than numpy's own pickle; every array comes back equal, writable as sent
    for a in (np.zeros(1), np.arange(6, dtype=">i4").reshape(2, 3), np.zeros((0, 3)),
              np.array(2.5), np.array(["ab", "c"]), np.ones(3, dtype=np.complex64),
              np.array([True, False])):
        data, bufs = marshal.dumps(a)
        assert len(data) < len(pickle.dumps(a, protocol=5)), a.dtype
        back = marshal.loads(data, bufs)
        assert type(back) is np.ndarray and back.dtype == a.dtype and back.shape == a.shape
        assert np.array_equal(back, a) and back.flags.writeable
    frozen = np.arange(4)
    frozen.flags.writeable = False
    assert not marshal.loads(*marshal.dumps(frozen)).flags.writeable


def test_other_arrays_keep_numpys_own_pickle():
    for a in (np.arange(10)[::2], np.zeros((3, 2), order="F")[:, :1].T,
              np.zeros(2, dtype=[("x", "i4"), ("y", "f8")]), np.array([1, "x"], dtype=object),
              np.array(["2020-01-01"], dtype="M8[ns]"), np.ma.masked_array([1, 2], [0, 1])):
        data, bufs = marshal.dumps(a)
        back = marshal.loads(data, bufs)
        assert type(back) is type(a) and back.dtype == a.dtype and back.shape == a.shape
        assert back.tolist() == a.tolist()


def test_a_global_pointer_sent_twice_is_one_object_at_the_receiver():
    from macroflow.core.gptr import GlobalPointer
    g = GlobalPointer(1, "export", (1, 7), (("local", "h:1"),), "c0ffee")
    a, b = marshal.loads(*marshal.dumps(g)), marshal.loads(*marshal.dumps([g]))[0]
    assert a is b and a == g and (a.protocols, a.computation) == (g.protocols, g.computation)
    other = GlobalPointer(1, "export", (1, 7), (("local", "h:1"),), "beef")
    assert marshal.loads(*marshal.dumps(other)) is not a


def test_request_arguments_with_an_array_first_skip_the_pickle():
    frozen = np.arange(3)
    frozen.flags.writeable = False
    big, big2 = np.arange(50_000.0), np.arange(40_000, dtype=np.int32)
    cases = [(np.zeros(1),), (np.array(2.5), "x", 3), (np.zeros((0, 4)),),
             (np.arange(6, dtype=">i2").reshape(3, 2), {"k": [1]}), (big, "x", big2),
             (np.arange(10)[::3],), (frozen,), ("no array", np.zeros(2)), ()]
    for args in cases:
        data, bufs = marshal.dumps_args(args)
        # an array first, writable and contiguous: described, not pickled
        described = bool(args) and type(args[0]) is np.ndarray and \
            args[0].flags.c_contiguous and args[0].flags.writeable
        assert (data[1:2] != b"\x80") == described, args  # else: one pickle
        back = marshal.loads_args(data, [bytearray(b.raw()) for b in bufs])
        assert len(back) == len(args)
        for x, y in zip(args, back):
            if isinstance(x, np.ndarray):
                assert y.dtype == x.dtype and y.shape == x.shape and np.array_equal(x, y)
                assert y.flags.writeable == x.flags.writeable
            else:
                assert x == y
    data, bufs = marshal.dumps_args((big, big2))
    assert [b.raw().nbytes for b in bufs] == [big.nbytes, big2.nbytes]


def test_request_arguments_of_many_shapes_come_back_right_past_the_kept_descriptions():
    # descriptions are kept per (dtype, shape) at both ends, a bounded number:
    # more shapes than that, alternating and coming again, each come back as sent
    rng = np.random.default_rng(5)
    shapes = [(), (0,), (1,), (3, 0), (2, 3), (4, 1, 2)] + [(n,) for n in range(2, 300)]
    dtypes = [np.float64, np.int32, np.dtype(">i2"), np.complex64, np.uint8]
    for rep in range(2):
        for k, shape in enumerate(shapes):
            dt = dtypes[k % len(dtypes)]
            a = np.asarray(rng.standard_normal(shape) * 100).astype(dt)
            b = np.arange(k % 7 + 1, dtype=np.float64)
            data, bufs = marshal.dumps_args((a, b, k))
            x, y, kk = marshal.loads_args(data, [bytearray(v.raw()) for v in bufs])
            assert x.dtype == a.dtype and x.shape == a.shape and np.array_equal(x, a), shape
            assert np.array_equal(y, b) and kk == k and x.flags.writeable
    assert len(marshal._described) <= marshal._DESCRIBED_MAX
    assert len(marshal._undescribed) <= marshal._DESCRIBED_MAX


def test_request_arguments_after_the_arrays_pickle_plain_values_and_anything_else():
    arr = np.arange(3.0)
    for rest in [("x", 3, 2.5, None, True, b"raw"), ([1, {"k": (2,)}], "y"), (Fraction(1, 3),)]:
        for args in [(arr, *rest), rest]:
            back = marshal.loads_args(*marshal.dumps_args(args))
            assert back[len(args) - len(rest):] == rest
            if args[0] is arr:
                assert np.array_equal(back[0], arr)


def test_request_arguments_with_pointers_first_skip_the_pickle():
    from macroflow.core.gptr import GlobalPointer
    short = GlobalPointer(1, "export", (1, 2), (("local", "h:1"),), "c0ffee")
    long = GlobalPointer(2, "object", (0, 9), tuple(("tcp", f"host{i}:{i}") for i in range(40)), "beef")
    arr = np.arange(4.0)
    data, bufs = marshal.dumps_args((short, arr, long, "rest", short))
    assert data[1:2] != b"\x80"
    back = marshal.loads_args(data, bufs)
    assert back[0] == short and back[2] == long and back[2].protocols == long.protocols
    assert back[0] is back[4] and back[3] == "rest" and np.array_equal(back[1], arr)


ALIASED_SCRIPT = """
import sys
import macroflow as mf

def square(self, x):
    return x * x

Alias = mf.regular(type("Dyn", (), {"square": square}))  # __main__ has no name Dyn

def main():
    return Alias.create(on=1).square(7).result(timeout=30)

print(mf.run(main, contexts=2, transport=sys.argv[1]))
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["inproc", "local"])
def test_a_class_of_main_under_another_name_travels_on_every_transport(tmp_path, transport):
    # inproc sent every class of __main__ by reference: this one failed to pickle
    import subprocess
    import sys
    path = tmp_path / "aliased.py"
    path.write_text(ALIASED_SCRIPT)
    p = subprocess.run([sys.executable, str(path), transport], capture_output=True, text=True,
                       timeout=100)
    assert (p.returncode, p.stdout.strip()) == (0, "49"), p.stderr


@pytest.mark.timeout(60)
def test_a_result_the_receiver_cannot_unpickle_names_the_call_and_that_context(run):
    # (it said only "a value could not be unpickled on context 0")
    def main():
        said = []
        k = Keeper.create(on=1)
        for f in (lambda: k.make(), lambda: Keeper.create(on=2).take(k.make())):
            try:
                f().result(timeout=30)
            except mf.CallError as e:
                said.append(str(e))
        return said

    said = run(main, contexts=3)
    assert said[0].startswith("the result of Keeper.make (computed on context 1) could not "
                              "be unpickled on context 0: ValueError"), said
    assert said[1].startswith("an argument of Keeper.take could not be unpickled on "
                              "context 2: ValueError"), said


def test_a_scripts_classes_go_by_value_to_receivers_that_did_not_run_it():
    # `macroflow run` loads a script as the module __mf_script__: a context
    # added later (a spawned MPI rank, a worker that joins) never ran it, so
    # its classes and functions must travel by value, as __main__'s do
    import types
    mod = types.ModuleType("__mf_script__")
    exec("SCALE = 3\n"
         "def helper(x):\n    return x * SCALE\n"
         "class K:\n    def f(self, x):\n        return helper(x)\n", mod.__dict__)
    saved_mod, saved_snapshot = sys.modules.get("__mf_script__"), marshal._main_snapshot
    sys.modules["__mf_script__"] = mod
    try:
        marshal.snapshot_main()  # forked children share the module: by reference
        data, bufs = marshal.dumps(mod.K)
        assert b"__mf_script__" in data and len(data) < 60
        marshal.main_by_value()  # from now on receivers that never ran it
        data, bufs = marshal.dumps(mod.K)
        del sys.modules["__mf_script__"]  # the receiver has no such module
        K = marshal.loads(data, bufs)
        assert K().f(5) == 15  # by reference, it would not load here
        # cloudpickle was told for that one pickle only
        assert "__mf_script__" not in getattr(marshal.cloudpickle.cloudpickle,
                                              "_PICKLE_BY_VALUE_MODULES", set())
    finally:
        marshal._main_snapshot = saved_snapshot
        if saved_mod is not None:
            sys.modules["__mf_script__"] = saved_mod
        else:
            sys.modules.pop("__mf_script__", None)
