"""``macroflow bench peers``: which systems run, what is skipped and why, and how
figures and ratios are made from the rounds.

The suite must work with none of the optional peers installed: the first test
hides them and checks that macroflow and ProcessPoolExecutor are still
measured. Tests of a peer's own row run only where that peer is installed.
"""

import json

import numpy as np
import psutil
import pytest

from macroflow import cli
from macroflow.bench import peers
from common import our_processes

ALL_OPS = set(peers.OP_KEYS)
PPE_OPS = {"null_task", "pipelined_1000", "array_16mb", "startup"}
PEER_OPS = {"ray": ALL_OPS - {"round_trip"}, "dask": ALL_OPS - {"round_trip"},
            "mpi4py": {"round_trip", "array_16mb"}}


def _positive(x):
    return isinstance(x, (int, float)) and x > 0


def _hide(monkeypatch, modules):
    real = peers._installed
    monkeypatch.setattr(peers, "_installed", lambda m: False if m in modules else real(m))


@pytest.mark.timeout(180)
def test_quick_run_without_peers_skips_them_and_measures_macroflow_and_executor(
        monkeypatch, tmp_path, capsys):
    _hide(monkeypatch, set(peers.MODULES.values()))
    out = tmp_path / "peers.json"
    assert cli.main(["bench", "peers", "--quick", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    for title, module in (("Ray", "ray"), ("Dask", "distributed"), ("mpi4py", "mpi4py")):
        assert (f'{title}: skipped, not installed (install: pip install "macroflow[peers]", '
                f"or pip install {module}") in printed
    header = next(line for line in printed.splitlines() if line.startswith("operation"))
    assert header.split() == ["operation", "macroflow", "PPE", "PPE/mf"]

    res = json.loads(out.read_text())
    assert res["meta"]["quick"] is True and res["meta"]["config"]["rounds"] == 1
    assert sorted(res["results"]) == ["macroflow", "ppe"]
    assert sorted(res["ratios"]) == ["ppe"]
    for p in peers.PEERS:
        assert res["systems"][p]["status"] == "skipped"
    assert res["systems"]["macroflow"]["status"] == res["systems"]["ppe"]["status"] == "measured"
    mfr, ppe = res["results"]["macroflow"], res["results"]["ppe"]
    assert all(_positive(mfr[op]) for op in ALL_OPS), mfr
    assert all(_positive(ppe[op]) for op in PPE_OPS), ppe
    assert all(ppe[op] is None for op in ALL_OPS - PPE_OPS)
    # one round: each ratio is that round's peer figure over macroflow's
    for op in PPE_OPS:
        assert res["ratios"]["ppe"][op] == pytest.approx(ppe[op] / mfr[op])
    for op in ALL_OPS - PPE_OPS:
        assert res["ratios"]["ppe"][op] is None
    assert our_processes(zombies=True) == []


def test_mpi4py_without_mpiexec_is_skipped_with_the_reason(monkeypatch):
    monkeypatch.setattr(peers, "_installed", lambda m: True)
    monkeypatch.setattr(peers, "find_mpiexec", lambda: None)
    st = peers.peer_status(["mpi4py"])["mpi4py"]
    assert st["status"] == "skipped"
    assert "mpiexec not found" in st["reason"] and "pip install mpich" in st["reason"]


def test_unknown_peer_is_an_error_naming_the_peers(capsys):
    assert cli.main(["bench", "peers", "--peers", "ray,spark"]) == 2
    assert "unknown peer 'spark'; peers are ray, dask, mpi4py" in capsys.readouterr().err


def test_peers_option_belongs_to_the_peers_suite(capsys):
    assert cli.main(["bench", "micro", "--peers", "ray"]) == 2
    assert "peers suite only" in capsys.readouterr().err


class _FakeSpawn:
    """Stands for the workers: canned figures per system and round, or a failure."""

    def __init__(self, figures, fail=()):
        self.figures, self.fail, self.calls = figures, set(fail), []

    def __call__(self, system, cfg):
        self.calls.append(system)
        if system in self.fail:
            return {"error": "worker exited with code 1: boom"}
        k = sum(1 for s in self.calls if s == system) - 1
        return dict(self.figures[system][k], version="v")


def test_figures_are_medians_and_ratios_are_medians_of_each_rounds_ratio(monkeypatch):
    mf = [{"null_task": 10.0}, {"null_task": 20.0}, {"null_task": 40.0}]
    ppe = [{"null_task": 400.0}, {"null_task": 100.0}, {"null_task": 200.0}]
    fake = _FakeSpawn({"macroflow": mf, "ppe": ppe})
    monkeypatch.setattr(peers, "_spawn", fake)
    monkeypatch.setattr(peers, "QUICK", peers.Config(**dict(peers.QUICK.as_dict(), rounds=3)))
    res = peers.run(quick=True, peers=[])
    assert fake.calls == ["macroflow", "ppe"] * 3  # macroflow first in every round
    assert res["results"]["macroflow"]["null_task"] == 20.0
    assert res["results"]["ppe"]["null_task"] == 200.0
    # the rounds' own ratios are 40, 5 and 5: their median, not 200 / 20
    assert res["ratios"]["ppe"]["null_task"] == 5.0
    assert res["results"]["ppe"]["chain_100"] is None and res["ratios"]["ppe"]["chain_100"] is None


def test_a_failed_worker_is_reported_and_makes_the_exit_code_1(monkeypatch, capsys):
    fake = _FakeSpawn({"macroflow": [{"null_task": 10.0}]}, fail={"ppe"})
    monkeypatch.setattr(peers, "_spawn", fake)
    assert peers.main(quick=True, peers="") == 1
    printed = capsys.readouterr().out
    assert "ProcessPoolExecutor: failed, worker exited with code 1: boom" in printed


@pytest.mark.timeout(60)
def test_a_worker_past_its_time_is_killed_and_reported():
    cfg = peers.Config(**dict(peers.QUICK.as_dict(), timeout_s=0.05))
    res = peers._spawn("macroflow", cfg)
    assert res == {"error": "timed out after 0.05 s"}
    assert our_processes(zombies=True) == []


class _Driver:
    def __init__(self, echo=lambda a: a, chain=lambda n: n):
        self.echo, self.chain = echo, chain

    def task_null(self, i):
        return i

    def pipelined(self, n):
        return list(range(n))


def test_measure_checks_the_array_and_the_chain():
    cfg = peers.Config(**dict(peers.QUICK.as_dict(), budget_s=0.0, max_arrays=2))
    res = peers._measure(_Driver(), cfg)
    assert set(res) == {"null_task", "pipelined_1000", "chain_100", "array_16mb"}

    def corrupt(a):
        b = np.array(a)
        b[12345] ^= 1
        return b
    with pytest.raises(RuntimeError, match="came back different"):
        peers._measure(_Driver(echo=corrupt), cfg)
    with pytest.raises(RuntimeError, match="chain of 100: got 99"):
        peers._measure(_Driver(chain=lambda n: n - 1), cfg)


def _peer_missing(p):
    if not peers._installed(peers.MODULES[p]):
        return f"{p} is not installed ({peers.INSTALL[p]})"
    if p == "mpi4py" and peers.find_mpiexec() is None:
        return "mpiexec not found"
    return None


@pytest.mark.timeout(300)
@pytest.mark.parametrize("peer", peers.PEERS)
def test_an_installed_peer_gets_its_row(peer, tmp_path, capsys):
    why = _peer_missing(peer)
    if why:
        pytest.skip(why)
    out = tmp_path / "peers.json"
    assert peers.main(json_path=str(out), quick=True, peers=peer) == 0
    header = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("operation"))
    assert peers.COLUMNS[peer] in header.split() and f"{peers.COLUMNS[peer]}/mf" in header.split()
    res = json.loads(out.read_text())
    assert res["systems"][peer]["status"] == "measured" and res["systems"][peer]["version"]
    got = res["results"][peer]
    assert all(_positive(got[op]) for op in PEER_OPS[peer]), got
    assert all(got[op] is None for op in ALL_OPS - PEER_OPS[peer]), got
    assert all(_positive(res["ratios"][peer][op]) for op in PEER_OPS[peer])
    assert our_processes(zombies=True) == []


def test_is_installed_asks_the_import_system():
    assert peers._installed("json") is True
    assert peers._installed("no_such_module_here") is False
