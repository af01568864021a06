"""``macroflow bench tulip``: the figures of Tulip (Beckman and Gannon, 1996) for macroflow.

Each figure is printed beside the paper's own, and every ratio compares two
things measured in the same run:

  Figure 1     ``mf.get`` of 8 B to 1 MiB from context 1, whose SPMD function
               loops on ``mf.poll()`` (busy, as the SP2's owner in the paper),
               from memory registered as a plain numpy array (the kernel's
               cross-process copy) and from ``mf.shared_empty`` (a shared
               mapping); against two-sided send and receive (``local``: a
               hand-coded request and reply on an AF_UNIX socketpair with a
               forked process; ``mpi``: mpi4py ``Send`` of a request and
               ``Ssend``/``Recv`` of the data under ``mpiexec -n 2``) and the
               plain copy (``local``: ``np.copyto`` from a shared mapping in
               one process; ``mpi``: ``MPI_Get`` from a ``Win.Allocate`` window
               under ``mpiexec -n 2``)
  Section 4.2  a remote action ping-pong between contexts 0 and 1 while both
               wait in a barrier (context 2 asks context 0 to run it), against
               an ``mf.rsr`` ping-pong (rsr there, rsr back) between two
               idle contexts
  Figure 2     ``mf.barrier()`` of 2, 4 and 8 contexts, arrivals
               synchronised, randomly staggered and one late, against
               ``MPI_Barrier`` (mpi4py under ``mpiexec -n N``)
  Figure 3     :class:`macroflow.spmd.shmbarrier.ShmBarrier`, padded, packed
               and central, between 2, 4 and 8 forked processes in a tight loop

Bars (PASS/FAIL): a get of 1 MiB within 1.25x the plain copy on the same
transport; ``mf.barrier()`` on ``mpi`` within 2x ``MPI_Barrier``
(synchronised arrivals, the worst number of contexts that does not
oversubscribe the cores: a polling barrier with more ranks than cores waits
for the scheduler, as the paper's machines, one process a node, never did;
the table shows those rows); the remote action
ping-pong within 1.5x the rsr ping-pong. More contexts than cores are
marked "oversubscribed".

Every part runs in a fresh interpreter of its own (``python -m
macroflow.bench.tulip --worker ...``), MPI's under ``mpiexec``.

Run ``macroflow bench tulip [--quick] [--json FILE]``;
``python -m macroflow.bench.tulip results.json`` prints a saved run as Markdown.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import random
import signal
import socket
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

import macroflow as mf
from macroflow.bench import cores, json_problem, progress_printer, suite_main, write_json
from macroflow.bench.baselines import fork_child
from macroflow.bench.nexus import (_die_with_parent, _median, _us, _x, paired_ratio, size_label,
                                  summarize)
from macroflow.core.context import current_engine
from macroflow.spmd import memory
from macroflow.spmd.model import model_of

#: message sizes of Figure 1, in bytes: 8 B to 1 MiB, by 8, with the paper's 64 KiB
SIZES = (8, 64, 512, 4096, 32768, 65536, 262144, 1048576)
#: numbers of contexts of Figures 2 and 3
COUNTS = (2, 4, 8)
PATTERNS = ("synchronised", "staggered", "late")
LAYOUTS = ("padded", "packed", "central")
TRANSPORTS = ("local", "mpi")
#: Section 4.2's rows: remote actions while both contexts wait in a barrier, remote
#: actions between idle contexts (what the barrier adds), rsr there and back
RA_ROWS = ("ra", "ra_idle", "rsr")
#: Figure 1's rows
GET_ROWS = ("get_shm", "get_vm", "get_win", "get_msg", "two_sided", "copy")
#: Figure 1's ratios, as the table heads them
RATIO_TITLES = {"get_shm/copy": "shm/copy", "get_vm/copy": "process_vm/copy",
                "get_shm/two_sided": "shm/two-sided", "get_win/two_sided": "window/two-sided",
                "get_msg/two_sided": "message/two-sided"}
#: how each get row's gets may go (see macroflow.spmd.model.env_onesided)
ROW_PATHS = {"get_shm": "direct", "get_vm": "direct", "get_win": "window", "get_msg": "message"}
ROW_TITLES = {"get_shm": "get, shared_empty", "get_vm": "get, numpy (process_vm)",
              "get_win": "get, MPI window", "get_msg": "get, by message",
              "two_sided": "two-sided", "copy": "plain copy"}
TWO_SIDED = {"local": "hand-coded request and reply, AF_UNIX socketpair, forked process",
             "mpi": "mpi4py Send of a request, Ssend/Recv of the data, mpiexec -n 2"}
PLAIN_COPY = {"local": "np.copyto from the shared_empty memory the get reads, mapped by the "
                       "getter, while its owner polls",
              "mpi": "MPI_Get (Win.Allocate, Lock_all, Get, Flush), mpiexec -n 2"}
PAPER = {
    "figure1": "SP2: tulip_Get a small, nearly constant overhead above MPI_Ssend/MPI_Recv "
               "(the owner polls); at 64 KiB the SP2's MPI moved about 31.5 MB/s, the T3D's "
               "shmem_get about 35 MB/s",
    "remote_action": "ping-pong with both nodes waiting in the barrier and polling: "
                     "SP2 165 us, T3D 87.3 us",
    "figure2": "the T3D's hardware barrier never slower than 4 us (2 to 64 nodes); on the SP2 "
               "Tulip's polling barrier within about 2 to 3x MPI's blocking barrier; the three "
               "arrival patterns gave similar results",
    "figure3": "SGI Power Challenge: a tree within one 128-byte cache line was linear in the "
               "processors; nodes spread over lines made it faster than SGI's own barrier, "
               "itself near-linear (all fight for one resource)",
}
PAPER_FIGURES = {"sp2_mpi_64k_mb_s": 31.5, "t3d_shmem_get_64k_mb_s": 35.0, "ra_sp2_us": 165.0,
                 "ra_t3d_us": 87.3, "t3d_barrier_max_us": 4.0}
#: (key, label, limit): a bar passes when its ratio is at most the limit
BARS = (
    ("get_shm_1mib", "get of 1 MiB, shared_empty <= 1.25x the plain copy", 1.25),
    ("barrier_mpi", "mf.barrier on mpi <= 2x MPI_Barrier (synchronised, worst n not "
                    "oversubscribed)", 2.0),
    ("ra_pingpong", "remote action ping-pong in a barrier <= 1.5x rsr ping-pong", 1.5),
)
_RESULT_TAG = "MACROFLOW-BENCH-TULIP-RESULT "
_STOP = 2**64 - 1  # a request length that ends the hand-coded server
_LARGE = 65536  # bytes from which a size gets cfg.iters_large round trips
#: Figure 3: polls a waiter makes before it yields its core between polls (about 50 us)
SPIN_POLLS = 100


class Config:
    """How much each figure is measured; ``FULL`` and ``QUICK`` are the two presets."""

    def __init__(self, name: str, batches: int, iters_small: int, iters_large: int, warmup: int,
                 pingpongs: int, barriers: int, delay_us: float, shm_barriers: int,
                 rounds: int, timeout_s: float):
        self.name = name
        self.batches = batches  # Figure 1 and 4.2: batches, each running every row
        self.iters_small = iters_small  # gets per row per batch below 64 KiB
        self.iters_large = iters_large  # and from 64 KiB
        self.warmup = warmup
        self.pingpongs = pingpongs  # round trips per row per batch
        self.barriers = barriers  # Figure 2: barriers per pattern
        self.delay_us = delay_us  # staggered: up to this; late: this
        self.shm_barriers = shm_barriers  # Figure 3: barriers per measurement
        self.rounds = rounds  # Figures 2 and 3: every configuration once per round
        self.timeout_s = timeout_s  # per worker process

    def iters(self, nbytes: int) -> int:
        """Gets per row per batch for ``nbytes``.

        Example:
            >>> QUICK.iters(8), QUICK.iters(2**20)
            (20, 5)
        """
        return self.iters_small if nbytes < _LARGE else self.iters_large

    def as_dict(self) -> Dict[str, Any]:
        return dict(vars(self))


FULL = Config("full", batches=10, iters_small=150, iters_large=30, warmup=20, pingpongs=150,
              barriers=1000, delay_us=100.0, shm_barriers=3000, rounds=5, timeout_s=300)
QUICK = Config("quick", batches=2, iters_small=20, iters_large=5, warmup=3, pingpongs=20,
               barriers=15, delay_us=100.0, shm_barriers=200, rounds=1, timeout_s=120)


# --------------------------------------------------------------------------- helpers


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a and b else None


def _pattern(nbytes: int) -> np.ndarray:
    return np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)


def _spin_us(us: float) -> None:
    """Compute (a busy loop) for ``us`` microseconds."""
    end = time.perf_counter() + us * 1e-6
    while time.perf_counter() < end:
        pass


def _reap(pids: Sequence[int], kill: bool) -> List[int]:
    codes = []
    for pid in pids:
        if kill:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            codes.append(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
        except ChildProcessError:
            codes.append(-1)
    return codes


# --------------------------------------------------------------------------- Figure 1


class Fetcher:
    """A forked process that answers each request for ``n`` bytes with the
    first ``n`` bytes of its array: two-sided send and receive, no macroflow.

    The wire is :class:`macroflow.bench.nexus.Wire` (an 8-byte length, then
    raw bytes; both ends wait as the ``local`` transport does). Use it as a
    context manager; :meth:`fetch` is one request and its reply.

    Example:
        >>> out = np.zeros(16, np.uint8)
        >>> with Fetcher(64, spin_us=50) as f:
        ...     f.fetch(out)
        >>> bool((out == _pattern(64)[:16]).all())
        True
    """

    def __init__(self, capacity: int, spin_us: float):
        self.capacity, self.spin_us = capacity, spin_us
        self.pid: Optional[int] = None
        self.wire: Any = None

    def __enter__(self) -> "Fetcher":
        from macroflow.bench.nexus import Wire
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        ppid = os.getpid()
        pid = fork_child()
        if pid == 0:
            code = 1
            try:
                _die_with_parent(ppid)
                mine.close()
                wire = Wire(theirs, self.spin_us)
                data = memoryview(_pattern(self.capacity))
                while True:
                    n = wire.recv_length()
                    if n == _STOP:
                        break
                    wire.send_msg(data[:n])
                code = 0
            except BaseException:
                import traceback
                traceback.print_exc()
            finally:
                sys.stderr.flush()
                os._exit(code)
        self.pid = pid
        theirs.close()
        self.wire = Wire(mine, self.spin_us)
        return self

    def fetch(self, out: np.ndarray) -> None:
        """Ask for ``out.nbytes`` bytes and receive them into ``out``."""
        view = memoryview(out).cast("B")
        self.wire.send_msg(memoryview(b""), length=view.nbytes)
        self.wire.recv_msg(view)

    def __exit__(self, *exc: Any) -> None:
        if self.wire is not None:
            try:
                self.wire.send_msg(memoryview(b""), length=_STOP)
            except OSError:
                pass
            self.wire.sock.close()
            self.wire = None
        if self.pid is not None:
            code = _reap([self.pid], kill=exc[0] is not None)[0]
            self.pid = None
            if exc[0] is None and code != 0:
                raise RuntimeError(f"the hand-coded server exited with status {code}")


def _get_run(sizes: List[int], iters: List[int], warmup: int, check: bool,
             batch: int = 0, copy: bool = False) -> Any:
    """Figure 1's SPMD function (2 contexts): context 1 owns the memory and
    polls; context 0 times gets of each size, each kind in a block of its own
    (after its warm-up), the kinds' order rotating with ``batch``; with
    ``copy``, also the plain copy: ``np.copyto`` from the very shared memory
    the ``shared_empty`` get reads, mapped here, while context 1 polls as
    it does for the gets."""
    me, cap = mf.rank(), max(sizes)
    flag = np.zeros(1)
    mine = {}
    if me == 1:
        mine["get_shm"] = mf.shared_empty(cap, np.uint8)
        mine["get_vm"] = np.empty(cap, np.uint8)
        for a in mine.values():
            a[:] = _pattern(cap)
    own = [mf.register(flag)] + [mf.register(a) for a in mine.values()]
    ptrs = mf.allgather(own[0] if me == 0 else tuple(own))
    if me == 1:
        polls = 0
        while flag[0] == 0.0:  # busy: Tulip's owner calls tulip_Poll() in a loop
            mf.poll()
            polls += 1
        mf.barrier()
        for gp in own:
            mf.unregister(gp)
        return polls
    _, gp_shm, gp_vm = ptrs[1]
    # get_win: read through MPI's window (under mpiexec); get_msg: the owner
    # serves it; both as for memory on another host. A reply by message
    # lands in `out` (the receive posted before the request goes)
    model = model_of(current_engine())
    pointers = {"get_shm": gp_shm, "get_vm": gp_vm, "get_win": gp_vm, "get_msg": gp_vm}
    if not gp_vm.region.window or model.window() is None:
        del pointers["get_win"]
    view = memory.access().view(gp_shm.region) if copy else None
    if view is not None:
        pointers["copy"] = gp_shm  # (not a get: see below)
    out = np.empty(cap, np.uint8)
    clock = time.perf_counter_ns
    get = mf.get
    samples: Dict[str, List[List[int]]] = {k: [] for k in pointers}
    kinds = list(pointers)
    kinds = kinds[batch % len(kinds):] + kinds[:batch % len(kinds)]
    for s, k in zip(sizes, iters):
        o = out[:s]
        row: Dict[str, List[int]] = {}
        # a block per kind: interleaved, a kind that moves the bytes another
        # way (a socket, the kernel's copy) leaves the caches to the next one
        # in a state the plain copy it is compared with never sees
        for kind in kinds:
            if kind == "copy":
                row[kind] = _copy_block(o, view[:s], warmup, k,  # type: ignore[index]
                                        _pattern(cap)[:s] if check else None)
                continue
            g = pointers[kind][:s]
            model.onesided = ROW_PATHS[kind]
            if check:
                o[:] = 0
                get(g, out=o).wait()
                if not np.array_equal(o, _pattern(cap)[:s]):
                    raise RuntimeError(f"mf.get ({kind}) of {size_label(s)} read wrong bytes")
            for _ in range(warmup):
                get(g, out=o).wait()
            times = row[kind] = []
            for _ in range(k):
                t = clock()
                get(g, out=o).wait()
                times.append(clock() - t)
        for kind in pointers:
            samples[kind].append(row[kind])
    model.onesided = "direct"
    mf.put(ptrs[1][0], 1.0).wait()
    mf.barrier()
    mf.unregister(own[0])
    return samples


def _copy_block(o: np.ndarray, a: np.ndarray, warmup: int, k: int,
                expect: Optional[np.ndarray] = None) -> List[int]:
    """``k`` timed ``np.copyto(o, a)`` after ``warmup`` untimed ones (ns each);
    ``expect``: what ``o`` must then hold.

    Example:
        >>> len(_copy_block(np.empty(4, np.uint8), np.arange(4, dtype=np.uint8), 1, 3,
        ...                 np.arange(4, dtype=np.uint8)))
        3
    """
    clock = time.perf_counter_ns
    o[:] = 0
    for _ in range(max(warmup, 1)):
        np.copyto(o, a)
    if expect is not None and not np.array_equal(o, expect):
        raise RuntimeError(f"the plain copy of {size_label(len(a))} read wrong bytes")
    times = []
    for _ in range(k):
        t = clock()
        np.copyto(o, a)
        times.append(clock() - t)
    return times


def _get_worker(transport: str, cfg: Config, sizes: Sequence[int]) -> Dict[str, Any]:
    """Figure 1 on ``transport`` (this process is context 0): the get rows
    and (on ``local``) the plain copy, in one SPMD run, and the hand-coded two-sided row in the
    same batches, in a rotating order."""
    from macroflow.bench.nexus import module_problem
    from macroflow.launch import spin_us_setting
    problem = module_problem(transport)
    if problem is not None:
        return {"unavailable": problem}
    sizes = list(sizes)
    iters = [cfg.iters(s) for s in sizes]
    cap = max(sizes)
    spin_us = spin_us_setting()
    rows: List[str] = ["get"]  # both get rows come from one SPMD run
    src = mf.shared_empty(cap, np.uint8)
    src[:] = _pattern(cap)
    dst = np.zeros(cap, np.uint8)
    per_batch: Dict[str, List[List[List[int]]]] = {r: [] for r in GET_ROWS}  # [batch][size][sample]
    clock = time.perf_counter_ns
    with contextlib.ExitStack() as stack:
        fetcher = None
        if transport == "local":  # forked before the contexts, so it holds none of their sockets
            fetcher = stack.enter_context(Fetcher(cap, spin_us))
            rows += ["two_sided"]
        try:
            session = mf.init(contexts=2, transport=transport)
        except Exception as e:
            return {"unavailable": f"its launcher did not start 2 contexts: "
                                   f"{type(e).__name__}: {e}"}
        stack.callback(session.close)

        def two_sided(b: int) -> List[List[int]]:
            out = []
            for s, k in zip(sizes, iters):
                o = dst[:s]
                if b == 0:
                    o[:] = 0
                    fetcher.fetch(o)
                    if not np.array_equal(o, src[:s]):
                        raise RuntimeError(f"two-sided fetch of {size_label(s)} got wrong bytes")
                for _ in range(cfg.warmup):
                    fetcher.fetch(o)
                batch = []
                for _ in range(k):
                    t = clock()
                    fetcher.fetch(o)
                    batch.append(clock() - t)
                out.append(batch)
            return out

        for b in range(cfg.batches):
            order = rows[b % len(rows):] + rows[:b % len(rows)]
            for row in order:
                if row == "get":
                    got = mf.spmd(_get_run, sizes, iters, cfg.warmup, b == 0, b,
                                  transport == "local")[0]
                    for kind, samples in got.items():
                        per_batch[kind].append(samples)
                elif row == "two_sided":
                    per_batch["two_sided"].append(two_sided(b))
    return {"rows": {r: _size_figures(per_batch[r], len(sizes)) for r in GET_ROWS if per_batch[r]},
            "spin_us": spin_us}


def _size_figures(batches: List[List[List[int]]], nsizes: int) -> List[Dict[str, Any]]:
    """Per size: the summary over every sample, and each batch's median (us)."""
    out = []
    for i in range(nsizes):
        every = [x for batch in batches for x in batch[i]]
        fig = summarize(every)
        fig["batch_medians_us"] = [float(np.median(batch[i])) / 1e3 for batch in batches]
        out.append(fig)
    return out


def _mpi_p2p(cfg: Config, sizes: Sequence[int]) -> Optional[Dict[str, Any]]:
    """Rank 0 and 1 of ``mpiexec -n 2``: Figure 1's two-sided and MPI_Get rows."""
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    if comm.Get_size() != 2:
        raise RuntimeError(f"the MPI rows of Figure 1 need 2 ranks, got {comm.Get_size()}")
    sizes = list(sizes)
    cap = max(sizes)
    win = MPI.Win.Allocate(cap, 1, comm=comm)
    mem = np.frombuffer(win.tomemory(), np.uint8)
    if rank == 1:
        mem[:] = _pattern(cap)
        data = _pattern(cap)
    comm.Barrier()
    req = np.zeros(1, np.int64)
    out = np.zeros(cap, np.uint8)
    clock = time.perf_counter_ns
    rows = ["two_sided", "copy"]
    per_batch: Dict[str, List[List[List[int]]]] = {r: [] for r in rows}
    win.Lock_all()
    try:
        for b in range(cfg.batches):
            order = rows[b % 2:] + rows[:b % 2]
            batch_rows: Dict[str, List[List[int]]] = {r: [] for r in rows}
            for s in sizes:
                k = cfg.iters(s)
                n = (1 if b == 0 else 0) + cfg.warmup + k
                for row in order:
                    samples = []
                    o = out[:s]
                    if row == "two_sided":
                        for i in range(n):
                            if rank == 0:
                                req[0] = s
                                t = clock()
                                comm.Send(req, dest=1, tag=1)
                                comm.Recv(o, source=1, tag=2)
                                samples.append(clock() - t)
                            else:
                                comm.Recv(req, source=0, tag=1)
                                comm.Ssend(data[:int(req[0])], dest=0, tag=2)
                    elif rank == 0:
                        for i in range(n):
                            t = clock()
                            win.Get([o, MPI.BYTE], 1, [0, s, MPI.BYTE])
                            win.Flush(1)
                            samples.append(clock() - t)
                    if rank == 0:
                        if b == 0 and not np.array_equal(o, _pattern(cap)[:s]):
                            raise RuntimeError(f"{row} of {size_label(s)} over MPI got wrong bytes")
                        batch_rows[row].append(samples[n - k:])
                    comm.Barrier()  # rank 1 waits here (polling, in MPI) while rank 0 gets
            for r in rows:
                per_batch[r].append(batch_rows[r])
    finally:
        win.Unlock_all()
        win.Free()
    if rank != 0:
        return None
    return {"rows": {r: _size_figures(per_batch[r], len(sizes)) for r in rows},
            "version": _mpi_version()}


def _mpi_version() -> str:
    from mpi4py import MPI
    import mpi4py
    library = " ".join(MPI.Get_library_version().splitlines()[0].split())
    return f"mpi4py {mpi4py.__version__}, {library}"


# --------------------------------------------------------------------------- Section 4.2


@mf.persistent
class Bouncer:
    """What the rsr ping-pong's global pointer names on context 1."""

    def ready(self) -> int:
        return mf.context_id()


class Sink:
    """Counts the rsr ping-pong's arrivals on context 0 (exported)."""

    def __init__(self) -> None:
        self.arrived = 0


def _rsr_bounce(target: Any, home: Any) -> None:  # on context 1, inline
    mf.rsr(home, _rsr_arrive)


def _rsr_arrive(sink: Sink) -> None:  # on context 0, inline
    sink.arrived += 1


def _pong() -> int:
    return 1


def _ra_chain(k: int) -> List[int]:
    """On context 0, while its SPMD function waits in a barrier: ``k`` remote
    action round trips to context 1, which waits in the barrier too."""
    clock = time.perf_counter_ns
    out = []
    for _ in range(k):
        t = clock()
        mf.remote_action(1, _pong).wait()
        out.append(clock() - t)
    return out


def _ra_in_barrier(k: int) -> Any:
    """Section 4.2's SPMD function (3 contexts): context 2 has context 0 run
    the ping-pong with context 1 while both wait in a barrier."""
    if mf.rank() == 2:
        got = mf.remote_action(0, _ra_chain, k).wait()
        mf.barrier()
        return got
    mf.barrier()
    return None


def _pingpong_worker(transport: str, cfg: Config) -> Dict[str, Any]:
    """Section 4.2 on ``transport``: the ping-pongs of :data:`RA_ROWS` in
    batches, in a rotating order."""
    from macroflow.bench.nexus import module_problem
    from macroflow.core.context import current_engine
    problem = module_problem(transport)
    if problem is not None:
        return {"unavailable": problem}
    try:
        session = mf.init(contexts=3, transport=transport)
    except Exception as e:
        return {"unavailable": f"its launcher did not start 3 contexts: {type(e).__name__}: {e}"}
    with session:
        b = Bouncer.create(on=1)
        if b.ready().result(60) != 1:
            raise RuntimeError("the bouncer does not run on context 1")
        sink = Sink()
        home, g1 = mf.export(sink), mf.info(b).gptr
        drive = current_engine().driver.run_until
        clock = time.perf_counter_ns

        def rsr_pingpong(k: int) -> List[int]:
            out = []
            for _ in range(k):
                t = clock()
                want = sink.arrived + 1
                mf.rsr(g1, _rsr_bounce, home)
                drive(lambda: sink.arrived >= want)
                out.append(clock() - t)
            return out

        def ra_idle(k: int) -> List[int]:
            out = []
            for _ in range(k):
                t = clock()
                mf.remote_action(1, _pong).wait()
                out.append(clock() - t)
            return out

        rsr_pingpong(cfg.warmup)
        ra_idle(cfg.warmup)
        mf.spmd(_ra_in_barrier, cfg.warmup)
        rows = list(RA_ROWS)
        samples: Dict[str, List[List[int]]] = {r: [] for r in rows}
        for batch in range(cfg.batches):
            for row in rows[batch % 3:] + rows[:batch % 3]:
                if row == "ra":
                    samples["ra"].append(mf.spmd(_ra_in_barrier, cfg.pingpongs)[2])
                elif row == "ra_idle":
                    samples["ra_idle"].append(ra_idle(cfg.pingpongs))
                else:
                    samples["rsr"].append(rsr_pingpong(cfg.pingpongs))
    out = {}
    for row, batches in samples.items():
        fig = summarize([x for batch in batches for x in batch])
        fig["batch_medians_us"] = [float(np.median(batch)) / 1e3 for batch in batches]
        out[row] = fig
    return out


# --------------------------------------------------------------------------- Figure 2


def barrier_loop(barrier: Callable[[], Any], rank: int, n: int, pattern: str, count: int,
                 delay_us: float, seed: int = 0) -> float:
    """Mean microseconds spent in ``barrier()`` over ``count`` barriers, arrivals
    following ``pattern``: "synchronised" (one floating-point operation between
    barriers, as in the paper), "staggered" (each rank computes a random
    0..``delay_us`` before each barrier) or "late" (rank n-1 computes
    ``delay_us`` before each). The random delays depend only on ``seed``,
    ``rank`` and the barrier's number, so every barrier compared sees the same.

    Example:
        >>> barrier_loop(lambda: None, 0, 1, "synchronised", 10, 0.0) >= 0
        True
    """
    if pattern not in PATTERNS:
        raise ValueError(f"pattern must be one of {', '.join(PATTERNS)}; got {pattern!r}")
    rnd = random.Random(seed * 7919 + rank)
    clock = time.perf_counter_ns
    x, total = 0.0, 0
    for _ in range(count):
        if pattern == "synchronised":
            x += 1.0
        elif pattern == "staggered":
            _spin_us(rnd.uniform(0.0, delay_us))
        elif rank == n - 1:
            _spin_us(delay_us)
        t = clock()
        barrier()
        total += clock() - t
    return total / count / 1e3


def _barrier_run(count: int, warmup: int, delay_us: float, seed: int) -> Dict[str, float]:
    """Figure 2's SPMD function: every pattern, mf.barrier()."""
    me, n = mf.rank(), mf.size()
    barrier_loop(mf.barrier, me, n, "synchronised", warmup, delay_us, seed)
    return {p: barrier_loop(mf.barrier, me, n, p, count, delay_us, seed) for p in PATTERNS}


def _barrier_worker(transport: str, n: int, cfg: Config, seed: int) -> Dict[str, Any]:
    """mf.barrier() of ``n`` contexts on ``transport``: mean time in the
    barrier per pattern, averaged over the contexts."""
    from macroflow.bench.nexus import module_problem
    problem = module_problem(transport)
    if problem is not None:
        return {"unavailable": problem}
    try:
        session = mf.init(contexts=n, transport=transport)
    except Exception as e:
        return {"unavailable": f"its launcher did not start {n} contexts: {type(e).__name__}: {e}"}
    with session:
        per_rank = mf.spmd(_barrier_run, cfg.barriers, cfg.warmup, cfg.delay_us, seed)
    return {"us": {p: float(np.mean([r[p] for r in per_rank])) for p in PATTERNS}}


def _mpi_barrier(cfg: Config, seed: int) -> Optional[Dict[str, Any]]:
    """Every rank of ``mpiexec -n N``: MPI_Barrier in every pattern; rank 0 returns the means."""
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    me, n = comm.Get_rank(), comm.Get_size()
    barrier_loop(comm.Barrier, me, n, "synchronised", cfg.warmup, cfg.delay_us, seed)
    mine = {p: barrier_loop(comm.Barrier, me, n, p, cfg.barriers, cfg.delay_us, seed)
            for p in PATTERNS}
    every = comm.gather(mine, root=0)
    if me != 0:
        return None
    return {"us": {p: float(np.mean([r[p] for r in every])) for p in PATTERNS},
            "version": _mpi_version()}


# --------------------------------------------------------------------------- Figure 3


def shm_barrier_us(layout: str, n: int, count: int, yield_cpu: bool) -> float:
    """Microseconds per barrier of a :class:`ShmBarrier` between ``n`` processes
    (this one and ``n - 1`` forked ones), ``count`` barriers in a tight loop.

    A waiter polls; after :data:`SPIN_POLLS` polls in vain (or at once, when
    ``yield_cpu``: more processes than cores) it yields its core between
    polls, so that a rank preempted by a neighbour gets it back.

    Example:
        >>> shm_barrier_us("padded", 2, 50, True) > 0
        True
    """
    from macroflow.spmd.shmbarrier import ShmBarrier
    buf = mf.shared_zeros(ShmBarrier.nbytes(n, layout), np.uint8)
    ShmBarrier(buf, n, 0, layout)  # rank 0 sets up a central barrier's lock before the forks
    warm = max(10, count // 10)

    def loop(rank: int) -> float:
        b = ShmBarrier(buf, n, rank, layout)
        complete, arrive, yield_ = b.complete, b.arrive, os.sched_yield
        patience = 0 if yield_cpu else SPIN_POLLS
        for i in range(warm + count):
            if i == warm:
                t = time.perf_counter()
            e = arrive()
            polls = 0
            while not complete(e):
                polls += 1
                if polls > patience:
                    yield_()
        return time.perf_counter() - t

    pids = []
    ok = False
    try:
        ppid = os.getpid()
        for rank in range(1, n):
            pid = fork_child()
            if pid == 0:
                code = 1
                try:
                    _die_with_parent(ppid)
                    loop(rank)
                    code = 0
                finally:
                    os._exit(code)
            pids.append(pid)
        took = loop(0)
        ok = True
    finally:
        codes = _reap(pids, kill=not ok)
    if any(codes):
        raise RuntimeError(f"a process of the {layout} barrier exited with {codes}")
    return took / count * 1e6


def _shm_worker(cfg: Config, counts: Sequence[int]) -> Dict[str, Any]:
    """Figure 3: every layout and count, once per round (layouts alternate)."""
    ncores = cores()
    runs: Dict[str, Dict[str, List[float]]] = {l: {str(n): [] for n in counts} for l in LAYOUTS}
    for rnd in range(cfg.rounds):
        for n in counts:
            order = LAYOUTS[rnd % 3:] + LAYOUTS[:rnd % 3]
            for layout in order:
                runs[layout][str(n)].append(
                    shm_barrier_us(layout, n, cfg.shm_barriers, yield_cpu=n > ncores))
    return {"us": {l: {k: _median(v) for k, v in per.items()} for l, per in runs.items()},
            "rounds_us": runs}


# --------------------------------------------------------------------------- the suite


def _spawn(args: List[str], cfg: Config, mpiexec: Optional[str] = None, ranks: int = 2
           ) -> Dict[str, Any]:
    """Run a worker in a fresh interpreter (under ``mpiexec -n ranks`` if given); its result."""
    from macroflow.bench import spawn_worker
    return spawn_worker("macroflow.bench.tulip", [*args, "--config", json.dumps(cfg.as_dict())],
                        cfg.timeout_s, _RESULT_TAG, mpiexec, ranks)


def _status(res: Dict[str, Any]) -> Tuple[str, str]:
    if "unavailable" in res:
        return "not available", res["unavailable"]
    if "error" in res:
        return "failed", res["error"]
    return "measured", ""


def mpi_problem() -> Optional[str]:
    """Why the MPI parts (the mpi transport, mpi4py under mpiexec) cannot run here, or None.

    Example:
        >>> mpi_problem() is None or "mpi" in mpi_problem()
        True
    """
    from macroflow.bench.nexus import mpi4py_problem
    from macroflow.transport import mpi as mpi_transport
    return mpi_transport.available() or mpi4py_problem()


def _figure1(cfg: Config, sizes: List[int], mpi_missing: Optional[str],
             progress: Callable[[str], None]) -> Dict[str, Any]:
    from macroflow.bench.nexus import find_mpiexec
    out: Dict[str, Any] = {"sizes": [{"bytes": s, "label": size_label(s)} for s in sizes],
                           "transports": {}}
    for transport in TRANSPORTS:
        entry: Dict[str, Any] = {"two_sided": TWO_SIDED[transport], "copy": PLAIN_COPY[transport]}
        out["transports"][transport] = entry
        if transport == "mpi" and mpi_missing:
            entry.update(status="not available", reason=mpi_missing)
            continue
        progress(f"Figure 1 on {transport}")
        # on mpi under mpiexec: only an mpiexec job has the window of get_win
        res = _spawn(["--worker", "get", "--transport", transport,
                      "--sizes", ",".join(map(str, sizes))], cfg,
                     mpiexec=find_mpiexec() if transport == "mpi" else None, ranks=2)
        if transport == "mpi" and "rows" in res:
            progress("Figure 1: mpi4py under mpiexec -n 2")
            native = _spawn(["--mpi-native", "p2p", "--sizes", ",".join(map(str, sizes))], cfg,
                            mpiexec=find_mpiexec(), ranks=2)
            if "rows" in native:
                res["rows"].update(native["rows"])
                entry["mpi_version"] = native.get("version", "")
            else:
                res = {"error": f"mpi4py rows: {native.get('error') or native.get('unavailable')}"}
        status, reason = _status(res)
        entry.update(status=status, reason=reason)
        if status != "measured":
            continue
        rows = res["rows"]
        entry["rows"] = rows
        entry["statistic"] = (
            "time: median over every get; ratio: median over batches of that batch's ratio of "
            "medians" if transport == "local" else
            "time: median over every get; ratio: of those medians (the MPI rows run in a job "
            "of their own, just after)")
        ratios = {}
        for a, b in (p.split("/") for p in RATIO_TITLES):
            if a not in rows:
                continue
            if transport == "local":
                ratios[f"{a}/{b}"] = [paired_ratio(x["batch_medians_us"], y["batch_medians_us"])
                                      for x, y in zip(rows[a], rows[b])]
            else:
                ratios[f"{a}/{b}"] = [_ratio(x["median_us"], y["median_us"])
                                      for x, y in zip(rows[a], rows[b])]
        entry["ratios"] = ratios
        entry["mb_per_s"] = {r: [s / f["median_us"] if f["median_us"] else None
                                 for s, f in zip(sizes, rows[r])] for r in rows}
    return out


def _remote_action(cfg: Config, mpi_missing: Optional[str],
                   progress: Callable[[str], None]) -> Dict[str, Any]:
    out: Dict[str, Any] = {"contexts": 3, "oversubscribed": 3 > cores(), "transports": {}}
    for transport in TRANSPORTS:
        if transport == "mpi" and mpi_missing:
            out["transports"][transport] = {"status": "not available", "reason": mpi_missing}
            continue
        progress(f"Section 4.2 on {transport}")
        res = _spawn(["--worker", "pingpong", "--transport", transport], cfg)
        status, reason = _status(res)
        entry: Dict[str, Any] = {"status": status, "reason": reason}
        if status == "measured":
            entry.update({r: res[r] for r in RA_ROWS})
            entry["ratio"] = paired_ratio(res["ra"]["batch_medians_us"],
                                          res["rsr"]["batch_medians_us"])
            entry["ra/ra_idle"] = paired_ratio(res["ra"]["batch_medians_us"],
                                               res["ra_idle"]["batch_medians_us"])
        out["transports"][transport] = entry
    return out


def _figure2(cfg: Config, counts: List[int], mpi_missing: Optional[str],
             progress: Callable[[str], None]) -> Dict[str, Any]:
    from macroflow.bench.nexus import find_mpiexec
    ncores = cores()
    systems = ["local", "mpi", "MPI_Barrier"]
    runs: Dict[str, Dict[str, Dict[str, List[float]]]] = {
        s: {str(n): {p: [] for p in PATTERNS} for n in counts} for s in systems}
    status: Dict[str, Dict[str, str]] = {s: {"status": "measured", "reason": ""} for s in systems}
    if mpi_missing:
        for s in ("mpi", "MPI_Barrier"):
            status[s] = {"status": "not available", "reason": mpi_missing}
    for rnd in range(cfg.rounds):
        for n in counts:
            order = systems[rnd % 3:] + systems[:rnd % 3]
            for system in order:
                if status[system]["status"] != "measured":
                    continue
                progress(f"Figure 2: {system}, {n} contexts, round {rnd + 1}/{cfg.rounds}")
                if system == "MPI_Barrier":
                    res = _spawn(["--mpi-native", "barrier", "--seed", str(rnd)], cfg,
                                 mpiexec=find_mpiexec(), ranks=n)
                else:
                    res = _spawn(["--worker", "barrier", "--transport", system, "--n", str(n),
                                  "--seed", str(rnd)], cfg)
                st, reason = _status(res)
                if st != "measured":
                    status[system] = {"status": st, "reason": reason}
                    continue
                for p in PATTERNS:
                    runs[system][str(n)][p].append(res["us"][p])
    us = {s: {k: {p: _median(v) for p, v in per.items()} for k, per in by_n.items()}
          for s, by_n in runs.items()}
    ratios = {f"{s}/MPI_Barrier": {str(n): {p: _ratio(us[s][str(n)][p],
                                                      us["MPI_Barrier"][str(n)][p])
                                            for p in PATTERNS} for n in counts}
              for s in ("local", "mpi")}
    return {"counts": counts, "patterns": list(PATTERNS), "delay_us": cfg.delay_us,
            "oversubscribed": {str(n): n > ncores for n in counts}, "systems": status,
            "us": us, "rounds_us": runs, "ratios": ratios}


def evaluate_bars(res: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Judge :data:`BARS` from a result; a bar that was not measured is left out.

    Example:
        >>> res = _example_result()
        >>> bars = evaluate_bars(res)
        >>> [(b["key"], b["transport"], b["pass"]) for b in bars]  # doctest: +NORMALIZE_WHITESPACE
        [('get_shm_1mib', 'local', True), ('barrier_mpi', 'mpi', True),
         ('ra_pingpong', 'local', False)]
    """
    out = []
    labels = {k: (label, limit) for k, label, limit in BARS}

    def add(key: str, transport: str, value: Optional[float]) -> None:
        if value is None:
            return
        label, limit = labels[key]
        out.append({"key": key, "transport": transport, "label": label, "value": value,
                    "limit": limit, "pass": value <= limit})

    sizes = [s["bytes"] for s in res["figure1"]["sizes"]]
    for t, e in res["figure1"]["transports"].items():
        if e.get("status") == "measured" and 2**20 in sizes:
            i = sizes.index(2**20)
            # the get from shared memory against the copy from it; the table's
            # process_vm row (private memory, the kernel's copy) is not judged
            add("get_shm_1mib", t, e["ratios"]["get_shm/copy"][i])
    f2 = res["figure2"]
    if f2["systems"]["mpi"]["status"] == "measured" and \
            f2["systems"]["MPI_Barrier"]["status"] == "measured":
        # judged where each rank has a core, as on the paper's machines: with more
        # ranks than cores a polling barrier waits for the scheduler, which
        # MPI_Barrier's yielding spin does not (the table shows those rows)
        vals = [f2["ratios"]["mpi/MPI_Barrier"][str(n)]["synchronised"] for n in f2["counts"]
                if not f2["oversubscribed"].get(str(n))]
        vals = [v for v in vals if v is not None]
        add("barrier_mpi", "mpi", max(vals) if vals else None)
    for t, e in res["remote_action"]["transports"].items():
        if e.get("status") == "measured":
            add("ra_pingpong", t, e["ratio"])
    return out


def run(quick: bool = False, progress: Callable[[str], None] = lambda s: None,
        sizes: Sequence[int] = SIZES, counts: Sequence[int] = COUNTS,
        mpi: bool = True) -> Dict[str, Any]:
    """Measure every figure; return them as one JSON-able dict.

    Args:
        quick: far fewer iterations (a smoke run).
        sizes: Figure 1's sizes in bytes.
        counts: Figures 2 and 3's numbers of contexts.
        mpi: also the MPI rows when MPI is here (False: listed as not available).

    Example:
        >>> run(sizes=[0])
        Traceback (most recent call last):
        ...
        ValueError: sizes are numbers of bytes >= 1; got [0]
    """
    if not sizes or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes):
        raise ValueError(f"sizes are numbers of bytes >= 1; got {list(sizes)}")
    if not counts or any(isinstance(n, bool) or not isinstance(n, int) or n < 2 for n in counts):
        raise ValueError(f"counts are numbers of contexts >= 2; got {list(counts)}")
    cfg = QUICK if quick else FULL
    started = time.perf_counter()
    load = [os.getloadavg()[0]]
    mpi_missing = mpi_problem() if mpi else "not asked for (mpi=False)"
    sizes, counts = list(sizes), list(counts)
    res: Dict[str, Any] = {
        "meta": {"suite": "tulip", "quick": quick, "config": cfg.as_dict(),
                 "python": platform.python_version(), "platform": platform.platform(),
                 "cpus": cores(), "numpy": np.__version__, "macroflow": mf.__version__,
                 "time": time.strftime("%Y-%m-%d %H:%M:%S"), "mpi": mpi_missing or "available"},
        "paper": dict(PAPER, figures=PAPER_FIGURES),
    }
    res["figure1"] = _figure1(cfg, sizes, mpi_missing, progress)
    res["remote_action"] = _remote_action(cfg, mpi_missing, progress)
    res["figure2"] = _figure2(cfg, counts, mpi_missing, progress)
    progress("Figure 3: ShmBarrier")
    shm = _spawn(["--worker", "shm", "--counts", ",".join(map(str, counts))], cfg)
    st, reason = _status(shm)
    res["figure3"] = {"counts": counts, "layouts": list(LAYOUTS), "status": st, "reason": reason,
                      "oversubscribed": {str(n): n > cores() for n in counts},
                      "waiters": f"spin {SPIN_POLLS} polls, then yield the core between polls "
                                 f"(at once when oversubscribed)"}
    if st == "measured":
        res["figure3"].update(us=shm["us"], rounds_us=shm["rounds_us"])
    res["bars"] = evaluate_bars(res)
    load.append(os.getloadavg()[0])
    res["meta"].update(elapsed_s=time.perf_counter() - started, loadavg_1min=load)
    return res


# --------------------------------------------------------------------------- printing


def _n_label(res: Dict[str, Any], n: int, key: str) -> str:
    return f"{n} (oversubscribed)" if res[key]["oversubscribed"].get(str(n)) else str(n)


def tables(res: Dict[str, Any]) -> List[Tuple[str, List[str], List[List[str]], List[str]]]:
    """Every table of a result: (title, headers, rows, notes below it).

    Example:
        >>> [t[0].split(":")[0] for t in tables(_example_result())]
        ['Figure 1 on local', 'Section 4.2', 'Figure 2', 'Figure 3', 'Bars']
    """
    out = []
    f1 = res["figure1"]
    for t, e in f1["transports"].items():
        if e.get("status") != "measured":
            continue
        present = [r for r in GET_ROWS if r in e["rows"]]
        pairs = [p for p in RATIO_TITLES if p in e["ratios"]]
        heads = ["size"] + [ROW_TITLES[r] + ", us" for r in present] + \
            [RATIO_TITLES[p] for p in pairs] + ["get shm, MB/s"]
        rows = []
        for i, s in enumerate(f1["sizes"]):
            rows.append([s["label"]] + [_us(e["rows"][r][i]["median_us"]) for r in present] +
                        [_x(e["ratios"][p][i]) for p in pairs] +
                        ["n/a" if e["mb_per_s"]["get_shm"][i] is None
                         else f"{e['mb_per_s']['get_shm'][i]:,.0f}"])
        notes = [f"two-sided: {e['two_sided']}", f"plain copy: {e['copy']}",
                 f"paper: {PAPER['figure1']}"]
        if e.get("mpi_version"):
            notes.append(f"MPI: {e['mpi_version']}")
        out.append((f"Figure 1 on {t}: mf.get from a context that polls, median", heads, rows,
                    notes))
    ra = res["remote_action"]
    rows = [[t, _us(e["ra"]["median_us"]), _us(e["ra_idle"]["median_us"]),
             _us(e["rsr"]["median_us"]), _x(e["ratio"]), _x(e["ra/ra_idle"])]
            for t, e in ra["transports"].items() if e.get("status") == "measured"]
    over = " (3 contexts: oversubscribed)" if ra["oversubscribed"] else ""
    out.append((f"Section 4.2: remote action ping-pong while both contexts wait in a "
                f"barrier{over}, median round trip",
                ["transport", "RA in barrier, us", "RA idle, us", "rsr idle, us", "RA/rsr",
                 "in barrier/idle"], rows,
                ["RA in barrier: context 0 runs it while its function and context 1's wait in "
                 "mf.barrier(); idle: from context 0's main to an idle context 1",
                 f"paper: {PAPER['remote_action']}"]))
    f2 = res["figure2"]
    rows = []
    for n in f2["counts"]:
        for p in f2["patterns"]:
            u = {s: f2["us"][s][str(n)][p] for s in f2["us"]}
            rows.append([_n_label(res, n, "figure2"), p, _us(u["local"]), _us(u["mpi"]),
                         _us(u["MPI_Barrier"]),
                         _x(f2["ratios"]["local/MPI_Barrier"][str(n)][p]),
                         _x(f2["ratios"]["mpi/MPI_Barrier"][str(n)][p])])
    notes = [f"arrivals: synchronised (one flop between barriers), staggered (each context "
             f"computes 0..{f2['delay_us']:g} us first), late (the last context computes "
             f"{f2['delay_us']:g} us first); time in the barrier, mean over contexts",
             f"paper: {PAPER['figure2']}"]
    notes += [f"{s}: {v['status']}: {v['reason']}" for s, v in f2["systems"].items()
              if v["status"] != "measured"]
    out.append(("Figure 2: mean time in the barrier, us",
                ["contexts", "arrivals", "mf local", "mf mpi", "MPI_Barrier", "local/MPI",
                 "mpi/MPI"], rows, notes))
    f3 = res["figure3"]
    if f3["status"] == "measured":
        rows = [[layout] + [_us(f3["us"][layout][str(n)]) for n in f3["counts"]]
                for layout in f3["layouts"]]
        notes = [f"waiters: {f3['waiters']}"]
        ref = [f"{n} contexts {_us(f2['us']['local'][str(n)]['synchronised'])} us"
               for n in f3["counts"] if str(n) in f2["us"]["local"]]
        if ref:
            notes.append("for comparison, mf.barrier() on local, synchronised (Figure 2): "
                         + ", ".join(ref))
        notes.append(f"paper: {PAPER['figure3']}")
    else:
        rows, notes = [], [f"{f3['status']}: {f3['reason']}"]
    out.append(("Figure 3: ShmBarrier between processes, tight loop, us per barrier",
                ["layout"] + [f"n={_n_label(res, n, 'figure3')}" for n in f3["counts"]], rows,
                notes))
    rows = [[b["transport"], b["label"], _x(b["value"]), "PASS" if b["pass"] else "FAIL"]
            for b in res["bars"]]
    out.append(("Bars", ["transport", "bar", "ratio", "verdict"], rows, []))
    return out


def _unavailable_lines(res: Dict[str, Any]) -> List[str]:
    lines = []
    for what, part in (("Figure 1", res["figure1"]), ("Section 4.2", res["remote_action"])):
        for t, e in part["transports"].items():
            if e.get("status") != "measured":
                lines.append(f"{what} on {t}: {e['status']}: {e['reason']}")
    return lines


def report(res: Dict[str, Any], out: Any = None) -> None:
    """Print every table of :func:`run`'s result, the paper's figures beside ours.

    Example:
        >>> import io
        >>> buf = io.StringIO()
        >>> report(_example_result(), buf)
        >>> print(buf.getvalue())  # doctest: +ELLIPSIS +NORMALIZE_WHITESPACE
        macroflow bench tulip (quick): ...
        Figure 1 on local: mf.get from a context that polls, median
        ...
          FAIL  remote action ping-pong in a barrier <= 1.5x rsr ping-pong (local): 2.00x ...
        ...
    """
    from macroflow.bench.micro import render_table
    out = out or sys.stdout
    meta = res["meta"]
    print(f"macroflow bench tulip ({'quick' if meta['quick'] else 'full'}): {meta['platform']}, "
          f"{meta['cpus']} cpus, python {meta['python']}, {meta['elapsed_s']:.0f} s, 1-minute "
          f"load average {', '.join(f'{x:.2f}' for x in meta['loadavg_1min'])}", file=out)
    for title, heads, rows, notes in tables(res):
        if rows:
            render_table(title, heads, rows, out)
        else:
            print(f"\n{title}", file=out)
        for note in notes:
            print(f"  {note}", file=out)
    print("", file=out)
    for b in res["bars"]:
        print(f"  {'PASS' if b['pass'] else 'FAIL'}  {b['label']} ({b['transport']}): "
              f"{_x(b['value'])} (limit {b['limit']:g}x)", file=out)
    for line in _unavailable_lines(res):
        print(line, file=out)


def markdown(res: Dict[str, Any]) -> str:
    """The tables of :func:`report` as Markdown, for docs/benchmarks.md.

    Example:
        >>> print(markdown(_example_result()).splitlines()[2])
        **Figure 1 on local: mf.get from a context that polls, median**
    """
    meta = res["meta"]
    lines = [f"Run: {meta['time']}, {meta['platform']}, {meta['cpus']} cpus, python "
             f"{meta['python']}, numpy {meta['numpy']}, {meta['config']['name']}, "
             f"{meta['elapsed_s']:.0f} s, 1-minute load average "
             f"{', '.join(f'{x:.2f}' for x in meta['loadavg_1min'])}.", ""]
    for title, heads, rows, notes in tables(res):
        lines += [f"**{title}**", ""]
        if rows:
            lines += ["| " + " | ".join(heads) + " |", "| --- |" + " ---: |" * (len(heads) - 1)]
            lines += ["| " + " | ".join(r) + " |" for r in rows]
            lines.append("")
        lines += [f"- {n}" for n in notes]
        if notes:
            lines.append("")
    lines += [f"- {line}" for line in _unavailable_lines(res)]
    return "\n".join(lines) + "\n"


def _example_result() -> Dict[str, Any]:
    """A small result of the shape :func:`run` returns, for the examples."""
    sizes = [8, 2**20]
    fig = lambda us: {"median_us": us, "p10_us": us, "p90_us": us, "n": 5,  # noqa: E731
                      "batch_medians_us": [us, us]}
    local = {"status": "measured", "reason": "", "two_sided": TWO_SIDED["local"],
             "copy": PLAIN_COPY["local"],
             "rows": {"get_shm": [fig(16.0), fig(60.0)], "get_vm": [fig(20.0), fig(135.0)],
                      "get_msg": [fig(40.0), fig(420.0)],
                      "two_sided": [fig(30.0), fig(400.0)], "copy": [fig(1.0), fig(50.0)]},
             "ratios": {"get_shm/copy": [16.0, 1.2], "get_vm/copy": [20.0, 2.7],
                        "get_shm/two_sided": [0.53, 0.15], "get_msg/two_sided": [1.3, 1.05]},
             "mb_per_s": {"get_shm": [0.5, 17476.0]}}
    missing = "the mpi transport needs mpi4py"
    us = {p: 50.0 for p in PATTERNS}
    res = {"meta": {"quick": True, "platform": "Linux", "cpus": 2, "python": "3.11",
                    "numpy": "2", "config": {"name": "quick"}, "elapsed_s": 30.0,
                    "time": "2000-01-01 00:00:00", "loadavg_1min": [0.5, 0.6]},
           "figure1": {"sizes": [{"bytes": s, "label": size_label(s)} for s in sizes],
                       "transports": {"local": local,
                                      "mpi": {"status": "not available", "reason": missing}}},
           "remote_action": {"contexts": 3, "oversubscribed": True, "transports": {
               "local": {"status": "measured", "reason": "", "ra": fig(120.0),
                         "ra_idle": fig(110.0), "rsr": fig(60.0), "ratio": 2.0,
                         "ra/ra_idle": 1.09}}},
           "figure2": {"counts": [2], "patterns": list(PATTERNS), "delay_us": 100.0,
                       "oversubscribed": {"2": False},
                       "systems": {"local": {"status": "measured", "reason": ""},
                                   "mpi": {"status": "measured", "reason": ""},
                                   "MPI_Barrier": {"status": "measured", "reason": ""}},
                       "us": {s: {"2": dict(us)} for s in ("local", "mpi", "MPI_Barrier")},
                       "ratios": {k: {"2": {p: 1.0 for p in PATTERNS}}
                                  for k in ("local/MPI_Barrier", "mpi/MPI_Barrier")}},
           "figure3": {"counts": [2], "layouts": list(LAYOUTS), "status": "measured",
                       "reason": "", "oversubscribed": {"2": False}, "waiters": "spin",
                       "us": {layout: {"2": 2.0} for layout in LAYOUTS}}}
    res["bars"] = evaluate_bars(res)
    return res


def main(json_path: Optional[str] = None, quick: bool = False) -> int:
    """Run the suite, print it, optionally write the JSON; returns an exit code.

    0 when every part that could start was measured (whatever the bars say),
    1 when one failed while it was measured.

    Example:
        >>> main(json_path="/nonexistent/dir/out.json")
        2
    """
    if json_path is not None:
        problem = json_problem(json_path)
        if problem is not None:  # found now, not after minutes of measuring
            print(f"macroflow bench tulip: --json {json_path}: {problem}", file=sys.stderr)
            return 2
    res = run(quick=quick, progress=progress_printer("tulip"))
    report(res)
    write_json(res, json_path)
    return 1 if failures(res) else 0


def failures(res: Dict[str, Any]) -> List[str]:
    """The parts that failed while measured (not those not available here).

    Example:
        >>> failures(_example_result())
        []
    """
    out = []
    for what, part in (("Figure 1", res["figure1"]), ("Section 4.2", res["remote_action"])):
        for t, e in part["transports"].items():
            if e.get("status") == "failed":
                out.append(f"{what} on {t}: {e['reason']}")
    for s, v in res["figure2"]["systems"].items():
        if v["status"] == "failed":
            out.append(f"Figure 2 {s}: {v['reason']}")
    if res["figure3"]["status"] == "failed":
        out.append(f"Figure 3: {res['figure3']['reason']}")
    return out


def _arg(argv: List[str], name: str, default: Optional[str] = None) -> Optional[str]:
    return argv[argv.index(name) + 1] if name in argv else default


def _ints(text: Optional[str], default: Sequence[int]) -> List[int]:
    return [int(x) for x in text.split(",")] if text else list(default)


def _worker_main(argv: List[str]) -> int:
    cfg = Config(**json.loads(_arg(argv, "--config")))
    sizes = _ints(_arg(argv, "--sizes"), SIZES)
    seed = int(_arg(argv, "--seed", "0"))
    native = _arg(argv, "--mpi-native")
    if native == "p2p":
        res = _mpi_p2p(cfg, sizes)
    elif native == "barrier":
        res = _mpi_barrier(cfg, seed)
    else:
        worker, transport = _arg(argv, "--worker"), _arg(argv, "--transport", "local")
        if worker == "get":
            res = _get_worker(transport, cfg, sizes)
        elif worker == "pingpong":
            res = _pingpong_worker(transport, cfg)
        elif worker == "barrier":
            res = _barrier_worker(transport, int(_arg(argv, "--n")), cfg, seed)
        elif worker == "shm":
            res = _shm_worker(cfg, _ints(_arg(argv, "--counts"), COUNTS))
        else:
            raise ValueError(f"unknown worker {worker!r}")
    if res is not None:
        print(_RESULT_TAG + json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    # The importable module, so that the SPMD functions and handlers pickle by reference.
    from macroflow.bench import tulip as _suite
    sys.exit(suite_main(_suite, ["--worker", "--mpi-native"], sys.argv))
