"""The layers: the core knows no programming model; a model plugs into it
through the opcode registry and registered call kinds (see "How a model
plugs into the core" in the guide)."""

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

import macroflow as mf
from macroflow.core import context as core

SRC = Path(__file__).resolve().parent.parent / "src"


def test_no_core_module_mentions_the_object_model():
    mentions = re.compile(r"macroflow\.objects|\.\.objects|from \.\. import objects")
    found = [f"{p.name}:{i}: {line.strip()}"
             for p in sorted((SRC / "macroflow" / "core").glob("*.py"))
             for i, line in enumerate(p.read_text().splitlines(), 1) if mentions.search(line)]
    assert found == []


@pytest.mark.timeout(60)
def test_importing_the_core_imports_no_model():
    # the package's __init__ imports every model: stand in for it, so that
    # only what the core modules import themselves is loaded
    code = (
        "import sys, types, importlib, pkgutil\n"
        f"pkg = types.ModuleType('macroflow'); pkg.__path__ = [{str(SRC / 'macroflow')!r}]\n"
        "sys.modules['macroflow'] = pkg\n"
        "import macroflow.core\n"
        "for m in pkgutil.iter_modules(macroflow.core.__path__):\n"
        "    importlib.import_module('macroflow.core.' + m.name)\n"
        "from macroflow.core import context\n"
        "print(sorted(context.MODELS), sorted(n for n in sys.modules if n.startswith('macroflow.')"
        " and not n.startswith('macroflow.core')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[] []"


def test_the_object_model_registers_itself():
    from macroflow.objects import hosting

    assert core.MODELS["objects"] is hosting.ObjectHost
    with mf.init(contexts=1, transport="inproc"):
        eng = core.current_engine()
        assert sorted(eng.models["objects"].kinds) == sorted([hosting.PERSISTENT, hosting.CREATE,
                                                              hosting.REGULAR])
        # the engine serves the core's kind and every registered model's, nothing else
        declared = {k for m in eng.models.values() for k in m.kinds}
        assert sorted(eng.call_kinds) == sorted(declared | {core.SYSTEM})
        assert sorted(eng.models) == sorted(core.MODELS) and "spmd" in eng.models


def test_the_spmd_model_takes_opcodes_above_the_cores():
    from macroflow.spmd import model as spmd
    ours = [spmd.GET, spmd.PUT, spmd.MEMREPLY, spmd.COLL, spmd.ENDED, spmd.STATUS,
            spmd.STATUS_REPLY, spmd.REVOKED, spmd.WAKE]
    assert all(op >= 19 and op in core.HANDLERS for op in ours)
    # the memory it serves while a method computes needs no user code
    assert sorted(op for op in ours if op in core.SERVED_WHILE_BUSY) == sorted(
        [spmd.GET, spmd.PUT, spmd.STATUS, spmd.REVOKED])


def test_the_core_registers_its_own_opcodes_and_derives_the_served_set():
    mine = sorted(op for op in core.HANDLERS if op < 19)  # 19..255 are the models'
    assert mine == sorted(
        [core.FORWARD, core.RELEASE, core.RSR, core.RSR_NOW, core.READY, core.SHUTDOWN,
         core.FATAL, core.PROBE, core.MEMBERS, core.JOINED, core.RETIRE, core.HANDOVER,
         core.RETIRED, core.RETIRE_ACK, core.LEFT, core.BIG, core.STATS])
    assert sorted(op for op in core.SERVED_WHILE_BUSY if op < 19) == sorted(
        [core.FORWARD, core.RELEASE, core.RSR_NOW, core.BIG, core.STATS, core.RETIRE,
         core.RETIRED])
    core.register(210, lambda eng, src, msg: None, served_while_busy=True)
    try:
        assert 210 in core.HANDLERS and 210 in core.SERVED_WHILE_BUSY
    finally:
        core.unregister(210)
    assert 210 not in core.HANDLERS and 210 not in core.SERVED_WHILE_BUSY
    # a handler of its own while a method computes (as FORWARD has)
    assert core.SERVED_WHILE_BUSY[core.FORWARD] is not core.HANDLERS[core.FORWARD]
    busy = lambda eng, src, msg: False  # noqa: E731
    core.register(210, lambda eng, src, msg: None, served_while_busy=busy)
    try:
        assert core.SERVED_WHILE_BUSY[210] is busy
    finally:
        core.unregister(210)
    with pytest.raises(TypeError, match="served_while_busy must be True, False or a handler"):
        core.register(210, lambda eng, src, msg: None, served_while_busy=5)
    assert 210 not in core.HANDLERS


@pytest.mark.parametrize("opcode, error, text", [
    (core.CALL, ValueError, "already registered"),
    (core.FORWARD, ValueError, "already registered"),
    (256, ValueError, "0..255"),
    (-1, ValueError, "0..255"),
    ("7", TypeError, "must be an int"),
    (True, TypeError, "must be an int"),
])
def test_a_bad_or_taken_opcode_is_refused(opcode, error, text):
    with pytest.raises(error, match=text):
        core.register(opcode, lambda eng, src, msg: None)


def test_a_handler_must_be_callable_and_only_registered_opcodes_unregister():
    with pytest.raises(TypeError, match="callable"):
        core.register(211, "not a function")
    with pytest.raises(ValueError, match="not registered"):
        core.unregister(211)
    with pytest.raises(ValueError, match="not registered"):
        core.unregister(core.CALL)
    with pytest.raises(TypeError, match="landing must be callable"):
        core.register(211, lambda eng, src, msg: None, landing=5)
    assert 211 not in core.HANDLERS


LANDED, ASK = 222, 223
landed = []


def _on_ask(eng, src, msg):
    import numpy as np
    eng.send(src, (LANDED, "x", np.frombuffer(b"abc" + bytes((1 << 20) - 3), np.uint8)))


def _on_landed(eng, src, msg):
    landed.append((src, msg[1], bytes(msg[2][:3]), msg[2].nbytes))


def _land(eng, src, head, nbytes):
    return memoryview(posted)  # one posted buffer: the test sends one frame


posted = bytearray(1 << 20)


@pytest.mark.timeout(60)
def test_a_large_buffer_lands_where_the_opcodes_landing_says(transport):
    if transport in ("mpi", "inproc"):
        pytest.skip("mpi: spawned ranks do not have this registration; inproc: frames are "
                    "handed over, not received")
    core.register(LANDED, _on_landed, landing=_land)
    core.register(ASK, _on_ask)
    landed.clear()
    try:
        def main():
            eng = core.current_engine()
            eng.post(1, (ASK,))
            eng.driver.run_until(lambda: landed, time.monotonic() + 30)
            return landed[0], bytes(posted[:3])

        got, head = mf.run(main, contexts=2, transport=transport)
        assert got == (1, "x", b"abc", 1 << 20)
        assert head == b"abc"  # received into the posted buffer, not one of the transport's
    finally:
        core.unregister(LANDED)
        core.unregister(ASK)


PING, PONG = 220, 221
pongs = []


def _on_ping(eng, src, msg):
    eng.send(src, (PONG, eng.id, msg[1] * 2))


def _on_pong(eng, src, msg):
    pongs.append((src, msg[1], msg[2]))


@pytest.fixture
def ping_pong():
    core.register(PING, _on_ping)
    core.register(PONG, _on_pong)
    pongs.clear()
    yield
    core.unregister(PING)
    core.unregister(PONG)


@pytest.mark.timeout(60)
def test_a_registered_opcode_is_dispatched_on_every_context(run, transport, ping_pong):
    if transport == "mpi":
        pytest.skip("registered in this process: spawned MPI ranks do not have it")

    def main():
        eng = core.current_engine()
        for c in (1, 2):
            eng.post(c, (PING, 10 * c))
        eng.driver.run_until(lambda: len(pongs) == 2, time.monotonic() + 30)
        return sorted(pongs)

    assert run(main, contexts=3) == [(1, 1, 20), (2, 2, 40)]


@pytest.mark.timeout(60)
def test_a_call_of_a_kind_nobody_serves_fails_with_an_error_naming_it(run):
    def main():
        f = core.current_engine().issue("no-such-kind", None, "m", (), {}, 1)
        with pytest.raises(mf.CallError, match="no call kind 'no-such-kind'.*'p'"):
            f.result(timeout=30)
        return mf.context_id()

    assert run(main, contexts=2) == 0


class _Twice(core.CallKind):
    def accept(self, call):
        if not call.missing:
            self.arguments_ready(call)

    def arguments_ready(self, call):
        self.eng.spawn(self.eng._invoke, lambda x: (self.eng.id, 2 * x), call)

    def label(self, call):
        return f"twice.{call.method}"


class _TwiceModel(core.Model):
    def __init__(self, eng):
        super().__init__(eng)
        self.kinds = {"twice": _Twice(eng)}

    def snapshot(self, d):
        d["twice_model"] = True


@pytest.fixture
def twice_model():
    core.register_model("twice", _TwiceModel)
    yield
    core.unregister_model("twice")


@pytest.mark.timeout(60)
def test_a_registered_call_kind_serves_calls_with_dataflow_arguments(run, transport, twice_model):
    if transport == "mpi":
        pytest.skip("registered in this process: spawned MPI ranks do not have it")

    def main():
        eng = core.current_engine()
        first = eng.issue("twice", None, "m", (5,), {}, 1)
        # a future as the argument: the kind runs the call once its value has arrived
        second = eng.issue("twice", None, "m", (first,), {}, 2)
        return second.result(timeout=30), mf.stats()[1].get("twice_model")

    assert run(main, contexts=3) == ((2, (1, 10, 1, 10)), True)


class _Thief(core.Model):
    def __init__(self, eng):
        super().__init__(eng)
        self.kinds = {core.SYSTEM: _Twice(eng)}


def test_a_model_that_claims_a_served_call_kind_is_refused():
    core.register_model("thief", _Thief)
    try:
        with pytest.raises(ValueError, match="model 'thief' serves kinds \\['s'\\]"):
            with mf.init(contexts=1, transport="inproc"):
                pass
    finally:
        core.unregister_model("thief")
    with mf.init(contexts=1, transport="inproc"):
        assert "thief" not in core.current_engine().models


def test_macroflows_own_opcodes_cannot_be_unregistered():
    with pytest.raises(ValueError, match=f"opcode {core.FATAL} is macroflow's own"):
        core.unregister(core.FATAL)
    assert core.FATAL in core.HANDLERS


def _raises(eng, src, msg):
    raise RuntimeError(f"bad message {msg[1]}")


@mf.persistent
class Poster:
    def post(self, dest, opcode, what):
        from macroflow.core.context import current_engine
        eng = current_engine()
        eng.send(dest, (opcode, what))
        return "posted"

    def ok(self):
        return "alive"


@pytest.mark.timeout(60)
def test_a_registered_handler_that_raises_is_reported_and_its_context_serves_on(run, transport,
                                                                              capfd):
    if transport == "mpi":
        pytest.skip("registered in this process: spawned MPI ranks do not have it")
    core.register(212, _raises)
    try:
        def main():
            p, q = Poster.create(on=0), Poster.create(on=1)
            p.post(1, 212, "one").result(10)
            q.post(1, 212, "two").result(10)  # (to itself)
            return q.ok().result(10), mf.stats()[1]["handler_errors"]

        assert run(main, contexts=2) == ("alive", 2)
    finally:
        core.unregister(212)
    err = capfd.readouterr().err
    assert "the handler of opcode 212 (_raises) raised on a message from context 0" in err
    assert "RuntimeError: bad message one" in err and "RuntimeError: bad message two" in err
