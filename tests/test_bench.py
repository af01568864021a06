"""The micro benchmark suite runs end to end and reports every figure.

The figures themselves are not checked against limits (whether the bars pass
is a matter for benchmarks on a quiet machine, not for tests): what is checked
is that every figure was measured, that derived figures agree with the ones
they come from, and that each bar's verdict follows from its ratio.
"""

import io
import json
import math

import pytest

import macroflow.bench as bench
from macroflow.bench import micro
from common import our_processes
from conftest import MPI_MISSING

POSITIVE_TABLE1 = [
    "message_new_delete_us", "message_transport_us", "message_send_us", "rsr_send_us",
    "bandwidth_mb_s", "bandwidth_roundtrip_us", "computation_instance_us", "future_construct_us",
    "chain100_issue_us", "slots_insert_us", "slots_lookup_us", "object_instantiation_us",
    "object_destruction_us", "null_rpc_persistent_us", "guarded_null_rpc_us",
    "pipelined_persistent_us", "null_rpc_regular_local_us", "null_rpc_regular_remote_us",
    "pipelined_regular_default_us", "pipelined_regular_pinned_us", "chain_per_link_us",
    "startup_first_answer_s", "startup_total_s", "idle_rss_mb", "idle_rss_fresh_mb", "idle_uss_fresh_mb",
]
# differences of two measured times: noise may make them negative
FINITE_TABLE1 = ["block_predicate_us", "add_arc_us", "issue_bookkeeping_us", "total_overhead_us"]


def _positive(x):
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def _verdict(b):
    r, lim = b["ratio"], b["limit"]
    return {"<=": r <= lim, "<": r < lim, ">=": r >= lim}[b["op"]]


@pytest.mark.timeout(300)
def test_quick_micro_suite_writes_every_figure(tmp_path, capsys):
    out = tmp_path / "micro.json"
    assert bench.main("micro", json_path=str(out), quick=True) == 0
    printed = capsys.readouterr().out
    for title in ("Table I", "Table II", "METG", "Bars", "Chain length", "macroflow bench peers"):
        assert title in printed

    res = json.loads(out.read_text())
    # the plain-text tables (without rich, or into a file): a category stands
    # apart from its row's label, and a count of tasks is a whole number
    text = io.StringIO()
    micro.report(res, out=text)
    lines = text.getvalue().splitlines()
    assert any(line.startswith("Communication New and delete a message") for line in lines), lines
    metg = lines.index(next(line for line in lines if line.startswith("METG(50%)")))
    assert "ran on (tasks x 2 batches)" in lines[metg + 1], lines[metg + 1]
    first = lines[metg + 3].split()
    assert first[:2] == [f"{micro.QUICK.metg_grid_us[0]:g}", f"{res['metg']['curve'][0]['n_tasks']:,}"]
    for section in ("meta", "baselines", "table1", "flops", "table2", "metg", "bars", "rounds"):
        assert section in res
    assert "peers" not in res  # other systems are measured by the peers suite, never quoted
    for key in micro.BASELINE_KEYS + ("oneway_busypoll_us",):
        assert _positive(res["baselines"][key]), key
    t1 = res["table1"]
    for key in POSITIVE_TABLE1:
        assert _positive(t1[key]), key
    for key in FINITE_TABLE1:
        assert math.isfinite(t1[key]), key
    assert _positive(res["flops"]["python_flops"]) and _positive(res["flops"]["numpy_flops"])
    for k in ("k=2", "k=4"):
        for unit in ("ft_us", "ft_python_flops", "ft_numpy_flops"):
            assert _positive(res["table2"]["macroflow"][k][unit])
    curve = res["metg"]["curve"]
    assert len(curve) == len(micro.QUICK.metg_grid_us)
    for point in curve:
        assert _positive(point["task_us"]) and _positive(point["efficiency"]) and _positive(point["wall_s"])
    assert res["metg"]["metg_us"] is None or _positive(res["metg"]["metg_us"])
    assert t1["bandwidth_mb_s"] == pytest.approx(2 * micro.QUICK.bw_bytes / t1["bandwidth_roundtrip_us"])

    # the rows' names say where the regular calls ran: default placement keeps
    # a sync call on the caller, create(on=1) sends it to context 1
    assert t1["regular_default_sync_ran_on"] == {"0": 20}
    assert t1["regular_remote_sync_ran_on"] == {"1": 5}

    lengths = list(micro.QUICK.chain_lengths)
    for tr in ("local", "inproc"):
        cl = t1["chain_length"][tr]
        assert cl["lengths"] == lengths
        assert sorted(cl["per_link_us"], key=int) == [str(n) for n in lengths]
        assert all(_positive(v) for v in cl["per_link_us"].values()), tr
        assert cl["ratio"] == pytest.approx(cl["per_link_us"][str(lengths[-1])] / cl["per_link_us"][str(lengths[0])])

    names = [b["bar"] for b in res["bars"]]
    if MPI_MISSING is None:  # the MPI rows, measured under mpiexec in each round
        assert len(names) == 17
        for key in ("mpi_null_rpc_persistent_us", "mpi_bandwidth_mb_s", "mpi4py_bandwidth_mb_s",
                    "mpi4py_roundtrip_us", "mpi4py_pickled_roundtrip_us"):
            assert _positive(t1[key]), key
        assert sum("on mpi" in n for n in names) == 3
        assert "MPI transport" in printed
    else:
        assert len(names) == 14 and "MPI rows skipped" in printed
    assert _positive(res["baselines"]["pingpong_mailbox_us"])
    assert any("shared-memory mailbox" in n for n in names) and any(n.startswith("METG") for n in names)
    assert any(n.startswith("null regular call, remote") for n in names)
    for tr in ("local", "inproc"):
        assert sum(n.startswith(f"chain on one object ({tr})") for n in names) == 1
    for b in res["bars"]:
        # a METG not reached on the grid is an infinite ratio, and a FAIL
        assert _positive(b["ratio"]) or (b["bar"].startswith("METG") and b["ratio"] == math.inf), b["bar"]
        assert b["pass"] is _verdict(b), b["bar"]
    assert our_processes(zombies=True) == []


def test_bars_judge_the_chain_length_ratio():
    base = {"pingpong_busypoll_us": 10.0, "pingpong_blocking_us": 20.0, "baseline_bandwidth_mb_s": 1000.0,
            "pingpong_mailbox_us": 4.0}
    t1 = {"null_rpc_persistent_us": 25.0, "pipelined_persistent_us": 10.0, "null_rpc_regular_remote_us": 18.0,
          "null_rpc_regular_local_us": 5.0, "chain_per_link_us": 14.0, "bandwidth_mb_s": 900.0,
          "startup_first_answer_s": 0.01, "idle_rss_fresh_mb": 30.0,
          "chain_length": {"local": {"lengths": [100, 1000, 20000], "ratio": 1.2,
                                     "per_link_us": {"100": 30.0, "1000": 31.0, "20000": 36.0}},
                           "inproc": {"lengths": [100, 1000, 20000], "ratio": 9.0,
                                      "per_link_us": {"100": 30.0, "1000": 60.0, "20000": 270.0}}}}
    bars = {b["bar"]: b for b in micro.bars(t1, base, metg={"metg_us": 65.0})}
    local = bars["chain on one object (local): per link at 20,000 links <= 1.3x at 100"]
    inproc = bars["chain on one object (inproc): per link at 20,000 links <= 1.3x at 100"]
    assert (local["pass"], local["value"], local["reference"]) == (True, 36.0, 30.0)
    assert (inproc["pass"], inproc["ratio"]) == (False, 9.0)
    remote = next(b for b in bars.values() if b["bar"].startswith("null regular call, remote"))
    assert remote["counted"] and remote["pass"] and remote["ratio"] == pytest.approx(1.8)
    mailbox = bars["null persistent call <= 2.5x hand-coded shared-memory mailbox round trip"]
    assert (mailbox["pass"], mailbox["ratio"]) == (False, 6.25)
    pipelined = bars["pipelined null call, per call <= 0.5x busy-poll round trip"]
    assert (pipelined["pass"], pipelined["ratio"]) == (False, 1.0)
    metg = bars["METG(50%) on 2 contexts < 40 us"]
    assert (metg["pass"], metg["value"]) == (False, 65.0)
    assert micro.bars(t1, base, metg={"metg_us": None})[-3]["value"] == float("inf")
    local_call = next(b for b in bars.values() if "default placement" in b["bar"])
    assert not local_call["counted"]


@pytest.mark.parametrize("ncores, said", [(2, "us; 3 contexts on 2 cores: oversubscribed"),
                                          (4, "us")])
def test_the_chain_bar_says_when_its_three_contexts_oversubscribe_the_cores(monkeypatch, ncores,
                                                                             said):
    base = {"pingpong_busypoll_us": 10.0, "pingpong_blocking_us": 20.0, "baseline_bandwidth_mb_s": 1000.0,
            "pingpong_mailbox_us": 4.0}
    t1 = {"null_rpc_persistent_us": 25.0, "pipelined_persistent_us": 10.0, "null_rpc_regular_remote_us": 18.0,
          "null_rpc_regular_local_us": 5.0, "chain_per_link_us": 14.0, "bandwidth_mb_s": 900.0,
          "startup_first_answer_s": 0.01, "idle_rss_fresh_mb": 30.0}
    monkeypatch.setattr(micro, "cores", lambda: ncores)
    chain = next(b for b in micro.bars(t1, base, metg={"metg_us": 30.0})
                 if b["bar"].startswith("chain per link"))
    assert chain["note"] == said


def test_unknown_suite_is_an_error(capsys):
    assert bench.main("nonesuch") == 2
    assert "unknown suite" in capsys.readouterr().err


def test_table2_matches_mentats_worked_example():
    # Section 4.4: FT = 556 + 2 x (1730 + 170) = 4356 us, x 7 Mflop/s = 30492 flops
    t = micro.table2(556, 1730, 170, {"python_flops": 7e6, "numpy_flops": 10e6})
    assert round(t["k=2"]["ft_us"]) == 4356
    assert round(t["k=2"]["ft_python_flops"]) == 30492
    assert round(t["k=4"]["ft_us"]) == 1823


def test_metg_takes_the_smallest_duration_from_which_all_pass():
    curve = [{"task_us": 10, "efficiency": 0.1}, {"task_us": 100, "efficiency": 0.55},
             {"task_us": 1000, "efficiency": 0.4}, {"task_us": 10000, "efficiency": 0.9}]
    assert micro.metg_from_curve(curve)["metg_grid_us"] == 10000
    assert micro.metg_from_curve([{"task_us": 10, "efficiency": 0.1}])["metg_us"] is None


def test_baselines_write_their_figures_with_json(tmp_path, monkeypatch, capsys):
    # (--json was taken and nothing was written)
    from macroflow.bench import baselines
    fig = {"median_us": 1.0, "p10_us": 1.0, "p90_us": 1.0, "mean_us": 1.0}
    monkeypatch.setattr(baselines, "pingpong", lambda mode, **kw: dict(fig))
    monkeypatch.setattr(baselines, "mailbox", lambda **kw: dict(fig))
    monkeypatch.setattr(baselines, "bandwidth",
                        lambda **kw: dict(fig, nbytes=2 ** 20, mb_per_s=1.0, sndbuf=1))
    monkeypatch.setattr(baselines, "fork_roundtrip_startup",
                        lambda: dict(fig, min_us=1.0, max_us=1.0, runs=1))
    path = tmp_path / "b.json"
    assert bench.main("baselines", json_path=str(path)) == 0
    got = json.loads(path.read_text())
    assert sorted(got) == ["bandwidth", "fork_startup", "mailbox", "pingpong", "quick"]
    assert sorted(got["pingpong"]) == sorted(baselines.MODES)


@pytest.mark.timeout(120)
def test_ctrl_c_ends_a_bench_run_in_one_line(tmp_path):
    # (a traceback through the suite's code and a child's, and nothing said)
    import os
    import signal
    import subprocess
    import sys
    out = tmp_path / "x.json"
    p = subprocess.Popen([sys.executable, "-m", "macroflow", "bench", "micro", "--quick", "--json",
                          str(out)], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                         start_new_session=True)
    try:
        first = p.stderr.readline()  # "[bench micro] round 1/3": it measures
        assert "round" in first, first
        # once: one that lands in a fork hook or a finalizer, where Python
        # drops what is raised, is sent again (it was lost 1 time in 20)
        os.kill(p.pid, signal.SIGINT)
        try:
            _, err = p.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail("bench micro did not end 60 s after a Ctrl-C")
        err = first + err
        code = p.returncode
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert code == 130, err
    assert f"macroflow bench: interrupted (Ctrl-C); nothing was written to {out}" in err, err
    assert err.rstrip().endswith("macroflow bench: interrupted (Ctrl-C); nothing was written to "
                                 f"{out}"), err
    assert not out.exists()


HANGS_AFTER_MPI_INIT = """
import sys, time
from mpi4py import MPI
MPI.COMM_WORLD.Barrier()  # both ranks are up, their shared memory made
if MPI.COMM_WORLD.Get_rank() == 0:
    open(sys.argv[1], "w").write("up")
time.sleep(600)
"""


@pytest.mark.timeout(120)
@pytest.mark.skipif(MPI_MISSING is not None, reason=str(MPI_MISSING))
def test_an_mpi_worker_killed_by_the_bench_leaves_no_shared_memory(tmp_path, monkeypatch):
    # (a Ctrl-C or a timeout killed the ranks, and MPICH's files stayed in /dev/shm)
    import glob
    import os
    from macroflow.transport.mpi import _find_mpiexec
    (tmp_path / "hangs_after_mpi_init.py").write_text(HANGS_AFTER_MPI_INIT)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    before = set(glob.glob("/dev/shm/mpich_shm_*"))
    flag = tmp_path / "up"
    res = bench.spawn_worker("hangs_after_mpi_init", [str(flag)], 20, "RESULT ",
                             mpiexec=_find_mpiexec(), ranks=2)
    assert res == {"error": "timed out after 20 s"}
    assert flag.exists()  # (MPI had started: its files were made)
    assert set(glob.glob("/dev/shm/mpich_shm_*")) - before == set()
