"""Marshalling: pickle 5 with out-of-band buffers, by-value for what can't be imported."""

import pickle

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
