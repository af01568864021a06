"""``macroflow bench tulip``: the quick run prints every figure beside the paper's,
judges the bars from the ratios, writes every figure to JSON, and leaves no
process behind. Figures are checked for being measured, not against limits
(that is for a quiet machine)."""

import json
import math

import pytest

from common import our_processes
from conftest import MPI_MISSING
from macroflow import cli
from macroflow.bench import SUITES, tulip


def _positive(x):
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """One quick run through the command line: (exit code, what it printed, the JSON)."""
    out = tmp_path_factory.mktemp("tulip") / "tulip.json"
    capture = pytest.MonkeyPatch()
    import io
    import sys
    buf = io.StringIO()
    capture.setattr(sys, "stdout", buf)
    try:
        code = cli.main(["bench", "tulip", "--quick", "--json", str(out)])
    finally:
        capture.undo()
    return code, buf.getvalue(), json.loads(out.read_text())


@pytest.mark.timeout(240)
def test_the_quick_run_succeeds_and_writes_every_part(quick):
    code, printed, res = quick
    assert code == 0, printed
    assert set(res) == {"meta", "paper", "figure1", "remote_action", "figure2", "figure3", "bars"}
    assert res["meta"]["suite"] == "tulip" and res["meta"]["quick"] is True
    assert res["meta"]["config"]["name"] == "quick"
    assert res["paper"]["figures"]["ra_sp2_us"] == 165.0
    assert "\nwrote " in printed
    assert our_processes() == []  # (MPI's process manager, started by an earlier test, stays)


def test_figure_1_has_every_row_and_size_and_the_paper_beside_it(quick):
    _, printed, res = quick
    f1 = res["figure1"]
    assert [s["bytes"] for s in f1["sizes"]] == list(tulip.SIZES)
    assert f1["sizes"][0]["bytes"] == 8 and f1["sizes"][-1]["bytes"] == 2**20
    local = f1["transports"]["local"]
    assert local["status"] == "measured"
    transports = ["local"] + ([] if MPI_MISSING else ["mpi"])
    for name in transports:
        e = f1["transports"][name]
        assert e["status"] == "measured", e
        # the window row only where there is one: mpi, whose Figure 1 runs under mpiexec
        assert set(e["rows"]) == set(tulip.GET_ROWS) - ({"get_win"} if name == "local" else set())
        for row, figs in e["rows"].items():
            assert len(figs) == len(tulip.SIZES)
            assert all(_positive(f["median_us"]) for f in figs), (name, row)
        keys = ["get_shm/copy", "get_vm/copy", "get_shm/two_sided", "get_msg/two_sided"]
        for key in keys + (["get_win/two_sided"] if name == "mpi" else []):
            assert len(e["ratios"][key]) == len(tulip.SIZES)
            assert all(_positive(r) for r in e["ratios"][key]), (name, key)
        assert f"Figure 1 on {name}: mf.get from a context that polls" in printed
    # each local get row was measured in every batch, quick.iters(size) gets each
    for f, s in zip(local["rows"]["get_shm"], tulip.SIZES):
        assert f["n"] == tulip.QUICK.batches * tulip.QUICK.iters(s)
        assert len(f["batch_medians_us"]) == tulip.QUICK.batches
    assert f"paper: {tulip.PAPER['figure1']}" in printed
    if MPI_MISSING:
        assert f1["transports"]["mpi"]["status"] == "not available"
        assert f"Figure 1 on mpi: not available: {f1['transports']['mpi']['reason']}" in printed


def test_the_remote_action_ping_pong_is_beside_the_rsr_one_and_the_paper(quick):
    _, printed, res = quick
    ra = res["remote_action"]
    assert ra["contexts"] == 3 and ra["oversubscribed"] == (3 > res["meta"]["cpus"])
    e = ra["transports"]["local"]
    assert e["status"] == "measured"
    for row in ("ra", "ra_idle", "rsr"):
        assert _positive(e[row]["median_us"])
        assert e[row]["n"] == tulip.QUICK.batches * tulip.QUICK.pingpongs
    assert _positive(e["ratio"]) and _positive(e["ra/ra_idle"])
    assert e["ratio"] == tulip.paired_ratio(e["ra"]["batch_medians_us"],
                                            e["rsr"]["batch_medians_us"])
    assert "RA in barrier, us" in printed and "SP2 165 us, T3D 87.3 us" in printed


def test_figure_2_times_every_count_and_pattern_and_marks_oversubscription(quick):
    _, printed, res = quick
    f2 = res["figure2"]
    assert f2["counts"] == list(tulip.COUNTS) and f2["patterns"] == list(tulip.PATTERNS)
    systems = ["local"] + ([] if MPI_MISSING else ["mpi", "MPI_Barrier"])
    for s in systems:
        assert f2["systems"][s]["status"] == "measured", f2["systems"][s]
        for n in tulip.COUNTS:
            assert all(_positive(f2["us"][s][str(n)][p]) for p in tulip.PATTERNS), (s, n)
    if not MPI_MISSING:
        assert all(_positive(f2["ratios"]["mpi/MPI_Barrier"][str(n)][p])
                   for n in tulip.COUNTS for p in tulip.PATTERNS)
    cpus = res["meta"]["cpus"]
    for n in tulip.COUNTS:
        assert f2["oversubscribed"][str(n)] == (n > cpus)
    if max(tulip.COUNTS) > cpus:
        assert "(oversubscribed)" in printed
    assert f"paper: {tulip.PAPER['figure2']}" in printed


def test_figure_3_times_every_layout_and_count(quick):
    _, printed, res = quick
    f3 = res["figure3"]
    assert f3["status"] == "measured"
    assert f3["layouts"] == ["padded", "packed", "central"]
    for layout in f3["layouts"]:
        assert all(_positive(f3["us"][layout][str(n)]) for n in tulip.COUNTS)
    assert "Figure 3: ShmBarrier between processes" in printed
    assert f"paper: {tulip.PAPER['figure3']}" in printed


def test_every_bar_is_judged_from_its_ratio_and_printed(quick):
    _, printed, res = quick
    bars = res["bars"]
    keys = {(b["key"], b["transport"]) for b in bars}
    want = {("get_shm_1mib", "local"), ("ra_pingpong", "local")}
    if not MPI_MISSING:
        want |= {("get_shm_1mib", "mpi"), ("barrier_mpi", "mpi"),
                 ("ra_pingpong", "mpi")}
    assert keys == want
    for b in bars:
        assert b["pass"] == (b["value"] <= b["limit"])
        verdict = "PASS" if b["pass"] else "FAIL"
        assert f"{verdict}  {b['label']} ({b['transport']}): " in printed
    i = tulip.SIZES.index(2**20)
    local = res["figure1"]["transports"]["local"]
    got = next(b for b in bars if b["key"] == "get_shm_1mib" and b["transport"] == "local")
    assert got["value"] == local["ratios"]["get_shm/copy"][i] and got["limit"] == 1.25
    if not MPI_MISSING:
        f2 = res["figure2"]["ratios"]["mpi/MPI_Barrier"]
        got = next(b for b in bars if b["key"] == "barrier_mpi")
        over = res["figure2"]["oversubscribed"]
        # judged only where every rank has a core of its own
        assert got["value"] == max(f2[str(n)]["synchronised"] for n in tulip.COUNTS
                                   if not over[str(n)])


def test_a_saved_run_prints_as_markdown(quick):
    _, _, res = quick
    md = tulip.markdown(res)
    assert md.startswith("Run: ")
    assert "**Figure 1 on local: mf.get from a context that polls, median**" in md
    assert "| size | get, shared_empty, us |" in md
    assert "**Bars**" in md and ("| PASS |" in md or "| FAIL |" in md)


def test_tulip_is_a_suite_of_the_command():
    assert "tulip" in SUITES
    help_text = cli.build_parser()._subparsers._group_actions[0].choices["bench"].format_help()
    assert "tulip" in help_text


def test_bad_arguments_are_refused_before_anything_runs():
    with pytest.raises(ValueError, match="sizes are numbers of bytes >= 1"):
        tulip.run(sizes=[8, -1])
    with pytest.raises(ValueError, match="counts are numbers of contexts >= 2"):
        tulip.run(counts=[1])
    with pytest.raises(ValueError, match="pattern must be one of synchronised, staggered, late"):
        tulip.barrier_loop(lambda: None, 0, 2, "lockstep", 1, 0.0)
    with pytest.raises(ValueError, match="layout must be one of"):
        tulip.shm_barrier_us("tree", 2, 10, False)
    assert cli.main(["bench", "tulip", "--json", "/nonexistent/dir/out.json"]) == 2


def test_barrier_loop_delays_whom_each_pattern_says_the_same_way_every_time(monkeypatch):
    delays = []
    monkeypatch.setattr(tulip, "_spin_us", delays.append)
    calls = []
    for rank in range(3):
        tulip.barrier_loop(lambda: calls.append(1), rank, 3, "late", 4, 100.0)
    assert delays == [100.0] * 4 and len(calls) == 12  # only the last rank computes first
    delays.clear()
    tulip.barrier_loop(lambda: None, 1, 3, "synchronised", 4, 100.0)
    assert delays == []
    tulip.barrier_loop(lambda: None, 1, 3, "staggered", 4, 100.0, seed=5)
    first, delays[:] = list(delays), []
    tulip.barrier_loop(lambda: None, 1, 3, "staggered", 4, 100.0, seed=5)
    assert delays == first and len(first) == 4 and all(0 <= d <= 100.0 for d in first)
    delays.clear()
    tulip.barrier_loop(lambda: None, 2, 3, "staggered", 4, 100.0, seed=5)
    assert delays != first  # each rank its own delays
