"""The micro benchmark suite runs end to end and reports every figure.

Only the shape of the report is checked: whether the bars pass is a matter
for benchmarks on a quiet machine, not for tests.
"""

import json
import math

import psutil
import pytest

import macroflow.bench as bench
from macroflow.bench import micro

POSITIVE_TABLE1 = [
    "message_new_delete_us", "message_transport_us", "message_send_us", "rsr_send_us",
    "bandwidth_mb_s", "bandwidth_roundtrip_us", "computation_instance_us", "future_construct_us",
    "chain100_issue_us", "slots_insert_us", "slots_lookup_us", "object_instantiation_us",
    "object_destruction_us", "null_rpc_persistent_us", "guarded_null_rpc_us",
    "pipelined_persistent_us", "null_rpc_regular_default_us", "null_rpc_regular_pinned_us",
    "pipelined_regular_default_us", "pipelined_regular_pinned_us", "chain_per_link_us",
    "startup_first_answer_s", "startup_total_s", "idle_rss_mb", "idle_rss_fresh_mb", "idle_uss_fresh_mb",
]
# differences of two measured times: noise may make them negative
FINITE_TABLE1 = ["block_predicate_us", "add_arc_us", "issue_bookkeeping_us", "total_overhead_us"]


def _positive(x):
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.mark.timeout(300)
def test_quick_micro_suite_writes_every_figure(tmp_path, capsys):
    out = tmp_path / "micro.json"
    assert bench.main("micro", json_path=str(out), quick=True) == 0
    printed = capsys.readouterr().out
    for title in ("Table I", "Table II", "METG", "Bars"):
        assert title in printed

    res = json.loads(out.read_text())
    for section in ("meta", "baselines", "table1", "flops", "table2", "metg", "bars", "peers", "rounds"):
        assert section in res
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
    assert len(res["bars"]) >= 8
    for b in res["bars"]:
        assert isinstance(b["pass"], bool) and _positive(b["ratio"]), b["bar"]
    assert _positive(res["peers"]["ray_null_actor_call_us"])
    assert psutil.Process().children(recursive=True) == []


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
