"""Distributed matrix-vector products with a Collection of row blocks (pC++'s style).

The matrix A is a ``Collection`` of ``RowBlock`` elements: block i holds a band
of consecutive rows, made on the context where it lives (from its index, so
the matrix never exists in one place). Two whole-collection operations:

    y = A @ x       coll.map_blocks(np.matmul, x)   fn(block.data, x) on every block
    A^k x           coll.apply("times", x), k times, normalised in between (power steps)

Each issues one call per context that holds blocks and returns one future of
the list of the blocks' results, in block order. The check is numpy's
``A @ x`` on the same matrix, assembled in this process.

    python examples/matvec.py                       # 2000x2000, a context per core, a block each
    python examples/matvec.py --size 500 --blocks 8 --contexts 2
"""

from __future__ import annotations

import os

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")  # before numpy is imported: one BLAS thread everywhere

import argparse  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

import macroflow as mf  # noqa: E402
from macroflow.cli import ArgumentParser  # noqa: E402


def block_rows(index: int, n: int, blocks: int) -> tuple:
    """Rows (lo, hi) of block ``index`` of ``blocks`` over n rows."""
    base, extra = divmod(n, blocks)
    lo = index * base + min(index, extra)
    return lo, lo + base + (1 if index < extra else 0)


def make_block(index: int, n: int, blocks: int, seed: int) -> np.ndarray:
    """Block ``index`` of the matrix: the same numbers wherever it is made."""
    lo, hi = block_rows(index, n, blocks)
    return np.random.default_rng([seed, index]).standard_normal((hi - lo, n)) / np.sqrt(n)


class RowBlock:
    """A band of rows of A; map_blocks reads it in ``data``."""

    def __init__(self, index, n, blocks, seed):
        self.data = make_block(index, n, blocks, seed)

    def times(self, x):
        return self.data @ x


def parse_args(argv: list) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__.splitlines()[0])  # help and errors: rank 0 alone
    p.add_argument("--size", type=int, default=2000, help="A is size x size (default 2000)")
    p.add_argument("--blocks", type=int, default=None, help="row blocks (default: one per context)")
    p.add_argument("--contexts", type=int, default=None,
                   help="number of contexts (default: one per core; under mpiexec, one per rank)")
    p.add_argument("--steps", type=int, default=5, help="power steps A^k x (default 5)")
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    if args.size < 1 or (args.contexts is not None and args.contexts < 1) or args.steps < 0 \
            or (args.blocks is not None and args.blocks < 1):
        p.error("--size, --contexts and --blocks must be at least 1, --steps at least 0")
    if args.blocks is not None and args.blocks > args.size:
        p.error(f"--blocks: at most one block per row ({args.size})")
    return args


def main() -> None:
    args = parse_args(sys.argv[1:])
    n, seed = args.size, args.seed
    k = args.blocks if args.blocks is not None else min(mf.num_contexts(), n)
    A = mf.Collection(RowBlock, k, n, k, seed)
    print(f"matvec: {n}x{n} float64, {k} row blocks on contexts "
          f"{sorted({A.owner(i) for i in range(k)})}")
    x = np.random.default_rng(seed + 1).standard_normal(n)

    A.map_blocks(np.matmul, x).result()  # once untimed: the first call sets up each context
    t0 = time.perf_counter()
    y = np.concatenate(A.map_blocks(np.matmul, x).result())
    t_product = time.perf_counter() - t0

    t0 = time.perf_counter()
    v = x
    for _ in range(args.steps):
        w = np.concatenate(A.apply("times", v).result())
        v = w / np.linalg.norm(w)
    t_power = time.perf_counter() - t0

    a = np.vstack([make_block(i, n, k, seed) for i in range(k)])  # the same A, in one piece
    t0 = time.perf_counter()
    expected = a @ x
    t_serial = time.perf_counter() - t0
    u = x
    for _ in range(args.steps):
        u = a @ u
        u = u / np.linalg.norm(u)

    err = float(np.max(np.abs(y - expected)))
    err_power = float(np.max(np.abs(v - u)))
    pairs = ((y, expected), (v, u))
    ok = all(np.allclose(got, want, rtol=1e-12, atol=1e-12) for got, want in pairs)
    print(f"verified against numpy's A @ x: {'yes' if ok else 'NO'}  "
          f"(max abs difference {err:.1e}; after {args.steps} power steps {err_power:.1e})")
    print(f"serial numpy A @ x          {t_serial * 1e3:8.2f} ms")
    print(f"map_blocks(np.matmul, x)    {t_product * 1e3:8.2f} ms")
    print(f"apply('times', v), per step {t_power * 1e3 / max(args.steps, 1):8.2f} ms")


if __name__ == "__main__":
    mf.run(main, contexts=parse_args(sys.argv[1:]).contexts)
