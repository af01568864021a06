"""Fan-out/fan-in with k workers: Mentat's classic, estimating pi by Monte Carlo.

The main program fans out k*m tasks to a regular (stateless) class; each task
throws darts at the unit square with numpy and counts the hits inside the
quarter circle. The fan-in is itself dataflow: a tree of regular ``combine``
calls whose arguments are the futures of the level below, so every partial
count travels straight from the worker that made it to the one that adds it
up, and the main program receives one small value at the end.

    python examples/fanout.py                    # a context per core, 8 tasks each
    python examples/fanout.py --contexts 2 --tasks-per-worker 4
    macroflow run -n 4 examples/fanout.py --samples 2000000
    python examples/fanout.py --listen 0.0.0.0:7000 --wait-for 8   # then, on other hosts:
    MACROFLOW_SECRET=<printed> macroflow worker --connect THIS_HOST:7000 -n 4

The serial time is the same tasks run one after the other in this process;
both runs use the same seeds, so the parallel count must equal the serial one
exactly.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import numpy as np

import macroflow as mf
from macroflow.cli import ArgumentParser

CHUNK = 1 << 20  # darts per numpy batch: keeps each task's memory at ~16 MB


def count_inside(samples: int, seed: int, task: int) -> int:
    """Darts out of ``samples`` that land inside the quarter circle (task ``task``'s stream)."""
    rng = np.random.default_rng([seed, task])
    inside = 0
    left = samples
    while left > 0:
        n = min(CHUNK, left)
        xy = rng.random((2, n))
        inside += int(np.count_nonzero(xy[0] * xy[0] + xy[1] * xy[1] <= 1.0))
        left -= n
    return inside


@mf.regular
class Worker:
    """Stateless: any instance in any context may serve any call."""

    def darts(self, samples: int, seed: int, task: int) -> tuple:
        return count_inside(samples, seed, task), samples

    def combine(self, parts: list) -> tuple:
        # ``parts`` arrives as a list of (inside, samples) pairs: the caller
        # passed a list of futures, and each producer sent its value here.
        return sum(p[0] for p in parts), sum(p[1] for p in parts)


def reduce_tree(worker: Worker, leaves: list, arity: int) -> mf.Future:
    """Fan in ``leaves`` (futures) with a tree of combine calls; returns the root's future."""
    level = leaves
    while len(level) > 1:
        level = [worker.combine(level[i:i + arity]) for i in range(0, len(level), arity)]
    return level[0]


def parse_args(argv: list) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__.splitlines()[0])  # help and errors: rank 0 alone
    p.add_argument("--contexts", type=int, default=None,
                   help="number of contexts (default: one per core; under mpiexec, one per rank)")
    p.add_argument("--tasks-per-worker", type=int, default=8, help="m: tasks per worker (default 8)")
    p.add_argument("--samples", type=int, default=6_000_000, help="darts per task (default 6M, ~0.1 s)")
    p.add_argument("--arity", type=int, default=4, help="fan-in of the reduction tree (default 4)")
    p.add_argument("--seed", type=int, default=2024)
    p.add_argument("--no-serial", action="store_true", help="skip the serial run")
    p.add_argument("--listen", default=None, metavar="HOST:PORT",
                   help="also accept workers of other hosts here (macroflow worker --connect)")
    p.add_argument("--wait-for", type=int, default=None, metavar="N",
                   help="with --listen: start once the computation has N contexts")
    args = p.parse_args(argv)
    if args.arity < 2 or args.tasks_per_worker < 1 or args.samples < 1:
        p.error("--arity must be at least 2, --tasks-per-worker and --samples at least 1")
    if args.contexts is not None and args.contexts < 1:
        p.error("--contexts must be at least 1")
    if args.seed < 0:
        p.error("--seed must be at least 0 (numpy's seeds are)")
    if args.wait_for is not None and (args.listen is None or args.wait_for < 1):
        p.error("--wait-for N needs --listen, and N at least 1")
    return args


def main() -> None:
    args = parse_args(sys.argv[1:])
    if args.wait_for:
        print(f"waiting for {args.wait_for} contexts...", flush=True)
        mf.wait_contexts(args.wait_for)
    k = mf.num_contexts()
    tasks = k * args.tasks_per_worker
    print(f"fan-out/fan-in: k={k} contexts, {tasks} tasks of {args.samples:,} darts, "
          f"reduction tree of arity {args.arity}")

    serial = None
    if not args.no_serial:
        t0 = time.perf_counter()
        serial = sum(count_inside(args.samples, args.seed, t) for t in range(tasks))
        t_serial = time.perf_counter() - t0

    t0 = time.perf_counter()
    w = Worker()  # an unbound handle: the instantiation managers place every call
    leaves = [w.darts(args.samples, args.seed, t) for t in range(tasks)]  # fan-out: returns at once
    root = reduce_tree(w, leaves, args.arity)  # fan-in: still no waiting
    inside, total = root.result()  # the only strict use
    t_parallel = time.perf_counter() - t0

    pi = 4.0 * inside / total
    print(f"pi ~= {pi:.6f}  (error {abs(pi - math.pi):.2e}, {total:,} darts)")
    if serial is not None:
        print(f"serial   {t_serial:7.3f} s")
        print(f"parallel {t_parallel:7.3f} s   speedup {t_serial / t_parallel:.2f}x on "
              f"{k} contexts")
        print(f"match serial: {'yes' if serial == inside else 'NO'}")
    else:
        print(f"parallel {t_parallel:7.3f} s")

    # Per-context counters. Context 0 ran calls too, while main waited in
    # result(); it received a few hundred bytes in all: the partial counts went
    # from worker to combiner, and only the root's value came to main.
    stats = mf.stats()
    print("context  calls executed  values sent  bytes received  bytes sent")
    for c in sorted(stats):
        s = stats[c]
        print(f"{c:>7}  {s['calls_executed']:>14}  {s['values_sent']:>11}  "
              f"{s['bytes_received']:>14,}  {s['bytes_sent']:>10,}")


if __name__ == "__main__":
    options = parse_args(sys.argv[1:])
    mf.run(main, contexts=options.contexts, listen=options.listen)
