"""Jacobi heat diffusion on a 2-D grid, split into bands of rows that exchange halos with get.

The grid's edges are fixed (the top edge hot, the left edge warm, the others
cold); every iteration replaces each inner point with the mean of its four
neighbours. The inner rows are split into one band per context, a
``Collection`` of ``Band`` elements. Each band keeps its rows plus a halo row
above and below, twice over (one buffer is read while the other is written),
so one barrier per iteration is enough. In an SPMD run, every context then
loops:

    get the halo rows from the neighbours' buffers    mf.get(pointer, out=halo)
    compute the new band from the old                 numpy, on its own rows
    mf.barrier()                                      the new rows are ready

A neighbour's rows are read without its code taking part (on one host the
requester copies them itself). A serial numpy version computes the same grid;
the two must agree exactly.

    python examples/stencil.py                              # 256x256, 200 iterations, a context per core
    python examples/stencil.py --size 512 --iterations 500 --contexts 2
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

import macroflow as mf
from macroflow.cli import ArgumentParser


def band_rows(index: int, n: int, bands: int) -> tuple:
    """The inner rows (lo, hi) of band ``index``: inner rows are 1..n-2."""
    base, extra = divmod(n - 2, bands)
    lo = 1 + index * base + min(index, extra)
    return lo, lo + base + (1 if index < extra else 0)


def initial_rows(n: int, lo: int, hi: int) -> np.ndarray:
    """Rows lo..hi-1 of the starting grid: hot top edge, warm left edge, cold elsewhere."""
    rows = np.zeros((hi - lo, n))
    rows[:, 0] = 0.5
    if lo == 0:
        rows[0] = 1.0
    return rows


def relax(old: np.ndarray, new: np.ndarray) -> None:
    """One Jacobi step: each inner point of ``new`` gets the mean of its neighbours in ``old``."""
    new[1:-1, 1:-1] = 0.25 * (old[:-2, 1:-1] + old[2:, 1:-1] + old[1:-1, :-2] + old[1:-1, 2:])


class Band:
    """Inner rows lo..hi-1 of the grid with one halo row on each side, in two buffers."""

    def __init__(self, index, n, bands):
        self.lo, self.hi = band_rows(index, n, bands)
        self.even = initial_rows(n, self.lo - 1, self.hi + 1)  # read at even iterations
        self.odd = self.even.copy()


def jacobi(bands: mf.Collection, iterations: int):
    """Every context's part: its band, relaxed ``iterations`` times."""
    ((index, band),) = bands.local()  # one band per context
    n = band.even.shape[1]
    nrows = band.hi - band.lo
    buffers = (band.even, band.odd)
    halos = []  # (pointers to a neighbour's inner row in each buffer, which of my halo rows)
    if index > 0:  # the last inner row of the band above
        ptrs = [bands.pointer(index - 1, name) for name in ("even", "odd")]
        last = len(ptrs[0]) // n - 2
        halos.append(([p[last * n:(last + 1) * n] for p in ptrs], 0))
    if index < len(bands) - 1:  # the first inner row of the band below
        ptrs = [bands.pointer(index + 1, name) for name in ("even", "odd")]
        halos.append(([p[n:2 * n] for p in ptrs], nrows + 1))
    mf.barrier()
    t0 = time.perf_counter()
    for k in range(iterations):
        old, new = buffers[k % 2], buffers[(k + 1) % 2]
        handles = [mf.get(ptrs[k % 2], out=old[row]) for ptrs, row in halos]
        for h in handles:
            h.wait()
        relax(old, new)
        # the new rows are ready; and nobody still reads the old ones, which
        # the next iteration but one overwrites
        mf.barrier()
    return index, buffers[iterations % 2][1:-1].copy(), time.perf_counter() - t0


def serial(n: int, iterations: int) -> np.ndarray:
    a = initial_rows(n, 0, n)
    b = a.copy()
    for k in range(iterations):
        old, new = (a, b) if k % 2 == 0 else (b, a)
        relax(old, new)
    return (a, b)[iterations % 2]


def parse_args(argv: list) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__.splitlines()[0])  # help and errors: rank 0 alone
    p.add_argument("--size", type=int, default=256, help="the grid is size x size (default 256)")
    p.add_argument("--iterations", type=int, default=200, help="Jacobi iterations (default 200)")
    p.add_argument("--contexts", type=int, default=None,
                   help="contexts, one band each (default: one per core; under mpiexec, one per rank)")
    args = p.parse_args(argv)
    if args.size < 3 or args.iterations < 0 or (args.contexts is not None and args.contexts < 1):
        p.error("--size must be at least 3, --iterations at least 0, --contexts at least 1")
    if args.contexts is not None and args.contexts > args.size - 2:
        p.error(f"--contexts: a {args.size}x{args.size} grid has {args.size - 2} inner rows, "
                f"at most one band per row")
    return args


def main() -> None:
    args = parse_args(sys.argv[1:])
    n, iterations, k = args.size, args.iterations, mf.num_contexts()
    if k > n - 2:  # (contexts left to the default: one per core or rank)
        raise SystemExit(f"stencil: a {n}x{n} grid has {n - 2} inner rows, fewer than the {k} "
                         f"contexts (a band each): pass a larger --size")
    print(f"stencil: {n}x{n} grid, {iterations} Jacobi iterations, {k} bands on {k} contexts")

    t0 = time.perf_counter()
    expected = serial(n, iterations)
    t_serial = time.perf_counter() - t0

    bands = mf.Collection(Band, k, n, k)
    t0 = time.perf_counter()
    parts = mf.spmd(jacobi, bands, iterations)
    t_parallel = time.perf_counter() - t0
    inner = np.vstack([rows for _, rows, _ in sorted(parts, key=lambda part: part[0])])
    grid = np.vstack([expected[:1], inner, expected[-1:]])  # the fixed top and bottom edges

    diff = float(np.max(np.abs(grid - expected)))
    match = "yes" if diff == 0 else "NO"
    print(f"max abs difference from serial: {diff:.1e}  match serial: {match}")
    print(f"serial numpy            {t_serial:7.3f} s")
    print(f"bands, whole SPMD run   {t_parallel:7.3f} s   "
          f"(loop {max(t for _, _, t in parts):.3f} s, {iterations} barriers)")
    stats = mf.stats()
    direct = sum(s.get("spmd_gets_direct", 0) for s in stats.values())
    served = sum(s.get("spmd_gets_served", 0) for s in stats.values())
    print(f"halo rows read: {direct} copied by the reader, {served} served by their owner")


if __name__ == "__main__":
    mf.run(main, contexts=parse_args(sys.argv[1:]).contexts)
