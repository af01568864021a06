"""``macroflow bench nexus``: Nexus's Figure 3, round-trip time against message size.

Nexus (Foster, Kesselman and Tuecke, 1994, section 3) circulated an array of
doubles between two contexts, "starting and finishing in a user-defined
array", with remote service requests run in a preallocated thread and in a
new thread, against PVM's send and receive. This suite does the same for
macroflow, for sizes from one double (8 B) to 131,072 doubles (1 MiB):

  inline      context 0 sends ``mf.rsr(gptr_on_1, _bounce, array, home)``; the
              handler runs inline on context 1's engine and sends the array
              back with ``mf.rsr(home, _arrive, array)``; ``_arrive`` runs
              inline on context 0, copies the array into the user array and
              counts the arrival; context 0 waits by driving its engine
              (``engine.driver.run_until``, what ``Future.result`` uses)
  new thread  the same with ``thread="new"`` for both handlers: a new
              lightweight thread per handler
  hand-coded  the same bytes on the same kind of socket with no runtime: an
              8-byte length, then the raw bytes, received with ``recv_into``
              straight into a preallocated numpy array at both ends. Both
              ends wait as the ``local`` transport does: non-blocking sockets,
              poll for ``spin_us`` (the session's setting, 50 by default),
              yielding the core between polls, then sleep in ``poll``; a
              process that finds itself preempted stops spinning for 10 ms.
              ``local``: an AF_UNIX socketpair with a forked child; ``tcp``:
              TCP over loopback with TCP_NODELAY; ``mpi``: mpi4py's rows
  mpi4py      ``comm.Send``/``comm.Recv`` of the numpy buffer between two ranks
              under ``mpiexec -n 2``, into preallocated arrays (when mpi4py and
              an ``mpiexec`` are present)

Every transport in :data:`TRANSPORTS` (and any other registered one but
``inproc``) gets a table when its module imports and its launcher starts two
contexts; the others are listed as "not available" with the reason. Each
transport runs in a fresh interpreter of its own; ``mpi`` in a job of
``mpiexec -n 2``, as MPI programs are run (rank 0 measures, rank 1 is
context 1; on one host the ranks talk through shared-memory rings). Within it, every message
size is measured in batches, and each batch runs the three variants one after
the other in a rotating order, so that all three see the same moments of a
shared machine. A time is the median over every round trip of a variant; a
ratio is the median over batches of that batch's own ratio of medians.

Run ``macroflow bench nexus [--quick] [--json FILE]``;
``python -m macroflow.bench.nexus results.json`` prints a saved run as Markdown.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import platform
import select
import signal
import socket
import statistics
import struct
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

import macroflow as mf
from macroflow.bench import json_problem, progress_printer, suite_main, write_json
from macroflow.bench.baselines import _die_with_parent, fork_child

#: message sizes, in float64 elements: 8 B, 128 B, 1 KiB, 8 KiB, 64 KiB, 512 KiB, 1 MiB
SIZES = (1, 16, 128, 1024, 8192, 65536, 131072)
#: transports tried, in this order; other registered ones (but inproc) follow
TRANSPORTS = ("local", "tcp", "mpi")
VARIANTS = ("inline", "new", "hand")
TITLES = {"inline": "inline", "new": "new thread", "hand": "hand-coded"}
#: the socket of each transport's hand-coded rows ("mpi": mpi4py's figures stand for them)
HAND_SOCKETS = {"local": "unix", "tcp": "tcp"}
HAND_LABELS = {"local": "AF_UNIX socketpair", "tcp": "TCP loopback, TCP_NODELAY",
               "mpi": "mpi4py Send/Recv under mpiexec -n 2"}
PAPER = "Nexus 1994: inline ~15% below PVM; new thread +40% small, +10-20% large"
PAPER_DETAIL = {
    "figure": "Figure 3: round-trip time against message size, two Sun 10s, Solaris 2.3, Ethernet",
    "inline_vs_pvm": "execution times consistently lower by about 15% (preallocated thread)",
    "new_vs_inline": "higher when a thread is created: about 40% for small messages, "
                     "10 to 20% for larger ones",
}
#: (key, label, limit): a bar passes when its ratio is at most the limit
BARS = (
    ("inline_8b", "inline <= 2x hand-coded at 8 B", 2.0),
    ("inline_large", "inline <= 1.2x hand-coded from 64 KiB up (worst size)", 1.2),
    ("new_vs_inline", "new thread <= 1.5x inline (worst size)", 1.5),
)
LARGE = 64 * 1024  # bytes from which the large-message bar applies
_RESULT_TAG = "MACROFLOW-BENCH-NEXUS-RESULT "
_LEN = struct.Struct("<Q")
_STOP = 2**64 - 1  # a length that ends the hand-coded echo process
_SOCKBUF = 4 * 2**20  # what the local transport asks for
_PREEMPTED = 1e-3  # the local transport's rule: a gap this long between two polls ...
_CALM = 0.01  # ... stops spinning for this long
SPIN_GROWTH = 20  # and its spin grows to at most this many times spin_us


class Config:
    """How much each size is measured; ``FULL`` and ``QUICK`` are the two presets.

    ``iters`` is the number of round trips per variant per batch, by message size.
    """

    def __init__(self, name: str, batches: int, iters_small: int, iters_mid: int,
                 iters_large: int, warmup: int, timeout_s: float):
        self.name = name
        self.batches = batches
        self.iters_small = iters_small
        self.iters_mid = iters_mid
        self.iters_large = iters_large
        self.warmup = warmup
        self.timeout_s = timeout_s

    def iters(self, nbytes: int) -> int:
        """Round trips per variant per batch for a message of ``nbytes``.

        Example:
            >>> QUICK.iters(8), QUICK.iters(64 * 1024), QUICK.iters(2**20)
            (20, 10, 6)
        """
        if nbytes < LARGE:
            return self.iters_small
        return self.iters_mid if nbytes < 2**19 else self.iters_large

    def as_dict(self) -> Dict[str, Any]:
        return dict(vars(self))


FULL = Config("full", batches=30, iters_small=200, iters_mid=60, iters_large=30, warmup=50,
              timeout_s=600)
QUICK = Config("quick", batches=2, iters_small=20, iters_mid=10, iters_large=6, warmup=3,
               timeout_s=120)


def size_label(nbytes: int) -> str:
    """A message size as the tables print it.

    Example:
        >>> [size_label(8 * n) for n in SIZES]
        ['8 B', '128 B', '1 KiB', '8 KiB', '64 KiB', '512 KiB', '1 MiB']
    """
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def transport_names() -> List[str]:
    """The transports to try: :data:`TRANSPORTS`, then any other registered one but inproc.

    Example:
        >>> transport_names()[:3]
        ['local', 'tcp', 'mpi']
    """
    from macroflow.transport.base import REGISTRY
    return list(TRANSPORTS) + sorted(n for n in REGISTRY if n not in TRANSPORTS and n != "inproc")


def module_problem(name: str) -> Optional[str]:
    """Why transport ``name``'s protocol module cannot be used here, or None.

    Example:
        >>> module_problem("local") is None
        True
        >>> module_problem("carrier-pigeon")  # doctest: +ELLIPSIS
        "no transport 'carrier-pigeon' is registered (registered: inproc, local, ...)"
    """
    from macroflow.launch import load_transport
    from macroflow.transport.base import REGISTRY
    if name not in REGISTRY:
        return f"no transport {name!r} is registered (registered: {', '.join(sorted(REGISTRY))})"
    try:
        mod = load_transport(name)
    except Exception as e:  # ImportError, or anything its import raised
        return f"its module {REGISTRY[name]} does not import: {type(e).__name__}: {e}"
    if not callable(getattr(mod, "launcher", None)):
        return f"its module {REGISTRY[name]} defines no launcher(session)"
    return None


def find_mpiexec() -> Optional[str]:
    """The ``mpiexec`` for the mpi4py rows (the peers suite's choice), or None.

    Example:
        >>> path = find_mpiexec()
        >>> path is None or os.access(path, os.X_OK)
        True
    """
    from macroflow.bench.peers import find_mpiexec as find
    return find()


def mpi4py_problem() -> Optional[str]:
    """Why the mpi4py rows cannot run here, or None.

    Example:
        >>> mpi4py_problem() is None or "mpi" in mpi4py_problem()
        True
    """
    if importlib.util.find_spec("mpi4py") is None:
        return "mpi4py is not installed (pip install mpi4py mpich)"
    if find_mpiexec() is None:
        return "mpiexec not found beside this Python nor on PATH (pip install mpich)"
    return None


# --------------------------------------------------------------------------- statistics


def _median(xs: Sequence[float]) -> Optional[float]:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    return float(statistics.median(xs)) if xs else None


def summarize(samples_ns: Sequence[float]) -> Dict[str, float]:
    """Median, 10th and 90th percentile (microseconds) and count of round-trip samples (ns).

    Example:
        >>> summarize([1000, 2000, 3000, 4000, 100000])["median_us"]
        3.0
    """
    us = np.asarray(samples_ns, dtype=np.float64) / 1e3
    return {"median_us": float(np.median(us)), "p10_us": float(np.percentile(us, 10)),
            "p90_us": float(np.percentile(us, 90)), "n": int(us.size)}


def paired_ratio(num: Sequence[float], den: Sequence[float]) -> Optional[float]:
    """The median over batches of ``num[b] / den[b]`` (each a batch's median).

    Example:
        >>> paired_ratio([10.0, 40.0, 30.0], [5.0, 10.0, 10.0])
        3.0
        >>> paired_ratio([], []) is None
        True
    """
    return _median([a / b for a, b in zip(num, den) if a and b])


# --------------------------------------------------------------------------- hand-coded


class Wire:
    """Length-prefixed raw bytes over a non-blocking stream socket, waiting as
    the ``local`` transport waits: poll for ``spin_us`` (yielding the core
    between polls), then sleep in ``poll``; preempted, stop spinning a while.
    With ``grow`` (the transport with rings) the poll lasts longer after a
    wait that ended soon after it gave up, as the transport's does; ``tcp``
    does not grow its own.

    Example:
        >>> a, b = socket.socketpair()
        >>> wa, wb = Wire(a, 50), Wire(b, 50)
        >>> wa.send_msg(memoryview(np.arange(3.0)).cast("B"))
        >>> out = np.zeros(3)
        >>> wb.recv_msg(memoryview(out).cast("B")); out
        array([0., 1., 2.])
        >>> a.close(); b.close()
    """

    def __init__(self, sock: socket.socket, spin_us: float, grow: bool = True):
        self.sock = sock
        self.grow = grow
        sock.setblocking(False)
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            try:
                sock.setsockopt(socket.SOL_SOCKET, opt, _SOCKBUF)
            except OSError:
                pass
        self.spin_s = spin_us / 1e6
        self.spin_cur = self.spin_s  # grown and shrunk as the local transport's is
        self.calm_until = 0.0
        self.poller = select.poll()
        self.poller.register(sock, select.POLLIN)
        self.hdr = bytearray(_LEN.size)
        self.hdrmv = memoryview(self.hdr)

    def send_msg(self, data: memoryview, length: Optional[int] = None) -> None:
        """Send a length header and ``data`` (one ``sendmsg`` unless the socket is full)."""
        parts = [memoryview(_LEN.pack(data.nbytes if length is None else length)), data]
        while parts:
            try:
                sent = self.sock.sendmsg(parts)
            except BlockingIOError:
                select.select([], [self.sock], [])
                continue
            while parts and sent >= parts[0].nbytes:
                sent -= parts.pop(0).nbytes
            if sent:
                parts[0] = parts[0][sent:]

    def recv_length(self) -> int:
        """Receive the next length header."""
        self._recv_into(self.hdrmv)
        return _LEN.unpack(self.hdr)[0]

    def recv_msg(self, into: memoryview) -> None:
        """Receive a message that must be exactly ``into.nbytes`` long, straight into ``into``."""
        n = self.recv_length()
        if n != into.nbytes:
            raise RuntimeError(f"hand-coded: a {n}-byte message, expected {into.nbytes}")
        self._recv_into(into)

    def _recv_into(self, view: memoryview) -> None:
        got, want = 0, view.nbytes
        recv_into = self.sock.recv_into
        while got < want:
            try:
                n = recv_into(view[got:] if got else view)
            except BlockingIOError:
                self._wait()
                continue
            if n == 0:
                raise EOFError("hand-coded: the other end closed the connection")
            got += n

    def _wait(self) -> None:
        now = time.perf_counter()
        if self.spin_s > 0.0 and now >= self.calm_until:
            deadline, last = now + self.spin_cur, now
            poll, clock, yield_ = self.poller.poll, time.perf_counter, os.sched_yield
            while True:
                yield_()
                if poll(0):
                    return
                t = clock()
                if t - last > _PREEMPTED:
                    self.calm_until = t + _CALM
                    break
                if t > deadline:
                    break
                last = t
        self.poller.poll(-1)  # POLLHUP wakes it too when the other end goes
        if self.grow and self.spin_s > 0.0:
            waited = time.perf_counter() - now
            if waited <= SPIN_GROWTH * self.spin_s:
                self.spin_cur = min(SPIN_GROWTH * self.spin_s, max(self.spin_cur, 1.5 * waited))
            else:
                self.spin_cur = max(self.spin_s, 0.5 * self.spin_cur)


def _echo(wire: Wire, capacity: int) -> None:
    buf = np.empty(capacity, dtype=np.uint8)  # the echo end's user array
    mv = memoryview(buf)
    while True:
        n = wire.recv_length()
        if n == _STOP:
            return
        view = mv[:n]
        wire._recv_into(view)
        wire.send_msg(view)


class HandCoded:
    """A forked process that sends back every message it receives: no macroflow in between.

    ``kind`` is "unix" (an AF_UNIX socketpair) or "tcp" (TCP over loopback with
    TCP_NODELAY at both ends). Use it as a context manager; :meth:`bounce` is
    one round trip.

    Example:
        >>> src, out = np.arange(4.0), np.zeros(4)
        >>> with HandCoded("unix", capacity=32, spin_us=50) as h:
        ...     h.bounce(src, out)
        >>> out
        array([0., 1., 2., 3.])
    """

    def __init__(self, kind: str, capacity: int, spin_us: float):
        if kind not in ("unix", "tcp"):
            raise ValueError(f"kind must be 'unix' or 'tcp'; got {kind!r}")
        self.kind, self.capacity, self.spin_us = kind, capacity, spin_us
        self.pid: Optional[int] = None
        self.wire: Optional[Wire] = None

    def __enter__(self) -> "HandCoded":
        listener = mine = theirs = None
        if self.kind == "unix":
            mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        else:
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            listener.bind(("127.0.0.1", 0))
            listener.listen(1)
        ppid = os.getpid()
        pid = fork_child()
        if pid == 0:  # the echo process
            code = 1
            try:
                _die_with_parent(ppid)
                if listener is not None:
                    theirs = socket.create_connection(listener.getsockname(), timeout=30)
                    listener.close()
                    theirs.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                else:
                    mine.close()
                _echo(Wire(theirs, self.spin_us, self.kind == "unix"), self.capacity)
                code = 0
            except BaseException:
                import traceback
                traceback.print_exc()
            finally:
                sys.stderr.flush()
                os._exit(code)
        self.pid = pid
        try:
            if listener is not None:
                listener.settimeout(30)
                mine, _ = listener.accept()
                listener.close()
                mine.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            else:
                theirs.close()
            self.wire = Wire(mine, self.spin_us, self.kind == "unix")
        except BaseException:
            self._kill()
            raise
        return self

    def bounce(self, src: np.ndarray, out: np.ndarray) -> None:
        """Send ``src`` to the echo process and receive what comes back into ``out``."""
        w = self.wire
        w.send_msg(memoryview(src).cast("B"))
        w.recv_msg(memoryview(out).cast("B"))

    def __exit__(self, *exc: Any) -> None:
        if self.wire is not None:
            try:
                self.wire.send_msg(memoryview(b""), length=_STOP)
            except OSError:
                pass
            self.wire.sock.close()
            self.wire = None
        self._reap(clean=exc[0] is None)

    def _reap(self, clean: bool) -> None:
        if self.pid is None:
            return
        pid, self.pid = self.pid, None
        if not clean:
            _kill_pid(pid)
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        if clean and code != 0:
            raise RuntimeError(f"hand-coded echo process exited with status {code}")

    def _kill(self) -> None:
        if self.pid is not None:
            _kill_pid(self.pid)
            os.waitpid(self.pid, 0)
            self.pid = None


def _kill_pid(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


# --------------------------------------------------------------------------- macroflow


@mf.persistent
class Bouncer:
    """What the global pointer on context 1 names; the handlers do not touch it."""

    def ready(self) -> int:
        return mf.context_id()


class Sink:
    """The user array on context 0 and a count of arrivals (exported; the
    handler :func:`_arrive` fills it)."""

    def __init__(self) -> None:
        self.arr = np.zeros(0)
        self.arrived = 0


def _bounce(target: Any, data: np.ndarray, home: Any, thread: str) -> None:  # on context 1
    mf.rsr(home, _arrive, data, thread=thread)


def _arrive(sink: Sink, data: np.ndarray) -> None:  # on context 0
    sink.arr[...] = data
    sink.arrived += 1


def _check_same(out: np.ndarray, src: np.ndarray, who: str) -> None:
    if not np.array_equal(out, src):
        raise RuntimeError(f"{who}: {size_label(src.nbytes)} came back different")


def _pattern(n: int) -> np.ndarray:
    return np.random.default_rng(n).standard_normal(n)


def _measure(bouncers: Dict[str, Callable[[np.ndarray, np.ndarray], None]], cfg: Config,
             sizes: Sequence[int]) -> Dict[str, Any]:
    """Every size, batch by batch, each batch running every variant in a rotating order.

    ``bouncers[v](src, out)`` is one round trip of variant ``v``: ``src`` goes
    to the other end and what comes back lands in ``out``.
    """
    variants = list(bouncers)
    ns = time.perf_counter_ns
    out: Dict[str, Any] = {v: [] for v in variants}
    batch_medians: Dict[str, List[List[float]]] = {v: [] for v in variants}
    for n in sizes:
        arr = np.arange(n, dtype=np.float64)  # the user array, circulated
        src = _pattern(n)
        for v in variants:  # each path checked once, into a zeroed array
            got = np.zeros(n)
            bouncers[v](src, got)
            _check_same(got, src, TITLES.get(v, v))
            for _ in range(cfg.warmup):
                bouncers[v](arr, arr)
        k = cfg.iters(8 * n)
        samples: Dict[str, List[int]] = {v: [] for v in variants}
        meds: Dict[str, List[float]] = {v: [] for v in variants}
        for b in range(cfg.batches):
            order = variants[b % len(variants):] + variants[:b % len(variants)]
            for v in order:
                fn, batch = bouncers[v], []
                for _ in range(k):
                    t0 = ns()
                    fn(arr, arr)
                    batch.append(ns() - t0)
                samples[v] += batch
                meds[v].append(float(np.median(batch)) / 1e3)
        for v in variants:
            out[v].append(summarize(samples[v]))
            batch_medians[v].append(meds[v])
    out["batch_medians_us"] = batch_medians
    return out


def _macroflow_bouncers(g1: Any, home: Any, sink: Sink) -> Dict[str, Callable]:
    from macroflow.core.context import current_engine
    drive = current_engine().driver.run_until
    rsr = mf.rsr

    def make(thread: str) -> Callable[[np.ndarray, np.ndarray], None]:
        def bounce(src: np.ndarray, out: np.ndarray) -> None:
            sink.arr = out
            k = sink.arrived + 1
            rsr(g1, _bounce, src, home, thread, thread=thread)
            drive(lambda: sink.arrived >= k)
        return bounce

    return {"inline": make("inline"), "new": make("new")}


def _worker(transport: str, cfg: Config, sizes: Sequence[int] = SIZES) -> Dict[str, Any]:
    """One transport in this process: start two contexts, measure, stop.

    Returns the figures, or ``{"unavailable": why}`` when the transport's
    module or launcher does not work here.
    """
    from macroflow.launch import spin_us_setting
    problem = module_problem(transport)
    if problem is not None:
        return {"unavailable": problem}
    spin_us = spin_us_setting()
    hand_kind = HAND_SOCKETS.get(transport)
    with contextlib.ExitStack() as stack:
        hand = None
        if hand_kind is not None:  # forked before the contexts, so it holds none of their sockets
            hand = stack.enter_context(HandCoded(hand_kind, 8 * max(sizes), spin_us))
        try:
            session = mf.init(contexts=2, transport=transport)
        except Exception as e:
            return {"unavailable": f"its launcher did not start 2 contexts: {type(e).__name__}: {e}"}
        stack.callback(session.close)
        try:
            b = Bouncer.create(on=1)
            where = b.ready().result(60)
        except Exception as e:
            return {"unavailable": f"a first call to context 1 failed: {type(e).__name__}: {e}"}
        if where != 1:
            raise RuntimeError(f"the bouncer runs on context {where}, not 1")
        sink = Sink()
        bouncers = _macroflow_bouncers(mf.info(b).gptr, mf.export(sink), sink)
        if hand is not None:
            bouncers["hand"] = hand.bounce
        res = _measure(bouncers, cfg, sizes)
    res["spin_us"] = spin_us
    return res


def _mpi_worker(cfg: Config, sizes: Sequence[int] = SIZES) -> Optional[Dict[str, Any]]:
    """Rank 0 and rank 1 of ``mpiexec -n 2``: Send/Recv bounces; rank 0 returns the figures."""
    from mpi4py import MPI
    import mpi4py
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    if comm.Get_size() != 2:
        raise RuntimeError(f"the mpi4py rows need 2 ranks, got {comm.Get_size()}")
    other = 1 - rank
    ns = time.perf_counter_ns
    figures, batch_medians = [], []
    for n in sizes:
        arr = np.arange(n, dtype=np.float64)  # each rank's user array
        if rank == 0:
            src, got = _pattern(n), np.zeros(n)
            comm.Send(src, dest=other)
            comm.Recv(got, source=other)
            _check_same(got, src, "mpi4py")
        else:
            comm.Recv(arr, source=other)
            comm.Send(arr, dest=other)
        k = cfg.iters(8 * n)
        samples, meds = [], []
        for _ in range(cfg.warmup + cfg.batches * k):  # both ranks run the same count
            if rank == 0:
                t0 = ns()
                comm.Send(arr, dest=other)
                comm.Recv(arr, source=other)
                samples.append(ns() - t0)
            else:
                comm.Recv(arr, source=other)
                comm.Send(arr, dest=other)
        if rank == 0:
            samples = samples[cfg.warmup:]
            meds = [float(np.median(samples[i:i + k])) / 1e3 for i in range(0, len(samples), k)]
            figures.append(summarize(samples))
            batch_medians.append(meds)
    if rank != 0:
        return None
    library = " ".join(MPI.Get_library_version().splitlines()[0].split())
    return {"mpi4py": figures, "batch_medians_us": {"mpi4py": batch_medians},
            "version": f"mpi4py {mpi4py.__version__}, {library}"}


# --------------------------------------------------------------------------- the suite (parent)


def _spawn(args: List[str], cfg: Config, mpiexec: Optional[str] = None) -> Dict[str, Any]:
    """Run a worker in a fresh interpreter (under ``mpiexec -n 2`` if given); its result."""
    from macroflow.bench import spawn_worker
    return spawn_worker("macroflow.bench.nexus", [*args, "--config", json.dumps(cfg.as_dict())],
                        cfg.timeout_s, _RESULT_TAG, mpiexec)


def _ratios(medians: Dict[str, List[List[float]]], a: str, b: str) -> List[Optional[float]]:
    return [paired_ratio(x, y) for x, y in zip(medians[a], medians[b])]


def evaluate_bars(sizes_bytes: Sequence[int], inline_hand: Sequence[Optional[float]],
                  new_inline: Sequence[Optional[float]]) -> List[Dict[str, Any]]:
    """Judge one transport's ratios (one per size) against :data:`BARS`.

    A bar whose ratios were not measured (no hand-coded rows, or no size in
    its range) is left out.

    Example:
        >>> bars = evaluate_bars([8, 2**16, 2**20], [2.5, 1.1, 1.3], [1.4, 1.2, 1.1])
        >>> [(b["key"], b["ratio"], b["pass"]) for b in bars]
        [('inline_8b', 2.5, False), ('inline_large', 1.3, False), ('new_vs_inline', 1.4, True)]
    """
    out = []
    picks = {
        "inline_8b": [r for s, r in zip(sizes_bytes, inline_hand) if s == 8],
        "inline_large": [r for s, r in zip(sizes_bytes, inline_hand) if s >= LARGE],
        "new_vs_inline": list(new_inline),
    }
    for key, label, limit in BARS:
        vals = [r for r in picks[key] if r is not None]
        if not vals:
            continue
        worst = max(vals)
        out.append({"key": key, "label": label, "ratio": worst, "limit": limit,
                    "pass": worst <= limit})
    return out


def run(quick: bool = False, progress: Callable[[str], None] = lambda s: None,
        sizes: Sequence[int] = SIZES) -> Dict[str, Any]:
    """Measure every available transport and mpi4py; the figures as a dict.

    Example:
        >>> run(sizes=[0])
        Traceback (most recent call last):
        ...
        ValueError: sizes are numbers of float64 elements >= 1; got [0]
    """
    if not sizes or any(not isinstance(n, int) or n < 1 for n in sizes):
        raise ValueError(f"sizes are numbers of float64 elements >= 1; got {list(sizes)}")
    cfg = QUICK if quick else FULL
    started = time.perf_counter()
    sizes = list(sizes)
    nbytes = [8 * n for n in sizes]
    load = [os.getloadavg()[0]]
    transports: Dict[str, Dict[str, Any]] = {}
    for name in transport_names():
        problem = module_problem(name)
        if problem is None:
            progress(f"transport {name}")
            args = ["--worker", name, "--sizes", ",".join(map(str, sizes))]
            if name == "mpi":
                # as MPI is run: ranks of one mpiexec job (on one host they
                # share memory rings), like the mpi4py rows it is judged by
                mpiexec = find_mpiexec()
                res = _spawn(args, cfg, mpiexec=mpiexec) if mpiexec else \
                    {"unavailable": "mpiexec not found beside this Python nor on PATH"}
            else:
                res = _spawn(args, cfg)
        else:
            res = {"unavailable": problem}
        transports[name] = _transport_entry(name, res)
    load.append(os.getloadavg()[0])
    problem = mpi4py_problem()
    if problem is None:
        progress("mpi4py under mpiexec -n 2")
        res = _spawn(["--mpi-worker", "--sizes", ",".join(map(str, sizes))], cfg,
                     mpiexec=find_mpiexec())
    else:
        res = {"unavailable": problem}
    mpi = _mpi_entry(res)
    mpi_t = transports.get("mpi")
    if mpi_t is not None and mpi_t["status"] == "measured" and mpi["status"] == "measured":
        # mpi4py's own Send/Recv is the hand-coded floor of the mpi transport (another run)
        mpi_t["results"]["hand"] = mpi["results"]
        mpi_t["ratios"]["inline_hand"] = [
            (a["median_us"] / h["median_us"]) if h["median_us"] else None
            for a, h in zip(mpi_t["results"]["inline"], mpi["results"])]
    for entry in transports.values():
        if entry["status"] == "measured":
            entry["bars"] = evaluate_bars(nbytes, entry["ratios"]["inline_hand"],
                                          entry["ratios"]["new_inline"])
    return {
        "meta": {"suite": "nexus", "quick": quick, "config": cfg.as_dict(),
                 "python": platform.python_version(), "platform": platform.platform(),
                 "cpus": os.cpu_count(), "numpy": np.__version__, "macroflow": mf.__version__,
                 "time": time.strftime("%Y-%m-%d %H:%M:%S"),
                 "elapsed_s": time.perf_counter() - started, "loadavg_1min": load,
                 "statistic": "time: median over every round trip of the variant; ratio: median "
                              "over batches of that batch's ratio of medians"},
        "sizes": [{"doubles": n, "bytes": b, "label": size_label(b)} for n, b in zip(sizes, nbytes)],
        "paper": dict(PAPER_DETAIL, summary=PAPER),
        "transports": transports,
        "mpi4py": mpi,
    }


def _transport_entry(name: str, res: Dict[str, Any]) -> Dict[str, Any]:
    hand = HAND_LABELS.get(name)
    if "unavailable" in res:
        return {"status": "not available", "reason": res["unavailable"], "hand_coded": hand}
    if "error" in res:
        return {"status": "failed", "reason": res["error"], "hand_coded": hand}
    med = res["batch_medians_us"]
    results = {v: res[v] for v in VARIANTS if v in res}
    ratios = {"inline_hand": _ratios(med, "inline", "hand") if "hand" in med
              else [None] * len(med["inline"]),
              "new_inline": _ratios(med, "new", "inline")}
    return {"status": "measured", "reason": "", "hand_coded": hand, "spin_us": res.get("spin_us"),
            "results": results, "ratios": ratios, "batch_medians_us": med}


def _mpi_entry(res: Dict[str, Any]) -> Dict[str, Any]:
    if "unavailable" in res:
        return {"status": "not available", "reason": res["unavailable"]}
    if "error" in res:
        return {"status": "failed", "reason": res["error"]}
    return {"status": "measured", "reason": "", "version": res.get("version", ""),
            "results": res["mpi4py"], "batch_medians_us": res["batch_medians_us"]["mpi4py"]}


# --------------------------------------------------------------------------- printing


def _us(v: Optional[float]) -> str:
    if v is None:
        return "n/a"
    return f"{v:,.0f}" if v >= 100 else f"{v:.1f}"


def _x(v: Optional[float]) -> str:
    return "n/a" if v is None else f"{v:.2f}x"


def _table(res: Dict[str, Any], name: str) -> Tuple[List[str], List[List[str]]]:
    e = res["transports"][name]
    headers = ["size", "inline, us", "new thread, us", "hand-coded, us", "inline/hand", "new/inline"]
    rows = []
    hand = e["results"].get("hand")
    for i, s in enumerate(res["sizes"]):
        rows.append([s["label"], _us(e["results"]["inline"][i]["median_us"]),
                     _us(e["results"]["new"][i]["median_us"]),
                     _us(hand[i]["median_us"]) if hand else "n/a",
                     _x(e["ratios"]["inline_hand"][i]), _x(e["ratios"]["new_inline"][i])])
    return headers, rows


def _mpi_table(res: Dict[str, Any]) -> Tuple[List[str], List[List[str]]]:
    m = res["mpi4py"]
    rows = [[s["label"], _us(r["median_us"]), _us(r["p10_us"]), _us(r["p90_us"])]
            for s, r in zip(res["sizes"], m["results"])]
    return ["size", "Send/Recv, us", "p10", "p90"], rows


def _ours(e: Dict[str, Any]) -> str:
    ih, ni = e["ratios"]["inline_hand"], e["ratios"]["new_inline"]
    parts = []
    if any(r is not None for r in ih):
        parts.append(f"inline/hand-coded {_x(ih[0])} at the smallest size, {_x(ih[-1])} at the largest")
    parts.append(f"new thread/inline {_x(ni[0])} at the smallest, {_x(ni[-1])} at the largest")
    return "; ".join(parts)


def _text_table(headers: List[str], rows: List[List[str]]) -> List[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    line = lambda cells: "  ".join(c.ljust(w) if i == 0 else c.rjust(w)  # noqa: E731
                                   for i, (c, w) in enumerate(zip(cells, widths)))
    return [line(headers), "  ".join("-" * w for w in widths)] + [line(r) for r in rows]


def report(res: Dict[str, Any], out: Any = None) -> None:
    """Print one table per measured transport with its bars, the mpi4py table, and
    a "not available" line for each transport that could not run.

    Example:
        >>> import io
        >>> buf = io.StringIO()
        >>> report(_example_result(), buf)
        >>> print(buf.getvalue())  # doctest: +ELLIPSIS +NORMALIZE_WHITESPACE
        macroflow bench nexus (quick): ...
        local: macroflow RSR vs hand-coded AF_UNIX socketpair, round trip (median)
        size  inline, us  new thread, us  hand-coded, us  inline/hand  new/inline
        ...
        8 B   80.0  120  20.0  4.00x  1.50x
        ...
          FAIL  inline <= 2x hand-coded at 8 B: 4.00x (limit 2x)
        ...
        tcp: not available: no transport 'tcp' is registered ...
        mpi4py: not available: mpi4py is not installed ...
    """
    out = out or sys.stdout
    meta = res["meta"]
    print(f"macroflow bench nexus ({'quick' if meta['quick'] else 'full'}): {meta['platform']}, "
          f"{meta['cpus']} cpus, python {meta['python']}, {meta['elapsed_s']:.0f} s, "
          f"1-minute load average {', '.join(f'{x:.2f}' for x in meta['loadavg_1min'])}", file=out)
    print("Nexus's Figure 3: an array of float64 circulated between two contexts, starting and "
          "finishing in a user array", file=out)
    for name, e in res["transports"].items():
        if e["status"] != "measured":
            continue
        hand = e["hand_coded"] or "none"
        print(f"\n{name}: macroflow RSR vs hand-coded {hand}, round trip (median)", file=out)
        for line in _text_table(*_table(res, name)):
            print(line, file=out)
        print(f"  paper: {PAPER}", file=out)
        print(f"  ours:  {_ours(e)}", file=out)
        for b in e["bars"]:
            print(f"  {'PASS' if b['pass'] else 'FAIL'}  {b['label']}: {_x(b['ratio'])} "
                  f"(limit {b['limit']:g}x)", file=out)
        if not any(b["key"].startswith("inline") for b in e["bars"]):
            print("  (no hand-coded rows for this transport: its inline bars are not judged)", file=out)
    if res["mpi4py"]["status"] == "measured":
        print(f"\nmpi4py Send/Recv under mpiexec -n 2 ({res['mpi4py']['version']}), round trip",
              file=out)
        for line in _text_table(*_mpi_table(res)):
            print(line, file=out)
    print("", file=out)
    for name, e in res["transports"].items():
        if e["status"] != "measured":
            print(f"{name}: {e['status']}: {e['reason']}", file=out)
    if res["mpi4py"]["status"] != "measured":
        print(f"mpi4py: {res['mpi4py']['status']}: {res['mpi4py']['reason']}", file=out)


def markdown(res: Dict[str, Any]) -> str:
    """The tables of :func:`report` as Markdown, for docs/benchmarks.md.

    Example:
        >>> print(markdown(_example_result()).splitlines()[2])
        | size | inline, us | new thread, us | hand-coded, us | inline/hand | new/inline |
    """
    meta = res["meta"]
    lines = [f"Run: {meta['time']}, {meta['platform']}, {meta['cpus']} cpus, python {meta['python']}, "
             f"numpy {meta.get('numpy', '?')}, {meta['config']['name']} ({meta['config']['batches']} "
             f"batches), {meta['elapsed_s']:.0f} s, 1-minute load average "
             f"{', '.join(f'{x:.2f}' for x in meta['loadavg_1min'])}.", ""]
    for name, e in res["transports"].items():
        if e["status"] != "measured":
            continue
        headers, rows = _table(res, name)
        lines += ["| " + " | ".join(headers) + " |", "| --- |" + " ---: |" * (len(headers) - 1)]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        spin = e.get("spin_us")
        lines += ["", f"`{name}`, hand-coded: {e['hand_coded']}, spin_us "
                      f"{'n/a' if spin is None else format(spin, 'g')}. "
                      f"Paper: {PAPER}. Ours: {_ours(e)}.", ""]
        lines += [f"- **{'PASS' if b['pass'] else 'FAIL'}** {b['label']}: {_x(b['ratio'])} "
                  f"(limit {b['limit']:g}x)" for b in e["bars"]]
        lines.append("")
    if res["mpi4py"]["status"] == "measured":
        headers, rows = _mpi_table(res)
        lines += [f"mpi4py Send/Recv under `mpiexec -n 2` ({res['mpi4py']['version']}):", "",
                  "| " + " | ".join(headers) + " |", "| --- |" + " ---: |" * (len(headers) - 1)]
        lines += ["| " + " | ".join(r) + " |" for r in rows]
        lines.append("")
    for name, e in res["transports"].items():
        if e["status"] != "measured":
            lines.append(f"- `{name}`: {e['status']}: {e['reason']}")
    if res["mpi4py"]["status"] != "measured":
        lines.append(f"- mpi4py: {res['mpi4py']['status']}: {res['mpi4py']['reason']}")
    return "\n".join(lines) + "\n"


def _example_result() -> Dict[str, Any]:
    """A small result of the shape :func:`run` returns, for the examples."""
    sizes = [1, 131072]
    nbytes = [8 * n for n in sizes]
    fig = lambda us: {"median_us": us, "p10_us": us, "p90_us": us, "n": 10}  # noqa: E731
    ih, ni = [4.0, 1.1], [1.5, 1.05]
    local = {"status": "measured", "reason": "", "hand_coded": HAND_LABELS["local"], "spin_us": 50.0,
             "results": {"inline": [fig(80.0), fig(1100.0)], "new": [fig(120.0), fig(1155.0)],
                         "hand": [fig(20.0), fig(1000.0)]},
             "ratios": {"inline_hand": ih, "new_inline": ni},
             "bars": evaluate_bars(nbytes, ih, ni)}
    return {"meta": {"quick": True, "platform": "Linux", "cpus": 2, "python": "3.11", "numpy": "2",
                     "config": {"name": "quick", "batches": 2}, "elapsed_s": 9.0,
                     "time": "2000-01-01 00:00:00", "loadavg_1min": [0.5, 0.6]},
            "sizes": [{"doubles": n, "bytes": b, "label": size_label(b)} for n, b in zip(sizes, nbytes)],
            "transports": {"local": local,
                           "tcp": {"status": "not available", "hand_coded": HAND_LABELS["tcp"],
                                   "reason": "no transport 'tcp' is registered (registered: "
                                             "inproc, local)"}},
            "mpi4py": {"status": "not available",
                       "reason": "mpi4py is not installed (pip install mpi4py mpich)"}}


def main(json_path: Optional[str] = None, quick: bool = False) -> int:
    """Run the suite, print it, optionally write the JSON; returns an exit code.

    0 when every transport that could start was measured (whatever the bars
    say), 1 when one failed while it was measured.

    Example:
        >>> main(json_path="/nonexistent/dir/out.json")
        2
    """
    if json_path is not None:
        problem = json_problem(json_path)
        if problem is not None:  # found now, not after minutes of measuring
            print(f"macroflow bench nexus: --json {json_path}: {problem}", file=sys.stderr)
            return 2

    progress = progress_printer("nexus")
    res = run(quick=quick, progress=progress)
    report(res)
    write_json(res, json_path)
    failed = [e for e in res["transports"].values() if e["status"] == "failed"]
    return 1 if failed or res["mpi4py"]["status"] == "failed" else 0


def _worker_main(argv: List[str]) -> int:
    cfg = Config(**json.loads(argv[argv.index("--config") + 1]))
    sizes = [int(x) for x in argv[argv.index("--sizes") + 1].split(",")]
    if "--mpi-worker" in argv:
        res = _mpi_worker(cfg, sizes)
    else:
        res = _worker(argv[argv.index("--worker") + 1], cfg, sizes)
    if res is not None:
        print(_RESULT_TAG + json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    # The importable module, so that the handlers and Bouncer pickle by reference.
    from macroflow.bench import nexus as _suite
    sys.exit(suite_main(_suite, ["--worker", "--mpi-worker"], sys.argv))
