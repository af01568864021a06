"""``macroflow bench micro``: Mentat's Table I and Table II for macroflow, METG, bars.

Every macroflow row is measured on the ``local`` transport (contexts are real
processes joined by socketpairs) next to the hand-coded baselines of
:mod:`macroflow.bench.baselines`, which are measured in the same run: the
suite runs in *rounds*, and each round measures the baselines first and then
macroflow, so a noisy neighbour slows both. Each figure is the median over
rounds of a per-round figure (itself a median of per-iteration samples for
round trips, or a mean over a batch for pipelined and local loops).

What each row is in macroflow (Mentat's definition in brackets, section 4.3):

Communication
  message new/delete     marshal.dumps + marshal.loads of a CALL header
                         [allocate, fill and delete a mentat_message]
  message transport      one way: half the round trip of two remote service
                         requests (mf.rsr, thread="inline") bouncing between
                         context 0 and 1; context 0 waits by running its
                         progress engine until an exported box changes
                         [A->B->A, divided by two]
  message send           issuing one call (p.null(i)) without waiting, mean
                         over a batch [asynchronous send of one byte]
  rsr send               the same for a bare mf.rsr (no future, no call)
  bandwidth              16 MB numpy array to a persistent method that
                         returns it: 2 * bytes / round trip
Dataflow detection
  computation instance   Call(...) + Slot() made and dropped (the callee's record)
  construct a future     Future(...) made and dropped (its release queued)
  issue bookkeeping      message send minus rsr send: what a call costs the
                         caller beyond encoding and sending one frame
  100 actors             caller's time to issue a chain of 100 dependent calls
  add an arc             issuing p.take(f), f a pending future, minus
                         issuing p.take(1) (includes the FORWARD message
                         macroflow sends to f's home)
  slots insert/lookup    Slot() inserted into / looked up in a dict keyed by
                         (context, counter), as engine.slots is [RV_TABLE]
Token management
  block predicate        a call on a guarded method whose guard holds minus
                         the same call unguarded (interleaved, medians)
Scheduling
  object instantiation   Cls.create(on=1) and its first call answered
  object destruction     mf.destroy(handle).result()
Composites
  null RPC persistent    p.null(i).result() in a loop (p on context 1)
  pipelined persistent   1000 calls issued, then mf.gather; per call
  null regular, local    R().null(i).result() with default placement: the
                         instantiation managers keep a sync call on the
                         caller, so it runs on context 0 (no message)
  null regular, remote   R.create(on=1).null(i).result(): pinned to context 1
  pipelined regular      the same two, 1000 issued then gathered
  total overhead         null RPC persistent - 2 x one-way hand-coded
                         busy-poll transport (= - one busy-poll round trip)
Extras
  chain per link         contexts=3, A on 1 and B on 2: x = A.f(x); x = B.f(x)
                         x 50, caller gathers only the last; time / 100
                         (also on 2 contexts, B on context 0)
  chain length           one persistent object on context 1, a chain of N
                         calls each taking the previous call's future
                         (x = A.f(x)), caller waits for the last; time / N
                         at three lengths (100, 1,000, 20,000; quick: 100,
                         500, 2,000) on ``local`` and ``inproc``, once per run
  startup                mf.run(main, contexts=4) until main has the answer
                         of a first call on context 3 (fork included)
  idle context memory    psutil on context 1's pid (asked with a system call)
                         in a minimal program run by a fresh interpreter, and
                         in a context forked from this bench process

MPI (when mpi4py and an mpiexec are installed; the rows are skipped otherwise)
  null RPC persistent    the composite row above on the ``mpi`` transport, in a
                         job of ``mpiexec -n 2`` started by each round (rank 0
                         runs the session, rank 1 hosts the object)
  bandwidth              the 16 MB pass-and-return above, on ``mpi``
  mpi4py Send/Recv       the same array sent to rank 1 and back with mpi4py's
                         own Send/Recv (rank 1 runs a method that echoes it
                         with Recv/Send), same job, same ranks
  mpi4py round trip      a 1-byte Send/Recv ping-pong, same job
  The bars compare the null call on mpi with the null call on local of the same
  round, and the 16 MB figure with mpi4py's.

A warm-up session first pipelines a batch and drops its futures, so that every
round starts from the same process state (the runtime's reused pickler keeps
the memo size of the largest message it has pickled).

Run ``macroflow bench micro [--quick] [--json FILE]``. Other systems doing the
same operations are measured by ``macroflow bench peers`` (:mod:`macroflow.bench.peers`).
"""

from __future__ import annotations

import gc
import json
import math
import os
import platform
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

import macroflow as mf
from macroflow.core import marshal
from macroflow.core.context import CALL, RELEASE, SYSTEM, Call, Slot, current_engine
from macroflow.core.future import CallSite, Future
from macroflow.objects.hosting import PERSISTENT

from . import baselines, cores, progress_printer, write_json

# --------------------------------------------------------------------------- parameters


class Config:
    """How much work each row does; ``FULL`` and ``QUICK`` are the two presets."""

    def __init__(self, name: str, rounds: int, rtt_iters: int, rtt_warmup: int, pipe_calls: int,
                 pipe_batches: int, local_iters: int, create_iters: int, bw_iters: int,
                 chain_reps: int, startup_runs: int, baseline_iters: int,
                 metg_grid_us: List[float], metg_work_s: float, metg_reps: int,
                 bw_bytes: int = 16 * 2**20, bw_warmup: int = 4, chain_links: int = 100,
                 chain_lengths: Tuple[int, ...] = (100, 1000, 20_000)):
        self.name = name
        self.rounds = rounds
        self.rtt_iters = rtt_iters
        self.rtt_warmup = rtt_warmup
        self.pipe_calls = pipe_calls
        self.pipe_batches = pipe_batches
        self.local_iters = local_iters
        self.create_iters = create_iters
        self.bw_iters = bw_iters
        self.chain_reps = chain_reps
        self.startup_runs = startup_runs
        self.baseline_iters = baseline_iters
        self.metg_grid_us = metg_grid_us
        self.metg_work_s = metg_work_s
        self.metg_reps = metg_reps
        self.bw_bytes = bw_bytes
        # round trips of 16 MB before any is timed, the same for macroflow and its
        # baselines: memory first touched copies slowly for a few passes on these
        # machines (16 MB into a new shared mapping: 10.7, 2.4, 1.8, 1.5, 1.4 ms),
        # and a transport's rings and bulk areas are made at its first frames
        self.bw_warmup = bw_warmup
        self.chain_links = chain_links
        self.chain_lengths = chain_lengths

    def as_dict(self) -> Dict[str, Any]:
        return dict(vars(self))


FULL = Config("full", rounds=7, rtt_iters=1500, rtt_warmup=150, pipe_calls=1000, pipe_batches=5,
              local_iters=100_000, create_iters=40, bw_iters=8, chain_reps=15, startup_runs=3,
              baseline_iters=2000,
              metg_grid_us=[10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10_000, 20_000, 50_000,
                            100_000],
              metg_work_s=0.4, metg_reps=3)
QUICK = Config("quick", rounds=3, rtt_iters=300, rtt_warmup=50, pipe_calls=1000, pipe_batches=2,
               local_iters=20_000, create_iters=8, bw_iters=3, chain_reps=4, startup_runs=2,
               baseline_iters=300,
               metg_grid_us=[20, 100, 500, 2000, 10_000, 50_000], metg_work_s=0.08, metg_reps=2,
               chain_lengths=(100, 500, 2000))

# Mentat's Table I (Sun network, Intel Paragon), microseconds unless noted.
MENTAT = {
    "message_new_delete_us": (16, 16),
    "message_transport_us": (1730, 260),
    "message_send_us": (566, 16),
    "bandwidth_mb_s": (0.710, 3.930),
    "computation_instance_us": (21, 15),
    "add_arc_us": (3, 3),
    "future_construct_us": (57, 6),
    "chain100_issue_us": (1684, 910),
    "slots_insert_us": (13, 20),
    "slots_lookup_us": (10, 20),
    "block_predicate_us": (170, 48),
    "object_instantiation_us": (235_800, 621_000),
    "object_destruction_us": (2400, 300),
    "null_rpc_persistent_us": (3960, 1280),
    "pipelined_persistent_us": (775, 413),
    "null_rpc_regular_remote_us": (12_320, 520_800),
    "pipelined_regular_default_us": (2950, 10_210),
    "total_overhead_us": (500, 760),
}
MENTAT_TABLE2 = {"Sun SparcStation 2": (4356, 1823, 30492, 12761),
                 "Intel Paragon": (676, 265, 6760, 2650)}

# --------------------------------------------------------------------------- parallel objects
# Defined at module level: classes travel by reference (this module is
# imported before the contexts are forked).


@mf.persistent
class Echo:
    """The persistent object of the composite rows."""

    def null(self, x):
        return x

    def send_null(self, x):
        return x

    def src(self):
        return 1

    def take(self, x):
        return x

    def echo(self, a):
        return a

    @mf.guard(lambda self: True)
    def gnull(self, x):
        return x


@mf.regular
class Stateless:
    """The regular object of the composite rows."""

    def null(self, x):
        return x

    def where(self):
        return mf.context_id()


@mf.persistent
class Link:
    """One stage of the chain: adds one."""

    def f(self, x):
        return x + 1

    def ping(self):
        return 0


@mf.regular
class Spin:
    """METG's task: busy-wait ``d_us`` microseconds, report where it ran."""

    def spin(self, d_us):
        end = time.perf_counter() + d_us * 1e-6
        while time.perf_counter() < end:
            pass
        return mf.context_id()


RAW_TAG = 99  # mpi4py's own ping-pong: a tag the mpi transport does not use


@mf.persistent
class RawEcho:
    """Context 1's side of mpi4py's own ping-pong on the engine's communicator."""

    def serve(self, nbytes: int, iters: int) -> int:
        from macroflow.transport.mpi import mpi
        MPI = mpi()
        comm = current_engine().transport.comm
        buf = np.empty(nbytes, np.uint8)
        for _ in range(iters):
            comm.Recv([buf, MPI.BYTE], 0, RAW_TAG)
            comm.Send([buf, MPI.BYTE], 0, RAW_TAG)
        return iters

    def serve_pickled(self, iters: int) -> int:
        # the hand-coded RPC of the local baselines: a pickled call, a pickled reply
        comm = current_engine().transport.comm
        for _ in range(iters):
            msg = comm.recv(source=0, tag=RAW_TAG)
            comm.send(("result", msg[1], 1), 0, RAW_TAG)
        return iters


def _rsr_pong(target, g0, i):  # inline on context 1
    mf.rsr(g0, _rsr_arrive, i)


def _rsr_arrive(box, i):  # inline on context 0
    box[0] = i


def _rsr_noop(target, i):
    pass


# --------------------------------------------------------------------------- helpers

_ns = time.perf_counter_ns


def _median(xs) -> float:
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return float(statistics.median(xs)) if xs else float("nan")


def _sync_us(fn: Callable[[int], Any], iters: int, warmup: int) -> float:
    """Median of per-iteration times of ``fn(i)``, in microseconds."""
    for i in range(warmup):
        fn(i)
    samples = []
    for i in range(iters):
        t0 = _ns()
        fn(i)
        samples.append(_ns() - t0)
    return _median(samples) / 1e3


def _empty_loop_ns(n: int) -> float:
    t0 = _ns()
    for _ in range(n):
        pass
    return (_ns() - t0) / n


def _local_us(body: Callable[[int], None], n: int) -> float:
    """Mean cost of a local loop body, the empty loop's cost taken off (microseconds)."""
    body(min(n, 1000))  # warm up
    gc.collect()
    t0 = _ns()
    body(n)
    per = (_ns() - t0) / n
    return max(0.0, per - _empty_loop_ns(n)) / 1e3


def _system_call(method: str, ctx: int, *args: Any) -> Any:
    eng = current_engine()
    return eng.issue(SYSTEM, method, method, args, {}, ctx, site=CallSite(method), pinned=True).result(30)


# --------------------------------------------------------------------------- local rows


def _local_rows(n: int) -> Dict[str, float]:
    eng = current_engine()
    out: Dict[str, float] = {}
    header = (CALL, (0, 123456), PERSISTENT, ((0, 7),), "null", (1,), {}, None, 4, 0)
    loads = marshal.loads

    def msg_with(enc):
        def msg(k):
            dumps = enc.dumps
            for _ in range(k):
                data, bufs = dumps(header)
                loads(data, bufs)
        return msg
    # A fresh encoder, and one that has once pickled the RELEASE of 1000
    # futures dropped at once (as after mf.gather of a 1000-call batch):
    # the reused pickler's memo table keeps its largest size.
    out["message_new_delete_us"] = _local_us(msg_with(marshal._Encoder()), n)
    used = marshal._Encoder()
    used.dumps((RELEASE, [(0, i) for i in range(1000)]))
    out["message_new_delete_after_release_us"] = _local_us(msg_with(used), n)

    def instance(k):
        fid = (1, 99)
        for _ in range(k):
            Call(fid, PERSISTENT, ((0, 7),), "null", (1,), {}, None, 4, 1)
            Slot()
    out["computation_instance_us"] = _local_us(instance, n)

    site = CallSite("bench.future")
    seq = iter(range(1 << 62))

    def future(k):
        for _ in range(k):
            # a future of a call issued by another context: dropping it queues
            # no release here (releases are part of every call row instead)
            Future(eng, (-1, next(seq)), 1, None, site)
    out["future_construct_us"] = _local_us(future, n)

    keys = [(0, i) for i in range(n)]
    holder: List[Dict[Any, Slot]] = []

    def insert(k):
        d: Dict[Any, Slot] = {}
        for key in keys[:k]:
            d[key] = Slot()
        holder[:] = [d]
    out["slots_insert_us"] = _local_us(insert, n)
    table = holder[0]

    def lookup(k):
        get = table.get
        for key in keys[:k]:
            get(key)
    out["slots_lookup_us"] = _local_us(lookup, n)
    return out


def _flop_rates() -> Dict[str, float]:
    """Floating-point rate of this machine: a pure-Python loop and a numpy matmul."""
    def py(n):
        x, a, b = 0.0, 0.999999, 1e-6
        for _ in range(n):
            x = x * a + b  # two flops
        return x
    n = 2_000_000
    py(10_000)
    samples = []
    for _ in range(3):
        t0 = time.perf_counter()
        py(n)
        samples.append(time.perf_counter() - t0)
    py_rate = 2 * n / min(samples)
    m = 384
    a = np.random.default_rng(0).random((m, m))
    a @ a
    samples = []
    for _ in range(5):
        t0 = time.perf_counter()
        a @ a
        samples.append(time.perf_counter() - t0)
    np_rate = 2 * m**3 / min(samples)
    return {"python_flops": py_rate, "numpy_flops": np_rate}


# --------------------------------------------------------------------------- two-context rows


def _pipelined_us(issue: Callable[[int], Any], calls: int, batches: int) -> float:
    per = []
    for _ in range(batches):
        gc.collect()
        t0 = _ns()
        fs = [issue(i) for i in range(calls)]
        mf.gather(fs)
        per.append((_ns() - t0) / calls / 1e3)
    return _median(per)


def _issue_only_us(issue: Callable[[int], Any], calls: int, batches: int,
                   drain: Callable[[Any], Any]) -> float:
    per = []
    for _ in range(batches):
        gc.collect()
        t0 = _ns()
        fs = [issue(i) for i in range(calls)]
        per.append((_ns() - t0) / calls / 1e3)
        drain(fs)
        del fs
    return _median(per)


def _session_main(cfg: Config) -> Dict[str, Any]:
    """Context 0 of a two-context computation: every row that needs one remote context."""
    eng = current_engine()
    out: Dict[str, Any] = {}
    n, w = cfg.rtt_iters, cfg.rtt_warmup

    # idle context: asked first, before this context has done any work
    pid = _system_call("pid", 1)
    try:
        import psutil
        proc = psutil.Process(pid)
        out["idle_rss_mb"] = proc.memory_info().rss / 2**20
        try:
            full = proc.memory_full_info()
            out["idle_uss_mb"] = full.uss / 2**20
            if hasattr(full, "pss"):
                out["idle_pss_mb"] = full.pss / 2**20
        except Exception:
            pass
    except ImportError:
        pass

    out.update(_local_rows(cfg.local_iters))

    p = Echo.create(on=1)
    mf.info(p).created.result(30)
    p.null(0).result(30)

    # message transport: two RSRs bouncing between context 0 and 1
    box = [-1]
    g0 = mf.export(box)
    g1 = mf.info(p).gptr
    drive = eng.driver.run_until
    rsr = mf.rsr

    def bounce(i):
        rsr(g1, _rsr_pong, g0, i)
        drive(lambda: box[0] == i)
    out["message_transport_us"] = _sync_us(bounce, n, w) / 2
    mf.unexport(g0)

    # composites: sync null calls
    out["null_rpc_persistent_us"] = _sync_us(lambda i: p.null(i).result(), n, w)

    # block predicate: guarded vs unguarded, interleaved so drift hits both
    plain, guarded = [], []
    for i in range(w + n):
        plain_first = bool(i % 2)
        first, second = (p.null, p.gnull) if plain_first else (p.gnull, p.null)
        t0 = _ns()
        first(i).result()
        t1 = _ns()
        second(i).result()
        t2 = _ns()
        if i >= w:
            a, b = t1 - t0, t2 - t1
            plain.append(a if plain_first else b)
            guarded.append(b if plain_first else a)
    out["block_predicate_us"] = (_median(guarded) - _median(plain)) / 1e3
    out["guarded_null_rpc_us"] = _median(guarded) / 1e3

    r_default = Stateless()
    r_pinned = Stateless.create(on=1)
    out["null_rpc_regular_local_us"] = _sync_us(lambda i: r_default.null(i).result(), n, w)
    out["null_rpc_regular_remote_us"] = _sync_us(lambda i: r_pinned.null(i).result(), n, w)
    where = mf.gather([r_default.where() for _ in range(20)])
    out["regular_default_ran_on"] = {str(c): where.count(c) for c in sorted(set(where))}
    where = []
    for _ in range(20):
        where.append(r_default.where().result())
    out["regular_default_sync_ran_on"] = {str(c): where.count(c) for c in sorted(set(where))}
    where = [r_pinned.where().result() for _ in range(5)]
    out["regular_remote_sync_ran_on"] = {str(c): where.count(c) for c in sorted(set(where))}

    # pipelined
    calls, batches = cfg.pipe_calls, cfg.pipe_batches
    out["pipelined_persistent_us"] = _pipelined_us(p.null, calls, batches)
    out["pipelined_regular_default_us"] = _pipelined_us(r_default.null, calls, batches)
    out["pipelined_regular_pinned_us"] = _pipelined_us(r_pinned.null, calls, batches)

    # message send: issue without waiting; and a bare rsr send
    out["message_send_us"] = _issue_only_us(p.send_null, calls, batches, mf.gather)

    def drain_rsr(_):
        p.null(0).result()  # the socket is FIFO: the rsrs have been served
    out["rsr_send_us"] = _issue_only_us(lambda i: rsr(g1, _rsr_noop, i), calls, batches, drain_rsr)
    out["issue_bookkeeping_us"] = out["message_send_us"] - out["rsr_send_us"]

    # add an arc: issuing a call with a pending future argument vs a plain value
    # (batches of calls // 2, so that no more than ~1000 futures are dropped at once)
    half = max(1, calls // 2)
    diffs = []
    for b in range(batches * 2):
        srcs = [p.src() for _ in range(half)]  # never asked for: stay pending here
        p.null(0).result()
        gc.collect()
        times = {}
        futs = []
        for with_arc in ((False, True) if b % 2 else (True, False)):
            t0 = _ns()
            if with_arc:
                fs = [p.take(f) for f in srcs]
            else:
                fs = [p.take(1) for _ in srcs]
            times[with_arc] = (_ns() - t0) / half
            futs.append(fs)
        for fs in futs:
            mf.gather(fs)
        diffs.append((times[True] - times[False]) / 1e3)
        del srcs, futs, fs
        p.null(0).result()  # their releases leave now
    out["add_arc_us"] = _median(diffs)

    # the chain on two contexts: A on context 1, B on context 0 (served while main waits)
    out["chain_per_link_2ctx_us"] = _chain(Link.create(on=1), Link.create(on=0), cfg)["chain_per_link_us"]

    # scheduling: instantiation and destruction
    inst, dest = [], []
    for _ in range(cfg.create_iters):
        t0 = _ns()
        h = Echo.create(on=1)
        h.null(0).result()
        t1 = _ns()
        mf.destroy(h).result()
        t2 = _ns()
        inst.append(t1 - t0)
        dest.append(t2 - t1)
    out["object_instantiation_us"] = _median(inst) / 1e3
    out["object_destruction_us"] = _median(dest) / 1e3

    # bandwidth: a 16 MB array passed to a persistent method that returns it
    nbytes = cfg.bw_bytes
    arr = np.random.default_rng(1).integers(0, 256, nbytes, dtype=np.uint8)
    out["bandwidth_roundtrip_us"] = _echo_us(p, arr, cfg, None, "bandwidth")
    out["bandwidth_mb_s"] = 2 * nbytes / out["bandwidth_roundtrip_us"]
    del arr
    return out


def _echo_us(p: Any, arr: np.ndarray, cfg: Config, timeout: Optional[float], what: str) -> float:
    """The median round trip, in us, of ``arr`` to ``p.echo`` and back, after
    ``cfg.bw_warmup`` untimed ones that check it comes back the same."""
    for _ in range(cfg.bw_warmup):
        back = p.echo(arr).result(timeout)
        if not np.array_equal(back, arr):
            raise RuntimeError(f"{what}: the array came back different")
        del back
    samples = []
    for _ in range(cfg.bw_iters):
        t0 = _ns()
        back = p.echo(arr).result(timeout)
        samples.append(_ns() - t0)
        del back
    return _median(samples) / 1e3


def _mpi_session(cfg: Config) -> Dict[str, float]:
    """Context 0 of ``mpiexec -n 2``: the mpi rows, and mpi4py's own figures."""
    from macroflow.transport.mpi import mpi
    MPI = mpi()
    comm = current_engine().transport.comm
    out: Dict[str, float] = {}
    n, w = cfg.rtt_iters, cfg.rtt_warmup
    p = Echo.create(on=1)
    p.null(0).result(30)
    out["mpi_null_rpc_persistent_us"] = _sync_us(lambda i: p.null(i).result(), n, w)
    arr = np.random.default_rng(1).integers(0, 256, cfg.bw_bytes, dtype=np.uint8)
    out["mpi_bandwidth_roundtrip_us"] = _echo_us(p, arr, cfg, 60, "mpi bandwidth")
    out["mpi_bandwidth_mb_s"] = 2 * cfg.bw_bytes / out["mpi_bandwidth_roundtrip_us"]

    # mpi4py's own: context 1 runs a method that echoes with Recv/Send
    raw = RawEcho.create(on=1)
    for nbytes, iters, skip, key in (
            (1, n + w, w, "mpi4py_roundtrip_us"),
            (cfg.bw_bytes, cfg.bw_iters + cfg.bw_warmup, cfg.bw_warmup,
             "mpi4py_bandwidth_roundtrip_us")):
        done = raw.serve(nbytes, iters)
        buf = arr[:nbytes].copy()
        samples = []
        for i in range(iters):
            t0 = _ns()
            comm.Send([buf, MPI.BYTE], 1, RAW_TAG)
            comm.Recv([buf, MPI.BYTE], 1, RAW_TAG)
            samples.append(_ns() - t0)
        done.result(60)
        out[key] = _median(samples[skip:]) / 1e3
    out["mpi4py_bandwidth_mb_s"] = 2 * cfg.bw_bytes / out["mpi4py_bandwidth_roundtrip_us"]
    # mpi4py's pickled send/recv, with the call and reply of the local baselines
    done = raw.serve_pickled(n + w)
    samples = baselines.round_trips(lambda call: comm.send(call, 1, RAW_TAG),
                                    lambda: comm.recv(source=1, tag=RAW_TAG),
                                    baselines.CALL, n + w, w)
    done.result(60)
    out["mpi4py_pickled_roundtrip_us"] = _median(samples) / 1e3
    return out


def _rings_compiled() -> bool:
    """Whether the rings' common steps run compiled here (see transport.ring.COMPILED)."""
    from macroflow.transport import ring
    return ring.COMPILED


def mpi_rows(cfg: Config, timeout: float = 600.0) -> Dict[str, Any]:
    """The MPI rows, measured in a job of ``mpiexec -n 2`` (see the module's notes).

    Returns {"mpi_skipped": reason} where mpi4py or mpiexec is missing.

    Example:
        >>> r = mpi_rows(QUICK)
        >>> "mpi_skipped" in r or r["mpi_null_rpc_persistent_us"] > 0
        True
    """
    import subprocess
    from macroflow.transport.mpi import _find_mpiexec, available
    why = available()
    mpiexec = _find_mpiexec()
    if why is not None or mpiexec is None:
        return {"mpi_skipped": why or "mpiexec not found"}
    cmd = [mpiexec, "-n", "2", sys.executable, "-m", "macroflow.bench.micro", "--mpi-rows", cfg.name]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    for line in r.stdout.splitlines():
        if line.startswith("MPI_ROWS "):
            return json.loads(line[len("MPI_ROWS "):])
    raise RuntimeError(f"the mpi rows failed (exit {r.returncode}):\n{r.stdout}\n{r.stderr}")


def _chain(a: Any, b: Any, cfg: Config) -> Dict[str, float]:
    a.ping().result(30)
    b.ping().result(30)
    links = cfg.chain_links
    per_link, issue = [], []
    for rep in range(cfg.chain_reps + 2):
        gc.collect()
        t0 = _ns()
        x: Any = 0
        for _ in range(links // 2):
            x = a.f(x)
            x = b.f(x)
        t1 = _ns()
        v = x.result(60)
        t2 = _ns()
        if v != links:
            raise RuntimeError(f"chain: got {v}, expected {links}")
        if rep >= 2:
            per_link.append((t2 - t0) / links / 1e3)
            issue.append((t1 - t0) / 1e3)
    return {"chain_per_link_us": _median(per_link), "chain100_issue_us": _median(issue)}


def _chain_main(cfg: Config) -> Dict[str, float]:
    return _chain(Link.create(on=1), Link.create(on=2), cfg)


def _chain_length_main(lengths: Sequence[int]) -> Dict[str, float]:
    """Per-link cost of a chain of each length on one persistent object on context 1."""
    a = Link.create(on=1)
    a.ping().result(60)
    out: Dict[str, float] = {}
    for n in lengths:
        samples = []
        # short chains are cheap enough to repeat; the longest runs once
        for _ in range(max(1, min(5, max(lengths) // n - 1))):
            gc.collect()
            t0 = _ns()
            x: Any = 0
            for _ in range(n):
                x = a.f(x)
            v = x.result(900)
            t1 = _ns()
            if v != n:
                raise RuntimeError(f"chain of {n}: got {v}, expected {n}")
            del x
            samples.append((t1 - t0) / n / 1e3)
        out[str(n)] = _median(samples)
    return out


def chain_length(lengths: Sequence[int], transport: str) -> Dict[str, Any]:
    """Per-link cost (us) of a chain of dependent calls at each length, and longest / shortest.

    Each call ``x = A.f(x)`` takes the previous call's future; ``A`` is one
    persistent object on context 1 of a 2-context run; the caller waits only
    for the last link.

    Example:
        >>> r = chain_length([10, 40], "inproc")
        >>> sorted(r["per_link_us"]), r["ratio"] == r["per_link_us"]["40"] / r["per_link_us"]["10"]
        (['10', '40'], True)
    """
    lengths = sorted(lengths)
    per = mf.run(_chain_length_main, lengths, contexts=2, transport=transport)
    return {"lengths": lengths, "per_link_us": per,
            "ratio": per[str(lengths[-1])] / per[str(lengths[0])]}


def _warm_main(calls: int) -> None:
    p = Echo.create(on=1)
    fs = [p.null(i) for i in range(calls)]
    mf.gather(fs)
    del fs
    p.null(0).result()


_IDLE_PROGRAM = r"""
import json, time
import psutil
import macroflow as mf
from macroflow.core.context import SYSTEM, current_engine
from macroflow.core.future import CallSite

def main():
    pid = current_engine().issue(SYSTEM, "pid", "pid", (), {}, 1, site=CallSite("pid"),
                                 pinned=True).result(30)
    time.sleep(0.05)  # idle
    p = psutil.Process(pid)
    full = p.memory_full_info()
    return {"rss": p.memory_info().rss, "uss": full.uss, "pss": getattr(full, "pss", 0)}

print(json.dumps(mf.run(main, contexts=2)))
"""


def _idle_fresh(runs: int) -> Dict[str, float]:
    """Idle context memory of a minimal program (a fresh interpreter running
    mf.run(main, contexts=2)), not of contexts forked from this bench process."""
    import subprocess
    rss, uss, pss = [], [], []
    for _ in range(runs):
        try:
            r = subprocess.run([sys.executable, "-c", _IDLE_PROGRAM], capture_output=True, text=True,
                               timeout=60)
            d = json.loads(r.stdout.strip().splitlines()[-1])
        except Exception:
            continue
        rss.append(d["rss"] / 2**20)
        uss.append(d["uss"] / 2**20)
        pss.append(d["pss"] / 2**20)
    return {"idle_rss_fresh_mb": _median(rss), "idle_uss_fresh_mb": _median(uss),
            "idle_pss_fresh_mb": _median(pss)}


def _startup_main() -> float:
    Stateless.create(on=3).null(1).result(30)
    return time.perf_counter()


def _startup(runs: int) -> Dict[str, float]:
    first, total = [], []
    for _ in range(runs):
        gc.collect()
        t0 = time.perf_counter()
        t1 = mf.run(_startup_main, contexts=4)
        t2 = time.perf_counter()
        first.append(t1 - t0)
        total.append(t2 - t0)
    return {"startup_first_answer_s": _median(first), "startup_total_s": _median(total)}


# --------------------------------------------------------------------------- METG


def _metg_main(cfg: Config) -> List[Dict[str, Any]]:
    s = Spin()
    mf.gather([s.spin(1) for _ in range(20)])  # warm up both contexts
    curve = []
    for d in cfg.metg_grid_us:
        n = int(round(cfg.metg_work_s * 1e6 / d))
        n = max(8, min(4000, n + (n % 2)))
        effs, walls, where = [], [], {}
        for _ in range(cfg.metg_reps):
            gc.collect()
            t0 = time.perf_counter()
            ran = mf.gather([s.spin(d) for _ in range(n)])
            wall = time.perf_counter() - t0
            walls.append(wall)
            effs.append(n * d * 1e-6 / (wall * 2))
            for c in ran:
                where[str(c)] = where.get(str(c), 0) + 1
        curve.append({"task_us": float(d), "n_tasks": n, "efficiency": _median(effs),
                      "wall_s": _median(walls), "ran_on": where})
    return curve


def metg_from_curve(curve: List[Dict[str, Any]], level: float = 0.5) -> Dict[str, Optional[float]]:
    """Smallest task duration from which every larger one reaches ``level`` efficiency.

    Also a log-linear interpolation between that grid point and the next smaller one.

    Example:
        >>> c = [{"task_us": 10, "efficiency": 0.2}, {"task_us": 100, "efficiency": 0.6},
        ...      {"task_us": 1000, "efficiency": 0.9}]
        >>> r = metg_from_curve(c); r["metg_grid_us"], round(r["metg_us"])
        (100, 56)
    """
    pts = sorted(curve, key=lambda p: p["task_us"])
    idx = None
    for i in range(len(pts) - 1, -1, -1):
        if pts[i]["efficiency"] >= level:
            idx = i
        else:
            break
    if idx is None:
        return {"metg_grid_us": None, "metg_us": None}
    grid = pts[idx]["task_us"]
    est = float(grid)
    if idx > 0:
        lo, hi = pts[idx - 1], pts[idx]
        e0, e1 = lo["efficiency"], hi["efficiency"]
        if e1 > e0:
            frac = (level - e0) / (e1 - e0)
            est = math.exp(math.log(lo["task_us"]) + frac * (math.log(hi["task_us"]) - math.log(lo["task_us"])))
    return {"metg_grid_us": grid, "metg_us": est}


# --------------------------------------------------------------------------- the suite


def _round(cfg: Config) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for mode in baselines.MODES:
        r = baselines.pingpong(mode, iters=cfg.baseline_iters, warmup=max(20, cfg.baseline_iters // 10))
        out[f"pingpong_{mode}_us"] = r["median_us"]
    r = baselines.mailbox(iters=cfg.baseline_iters, warmup=max(20, cfg.baseline_iters // 10))
    out["pingpong_mailbox_us"] = r["median_us"]
    out.update(mf.run(_session_main, cfg, contexts=2))
    out.update(mf.run(_chain_main, cfg, contexts=3))
    out.update(mpi_rows(cfg))
    bw = baselines.bandwidth(cfg.bw_bytes, iters=cfg.bw_iters, warmup=cfg.bw_warmup)
    out["baseline_bandwidth_mb_s"] = bw["mb_per_s"]
    out.update(_startup(cfg.startup_runs))
    out.update(_idle_fresh(1))
    out["fork_first_reply_us"] = baselines.fork_roundtrip_startup(runs=cfg.startup_runs)["median_us"]
    # null RPC - 2 x hand-coded one-way busy-poll transport, within the round
    out["total_overhead_us"] = out["null_rpc_persistent_us"] - out["pingpong_busypoll_us"]
    out["loadavg_1min"] = os.getloadavg()[0]
    return out


BASELINE_KEYS = ("pingpong_blocking_us", "pingpong_busypoll_us", "pingpong_pollsleep_us",
                 "pingpong_mailbox_us", "baseline_bandwidth_mb_s", "fork_first_reply_us")
DIFFERENCE_KEYS = ("block_predicate_us", "add_arc_us", "issue_bookkeeping_us", "total_overhead_us")


def table2(ms: float, mt: float, bp: float, rates: Dict[str, float]) -> Dict[str, Dict[str, float]]:
    """Mentat's minimum granularity FT = ((k-1) MS + 2 (MT + BP)) / (k-1), in us and flops.

    Example:
        >>> t = table2(556, 1730, 170, {"python_flops": 7e6, "numpy_flops": 7e6})
        >>> round(t["k=2"]["ft_us"]), round(t["k=2"]["ft_python_flops"]), round(t["k=4"]["ft_us"])
        (4356, 30492, 1823)
    """
    out = {}
    for k in (2, 4):
        ft = ((k - 1) * ms + 2 * (mt + bp)) / (k - 1)
        out[f"k={k}"] = {"ft_us": ft, "ft_python_flops": ft * 1e-6 * rates["python_flops"],
                         "ft_numpy_flops": ft * 1e-6 * rates["numpy_flops"]}
    return out


def bars(t1: Dict[str, float], base: Dict[str, float],
         rounds: Optional[List[Dict[str, Any]]] = None,
         metg: Optional[Dict[str, Any]] = None) -> List[Dict[str, Any]]:
    """The performance bars, each with its measured ratio and PASS/FAIL.

    ``value`` and ``reference`` are medians over rounds; ``ratio`` is the median
    over rounds of each round's own ratio (both sides measured minutes apart at
    most), which is what a noisy shared machine lets us compare.
    """
    rounds = rounds or []
    out = []

    def ratio_of(num: str, den: str, invert: bool = False) -> float:
        rs = []
        for rd in rounds:
            a, b = rd.get(num), rd.get(den)
            if isinstance(a, (int, float)) and isinstance(b, (int, float)) and a > 0 and b > 0:
                rs.append(b / a if invert else a / b)
        if rs:
            return _median(rs)
        a, b = t1.get(num, base.get(num)), t1.get(den, base.get(den))
        return (b / a) if invert else (a / b)

    def bar(name, value, ref, ratio, limit, op, note="", counted=True):
        passed = ratio <= limit if op == "<=" else ratio < limit if op == "<" else ratio >= limit
        out.append({"bar": name, "value": value, "reference": ref, "ratio": ratio, "limit": limit,
                    "op": op, "pass": bool(passed), "note": note, "counted": counted})

    busy, block = base["pingpong_busypoll_us"], base["pingpong_blocking_us"]
    bar("null persistent call <= 1.5x hand-coded busy-poll round trip", t1["null_rpc_persistent_us"],
        busy, ratio_of("null_rpc_persistent_us", "pingpong_busypoll_us"), 1.5, "<=", "us")
    if "pingpong_mailbox_us" in base:
        bar("null persistent call <= 2.5x hand-coded shared-memory mailbox round trip",
            t1["null_rpc_persistent_us"], base["pingpong_mailbox_us"],
            ratio_of("null_rpc_persistent_us", "pingpong_mailbox_us"), 2.5, "<=", "us")
    bar("null persistent call < hand-coded blocking round trip", t1["null_rpc_persistent_us"], block,
        ratio_of("null_rpc_persistent_us", "pingpong_blocking_us"), 1.0, "<", "us")
    sync, pipe = t1["null_rpc_persistent_us"], t1["pipelined_persistent_us"]
    bar("pipelined null call rate >= 2x sync call rate", 1e6 / pipe, 1e6 / sync,
        ratio_of("pipelined_persistent_us", "null_rpc_persistent_us", invert=True), 2.0, ">=",
        "calls/s")
    bar("pipelined null call, per call <= 0.5x busy-poll round trip", pipe, busy,
        ratio_of("pipelined_persistent_us", "pingpong_busypoll_us"), 0.5, "<=", "us")
    where = t1.get("regular_remote_sync_ran_on", {})
    bar("null regular call, remote (create(on=1)) <= 2x busy-poll round trip",
        t1["null_rpc_regular_remote_us"], busy,
        ratio_of("null_rpc_regular_remote_us", "pingpong_busypoll_us"), 2.0, "<=",
        f"us; ran on contexts {where}" if where else "us")
    where = t1.get("regular_default_sync_ran_on", {})
    bar("(reference) null regular call, default placement: a local call vs busy-poll round trip",
        t1["null_rpc_regular_local_us"], busy,
        ratio_of("null_rpc_regular_local_us", "pingpong_busypoll_us"), 3.0, "<=",
        f"us; reported, not a bar: no message is sent; ran on contexts {where}", counted=False)
    n = cores()
    bar("chain per link <= 1.5x busy-poll round trip", t1["chain_per_link_us"], busy,
        ratio_of("chain_per_link_us", "pingpong_busypoll_us"), 1.5, "<=",
        f"us; 3 contexts on {n} cores: oversubscribed" if n < 3 else "us")
    bar("16 MB pass-and-return >= 80% of hand-coded out-of-band socket bandwidth", t1["bandwidth_mb_s"],
        base["baseline_bandwidth_mb_s"], ratio_of("bandwidth_mb_s", "baseline_bandwidth_mb_s"), 0.8, ">=",
        "MB/s")
    for tr, cl in (t1.get("chain_length") or {}).items():
        short, long_ = str(cl["lengths"][0]), str(cl["lengths"][-1])
        bar(f"chain on one object ({tr}): per link at {int(long_):,} links <= 1.3x at {int(short):,}",
            cl["per_link_us"][long_], cl["per_link_us"][short], cl["ratio"], 1.3, "<=",
            "us per link; measured once per run")
    if "mpi_null_rpc_persistent_us" in t1:
        bar("null persistent call on mpi (mpiexec -n 2) <= the same on local",
            t1["mpi_null_rpc_persistent_us"], t1["null_rpc_persistent_us"],
            ratio_of("mpi_null_rpc_persistent_us", "null_rpc_persistent_us"), 1.0, "<=", "us")
        if "mpi4py_pickled_roundtrip_us" in t1:
            bar("null persistent call on mpi <= 3x mpi4py's pickled send/recv round trip",
                t1["mpi_null_rpc_persistent_us"], t1["mpi4py_pickled_roundtrip_us"],
                ratio_of("mpi_null_rpc_persistent_us", "mpi4py_pickled_roundtrip_us"), 3.0, "<=",
                "us")
        bar("16 MB pass-and-return on mpi >= 70% of mpi4py's own Send/Recv", t1["mpi_bandwidth_mb_s"],
            t1["mpi4py_bandwidth_mb_s"], ratio_of("mpi_bandwidth_mb_s", "mpi4py_bandwidth_mb_s"), 0.7,
            ">=", "MB/s")
    if metg is not None:
        v = metg.get("metg_us")
        v = float("inf") if v is None else v  # not reached on the grid
        bar("METG(50%) on 2 contexts < 40 us", v, 40.0, v / 40.0, 1.0, "<", "us")
    v = t1["startup_first_answer_s"]
    bar("mf.run with 4 contexts to first answer < 0.5 s", v, 0.5, v / 0.5, 1.0, "<", "seconds")
    v = t1.get("idle_rss_fresh_mb", float("nan"))
    bar("idle context < 50 MB RSS", v, 50.0, v / 50.0, 1.0, "<",
        f"MB, minimal program; USS {t1.get('idle_uss_fresh_mb', float('nan')):.1f} MB; "
        f"forked from the bench process: RSS {t1.get('idle_rss_mb', float('nan')):.1f} MB")
    return out


def run(quick: bool = False, progress: Callable[[str], None] = lambda s: None) -> Dict[str, Any]:
    """Measure everything; return the figures as one JSON-able dict."""
    cfg = QUICK if quick else FULL
    started = time.perf_counter()
    # Warm-up: one session that pipelines a batch and drops its futures, so that
    # every round (not just the first) starts from the same state of this
    # process, which the contexts of later sessions are forked from.
    mf.run(_warm_main, cfg.pipe_calls, contexts=2)
    rounds: List[Dict[str, Any]] = []
    for r in range(cfg.rounds):
        progress(f"round {r + 1}/{cfg.rounds}")
        rounds.append(_round(cfg))
    numeric = sorted({k for rd in rounds for k, v in rd.items() if isinstance(v, (int, float))})
    med = {k: _median([rd.get(k) for rd in rounds]) for k in numeric}
    base = {k: med[k] for k in BASELINE_KEYS}
    t1 = {k: v for k, v in med.items() if k not in BASELINE_KEYS and k != "loadavg_1min"}
    mpi_skipped = rounds[-1].get("mpi_skipped")
    for k in ("regular_default_ran_on", "regular_default_sync_ran_on", "regular_remote_sync_ran_on"):
        t1[k] = rounds[-1].get(k, {})
    for mode in baselines.MODES:
        base[f"oneway_{mode}_us"] = base[f"pingpong_{mode}_us"] / 2

    progress("flop rate")
    rates = _flop_rates()
    ms, mt, bp = t1["message_send_us"], t1["message_transport_us"], max(0.0, t1["block_predicate_us"])
    t2 = table2(ms, mt, bp, rates)
    t2_hand = table2(0.0, base["oneway_busypoll_us"], 0.0, rates)

    progress("METG")
    curve = mf.run(_metg_main, cfg, contexts=2)
    metg = metg_from_curve(curve)

    t1["chain_length"] = {}
    for tr in ("local", "inproc"):
        progress(f"chain length ({tr}: {', '.join(str(n) for n in cfg.chain_lengths)} links)")
        t1["chain_length"][tr] = chain_length(cfg.chain_lengths, tr)

    result = {
        "meta": {"suite": "micro", "quick": quick, "config": cfg.as_dict(),
                 "python": platform.python_version(), "platform": platform.platform(),
                 "cpus": os.cpu_count(), "numpy": np.__version__, "macroflow": mf.__version__,
                 "transport": "local",
                 "mpi": mpi_skipped or "mpiexec -n 2, in each round",
                 "spin_us": float(os.environ.get("MACROFLOW_SPIN_US") or 50.0),
                 "rings_compiled": _rings_compiled(),
                 "time": time.strftime("%Y-%m-%d %H:%M:%S"),
                 "loadavg_1min_per_round": [rd.get("loadavg_1min") for rd in rounds],
                 "statistic": "median over rounds of per-round medians (round trips) or means "
                              "(pipelined and local loops)"},
        "baselines": base,
        "table1": t1,
        "flops": rates,
        "table2": {"inputs_us": {"MS": ms, "MT": mt, "BP": bp}, "macroflow": t2,
                   "hand_coded_busypoll": t2_hand,
                   "formula": "FT = ((k-1)*MS + 2*(MT+BP)) / (k-1)"},
        "metg": {"level": 0.5, **metg, "curve": curve,
                 "definition": "efficiency = n_tasks * d / (wall * 2) on mf.run(contexts=2), "
                               "tasks Spin().spin(d) busy-wait d us, default placement"},
        "rounds": rounds,
    }
    result["bars"] = bars(t1, base, rounds, metg)
    result["meta"]["elapsed_s"] = time.perf_counter() - started
    return result


# --------------------------------------------------------------------------- printing

TABLE1_ROWS: List[Tuple[str, str, str, Optional[str], str]] = [
    # (category, label, key, hand-coded key, what macroflow measures)
    ("Communication", "New and delete a message", "message_new_delete_us", None,
     "marshal.dumps+loads of a CALL header"),
    ("", "  after a 1000-future release", "message_new_delete_after_release_us", None,
     "same, encoder that once pickled RELEASE of 1000 fids"),
    ("", "Message transport (one way)", "message_transport_us", "oneway_busypoll_us",
     "rsr ping-pong 0<->1 / 2; hand: busy-poll RTT / 2"),
    ("", "Message send (issue a call)", "message_send_us", None, "p.null(i) without waiting"),
    ("", "  bare rsr send", "rsr_send_us", None, "mf.rsr(g, noop, i)"),
    ("", "Bandwidth (MB/s)", "bandwidth_mb_s", "baseline_bandwidth_mb_s",
     "16 MB array to p.echo and back; hand: pickle-5 OOB"),
    ("Dataflow", "New and delete computation instance", "computation_instance_us", None,
     "Call(...) + Slot()"),
    ("", "Add an arc", "add_arc_us", None, "issue p.take(future) - p.take(1); the consumer pulls"),
    ("", "Construct a future - short", "future_construct_us", None, "Future(...) made and dropped"),
    ("", "  issue bookkeeping", "issue_bookkeeping_us", None, "message send - bare rsr send"),
    ("", "Construct a future - 100 actors", "chain100_issue_us", None,
     "issue a chain of 100 dependent calls"),
    ("", "RV_Table insert", "slots_insert_us", None, "Slot() into dict by (ctx, seq)"),
    ("", "RV_Table lookup", "slots_lookup_us", None, "dict.get by (ctx, seq)"),
    ("Tokens", "Block predicate", "block_predicate_us", None, "guarded - unguarded null call"),
    ("Scheduling", "Object instantiation", "object_instantiation_us", "fork_first_reply_us",
     "create(on=1) + first call; hand: fork+ping"),
    ("", "Object destruction", "object_destruction_us", None, "destroy().result()"),
    ("Composites", "Single null RPC - persistent", "null_rpc_persistent_us", "pingpong_busypoll_us",
     "p.null(i).result(); hand: busy-poll RTT"),
    ("", "  (hand-coded blocking RTT)", None, "pingpong_blocking_us", ""),
    ("", "  (hand-coded poll-then-sleep RTT)", None, "pingpong_pollsleep_us", ""),
    ("", "Pipelined null RPC - persistent", "pipelined_persistent_us", None,
     "1000 issued, gathered; per call"),
    ("", "Null regular call, local (default placement)", "null_rpc_regular_local_us", None,
     "R().null(i).result(): default placement runs it on ctx 0, no message"),
    ("", "Null regular call, remote (on=1)", "null_rpc_regular_remote_us", "pingpong_busypoll_us",
     "R.create(on=1).null(i).result()"),
    ("", "Pipelined null RPC - regular (default)", "pipelined_regular_default_us", None, ""),
    ("", "Pipelined null RPC - regular (on=1)", "pipelined_regular_pinned_us", None, ""),
    ("", "Total macroflow overhead", "total_overhead_us", None, "null RPC - 2 x hand one-way busy-poll"),
    ("Extras", "Chain of 100, per link (3 contexts)", "chain_per_link_us", "pingpong_busypoll_us",
     "A.f/B.f alternating on ctx 1/2"),
    ("", "Chain of 100, per link (2 contexts)", "chain_per_link_2ctx_us", "pingpong_busypoll_us",
     "A on ctx 1, B on ctx 0 (main serves it while waiting)"),
    ("", "Startup to first answer, 4 ctx (s)", "startup_first_answer_s", None,
     "mf.run incl. fork; hand (us): fork+ping above"),
    ("", "Startup incl. teardown, 4 ctx (s)", "startup_total_s", None, ""),
    ("", "Idle context RSS (MB)", "idle_rss_fresh_mb", None, "psutil on context 1 of a minimal program"),
    ("", "Idle context USS (MB)", "idle_uss_fresh_mb", None, "  its pages not shared with context 0"),
    ("", "Idle context PSS (MB)", "idle_pss_fresh_mb", None, "  shared pages divided among sharers"),
    ("", "Idle context RSS, bench (MB)", "idle_rss_mb", None, "context 1 forked from this bench process"),
]

MPI_ROWS: List[Tuple[str, str, str, str]] = [
    # (label, key, reference key, what the reference is)
    ("Null RPC - persistent (us)", "mpi_null_rpc_persistent_us", "null_rpc_persistent_us",
     "the same on local, same round"),
    ("Null RPC - persistent, mpi (us)", "mpi_null_rpc_persistent_us", "mpi4py_pickled_roundtrip_us",
     "mpi4py pickled send/recv, same call"),
    ("16 MB pass-and-return (MB/s)", "mpi_bandwidth_mb_s", "mpi4py_bandwidth_mb_s",
     "mpi4py Send/Recv, same job"),
    ("16 MB round trip (us)", "mpi_bandwidth_roundtrip_us", "mpi4py_bandwidth_roundtrip_us",
     "mpi4py Send/Recv, same job"),
    ("1-byte round trip, mpi4py (us)", "mpi4py_roundtrip_us", None, "no macroflow: the floor"),
]


def _mpi_table(t1: Dict[str, Any]) -> List[List[Any]]:
    return [[label, t1.get(key), t1.get(ref) if ref else None, note]
            for label, key, ref, note in MPI_ROWS if key in t1]


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "PASS" if v else "FAIL"
    if isinstance(v, int):
        return f"{v:,}"  # a count
    if isinstance(v, float):
        if isinstance(v, float) and math.isnan(v):
            return "n/a"
        a = abs(v)
        if a >= 1000:
            return f"{v:,.0f}"
        if a >= 100:
            return f"{v:.0f}"
        if a >= 10:
            return f"{v:.1f}"
        if a >= 1:
            return f"{v:.2f}"
        return f"{v:.3f}"
    return str(v)


def render_table(title: str, headers: List[str], rows: List[List[Any]], out=None) -> None:
    """Print a table with rich when it is installed, as plain text otherwise."""
    out = out or sys.stdout
    cells = [[_fmt(c) for c in row] for row in rows]
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        Console = None  # type: ignore[assignment]
    if Console is not None and out is sys.stdout:
        t = Table(title=title)
        for i, h in enumerate(headers):
            t.add_column(h, justify="right" if i and i < len(headers) - 1 else "left")
        for row in cells:
            t.add_row(*row)
        Console().print(t)
        return
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    line = "  ".join("-" * w for w in widths)
    print(f"\n{title}", file=out)
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths)), file=out)
    print(line, file=out)
    for r in cells:
        print("  ".join((c.ljust(w) if i == 0 or i == len(r) - 1 else c.rjust(w))
                        for i, (c, w) in enumerate(zip(r, widths))), file=out)


def report(res: Dict[str, Any], out=None) -> None:
    """Print Table I, Table II, METG and the bars from :func:`run`'s result."""
    t1, base = res["table1"], res["baselines"]
    meta = res["meta"]
    print(f"macroflow bench micro ({'quick' if meta['quick'] else 'full'}): {meta['platform']}, "
          f"{meta['cpus']} cpus, python {meta['python']}, transport local, spin_us {meta['spin_us']:g}, "
          f"rings {'compiled' if meta.get('rings_compiled') else 'in Python'}, "
          f"{meta['config']['rounds']} rounds, {meta['elapsed_s']:.0f} s", file=out or sys.stdout)
    rows = []
    width = max(len(row[0]) for row in TABLE1_ROWS) + 1
    for cat, label, key, hkey, note in TABLE1_ROWS:
        mentat = MENTAT.get(key or "", (None, None))
        rows.append([f"{cat:<{width}}{label}", t1.get(key) if key else None,
                     base.get(hkey) if hkey else None, mentat[0], mentat[1], note])
    render_table("Table I: macroflow on this machine (us unless noted), hand-coded in the same run, "
                 "Mentat 1995", ["row", "macroflow", "hand-coded", "Mentat Sun", "Mentat Paragon",
                                 "what macroflow measures"], rows, out)
    t2 = res["table2"]
    rates = res["flops"]
    rows = []
    for name, tab in (("macroflow (local)", t2["macroflow"]), ("hand-coded busy-poll (MS=BP=0)",
                                                              t2["hand_coded_busypoll"])):
        rows.append([name, tab["k=2"]["ft_us"], tab["k=4"]["ft_us"], tab["k=2"]["ft_python_flops"],
                     tab["k=4"]["ft_python_flops"], tab["k=2"]["ft_numpy_flops"], tab["k=4"]["ft_numpy_flops"]])
    for name, (a, b, c, d) in MENTAT_TABLE2.items():
        rows.append([f"Mentat {name}", a, b, c, d, None, None])
    inp = t2["inputs_us"]
    render_table(f"Table II: minimum granularity, {t2['formula']}; MS={inp['MS']:.1f} MT={inp['MT']:.1f} "
                 f"BP={inp['BP']:.2f} us; python {rates['python_flops'] / 1e6:.0f} Mflop/s "
                 f"(scalar loop x=x*a+b), numpy {rates['numpy_flops'] / 1e9:.1f} Gflop/s (384^2 matmul)",
                 ["", "FT us k=2", "FT us k=4", "py flops k=2", "py flops k=4", "np flops k=2",
                  "np flops k=4"], rows, out)
    m = res["metg"]
    rows = [[f"{c['task_us']:g}", c["n_tasks"], c["wall_s"] * 1e3, c["efficiency"] * 100,
             " ".join(f"ctx{k}:{v}" for k, v in sorted(c["ran_on"].items()))] for c in m["curve"]]
    metg = "not reached" if m["metg_us"] is None else f"{m['metg_us']:.0f} us (grid point {m['metg_grid_us']:g} us)"
    render_table(f"METG(50%) on 2 contexts: {metg}", ["task us", "tasks", "wall ms", "efficiency %",
                                                       _ran_on_header(res)], rows, out)
    rows = [[b["bar"], b["value"], b["reference"], b["ratio"], f"{b['op']} {b['limit']:g}",
             ("PASS" if b["pass"] else "FAIL") if b.get("counted", True) else "(info)", b["note"]]
            for b in res["bars"]]
    render_table("Bars (ratio: median over rounds of each round's own ratio)", ["bar", "value", "reference", "ratio", "limit",
                                                        "result", "note"], rows, out)
    rows = _chain_length_rows(t1)
    if rows:
        render_table("Chain length: one persistent object on context 1, per link (us)",
                     ["transport", "lengths", "per link", "longest / shortest"], rows, out)
    rows = _mpi_table(t1)
    if rows:
        render_table("MPI transport (mpiexec -n 2, in each round)", ["row", "mpi", "reference", "reference is"],
                     rows, out)
    else:
        print(f"MPI rows skipped: {meta.get('mpi')}", file=out or sys.stdout)
    print("Other systems doing the same operations: macroflow bench peers", file=out or sys.stdout)


def _ran_on_header(res: Dict[str, Any]) -> str:
    # "ran on" counts the tasks of every batch of a grid point, not of one
    reps = res["meta"]["config"].get("metg_reps")
    return f"ran on (tasks x {reps} batches)" if reps and reps > 1 else "ran on"


def _chain_length_rows(t1: Dict[str, Any]) -> List[List[Any]]:
    rows = []
    for tr, cl in (t1.get("chain_length") or {}).items():
        rows.append([tr, " / ".join(f"{n:,}" for n in cl["lengths"]),
                     " / ".join(_fmt(cl["per_link_us"][str(n)]) for n in cl["lengths"]), cl["ratio"]])
    return rows


def markdown(res: Dict[str, Any]) -> str:
    """The tables of :func:`report` as Markdown, for docs/benchmarks.md.

    ``python -m macroflow.bench.micro results.json`` prints it for a saved run.
    """
    t1, base, meta = res["table1"], res["baselines"], res["meta"]
    lines = [f"Run: {meta['time']}, {meta['platform']}, {meta['cpus']} cpus, python {meta['python']}, "
             f"numpy {meta['numpy']}, transport local, spin_us {meta['spin_us']:g}, "
             f"{meta['config']['rounds']} rounds ({'quick' if meta['quick'] else 'full'}), "
             f"{meta['elapsed_s']:.0f} s; 1-minute load average per round "
             f"{', '.join(f'{x:.2f}' for x in meta.get('loadavg_1min_per_round', []) if x is not None)}.",
             "", "### Table I", "",
             "| category | row | macroflow | hand-coded (same run) | Mentat Sun | Mentat Paragon | what macroflow measures |",
             "| --- | --- | ---: | ---: | ---: | ---: | --- |"]
    for cat, label, key, hkey, note in TABLE1_ROWS:
        mentat = MENTAT.get(key or "", (None, None))
        cells = [cat, label.strip(), _fmt(t1.get(key) if key else None),
                 _fmt(base.get(hkey) if hkey else None), _fmt(mentat[0]), _fmt(mentat[1]), note]
        lines.append("| " + " | ".join(cells) + " |")
    t2, rates = res["table2"], res["flops"]
    inp = t2["inputs_us"]
    lines += ["", "### Table II", "",
              f"{t2['formula']}, with MS = {inp['MS']:.1f} us (message send), MT = {inp['MT']:.1f} us "
              f"(message transport), BP = {inp['BP']:.2f} us (block predicate). Flop rates measured "
              f"here: {rates['python_flops'] / 1e6:.0f} Mflop/s for a pure-Python scalar loop "
              f"(x = x*a + b) and {rates['numpy_flops'] / 1e9:.1f} Gflop/s for a 384x384 numpy matmul.", "",
              "| | FT us k=2 | FT us k=4 | Python flops k=2 | Python flops k=4 | numpy flops k=2 | numpy flops k=4 |",
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, tab in (("macroflow (local)", t2["macroflow"]),
                      ("hand-coded busy-poll (MS = BP = 0)", t2["hand_coded_busypoll"])):
        lines.append("| " + " | ".join([name] + [_fmt(tab[k][u]) for u in ("ft_us",) for k in ("k=2", "k=4")]
                                       + [_fmt(tab[k][u]) for u in ("ft_python_flops", "ft_numpy_flops")
                                          for k in ("k=2", "k=4")]) + " |")
    for name, (a, b, c, d) in MENTAT_TABLE2.items():
        lines.append(f"| Mentat {name} (1995) | {_fmt(a)} | {_fmt(b)} | {_fmt(c)} | {_fmt(d)} | - | - |")
    m = res["metg"]
    metg = "not reached" if m["metg_us"] is None else \
        f"**{m['metg_us']:.0f} us** (smallest grid point passing: {m['metg_grid_us']:g} us)"
    lines += ["", "### METG(50%)", "", f"METG(50%) on 2 contexts: {metg}.", "",
              f"| task us | tasks | wall ms | efficiency % | {_ran_on_header(res)} |",
              "| ---: | ---: | ---: | ---: | --- |"]
    for c in m["curve"]:
        lines.append(f"| {c['task_us']:g} | {c['n_tasks']} | {_fmt(c['wall_s'] * 1e3)} | "
                     f"{_fmt(c['efficiency'] * 100)} | "
                     f"{' '.join(f'ctx{k}:{v}' for k, v in sorted(c['ran_on'].items()))} |")
    lines += ["", "### Bars", "", "| bar | value | reference | ratio | limit | result | note |",
              "| --- | ---: | ---: | ---: | --- | --- | --- |"]
    for b in res["bars"]:
        result = ("PASS" if b["pass"] else "**FAIL**") if b.get("counted", True) else "(info)"
        lines.append(f"| {b['bar']} | {_fmt(b['value'])} | {_fmt(b['reference'])} | {_fmt(b['ratio'])} | "
                     f"{b['op']} {b['limit']:g} | {result} | {b['note']} |")
    rows = _chain_length_rows(t1)
    if rows:
        lines += ["", "### Chain length", "",
                  "One persistent object on context 1 of 2; each call takes the previous call's future; "
                  "the caller waits for the last. Microseconds per link.", "",
                  "| transport | lengths | per link | longest / shortest |", "| --- | --- | --- | ---: |"]
        lines += [f"| {r[0]} | {r[1]} | {r[2]} | {_fmt(r[3])} |" for r in rows]
    rows = _mpi_table(t1)
    if rows:
        lines += ["", "### MPI transport", "",
                  "A job of `mpiexec -n 2` in each round: rank 0 runs the session, rank 1 hosts the "
                  "object; mpi4py's own Send/Recv between the same two ranks in the same job.", "",
                  "| row | mpi | reference | reference is |", "| --- | ---: | ---: | --- |"]
        lines += [f"| {r[0]} | {_fmt(r[1])} | {_fmt(r[2])} | {r[3]} |" for r in rows]
    return "\n".join(lines) + "\n"


def main(json_path: Optional[str] = None, quick: bool = False) -> int:
    """Run the suite, print it, optionally write the JSON; returns an exit code."""
    progress = progress_printer("micro")
    res = run(quick=quick, progress=progress)
    report(res)
    write_json(res, json_path)
    return 0


if __name__ == "__main__":
    # Use the importable module, so that its classes pickle by reference.
    from macroflow.bench import micro as _micro
    if len(sys.argv) == 3 and sys.argv[1] == "--mpi-rows":  # every rank of mpi_rows' job
        rows = mf.run(_micro._mpi_session, _micro.QUICK if sys.argv[2] == "quick" else _micro.FULL)
        print("MPI_ROWS " + json.dumps(rows), flush=True)
    elif len(sys.argv) == 2 and sys.argv[1].endswith(".json"):
        with open(sys.argv[1]) as f:
            print(_micro.markdown(json.load(f)))
    else:
        sys.exit(_micro.main(json_path=None, quick="--quick" in sys.argv))
