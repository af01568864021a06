"""``macroflow bench nexus``: the suite runs end to end, prints a table per
transport that can run and a reason for each one that cannot, judges the bars
from the ratios, writes every figure to JSON, and leaves no process behind.

Figures are not checked against limits here (that is for a quiet machine):
what is checked is that each was measured and that verdicts follow from ratios.
"""

import json
import math
import sys
import types

import numpy as np
import psutil
import pytest

from common import our_processes
from macroflow import cli
from macroflow.bench import nexus
from macroflow.transport.base import REGISTRY

VARIANTS = {"inline", "new", "hand"}


def _positive(x):
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.mark.timeout(120)
def test_quick_run_prints_tables_and_bars_and_writes_every_figure(tmp_path, capsys):
    out = tmp_path / "nexus.json"
    assert cli.main(["bench", "nexus", "--quick", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "local: macroflow RSR vs hand-coded AF_UNIX socketpair" in printed
    header = next(line for line in printed.splitlines() if line.startswith("size  "))
    assert header.split() == ["size", "inline,", "us", "new", "thread,", "us", "hand-coded,", "us",
                              "inline/hand", "new/inline"]
    assert f"paper: {nexus.PAPER}" in printed
    for _key, label, _limit in nexus.BARS:
        assert any(line.strip().startswith(("PASS", "FAIL")) and label in line
                   for line in printed.splitlines()), label

    res = json.loads(out.read_text())
    for section in ("meta", "sizes", "paper", "transports", "mpi4py"):
        assert section in res
    assert res["meta"]["suite"] == "nexus" and res["meta"]["quick"] is True
    assert [s["doubles"] for s in res["sizes"]] == list(nexus.SIZES)
    assert res["sizes"][0]["bytes"] == 8 and res["sizes"][-1]["bytes"] == 2**20
    assert list(res["transports"])[:3] == ["local", "tcp", "mpi"]
    for name, entry in res["transports"].items():
        if entry["status"] == "measured":
            assert f"{name}: macroflow RSR vs hand-coded" in printed
        else:  # every other transport says why, in the JSON and on screen
            assert entry["status"] == "not available" and entry["reason"]
            assert f"{name}: not available: {entry['reason']}" in printed

    local = res["transports"]["local"]
    assert local["status"] == "measured"
    assert set(local["results"]) == VARIANTS
    for v in VARIANTS:
        figs = local["results"][v]
        assert len(figs) == len(nexus.SIZES)
        assert all(_positive(f["median_us"]) and f["n"] == 2 * nexus.QUICK.iters(8 * n)
                   for f, n in zip(figs, nexus.SIZES)), (v, figs)
    for key in ("inline_hand", "new_inline"):
        assert len(local["ratios"][key]) == len(nexus.SIZES)
        assert all(_positive(r) for r in local["ratios"][key])
    assert [b["key"] for b in local["bars"]] == [k for k, _, _ in nexus.BARS]
    for b in local["bars"]:
        assert b["pass"] == (b["ratio"] <= b["limit"])
    assert local["bars"][0]["ratio"] == local["ratios"]["inline_hand"][0]

    mpi = res["mpi4py"]
    if mpi["status"] == "measured":
        assert "mpi4py Send/Recv under mpiexec -n 2" in printed
        assert all(_positive(f["median_us"]) for f in mpi["results"])
    else:
        assert mpi["status"] == "not available" and f"mpi4py: not available: {mpi['reason']}" in printed
    assert our_processes() == []  # (MPI's process manager, started by an earlier test, stays)


def test_unregistered_and_unimportable_transports_are_not_available(monkeypatch, capsys):
    monkeypatch.setattr(nexus, "TRANSPORTS", ("nonesuch", "broken", "local"))
    monkeypatch.setitem(REGISTRY, "broken", "macroflow.transport.no_such_module")
    monkeypatch.setattr(nexus, "mpi4py_problem", lambda: "left out of this test")
    spawned = []
    monkeypatch.setattr(nexus, "_spawn", lambda *a, **k: spawned.append(a) or {"error": "ran"})
    res = nexus.run(quick=True)
    # nothing is started for a transport that cannot import
    others = [n for n in nexus.transport_names() if n not in ("nonesuch", "broken", "local")
              and nexus.module_problem(n) is None]
    assert [args[1] for args, _cfg in spawned] == ["local", *others]
    t = res["transports"]
    assert list(t)[:3] == ["nonesuch", "broken", "local"]
    assert t["nonesuch"] == {"status": "not available", "hand_coded": None,
                             "reason": "no transport 'nonesuch' is registered (registered: "
                                       + ", ".join(sorted(REGISTRY)) + ")"}
    assert t["broken"]["status"] == "not available"
    assert t["broken"]["reason"].startswith(
        "its module macroflow.transport.no_such_module does not import: ModuleNotFoundError")
    nexus.report(res)
    printed = capsys.readouterr().out
    assert "nonesuch: not available: no transport 'nonesuch' is registered" in printed
    assert "broken: not available: its module macroflow.transport.no_such_module" in printed
    assert "mpi4py: not available: left out of this test" in printed


def test_a_transport_whose_launcher_fails_is_not_available(monkeypatch):
    fake = types.ModuleType("fake_nexus_transport")

    def launcher(session):
        raise RuntimeError("no such network here")
    fake.launcher = launcher
    monkeypatch.setitem(sys.modules, "fake_nexus_transport", fake)
    monkeypatch.setitem(REGISTRY, "fake", "fake_nexus_transport")
    res = nexus._worker("fake", nexus.QUICK, sizes=[1])
    assert res == {"unavailable": "its launcher did not start 2 contexts: "
                                  "RuntimeError: no such network here"}


def test_mpi4py_rows_say_why_they_cannot_run(monkeypatch):
    monkeypatch.setattr(nexus, "find_mpiexec", lambda: None)
    if nexus.importlib.util.find_spec("mpi4py") is not None:
        assert nexus.mpi4py_problem() == ("mpiexec not found beside this Python nor on PATH "
                                          "(pip install mpich)")
    monkeypatch.setattr(nexus.importlib.util, "find_spec", lambda name: None)
    assert nexus.mpi4py_problem() == "mpi4py is not installed (pip install mpi4py mpich)"


def test_a_worker_that_fails_while_measuring_makes_the_exit_code_1(monkeypatch, capsys):
    monkeypatch.setattr(nexus, "TRANSPORTS", ("local",))
    monkeypatch.setattr(nexus, "mpi4py_problem", lambda: "left out of this test")
    monkeypatch.setattr(nexus, "_spawn", lambda *a, **k: {"error": "worker exited with code 1: boom"})
    assert nexus.main(quick=True) == 1
    assert "local: failed: worker exited with code 1: boom" in capsys.readouterr().out


@pytest.mark.timeout(60)
def test_a_worker_past_its_time_is_killed_and_reported():
    cfg = nexus.Config(**dict(nexus.QUICK.as_dict(), timeout_s=0.05))
    assert nexus._spawn(["--worker", "local", "--sizes", "1"], cfg) == {
        "error": "timed out after 0.05 s"}
    assert our_processes() == []  # (MPI's process manager, started by an earlier test, stays)


@pytest.mark.parametrize("kind", ["unix", "tcp"])
@pytest.mark.timeout(60)
def test_hand_coded_bounce_brings_back_the_same_bytes(kind):
    with nexus.HandCoded(kind, capacity=8 * 2**17, spin_us=50) as h:
        for n in (1, 1000, 2**17):
            src, out = nexus._pattern(n), np.zeros(n)
            h.bounce(src, out)
            assert np.array_equal(out, src)
        pid = h.pid
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_hand_coded_kind_is_checked():
    with pytest.raises(ValueError, match="kind must be 'unix' or 'tcp'; got 'udp'"):
        nexus.HandCoded("udp", capacity=8, spin_us=0)


def test_measure_checks_every_path_and_alternates_variants():
    calls = []

    def good(name):
        def bounce(src, out):
            calls.append(name)
            out[...] = src
        return bounce

    cfg = nexus.Config(**dict(nexus.QUICK.as_dict(), batches=3, iters_small=2, warmup=0))
    res = nexus._measure({"inline": good("a"), "new": good("b"), "hand": good("c")}, cfg, [4])
    # one check each, then batches in rotating order: abc, bca, cab, 2 round trips each
    assert "".join(calls) == "abc" + "aabbcc" + "bbccaa" + "ccaabb"
    assert res["inline"][0]["n"] == 6 and len(res["batch_medians_us"]["new"][0]) == 3

    def corrupt(src, out):
        out[...] = src
        out[0] += 1
    with pytest.raises(RuntimeError, match="hand-coded: 32 B came back different"):
        nexus._measure({"inline": good("a"), "hand": corrupt}, cfg, [4])


def test_bars_follow_from_the_ratios():
    sizes = [8, 1024, 2**16, 2**20]
    bars = nexus.evaluate_bars(sizes, [1.9, 5.0, 1.1, 1.2], [1.5, 1.0, 1.2, 1.1])
    assert [(b["key"], b["ratio"], b["pass"]) for b in bars] == [
        ("inline_8b", 1.9, True), ("inline_large", 1.2, True), ("new_vs_inline", 1.5, True)]
    bars = nexus.evaluate_bars(sizes, [2.1, 1.0, 1.3, 1.0], [1.0, 1.6, 1.0, 1.0])
    assert [b["pass"] for b in bars] == [False, False, False]
    # without hand-coded rows only the new-thread bar is judged
    bars = nexus.evaluate_bars(sizes, [None] * 4, [1.0] * 4)
    assert [b["key"] for b in bars] == ["new_vs_inline"]


def test_bad_arguments_are_refused(capsys):
    assert cli.main(["bench", "nexus", "--peers", "ray"]) == 2
    assert "peers suite only" in capsys.readouterr().err
    assert cli.main(["bench", "nexus", "--json", "/nonexistent/dir/out.json"]) == 2
    assert "--json /nonexistent/dir/out.json: cannot write it" in capsys.readouterr().err
    with pytest.raises(ValueError, match="sizes are numbers of float64 elements >= 1"):
        nexus.run(sizes=[1, -8])


def test_a_saved_run_prints_as_markdown():
    md = nexus.markdown(nexus._example_result())
    assert "| 8 B | 80.0 | 120 | 20.0 | 4.00x | 1.50x |" in md
    assert "- **FAIL** inline <= 2x hand-coded at 8 B: 4.00x (limit 2x)" in md
    assert "- `tcp`: not available: no transport 'tcp' is registered" in md
