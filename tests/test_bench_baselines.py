import importlib.util
import pathlib
import pickle
import socket
import struct
import threading
import time

import psutil
import pytest
from common import our_processes

# Loaded by path so the test does not depend on the rest of the package existing.
_PATH = pathlib.Path(__file__).resolve().parents[1] / "src" / "macroflow" / "bench" / "baselines.py"
_spec = importlib.util.spec_from_file_location("_macroflow_bench_baselines", _PATH)
baselines = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(baselines)


def assert_no_children():
    # A zombie would still be listed, so this also proves every child was reaped.
    assert our_processes(zombies=True) == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", baselines.MODES)
def test_pingpong_modes(mode):
    r = baselines.pingpong(mode, iters=200, warmup=20)
    assert r["mode"] == mode and r["iters"] == 200
    for key in ("median_us", "mean_us", "p10_us", "p90_us"):
        assert isinstance(r[key], float) and r[key] > 0
    assert r["p10_us"] <= r["median_us"] <= r["p90_us"]
    assert_no_children()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", baselines.MODES)
def test_pingpong_large_payload_partial_reads(mode):
    # Bigger than the 64 KiB read buffer and the socket buffer: forces partial
    # sends, partial reads and buffer growth on both ends.
    r = baselines.pingpong(mode, iters=20, warmup=2, payload=b"x" * 600_000)
    assert r["median_us"] > 0
    assert_no_children()


@pytest.mark.timeout(60)
def test_pingpong_rejects_unknown_mode():
    with pytest.raises(ValueError):
        baselines.pingpong("spin-forever", iters=1)
    assert_no_children()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", baselines.MODES)
def test_conn_reassembles_dripped_and_coalesced_frames(mode):
    a, b = socket.socketpair()
    try:
        tx, rx = baselines._Conn(a, "blocking"), baselines._Conn(b, mode)
        tx.send(("one", 1))
        tx.send(("two", 2))  # two frames likely arrive in a single recv
        assert rx.recv() == ("one", 1)
        assert rx.recv() == ("two", 2)

        body = pickle.dumps(("three", b"y" * 100_000), protocol=5)
        frame = struct.pack("<Q", len(body)) + body

        def drip():
            for i in range(0, len(frame), 30_001):
                a.sendall(frame[i:i + 30_001])
                time.sleep(0.002)
            a.sendall(frame[:3])  # header split across reads
            time.sleep(0.002)
            a.sendall(frame[3:])

        t = threading.Thread(target=drip)
        t.start()
        assert rx.recv() == ("three", b"y" * 100_000)
        assert rx.recv() == ("three", b"y" * 100_000)
        t.join()
    finally:
        a.close()
        b.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("nbytes", [2**20, 1_000_003])
def test_bandwidth(nbytes):
    r = baselines.bandwidth(nbytes, iters=5, warmup=1)
    assert r["nbytes"] == nbytes
    assert r["verified"] == 1.0
    assert r["median_us"] > 0 and r["mb_per_s"] > 0
    assert r["mb_per_s"] == pytest.approx(2 * nbytes / r["median_us"])
    assert_no_children()


@pytest.mark.timeout(60)
def test_bandwidth_integrity_check_detects_corruption(capfd):
    # The child compares the first arrival with its pre-fork copy, so a byte
    # flipped in the parent after fork must fail the run.
    with pytest.raises(RuntimeError, match="exited"):
        baselines.bandwidth(2**20, iters=2, warmup=0, _corrupt_for_test=True)
    assert "child received corrupted data" in capfd.readouterr().err
    assert_no_children()


@pytest.mark.timeout(60)
def test_fork_roundtrip_startup():
    r = baselines.fork_roundtrip_startup()
    assert r["runs"] == 5
    assert 0 < r["min_us"] <= r["median_us"] <= r["max_us"]
    assert_no_children()


@pytest.mark.timeout(60)
def test_child_killed_when_parent_side_fails():
    def child(sock):
        time.sleep(60)

    with pytest.raises(KeyError):
        with baselines._forked(child) as (sock, _):
            pid, = [p.pid for p in our_processes(zombies=True)]
            raise KeyError("parent-side failure")
    assert not psutil.pid_exists(pid)
    assert_no_children()


@pytest.mark.timeout(60)
def test_mailbox_round_trip():
    r = baselines.mailbox(iters=300, warmup=30)
    assert r["mode"] == "mailbox" and r["iters"] == 300
    assert 0 < r["p10_us"] <= r["median_us"] <= r["p90_us"]
    assert_no_children()


@pytest.mark.timeout(60)
def test_a_mailbox_reader_stops_spinning_when_the_other_end_ends():
    import mmap
    mm = mmap.mmap(-1, 2 * baselines._BOX)

    def child(sock):
        baselines._Mailbox(mm, 0, sock)  # ends without ever writing

    with pytest.raises(EOFError, match="other end of the mailbox ended"):
        with baselines._forked(child) as (sock, _):
            baselines._Mailbox(mm, 0, sock).take()
    assert_no_children()


@pytest.mark.timeout(60)
def test_a_frame_larger_than_the_mailbox_is_refused():
    import mmap
    a, b = socket.socketpair()
    box = baselines._Mailbox(mmap.mmap(-1, baselines._BOX), 0, a)
    with pytest.raises(ValueError, match="does not fit"):
        box.put(b"x" * baselines._BOX)
    a.close()
    b.close()


@pytest.mark.timeout(120)
def test_quick_baselines_are_a_smoke_run(tmp_path, capsys):
    # (--quick ran the full baselines: 2000 round trips a mode, a 16 MiB array)
    import json
    import macroflow.bench as bench
    out = tmp_path / "b.json"
    assert bench.main("baselines", json_path=str(out), quick=True) == 0
    res = json.loads(out.read_text())
    assert res["quick"] is True
    assert res["bandwidth"]["nbytes"] == 2 ** 20
    assert set(res["pingpong"]) == set(baselines.MODES)
    assert "pingpong busypoll" in capsys.readouterr().out
