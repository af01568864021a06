"""``macroflow bench peers``: the same operations on macroflow and on its peers, in one run.

Systems (each optional peer is skipped, with a line saying how to install it,
when its package is missing):

  macroflow   ``mf.init(contexts=2)`` on the ``local`` transport: context 0 is
              the caller, the persistent object and the regular object are
              created on context 1 (``create(on=1)``)
  ray         ``ray.init(num_cpus=2)``: a Ray actor and ``@ray.remote`` functions
  dask        ``LocalCluster(n_workers=2, threads_per_worker=1)`` and a
              ``Client``: a Dask actor and ``client.submit``
  ppe         ``concurrent.futures.ProcessPoolExecutor(max_workers=2)``: no
              actors, and a future cannot be passed as an argument
  mpi4py      2 ranks under ``mpiexec -n 2`` (the one of the ``mpich`` wheel
              when it is beside this Python): send/recv only

Operations (rows of the table):

  null actor call     a method call on a persistent object / Ray actor / Dask
                      actor, waited for, in a loop (median)
  null task           a regular call / ray.remote function / client.submit /
                      executor.submit of a function returning its argument,
                      waited for, in a loop (median)
  1,000 pipelined     1,000 null tasks issued, then all waited for; per call
  chain of 100        100 dependent tasks, each taking the previous one's
                      future as its argument; the caller waits for the last;
                      per link
  16 MB array         a 16 MB numpy array sent to a task that returns it, and
                      back (mpi4py: Send to rank 1, which Sends it back)
  start-up            from creating the runtime (2 workers / contexts) to the
                      answer of a first null task; imports excluded
  small round trip    a small value to the other process and back, no call:
                      two ``mf.rsr`` bouncing between context 0 and 1; mpi4py
                      ``comm.send``/``comm.recv`` of an int between ranks

Each system runs in a fresh interpreter of its own (a subprocess), so that
none of them shares a process, imports or threads with another. The suite
runs in rounds; each round runs every system once, macroflow first; a figure
is the median over rounds, and a ratio (peer / macroflow, above 1 when
macroflow is faster) is the median over rounds of that round's own ratio.
Loops stop after a time budget, with a minimum number of samples.

Run ``macroflow bench peers [--quick] [--json FILE] [--peers ray,dask,mpi4py]``;
``python -m macroflow.bench.peers results.json`` prints a saved run as Markdown.
"""

from __future__ import annotations

import importlib.util
import json
import math
import multiprocessing
import os
import platform
import shutil
import statistics
import sys
import time
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence

import numpy as np

import macroflow as mf
from macroflow.bench import progress_printer, spawn_worker, suite_main, write_json
from macroflow.bench.micro import _fmt as _fmt_number

PEERS = ("ray", "dask", "mpi4py")
SYSTEMS = ("macroflow", "ray", "dask", "ppe", "mpi4py")
TITLES = {"macroflow": "macroflow", "ray": "Ray", "dask": "Dask", "ppe": "ProcessPoolExecutor",
          "mpi4py": "mpi4py"}
COLUMNS = dict(TITLES, ppe="PPE")  # table headers
MODULES = {"ray": "ray", "dask": "distributed", "mpi4py": "mpi4py"}
INSTALL = {"ray": "pip install ray", "dask": "pip install distributed",
           "mpi4py": "pip install mpi4py mpich"}
EXTRA = 'pip install "macroflow[peers]"'

# (key, label, unit)
OPERATIONS = [
    ("null_actor_call", "null actor call", "us"),
    ("null_task", "null task", "us"),
    ("pipelined_1000", "1,000 pipelined calls (per call)", "us"),
    ("chain_100", "chain of 100 dependent calls (per link)", "us"),
    ("array_16mb", "16 MB numpy array there and back", "ms"),
    ("startup", "start-up to first answer (2 workers)", "s"),
    ("round_trip", "small-message round trip (no call)", "us"),
]
OP_KEYS = tuple(k for k, _, _ in OPERATIONS)

# Operations a system does not have, and why.
NOT_APPLICABLE = {
    ("ray", "round_trip"): "no send/recv without a call",
    ("dask", "round_trip"): "no send/recv without a call",
    ("ppe", "null_actor_call"): "no actors",
    ("ppe", "chain_100"): "a future cannot be an argument",
    ("ppe", "round_trip"): "no send/recv without a call",
    ("mpi4py", "null_actor_call"): "no calls: message passing only",
    ("mpi4py", "null_task"): "no calls: message passing only",
    ("mpi4py", "pipelined_1000"): "no calls: message passing only",
    ("mpi4py", "chain_100"): "no calls: message passing only",
    ("mpi4py", "startup"): "started by mpiexec, not measured",
}

LEGEND = ("PPE is concurrent.futures.ProcessPoolExecutor; X/mf is that system's time divided by "
          "macroflow's (above 1: macroflow is faster).")

ARRAY_BYTES = 16 * 2**20
PIPELINED = 1000
CHAIN = 100
_RESULT_TAG = "MACROFLOW-BENCH-PEERS-RESULT "


class Config:
    """How long each operation runs; ``FULL`` and ``QUICK`` are the two presets."""

    def __init__(self, name: str, rounds: int, budget_s: float, min_iters: int, max_iters: int,
                 warmup: int, max_batches: int, max_chains: int, max_arrays: int, timeout_s: float):
        self.name = name
        self.rounds = rounds
        self.budget_s = budget_s
        self.min_iters = min_iters
        self.max_iters = max_iters
        self.warmup = warmup
        self.max_batches = max_batches
        self.max_chains = max_chains
        self.max_arrays = max_arrays
        self.timeout_s = timeout_s

    def as_dict(self) -> Dict[str, Any]:
        return dict(vars(self))


FULL = Config("full", rounds=3, budget_s=1.0, min_iters=20, max_iters=2000, warmup=10, max_batches=3,
              max_chains=5, max_arrays=5, timeout_s=240)
QUICK = Config("quick", rounds=1, budget_s=0.25, min_iters=10, max_iters=500, warmup=5, max_batches=2,
               max_chains=3, max_arrays=3, timeout_s=150)


# --------------------------------------------------------------------------- choosing the systems


def parse_peers(spec: Optional[Iterable[str]]) -> List[str]:
    """The peers to try, from ``"ray,dask"`` or a list; ``None`` means all of them.

    Raises:
        ValueError: a name that is not a peer (the message lists the peers).

    Example:
        >>> parse_peers("dask, ray")
        ['ray', 'dask']
        >>> parse_peers(None)
        ['ray', 'dask', 'mpi4py']
        >>> parse_peers("")
        []
        >>> parse_peers("spark")
        Traceback (most recent call last):
        ...
        ValueError: unknown peer 'spark'; peers are ray, dask, mpi4py
    """
    if spec is None:
        return list(PEERS)
    names = spec.split(",") if isinstance(spec, str) else list(spec)
    chosen = set()
    for name in names:
        name = name.strip().lower()
        if not name:
            continue
        if name not in PEERS:
            raise ValueError(f"unknown peer {name!r}; peers are {', '.join(PEERS)}")
        chosen.add(name)
    return [p for p in PEERS if p in chosen]


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def find_mpiexec() -> Optional[str]:
    """The ``mpiexec`` to launch mpi4py with, or None when there is none.

    The one beside this Python comes first (where the ``mpich`` wheel puts it),
    then the first on ``PATH``.

    Example:
        >>> path = find_mpiexec()
        >>> path is None or os.access(path, os.X_OK)
        True
    """
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if os.path.isfile(here) and os.access(here, os.X_OK):
        return here
    return shutil.which("mpiexec")


def peer_status(peers: Sequence[str]) -> Dict[str, Dict[str, str]]:
    """For each peer, whether it will run, and if not why and how to install it.

    Example:
        >>> st = peer_status([])
        >>> st["ray"]["status"], st["ray"]["reason"]
        ('skipped', 'not selected (--peers)')
    """
    out: Dict[str, Dict[str, str]] = {}
    for p in PEERS:
        if p not in peers:
            out[p] = {"status": "skipped", "reason": "not selected (--peers)"}
        elif not _installed(MODULES[p]):
            out[p] = {"status": "skipped",
                      "reason": f"not installed (install: {EXTRA}, or {INSTALL[p]})"}
        elif p == "mpi4py" and find_mpiexec() is None:
            out[p] = {"status": "skipped",
                      "reason": "mpiexec not found beside this Python nor on PATH "
                                "(the mpich wheel brings one: pip install mpich)"}
        else:
            out[p] = {"status": "run", "reason": ""}
    return out


# --------------------------------------------------------------------------- measuring (in workers)

_ns = time.perf_counter_ns


def _median(xs: Iterable[Optional[float]]) -> float:
    xs = [x for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return float(statistics.median(xs)) if xs else float("nan")


def _samples(fn: Callable[[int], Any], cfg: Config, least: int, most: int) -> List[float]:
    """Seconds per call of ``fn(i)``: at least ``least`` calls, then until the budget or ``most``."""
    out: List[float] = []
    start = time.perf_counter()
    while len(out) < most and (len(out) < least or time.perf_counter() - start < cfg.budget_s):
        t0 = _ns()
        fn(len(out))
        out.append((_ns() - t0) / 1e9)
    return out


def _sync_us(fn: Callable[[int], Any], cfg: Config) -> float:
    for i in range(cfg.warmup):
        fn(i)
    return _median(_samples(fn, cfg, cfg.min_iters, cfg.max_iters)) * 1e6


def _check_chain(v: Any) -> None:
    if v != CHAIN:
        raise RuntimeError(f"chain of {CHAIN}: got {v!r}, expected {CHAIN}")


def _array() -> np.ndarray:
    return np.random.default_rng(7).integers(0, 256, ARRAY_BYTES, dtype=np.uint8)


def _measure(drv: Any, cfg: Config) -> Dict[str, Any]:
    """Every operation of one driver (a started runtime); the start-up is timed by the caller."""
    out: Dict[str, Any] = {}
    if hasattr(drv, "actor_null"):
        drv.make_actor()
        out["null_actor_call"] = _sync_us(drv.actor_null, cfg)
    out["null_task"] = _sync_us(drv.task_null, cfg)
    drv.pipelined(PIPELINED)  # warm-up
    out["pipelined_1000"] = _median(_samples(lambda i: drv.pipelined(PIPELINED), cfg, 1,
                                             cfg.max_batches)) / PIPELINED * 1e6
    if hasattr(drv, "chain"):
        _check_chain(drv.chain(CHAIN))
        out["chain_100"] = _median(_samples(lambda i: _check_chain(drv.chain(CHAIN)), cfg, 1,
                                            cfg.max_chains)) / CHAIN * 1e6
    arr = _array()
    back = drv.echo(arr)
    if not np.array_equal(back, arr):
        raise RuntimeError("16 MB array: it came back different")
    del back
    out["array_16mb"] = _median(_samples(lambda i: drv.echo(arr), cfg, 2, cfg.max_arrays)) * 1e3
    if hasattr(drv, "round_trip"):
        out["round_trip"] = _sync_us(drv.round_trip, cfg)
    return out


# Module-level so that the executor's workers (forked from the worker process)
# and macroflow's contexts find them by reference.
def _null(x: Any) -> Any:
    return x


def _inc(x: int) -> int:
    return x + 1


@mf.persistent
class PeerActor:
    """The persistent object of the macroflow rows."""

    def null(self, x):
        return x


@mf.regular
class PeerTask:
    """The regular object of the macroflow rows (a task, pinned to context 1)."""

    def null(self, x):
        return x

    def inc(self, x):
        return x + 1

    def echo(self, a):
        return a


def _bounce_back(target: Any, home: Any, i: int) -> None:  # inline on context 1
    mf.rsr(home, _bounce_arrive, i)


def _bounce_arrive(box: List[int], i: int) -> None:  # inline on context 0
    box[0] = i


class _Macroflow:
    def start(self) -> None:
        self.session = mf.init(contexts=2, transport="local")
        self.task = PeerTask.create(on=1)
        self.task.null(1).result(60)

    def make_actor(self) -> None:
        self.actor = PeerActor.create(on=1)
        self.actor.null(0).result(60)
        self.box = [-1]
        self.home = mf.export(self.box)
        self.actor_gptr = mf.info(self.actor).gptr  # once: the round trip measures the RSRs
        from macroflow.core.context import current_engine
        self.drive = current_engine().driver.run_until

    def actor_null(self, i: int) -> Any:
        return self.actor.null(i).result()

    def task_null(self, i: int) -> Any:
        return self.task.null(i).result()

    def pipelined(self, n: int) -> Any:
        return mf.gather([self.task.null(i) for i in range(n)])

    def chain(self, n: int) -> Any:
        x: Any = 0
        for _ in range(n):
            x = self.task.inc(x)
        return x.result()

    def echo(self, a: np.ndarray) -> np.ndarray:
        return self.task.echo(a).result()

    def round_trip(self, i: int) -> None:
        box = self.box
        mf.rsr(self.actor_gptr, _bounce_back, self.home, i)
        self.drive(lambda: box[0] == i)

    def stop(self) -> None:
        self.session.close()

    @staticmethod
    def version() -> str:
        return mf.__version__


class _Ray:
    def start(self) -> None:
        import ray
        self.ray = ray
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR",
                 object_store_memory=256 * 2**20)

        # Defined here, so that they travel by value to Ray's workers.
        @ray.remote
        def null(x):
            return x

        @ray.remote
        def inc(x):
            return x + 1

        @ray.remote
        class Actor:
            def null(self, x):
                return x

        self.null, self.inc, self.Actor = null, inc, Actor
        ray.get(null.remote(1), timeout=120)

    def make_actor(self) -> None:
        self.actor = self.Actor.remote()
        self.ray.get(self.actor.null.remote(0), timeout=120)

    def actor_null(self, i: int) -> Any:
        return self.ray.get(self.actor.null.remote(i))

    def task_null(self, i: int) -> Any:
        return self.ray.get(self.null.remote(i))

    def pipelined(self, n: int) -> Any:
        return self.ray.get([self.null.remote(i) for i in range(n)])

    def chain(self, n: int) -> Any:
        x: Any = 0
        for _ in range(n):
            x = self.inc.remote(x)
        return self.ray.get(x)

    def echo(self, a: np.ndarray) -> np.ndarray:
        return self.ray.get(self.null.remote(a))

    def stop(self) -> None:
        self.ray.shutdown()

    @staticmethod
    def version() -> str:
        import ray
        return ray.__version__


class _Dask:
    def start(self) -> None:
        import logging

        from distributed import Client, LocalCluster
        self.cluster = LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                    dashboard_address=None, silence_logs=logging.ERROR)
        self.client = Client(self.cluster)

        def null(x):
            return x

        def inc(x):
            return x + 1

        class Actor:
            def null(self, x):
                return x

        self.null, self.inc, self.Actor = null, inc, Actor
        self.client.submit(null, 1, pure=False).result(timeout=120)

    def make_actor(self) -> None:
        self.actor = self.client.submit(self.Actor, actor=True).result(timeout=120)
        self.actor.null(0).result()

    def actor_null(self, i: int) -> Any:
        return self.actor.null(i).result()

    def task_null(self, i: int) -> Any:
        return self.client.submit(self.null, i, pure=False).result()

    def pipelined(self, n: int) -> Any:
        c = self.client
        return c.gather([c.submit(self.null, i, pure=False) for i in range(n)])

    def chain(self, n: int) -> Any:
        x: Any = 0
        for _ in range(n):
            x = self.client.submit(self.inc, x, pure=False)
        return x.result()

    def echo(self, a: np.ndarray) -> np.ndarray:
        import warnings
        with warnings.catch_warnings():
            # Dask suggests scattering large arguments first; this row is the plain call.
            warnings.simplefilter("ignore", UserWarning)
            return self.client.submit(self.null, a, pure=False).result()

    def stop(self) -> None:
        self.client.close()
        self.cluster.close()

    @staticmethod
    def version() -> str:
        import distributed
        return distributed.__version__


class _PPE:
    def start(self) -> None:
        from concurrent.futures import ProcessPoolExecutor
        self.ex = ProcessPoolExecutor(max_workers=2)
        self.ex.submit(_null, 1).result(timeout=120)

    def task_null(self, i: int) -> Any:
        return self.ex.submit(_null, i).result()

    def pipelined(self, n: int) -> Any:
        return [f.result() for f in [self.ex.submit(_null, i) for i in range(n)]]

    def echo(self, a: np.ndarray) -> np.ndarray:
        return self.ex.submit(_null, a).result()

    def stop(self) -> None:
        self.ex.shutdown(wait=True)

    @staticmethod
    def version() -> str:
        return f"python {platform.python_version()} ({multiprocessing.get_start_method()})"


DRIVERS = {"macroflow": _Macroflow, "ray": _Ray, "dask": _Dask, "ppe": _PPE}


def _worker(system: str, cfg: Config) -> Dict[str, Any]:
    """One system in this (fresh) process: start-up, every operation, shut down."""
    drv = DRIVERS[system]()
    t0 = time.perf_counter()
    drv.start()
    out: Dict[str, Any] = {"startup": time.perf_counter() - t0}
    try:
        out.update(_measure(drv, cfg))
    finally:
        t1 = time.perf_counter()
        drv.stop()
        out["shutdown_s"] = time.perf_counter() - t1
    out["version"] = drv.version()
    return out


def _mpi_worker(cfg: Config) -> Optional[Dict[str, Any]]:
    """Rank 0 and rank 1 of ``mpiexec -n 2``; rank 0 returns the figures."""
    from mpi4py import MPI
    import mpi4py
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    if comm.Get_size() != 2:
        raise RuntimeError(f"mpi4py rows need 2 ranks, got {comm.Get_size()}")
    other = 1 - rank
    # Both ranks must agree on every count, so no time budget here.
    n, warm = cfg.max_iters, cfg.warmup * 10
    samples = []
    for i in range(warm + n):
        if rank == 0:
            t0 = _ns()
            comm.send(i, dest=other)
            v = comm.recv(source=other)
            if i >= warm:
                samples.append(_ns() - t0)
            if v != i:
                raise RuntimeError(f"round trip: got {v!r}, expected {i}")
        else:
            comm.send(comm.recv(source=other), dest=other)
    arr = _array() if rank == 0 else np.empty(ARRAY_BYTES, dtype=np.uint8)
    back = np.empty_like(arr)
    times = []
    for i in range(1 + cfg.max_arrays):
        if rank == 0:
            t0 = _ns()
            comm.Send(arr, dest=other)
            comm.Recv(back, source=other)
            times.append(_ns() - t0)
            if i == 0 and not np.array_equal(back, arr):
                raise RuntimeError("16 MB array: it came back different")
        else:
            comm.Recv(arr, source=other)
            comm.Send(arr, dest=other)
    if rank != 0:
        return None
    library = " ".join(MPI.Get_library_version().splitlines()[0].split())
    return {"round_trip": _median(samples) / 1e3, "array_16mb": _median(times[1:]) / 1e6,
            "version": f"{mpi4py.__version__}, {library}"}


# --------------------------------------------------------------------------- the suite (parent)


def _spawn(system: str, cfg: Config) -> Dict[str, Any]:
    """Run one system's worker in a fresh interpreter; its figures, or an "error"."""
    mpiexec = None
    if system == "mpi4py":
        mpiexec = find_mpiexec()
        if mpiexec is None:
            return {"error": "mpiexec not found"}
    return spawn_worker("macroflow.bench.peers",
                        ["--worker", system, "--config", json.dumps(cfg.as_dict())],
                        cfg.timeout_s, _RESULT_TAG, mpiexec)


def run(quick: bool = False, peers: Optional[Iterable[str]] = None,
        progress: Callable[[str], None] = lambda s: None) -> Dict[str, Any]:
    """Measure macroflow, ProcessPoolExecutor and the installed peers; the figures as a dict.

    Args:
        quick: one round with short loops instead of three rounds.
        peers: the peers to try (see :func:`parse_peers`); None tries all.
        progress: called with a short message as the suite goes on.

    Raises:
        ValueError: an unknown peer.

    Example:
        >>> run(peers=["ray", "hadoop"])
        Traceback (most recent call last):
        ...
        ValueError: unknown peer 'hadoop'; peers are ray, dask, mpi4py
    """
    chosen = parse_peers(peers)
    cfg = QUICK if quick else FULL
    started = time.perf_counter()
    status: Dict[str, Dict[str, Any]] = {"macroflow": {"status": "run", "reason": ""},
                                         "ppe": {"status": "run", "reason": ""}}
    status.update(peer_status(chosen))
    systems = [s for s in SYSTEMS if status[s]["status"] == "run"]
    systems.remove("macroflow")
    systems.insert(0, "macroflow")
    rounds: List[Dict[str, Dict[str, Any]]] = []
    load: List[float] = []
    for r in range(cfg.rounds):
        load.append(os.getloadavg()[0])
        rd: Dict[str, Dict[str, Any]] = {}
        for s in systems:
            if status[s]["status"] != "run":
                continue
            progress(f"round {r + 1}/{cfg.rounds}: {TITLES[s]}")
            res = _spawn(s, cfg)
            if "error" in res:
                status[s] = {"status": "failed", "reason": res["error"]}
                continue
            status[s]["version"] = res.pop("version", "")
            rd[s] = res
        rounds.append(rd)
    measured = [s for s in systems if status[s]["status"] == "run"]
    for s in measured:
        status[s]["status"] = "measured"
    results: Dict[str, Dict[str, Optional[float]]] = {}
    ratios: Dict[str, Dict[str, Optional[float]]] = {}
    for s in measured:
        results[s] = {}
        for op in OP_KEYS + ("shutdown_s",):
            vals = [rd[s].get(op) for rd in rounds if s in rd]
            results[s][op] = _median(vals) if any(v is not None for v in vals) else None
        if s == "macroflow":
            continue
        ratios[s] = {}
        for op in OP_KEYS:
            per_round = [rd[s][op] / rd["macroflow"][op] for rd in rounds
                         if s in rd and "macroflow" in rd and rd[s].get(op) and rd["macroflow"].get(op)]
            ratios[s][op] = _median(per_round) if per_round else None
    return {
        "meta": {"suite": "peers", "quick": quick, "config": cfg.as_dict(),
                 "python": platform.python_version(), "platform": platform.platform(),
                 "cpus": os.cpu_count(), "numpy": np.__version__, "macroflow": mf.__version__,
                 "time": time.strftime("%Y-%m-%d %H:%M:%S"),
                 "elapsed_s": time.perf_counter() - started,
                 "loadavg_1min_per_round": load,
                 "statistic": "median over rounds; ratio = peer / macroflow, median over rounds of "
                              "each round's own ratio"},
        "operations": [{"key": k, "label": label, "unit": unit} for k, label, unit in OPERATIONS],
        "systems": status,
        "not_applicable": {s: {op: why for (s2, op), why in NOT_APPLICABLE.items() if s2 == s}
                           for s in SYSTEMS},
        "results": results,
        "ratios": ratios,
        "rounds": rounds,
    }


# --------------------------------------------------------------------------- printing


def _fmt(v: Any) -> str:
    return "n/a" if v is None else _fmt_number(v)  # a peer that lacks the operation


def _columns(res: Dict[str, Any]) -> List[str]:
    return [s for s in SYSTEMS if s in res["results"]]


def _rows(res: Dict[str, Any]) -> List[List[str]]:
    """Cells of the table: operation, macroflow, then each peer's figure and its ratio."""
    rows = []
    for op in res["operations"]:
        key = op["key"]
        row = [f"{op['label']}, {op['unit']}"]
        for s in _columns(res):
            v = res["results"][s].get(key)
            row.append(_fmt(v))
            if s != "macroflow":
                r = res["ratios"][s].get(key)
                row.append("n/a" if r is None or v is None else f"{_fmt(r)}x")
        rows.append(row)
    return rows


def _headers(res: Dict[str, Any]) -> List[str]:
    out = ["operation"]
    for s in _columns(res):
        out.append(COLUMNS[s])
        if s != "macroflow":
            out.append(f"{COLUMNS[s]}/mf")
    return out


def _skip_lines(res: Dict[str, Any]) -> List[str]:
    return [f"{TITLES[s]}: {st['status']}, {st['reason']}" for s, st in res["systems"].items()
            if st["status"] in ("skipped", "failed")]


def _na_lines(res: Dict[str, Any]) -> List[str]:
    out = []
    labels = {o["key"]: o["label"] for o in res["operations"]}
    for s in _columns(res):
        by_reason: Dict[str, List[str]] = {}
        for op, why in res["not_applicable"].get(s, {}).items():
            by_reason.setdefault(why, []).append(labels[op])
        for why, ops in by_reason.items():
            out.append(f"{TITLES[s]} n/a ({why}): {'; '.join(ops)}")
    return out


def report(res: Dict[str, Any], out: Any = None) -> None:
    """Print the table of :func:`run`'s result, with the skipped peers and the n/a reasons.

    Example:
        >>> import io
        >>> buf = io.StringIO()
        >>> report(_example_result(), buf)
        >>> print(buf.getvalue())  # doctest: +ELLIPSIS +NORMALIZE_WHITESPACE
        macroflow bench peers (quick): ...
        Ray: skipped, not installed (install: pip install "macroflow[peers]", or pip install ray)
        ...
        null actor call, us  40.0  n/a  n/a
        ...
    """
    out = out or sys.stdout
    meta = res["meta"]
    print(f"macroflow bench peers ({'quick' if meta['quick'] else 'full'}): {meta['platform']}, "
          f"{meta['cpus']} cpus, python {meta['python']}, {meta['config']['rounds']} round(s), "
          f"{meta['elapsed_s']:.0f} s, 1-minute load average per round "
          f"{', '.join(f'{x:.2f}' for x in meta.get('loadavg_1min_per_round', []))}", file=out)
    for line in _skip_lines(res):
        print(line, file=out)
    headers, rows = _headers(res), _rows(res)
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    print("", file=out)
    print("  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(headers, widths))),
          file=out)
    print("  ".join("-" * w for w in widths), file=out)
    for r in rows:
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))),
              file=out)
    print(f"\n{LEGEND}", file=out)
    for line in _na_lines(res):
        print(line, file=out)
    versions = [f"{TITLES[s]} {st['version']}" for s, st in res["systems"].items() if st.get("version")]
    if versions:
        print("versions: " + "; ".join(versions), file=out)


def markdown(res: Dict[str, Any]) -> str:
    """The table of :func:`report` as Markdown, for docs/benchmarks.md.

    Example:
        >>> print(markdown(_example_result()).splitlines()[2])
        | operation | macroflow | PPE | PPE/mf |
    """
    meta = res["meta"]
    headers, rows = _headers(res), _rows(res)
    versions = [f"{TITLES[s]} {st['version']}" for s, st in res["systems"].items() if st.get("version")]
    load = ", ".join(f"{x:.2f}" for x in meta.get("loadavg_1min_per_round", []))
    lines = [f"Run: {meta['time']}, {meta['platform']}, {meta['cpus']} cpus, python {meta['python']}, "
             f"{meta['config']['rounds']} round(s) ({'quick' if meta['quick'] else 'full'}), "
             f"{meta['elapsed_s']:.0f} s, 1-minute load average at the start of each round {load}; "
             + "; ".join(versions) + ".", "",
             "| " + " | ".join(headers) + " |",
             "| --- |" + " ---: |" * (len(headers) - 1)]
    for r in rows:
        lines.append("| " + " | ".join(r) + " |")
    lines += ["", LEGEND, ""]
    lines += [f"- {line}" for line in _skip_lines(res) + _na_lines(res)]
    return "\n".join(lines) + "\n"


def _example_result() -> Dict[str, Any]:
    """A small result of the shape :func:`run` returns, for the examples."""
    ops = [{"key": k, "label": label, "unit": unit} for k, label, unit in OPERATIONS]
    mfv = {k: 40.0 for k in OP_KEYS}
    ppe = dict(mfv, null_actor_call=None, chain_100=None, round_trip=None)
    return {"meta": {"quick": True, "platform": "Linux", "cpus": 2, "python": "3.11",
                     "config": {"rounds": 1}, "elapsed_s": 9.0, "time": "2000-01-01 00:00:00"},
            "operations": ops,
            "systems": {"macroflow": {"status": "measured", "reason": ""},
                        "ppe": {"status": "measured", "reason": ""},
                        "ray": {"status": "skipped",
                                "reason": f"not installed (install: {EXTRA}, or {INSTALL['ray']})"},
                        "dask": {"status": "skipped", "reason": "not selected (--peers)"},
                        "mpi4py": {"status": "skipped", "reason": "not selected (--peers)"}},
            "not_applicable": {"ppe": {"null_actor_call": "no actors"}},
            "results": {"macroflow": mfv, "ppe": ppe},
            "ratios": {"ppe": {k: (None if ppe[k] is None else 1.0) for k in OP_KEYS}}}


def main(json_path: Optional[str] = None, quick: bool = False,
         peers: Optional[Iterable[str]] = None) -> int:
    """Run the suite, print it, optionally write the JSON; returns an exit code.

    0 when every system that was tried was measured, 1 when one failed, 2 for
    an unknown peer.

    Example:
        >>> main(peers="spark")
        2
    """
    try:
        chosen = parse_peers(peers)
    except ValueError as e:
        print(f"macroflow bench peers: {e}", file=sys.stderr)
        return 2

    progress = progress_printer("peers")
    res = run(quick=quick, peers=chosen, progress=progress)
    report(res)
    write_json(res, json_path)
    return 1 if any(st["status"] == "failed" for st in res["systems"].values()) else 0


def _worker_main(argv: List[str]) -> int:
    system = argv[argv.index("--worker") + 1]
    cfg = Config(**json.loads(argv[argv.index("--config") + 1]))
    if system == "mpi4py":
        res = _mpi_worker(cfg)
    else:
        res = _worker(system, cfg)
    if res is not None:
        print(_RESULT_TAG + json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    # The importable module, so that classes and functions pickle by reference.
    from macroflow.bench import peers as _suite
    sys.exit(suite_main(_suite, ["--worker"], sys.argv))
