"""Intra-object parallelism: a persistent Matrix made of k persistent row blocks.

Mentat's data-parallel objects were persistent classes that encapsulate
several persistent objects: "a Mentat matrix class has been implemented by
decomposing the matrix into k submatrices; each submatrix is implemented using
a persistent Mentat object". Here a ``Matrix`` holds k ``Block`` objects on
different contexts. ``A.multiply(B)`` only issues calls and returns at once:

    B.to_numpy()             elaborates into Assemble.vstack(B's block rows);
                             the value goes straight to each of A's blocks
    A_i.times(B)             k block products, one per context, in parallel
    Block.create(prod, on=)  the product stays distributed: C's blocks are
                             made where A's were, from futures
    Matrix.create(blocks, n) the handle of C, returned to the caller

    python examples/matmul.py                    # a context per core, n=3000, a block each
    python examples/matmul.py --size 400 --blocks 2

The serial time is numpy's ``a @ b`` in this process. Every context (and the
serial run) uses one BLAS thread, so the speedup is macroflow's, not BLAS's.
"""

from __future__ import annotations

import os

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")  # before numpy is imported

import argparse  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

import macroflow as mf  # noqa: E402
from macroflow.cli import ArgumentParser  # noqa: E402


@mf.persistent
class Block:
    """A band of consecutive rows of a matrix, living on one context."""

    def __init__(self, rows):
        self.rows = rows

    def times(self, other):
        return self.rows @ other

    def get(self):
        return self.rows

    def nrows(self):
        return self.rows.shape[0]


@mf.regular
class Assemble:
    def vstack(self, parts):
        return np.vstack(parts)

    def total(self, counts, cols):
        return (sum(counts), cols)


@mf.persistent
class Matrix:
    """A matrix stored as k row blocks on k contexts; its methods run on all of them."""

    def __init__(self, blocks, cols):
        self.blocks = blocks
        self.cols = cols

    def multiply(self, other):
        b = other.to_numpy()  # a future: B, assembled where its blocks send their rows
        products = [blk.times(b) for blk in self.blocks]  # k products in parallel
        blocks = [Block.create(p, on=mf.info(blk).context) for p, blk in zip(products, self.blocks)]
        return Matrix.create(blocks, other.columns())  # a future as an argument: an arc

    def to_numpy(self):
        # Elaboration: the result is another call's future; this method ends at
        # once, and the rows go from the blocks to the assembler to whoever asks.
        return Assemble().vstack([blk.get() for blk in self.blocks])

    def shape(self):
        # Ready when every block is: the shape of C means C has been computed.
        return Assemble().total([blk.nrows() for blk in self.blocks], self.cols)

    def columns(self):
        return self.cols

    def __mf_destroy__(self):
        for blk in self.blocks:
            mf.destroy(blk)


def distribute(a: np.ndarray, k: int) -> Matrix:
    """Make a Matrix of ``a`` in k row blocks on contexts 0, 1, ... (context 0 serves
    its blocks while main waits)."""
    n = mf.num_contexts()
    homes = [i % n for i in range(k)]
    blocks = [Block.create(rows, on=home) for rows, home in zip(np.array_split(a, k), homes)]
    return Matrix.create(blocks, a.shape[1])


def parse_args(argv: list) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__.splitlines()[0])  # help and errors: rank 0 alone
    p.add_argument("--contexts", type=int, default=None,
                   help="number of contexts (default: one per core; under mpiexec, one per rank)")
    p.add_argument("--size", type=int, default=3000, help="n: the matrices are n x n (default 3000)")
    p.add_argument("--blocks", type=int, default=None,
                   help="k: row blocks per matrix (default: one per core, at most one per context)")
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    if args.size < 1 or (args.contexts is not None and args.contexts < 1) \
            or (args.blocks is not None and not 1 <= args.blocks <= args.size):
        p.error("--size and --contexts must be at least 1, --blocks from 1 to --size")
    return args


def main() -> None:
    args = parse_args(sys.argv[1:])
    k = args.blocks or min(mf.num_contexts(), os.cpu_count() or 1, args.size)
    rng = np.random.default_rng(args.seed)
    a = rng.standard_normal((args.size, args.size))
    b = rng.standard_normal((args.size, args.size))
    print(f"matmul: {args.size}x{args.size} float64, k={k} row blocks on {mf.num_contexts()} contexts")

    t0 = time.perf_counter()
    expected = a @ b
    t_serial = time.perf_counter() - t0

    A, B = distribute(a, k), distribute(b, k)
    mf.wait([A.shape(), B.shape()])  # both distributed before the clock starts

    t0 = time.perf_counter()
    C = A.multiply(B).result()  # returns as soon as the calls are issued
    t_issued = time.perf_counter() - t0
    shape = C.shape().result()  # every block of C exists
    t_multiply = time.perf_counter() - t0
    c = C.to_numpy().result()  # C's rows, assembled and sent here
    t_fetch = time.perf_counter() - t0

    err = float(np.max(np.abs(c - expected)))
    ok = shape == expected.shape and np.allclose(c, expected, rtol=1e-10, atol=1e-8 * args.size)
    print(f"verified against numpy: {'yes' if ok else 'NO'}  (max abs error {err:.1e})")
    print(f"serial numpy a @ b      {t_serial:7.3f} s")
    print(f"A.multiply(B) returned  {t_issued:7.3f} s")
    print(f"C computed (in blocks)  {t_multiply:7.3f} s   speedup {t_serial / t_multiply:.2f}x")
    print(f"C fetched to main       {t_fetch:7.3f} s   speedup {t_serial / t_fetch:.2f}x")

    for m in (A, B, C):
        mf.destroy(m)
    stats = mf.stats()
    print("context  calls executed  MB received  MB sent")
    for ctx in sorted(stats):
        s = stats[ctx]
        print(f"{ctx:>7}  {s['calls_executed']:>14}  {s['bytes_received'] / 2**20:>11.1f}  "
              f"{s['bytes_sent'] / 2**20:>7.1f}")


if __name__ == "__main__":
    mf.run(main, contexts=parse_args(sys.argv[1:]).contexts)
