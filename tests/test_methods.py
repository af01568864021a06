"""Method names and kinds: handles reserve no name; static, class and coroutine
methods; futures awaited from asyncio on the caller's side. On every transport."""

import pytest

import macroflow as mf

pytestmark = pytest.mark.timeout(60)


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
