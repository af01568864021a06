"""The documentation's promises, checked: every public name has an example that
runs (pytest runs the docstrings with --doctest-modules), no example is a
comment that runs nothing, and the guide describes every counter of mf.stats()."""

import ast
import doctest
import inspect
import re
from pathlib import Path

import pytest

import macroflow as mf

from conftest import TRANSPORTS

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src" / "macroflow"
GUIDE = ROOT / "docs" / "guide.md"


def docstrings():
    """(where, docstring) for every module, class and function in src/macroflow."""
    for path in sorted(SRC.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        rel = path.relative_to(ROOT)
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node, clean=True)
                if doc:
                    name = getattr(node, "name", "<module>")
                    yield f"{rel}:{getattr(node, 'lineno', 1)} {name}", doc


def is_code(source):
    """True if a doctest example's source has a statement, not only comments."""
    lines = [ln.strip() for ln in source.splitlines()]
    return any(ln and not ln.startswith("#") for ln in lines)


PROMPT_WITHOUT_CODE = re.compile(r"^\s*>>>(\s*|\s+#.*)$")


def prompts_without_code(doc):
    """The ``>>>`` lines of a docstring that hold no statement (only a comment).

    doctest skips them silently, so an example written that way runs nothing."""
    return [ln.strip() for ln in doc.splitlines() if PROMPT_WITHOUT_CODE.match(ln)]


def test_no_example_is_only_a_comment():
    bad = [f"{where}: {line}" for where, doc in docstrings() for line in prompts_without_code(doc)]
    assert not bad, "examples that run nothing (write one that shows a result):\n" + "\n".join(bad)


def test_the_comment_check_catches_a_comment_example():
    assert prompts_without_code("Example:\n    >>> # f.result() -> 3\n") == [">>> # f.result() -> 3"]
    assert prompts_without_code("Example:\n    >>>\n") == [">>>"]
    assert prompts_without_code("Example:\n    >>> f(1)  # why\n    3\n") == []
    # doctest would run nothing for the first: it skips comment-only examples
    assert doctest.DocTestParser().get_examples(">>> # f.result() -> 3\n") == []


def public_api():
    """Every public name of macroflow/__init__.py that is a class or a function,
    and the public methods and properties those classes define."""
    out = []
    for name in sorted(vars(mf)):
        obj = getattr(mf, name)
        if name.startswith("_") or inspect.ismodule(obj):
            continue
        if not (inspect.isclass(obj) or inspect.isfunction(obj)):
            continue
        out.append((f"mf.{name}", obj))
        if inspect.isclass(obj):
            for attr, val in vars(obj).items():
                if attr.startswith("_"):
                    continue
                if isinstance(val, (staticmethod, classmethod)):
                    val = val.__func__
                if inspect.isfunction(val) or isinstance(val, property):
                    out.append((f"mf.{name}.{attr}", val))
    return out


def test_public_api_is_found():
    names = {n for n, _ in public_api()}
    assert {"mf.run", "mf.rsr", "mf.Future.result", "mf.info", "mf.destroy"} <= names


@pytest.mark.parametrize("name,obj", public_api(), ids=[n for n, _ in public_api()])
def test_public_name_has_an_example(name, obj):
    doc = obj.__doc__ or ""
    examples = [ex for ex in doctest.DocTestParser().get_examples(doc) if is_code(ex.source)]
    assert examples, f"{name} has no example (>>>) in its docstring"


def guide_section(title):
    text = GUIDE.read_text()
    m = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert m, f"docs/guide.md has no '## {title}' section"
    return m.group(1)


@pytest.mark.timeout(60)
def test_guide_describes_every_stats_key():
    keys = set()
    for transport in TRANSPORTS:  # some keys come from one transport only
        for counters in mf.run(mf.stats, contexts=2, transport=transport).values():
            keys |= set(counters)
    described = set(re.findall(r"^\| `(\w+)` \|", guide_section("Statistics"), re.M))
    assert keys - described == set(), f"mf.stats() keys the guide does not describe: {keys - described}"
    assert described - keys == set(), f"the guide describes keys mf.stats() does not return: {described - keys}"


# -- behaviour the guide states --------------------------------------------------
@mf.regular
class Math:
    def square(self, x):
        return x * x


@mf.persistent
class Box:
    pass


@pytest.mark.timeout(60)
def test_other_threads_are_refused(run):
    import threading

    def main():
        m = Math()
        f = m.square(2)
        attempts = {
            "call": lambda: m.square(3),
            "create": lambda: Box.create(),
            "gather": lambda: mf.gather([f]),
            "wait": lambda: mf.wait([f]),
            "stats": mf.stats,
            "context_id": mf.context_id,
            "result": lambda: f.result(),
            "exception": lambda: f.exception(),
            "callback": lambda: f.add_done_callback(print),
            # the program's own (on main's thread: a helper's add_contexts
            # switched main's lightweight thread and hung its gather)
            "contexts": mf.contexts,
            "add_contexts": lambda: mf.add_contexts(1),
            "wait_contexts": lambda: mf.wait_contexts(2, timeout=1),
            "remove_context": lambda: mf.remove_context(1),
        }
        refused = {}
        read = []

        def other():
            read.append(f.done())  # only reads: allowed from any thread
            for name, attempt in attempts.items():
                try:
                    attempt()
                except RuntimeError as e:
                    refused[name] = str(e)

        t = threading.Thread(target=other)
        t.start()
        t.join()
        assert sorted(refused) == sorted(attempts), refused
        assert all("thread" in msg for msg in refused.values())
        assert read in ([True], [False])
        return m.square(5).result(), f.result()  # the computation is unharmed

    assert run(main, contexts=2) == (25, 4)


class LockedError(Exception):
    def __init__(self, msg):
        super().__init__(msg)
        self.lock = __import__("threading").Lock()  # cannot be pickled


@mf.regular
class Failing:
    def fail(self):
        raise LockedError("disk on fire")


@pytest.mark.timeout(60)
def test_unpicklable_remote_exception_arrives_as_remote_error(run):
    def main():
        with pytest.raises(mf.RemoteError) as info:
            Failing.create(on=1).fail().result()
        return info.value

    err = run(main, contexts=2)
    assert err.type_name == f"{__name__}.LockedError"
    assert err.message == "disk on fire"
    assert str(err) == f"{__name__}.LockedError: disk on fire"
    assert isinstance(err.__cause__, mf.RemoteTraceback)
    assert 'raise LockedError("disk on fire")' in err.__cause__.text
    assert err.__cause__.text.count("Traceback from context 1") == 1


class NeedsTwo(Exception):
    def __init__(self, a, b):
        super().__init__(f"{a}/{b}")  # pickles, but unpickling calls NeedsTwo("1/2")


@mf.regular
class FailingTwo:
    def fail(self):
        raise NeedsTwo(1, 2)


class KeywordOnly(Exception):
    def __init__(self, *, code):
        super().__init__(f"code {code}")  # pickles; unpickling calls KeywordOnly("code 7")
        self.code = code


@mf.regular
class FailingKw:
    def fail(self):
        raise KeywordOnly(code=7)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("cls, type_name, message", [
    (FailingTwo, "NeedsTwo", "1/2"), (FailingKw, "KeywordOnly", "code 7")])
def test_exception_that_cannot_be_rebuilt_arrives_as_remote_error(run, cls, type_name, message):
    def main():
        with pytest.raises(mf.RemoteError) as info:
            cls.create(on=1).fail().result()
        return info.value

    err = run(main, contexts=2)
    assert err.type_name == f"{__name__}.{type_name}"
    assert err.message == message
    assert isinstance(err.__cause__, mf.RemoteTraceback)
    assert f"raise {type_name}(" in err.__cause__.text
    # one traceback, from the context where it was raised
    assert err.__cause__.text.count("Traceback from context 1") == 1


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name,obj", public_api(),
                         ids=[n for n, _ in public_api()])
def test_public_example_runs_when_pasted(name, obj):
    # pytest runs docstrings with their module's globals, where a private
    # helper, or a public name left unqualified, resolves: pasted into a new
    # interpreter, the example failed with a NameError
    test = doctest.DocTestParser().get_doctest(obj.__doc__ or "", {}, name, None, 0)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    out = []
    runner.run(test, out=out.append)
    mf.shutdown()
    assert runner.tries and runner.failures == 0, "".join(out)
