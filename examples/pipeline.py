"""A three-stage pipeline of regular objects whose stages take data-dependent time.

Mentat's second example of run-time dataflow beating hand-written code: in a
filtering and feature-extraction pipeline the cost of a stage depends on the
data, so balancing the stages by hand is hard. With regular objects every item
of every stage gets its own (new or reused) instance wherever there is room,
and because the stages are connected by futures, an item moves on the moment
its previous stage is done: no stage waits for the whole previous stage, and
the signals travel from stage to stage without passing through the caller.

    stage 1  Source.generate(i)    a noisy signal of 50k..1.5M samples
    stage 2  Filter.denoise(x)     smoothing passes in proportion to the
                                   noise it measures: 1 to ~250 passes
    stage 3  Features.extract(y)   dominant frequency, peaks, energy

    python examples/pipeline.py                 # a context per core, 24 items
    python examples/pipeline.py --items 8 --max-size 200000
    python examples/pipeline.py --placement random

It prints every item's features, then the time of three runs: serial (one
process), dataflow (all 3*items calls issued at once, connected by futures),
and stage at a time (every stage collected by the caller before the next is
issued, as one might write it by hand; it runs last, on warmed-up contexts).
Under ``macroflow run`` the placement is the command's ``--placement``.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

import macroflow as mf
from macroflow.cli import ArgumentParser


def generate(item: int, seed: int, min_size: int, max_size: int) -> np.ndarray:
    rng = np.random.default_rng([seed, item])
    n = int(np.exp(rng.uniform(np.log(min_size), np.log(max_size))))
    noise = rng.uniform(0.05, 1.0)
    freq = int(rng.integers(3, 40))
    t = np.linspace(0.0, 1.0, n)
    return (np.sin(2 * np.pi * freq * t) + 0.5 * np.sin(2 * np.pi * 3 * freq * t)
            + noise * rng.standard_normal(n))


def denoise(x: np.ndarray) -> np.ndarray:
    # The noisier the signal, the more passes: the cost depends on the data.
    noise = float(np.std(np.diff(x))) / np.sqrt(2.0)
    passes = 1 + int(250 * noise)
    kernel = np.full(5, 0.2)
    for _ in range(passes):
        x = np.convolve(x, kernel, mode="same")
    return x


def extract(x: np.ndarray) -> dict:
    nfft = 1 << (len(x) - 1).bit_length()
    spectrum = np.abs(np.fft.rfft(x, n=nfft))
    peak = int(np.argmax(spectrum[1:])) + 1
    maxima = (x[1:-1] > x[:-2]) & (x[1:-1] >= x[2:]) & (x[1:-1] > 0.5)
    return {"n": len(x), "freq": round(peak * len(x) / nfft), "peaks": int(np.count_nonzero(maxima)),
            "energy": round(float(np.mean(x * x)), 6)}


@mf.regular
class Source:
    def generate(self, item, seed, min_size, max_size):
        return generate(item, seed, min_size, max_size)


@mf.regular
class Filter:
    def denoise(self, x):
        return denoise(x)


@mf.regular
class Features:
    def extract(self, x):
        return extract(x)


def run_serial(items, a):
    return [extract(denoise(generate(i, a.seed, a.min_size, a.max_size))) for i in items]


def run_stage_at_a_time(items, a):
    # A barrier after every stage, and every signal goes through the caller.
    signals = mf.gather([Source().generate(i, a.seed, a.min_size, a.max_size) for i in items])
    clean = mf.gather([Filter().denoise(x) for x in signals])
    return mf.gather([Features().extract(y) for y in clean])


def run_dataflow(items, a):
    src, flt, feat = Source(), Filter(), Features()
    out = []
    for i in items:
        x = src.generate(i, a.seed, a.min_size, a.max_size)  # a future
        y = flt.denoise(x)  # an arc: x goes from its producer straight to this call
        out.append(feat.extract(y))
    return mf.gather(out)  # the only strict use: small dicts come back


def parse_args(argv: list) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__.splitlines()[0])  # help and errors: rank 0 alone
    p.add_argument("--contexts", type=int, default=None,
                   help="number of contexts (default: one per core; under mpiexec, one per rank)")
    p.add_argument("--items", type=int, default=24, help="signals through the pipeline (default 24)")
    p.add_argument("--min-size", type=int, default=50_000)
    p.add_argument("--max-size", type=int, default=1_500_000)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--placement", default=None, choices=["round-robin", "random", "best-most-recently"],
                   help="round-robin (the default), random or best-most-recently")
    args = p.parse_args(argv)
    if args.contexts is not None and args.contexts < 1:
        p.error("--contexts must be at least 1")
    if args.items < 1 or args.min_size < 1 or args.max_size < args.min_size:
        p.error("--items and --min-size must be at least 1, --max-size at least --min-size")
    return args


def main() -> None:
    a = parse_args(sys.argv[1:])
    items = range(a.items)
    print(f"pipeline: {a.items} items of {a.min_size:,}..{a.max_size:,} samples "
          f"on {mf.num_contexts()} contexts")

    t0 = time.perf_counter()
    expected = run_serial(items, a)
    t_serial = time.perf_counter() - t0

    t0 = time.perf_counter()
    results = run_dataflow(items, a)
    t_flow = time.perf_counter() - t0

    t0 = time.perf_counter()  # second: it finds the contexts warmed up
    staged = run_stage_at_a_time(items, a)
    t_staged = time.perf_counter() - t0

    print(f"{'item':>4} {'samples':>9} {'freq':>5} {'peaks':>6} {'energy':>9}")
    for i, r in zip(items, results):
        print(f"{i:>4} {r['n']:>9,} {r['freq']:>5} {r['peaks']:>6} {r['energy']:>9.4f}")
    print(f"serial            {t_serial:7.3f} s")
    print(f"stage at a time   {t_staged:7.3f} s   speedup {t_serial / t_staged:.2f}x")
    print(f"dataflow          {t_flow:7.3f} s   speedup {t_serial / t_flow:.2f}x")
    ok = results == expected and staged == expected
    print(f"match serial: {'yes' if ok else 'NO'}")
    stats = mf.stats()
    print("calls executed per context: "
          + ", ".join(f"{c}: {s['calls_executed']}" for c, s in sorted(stats.items())))


if __name__ == "__main__":
    options = parse_args(sys.argv[1:])
    mf.run(main, contexts=options.contexts, placement=options.placement)
