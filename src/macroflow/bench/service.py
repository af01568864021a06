"""``macroflow bench service``: a context serves while a method computes.

Context 1 of 2 (``local`` transport) runs one method, ``Worker.compute``,
for ``duration`` seconds; meanwhile context 0 asks, one request every
``interval`` seconds on average (pauses drawn from 0.5 to 1.5 times it),
for values context 1 holds (results of calls that ran
there before the method started, never asked for until then). Three kinds
of computation:

  python   a pure-Python loop (the method holds the interpreter)
  numpy    a = np.sqrt(a * a + 1.0) on 100,000 doubles, again and again
           (numpy releases the interpreter inside each operation)
  sleep    time.sleep(duration)

and each service mechanism (MACROFLOW_SERVICE, see
:mod:`macroflow.core.threads`): ``signal`` (the default), ``thread``,
``timer``, and ``poll`` (nothing serves but mf.poll(), which this method
does not call: the reference for the computation's speed).

The same configurations also time a null call (``p.null(i).result()``,
``p`` on context 1) when nobody computes, to show what each mechanism costs
the common path.

Figures, each the median over rounds (a round runs every configuration
once, mechanisms alternating, so that a noisy neighbour slows all alike):

  latency_ms     median time for context 0 to get such a value
                 (``f.result()``, round trip included)
  cost           CPU time the service spent serving while the method ran
                 (counted in the handlers and the service thread), plus the
                 measured cost of one signal for each signal handled, over
                 the method's time: what serving took from the computation,
                 without the noise of a shared machine; the bars judge this
  slowdown       quiet: 1 - work per second of the method / the same with
                 no service at all (mechanism ``poll``), no requests, run
                 next to it (per CPU second of the method's thread, and per
                 wall-clock second); requests: 1 - work per second while
                 requests come / work per second while none do, in one run
                 whose requests come in phases (0.2 s), every other phase
                 (per CPU second of the context's process, service thread
                 included, and per wall-clock second). On a shared machine
                 these move by more than 3% between identical runs

Run ``macroflow bench service [--quick] [--json FILE]``.
"""

from __future__ import annotations

import array
import bisect
import os
import platform
import random
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

import macroflow as mf
from macroflow.core.threads import DEFAULT_SERVICE

from .micro import render_table
from . import progress_printer, write_json

MECHANISMS = ("signal", "thread", "timer", "poll")
KINDS = ("python", "numpy", "sleep")
REFERENCE = "poll"
BARS_MS = {"python": 10.0, "numpy": 1.0, "sleep": 1.0}
SLOWDOWN_BAR = 0.03


class Config:
    """How long and how often; ``FULL`` and ``QUICK`` are the two presets."""

    def __init__(self, name: str, rounds: int, duration: float, interval: float,
                 null_calls: int, phase: float):
        self.name = name
        self.rounds = rounds
        self.duration = duration
        self.interval = interval
        self.null_calls = null_calls
        self.phase = phase  # seconds with requests, then without, and so on

    def as_dict(self) -> Dict[str, Any]:
        return dict(vars(self))


FULL = Config("full", rounds=5, duration=2.0, interval=0.005, null_calls=2000, phase=0.2)
QUICK = Config("quick", rounds=1, duration=1.0, interval=0.005, null_calls=300, phase=0.1)


@mf.persistent
class Holder:
    """Holds the values context 0 asks for."""

    def value(self, i):
        return i

    def take(self, x):
        return None

    def null(self, x):
        return x

    def service(self):
        """What the context's service mechanism spent: CPU seconds serving,
        and signals handled."""
        from macroflow.core.context import current_engine
        eng = current_engine()
        return {"service_cpu_s": eng.service_cpu, "signals": getattr(eng.service, "signals", 0)}


@mf.persistent
class Worker:
    """The method that computes while its context is asked for values."""

    def compute(self, kind: str, seconds: float):
        t0 = time.perf_counter()
        c0 = time.thread_time()
        end = t0 + seconds
        # when each unit of work ended: wall clock, and CPU time of this process
        # (its service thread included)
        stamps, cpu = array.array("d"), array.array("d")
        clock, process_time = time.perf_counter, time.process_time
        if kind == "python":
            s = 0
            while clock() < end:
                for i in range(2_000):
                    s += i * i
                stamps.append(clock())
                cpu.append(process_time())
        elif kind == "numpy":
            a = np.ones(100_000)
            while clock() < end:
                a = np.sqrt(a * a + 1.0)
                stamps.append(clock())
                cpu.append(process_time())
        else:
            time.sleep(seconds)
        wall = time.perf_counter() - t0
        return {"work": len(stamps), "wall_s": wall, "cpu_s": time.thread_time() - c0,
                "stamps": stamps.tobytes(), "cpu_stamps": cpu.tobytes()}


def _main(kind: str, duration: float, interval: float, phase: float,
          requests: bool, holder: int = 1) -> Dict[str, Any]:
    h, w = Holder.create(on=holder), Worker.create(on=1)
    # a value passed to another call keeps its call site lazy: the values
    # below stay at context 1 until asked for
    h.take(h.value(-1)).result()
    w.compute("sleep", 0.0).result()
    futures = iter([h.value(i) for i in range(int(duration / interval) + 100)])
    started = time.perf_counter()
    running = w.compute(kind, duration)
    latencies: List[float] = []
    phases: List[Tuple[float, float, bool]] = []  # (start, end, requests sent)
    if requests:
        # phases with and without requests alternate, so the work rates with
        # and without them are compared in one run, under the same neighbours
        time.sleep(min(0.1, duration / 4))  # the method has started
        last = started + duration - min(0.15, duration / 4)  # then it is about to end
        on = kind == "sleep"  # a sleep has no rate to compare: requests throughout
        # pauses vary about their mean, so that no request keeps arriving at the
        # same point of a periodic mechanism's cycle
        pause = random.Random(1).uniform
        while time.perf_counter() < last:
            begin = time.perf_counter()
            end = min(begin + phase, last)
            if on:
                while time.perf_counter() < end:
                    t = time.perf_counter()
                    next(futures).result()
                    latencies.append(time.perf_counter() - t)
                    time.sleep(pause(0.5 * interval, 1.5 * interval))
            else:
                time.sleep(max(0.0, end - time.perf_counter()))
            phases.append((begin, time.perf_counter(), on))
            on = kind == "sleep" or not on
    out = running.result()
    out.update(h.service().result())
    out["phases"] = phases
    out["latencies_s"] = latencies
    out["served_while_busy"] = mf.stats()[1]["served_while_busy"]
    return out


def rate_ratio(stamps: List[float], phases: List[Tuple[float, float, bool]],
               margin: float = 0.02, cpu: Optional[List[float]] = None) -> Optional[float]:
    """Work per second in the phases with requests over the phases without
    (``margin`` seconds trimmed at each end of a phase); None if either is
    empty. ``stamps`` are the wall-clock times at which units of work ended;
    with ``cpu`` (the CPU time at each), per CPU second instead.

    Example:
        >>> stamps = [i * 0.001 for i in range(1000)] + [1 + i * 0.002 for i in range(500)]
        >>> rate_ratio(stamps, [(0.0, 1.0, False), (1.0, 2.0, True)])
        0.5
        >>> rate_ratio(stamps, [(0.0, 1.0, False), (1.0, 2.0, True)], cpu=stamps)
        0.5
    """
    work = {False: 0, True: 0}
    span = {False: 0.0, True: 0.0}
    for begin, end, on in phases:
        i, j = bisect.bisect_left(stamps, begin + margin), bisect.bisect_left(stamps, end - margin)
        if j - i < 2:
            continue
        work[on] += j - 1 - i
        span[on] += (cpu[j - 1] - cpu[i]) if cpu is not None else (stamps[j - 1] - stamps[i])
    if not (span[False] and span[True] and work[False]):
        return None
    return round((work[True] / span[True]) / (work[False] / span[False]), 6)


def signal_cost_us(n: int = 20_000) -> float:
    """CPU microseconds one signal costs a process that computes: the kernel's
    delivery, and Python running a handler that does nothing (measured here,
    sending SIGUSR1 to itself; a signal that interrupts a long computation
    also costs it some of its caches, which this does not count).

    Example:
        >>> 0 < signal_cost_us(200) < 1000
        True
    """
    import signal
    old = signal.signal(signal.SIGUSR1, lambda *a: None)
    try:
        kill, pid, sig = os.kill, os.getpid(), signal.SIGUSR1
        t = time.thread_time()
        for _ in range(n):
            kill(pid, sig)
        return (time.thread_time() - t) / n * 1e6
    finally:
        signal.signal(signal.SIGUSR1, old)


def _null_main(n: int) -> float:
    h = Holder.create(on=1)
    for i in range(100):
        h.null(i).result()
    samples = []
    for i in range(n):
        t = time.perf_counter()
        h.null(i).result()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples) * 1e6


def _under(mechanism: str, main: Callable[..., Any], *args: Any) -> Any:
    old = os.environ.get("MACROFLOW_SERVICE")
    os.environ["MACROFLOW_SERVICE"] = mechanism
    try:
        return mf.run(main, *args, contexts=2, transport="local")
    finally:
        if old is None:
            del os.environ["MACROFLOW_SERVICE"]
        else:
            os.environ["MACROFLOW_SERVICE"] = old


def null_call_us(mechanism: str, cfg: Config) -> float:
    """Median null call on a persistent object of context 1 under ``mechanism``."""
    return _under(mechanism, _null_main, cfg.null_calls)


def measure(mechanism: str, kind: str, requests: bool, cfg: Config) -> Dict[str, Any]:
    """One method on context 1 under ``mechanism``, with or without requests."""
    r = _under(mechanism, _main, kind, cfg.duration, cfg.interval, cfg.phase, requests)
    lat = r.pop("latencies_s")
    stamps, cpu = array.array("d"), array.array("d")
    stamps.frombytes(r.pop("stamps"))
    cpu.frombytes(r.pop("cpu_stamps"))
    r["served_per_s"] = r["served_while_busy"] / r["wall_s"] if r["wall_s"] else 0.0
    for key, c in (("slowdown_requests", None), ("slowdown_requests_cpu", list(cpu))):
        ratio = rate_ratio(list(stamps), r["phases"], cfg.phase / 10, c) \
            if requests and kind != "sleep" else None
        r[key] = None if ratio is None else 1 - ratio
    r.update(mechanism=mechanism, kind=kind, requests=requests, n_requests=len(lat),
             latency_ms=statistics.median(lat) * 1e3 if lat else None,
             latency_p90_ms=float(np.percentile(lat, 90)) * 1e3 if lat else None)
    return r


def _median(xs: List[Optional[float]]) -> Optional[float]:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def run(quick: bool = False, progress: Callable[[str], None] = lambda s: None) -> Dict[str, Any]:
    """Measure every mechanism and kind; return the figures as one JSON-able dict."""
    cfg = QUICK if quick else FULL
    started = time.perf_counter()
    runs: List[Dict[str, Any]] = []
    nulls: Dict[str, List[float]] = {m: [] for m in MECHANISMS}
    signal_us = signal_cost_us()
    for rnd in range(cfg.rounds):
        progress(f"round {rnd + 1}/{cfg.rounds}")
        for mech in MECHANISMS:
            nulls[mech].append(null_call_us(mech, cfg))
        for kind in KINDS:
            for mech in MECHANISMS:
                for requests in (False, True):
                    if kind == "sleep" and not requests:
                        continue  # nothing to slow down
                    if mech == REFERENCE and requests and rnd:
                        continue  # nothing serves: once shows it
                    r = measure(mech, kind, requests, cfg)
                    r["round"] = rnd
                    runs.append(r)

    def pick(mech, kind, requests, rnd=None):
        return [r for r in runs if r["mechanism"] == mech and r["kind"] == kind
                and r["requests"] == requests and (rnd is None or r["round"] == rnd)]

    latency = {m: {k: _median([r["latency_ms"] for r in pick(m, k, True)]) for k in KINDS}
               for m in MECHANISMS}
    p90 = {m: {k: _median([r["latency_p90_ms"] for r in pick(m, k, True)]) for k in KINDS}
           for m in MECHANISMS}
    slowdown: Dict[str, Dict[str, Dict[str, Optional[float]]]] = {}
    for m in MECHANISMS:
        slowdown[m] = {}
        for k in ("python", "numpy"):
            # quiet: against the same method with no service at all, run by
            # its side in each round (another process: the neighbours differ)
            wall, cpu = [], []
            for rnd in range(cfg.rounds):
                ref, got = pick(REFERENCE, k, False, rnd), pick(m, k, False, rnd)
                if not ref or not got or not ref[0]["work"]:
                    continue
                ref, got = ref[0], got[0]
                wall.append(1 - (got["work"] / got["wall_s"]) / (ref["work"] / ref["wall_s"]))
                if got["cpu_s"] > 0 and ref["cpu_s"] > 0:
                    cpu.append(1 - (got["work"] / got["cpu_s"]) / (ref["work"] / ref["cpu_s"]))
            # requests: phases with them against phases without, in one run
            served = [] if m == REFERENCE else pick(m, k, True)
            slowdown[m][k] = {
                "quiet": _median(wall), "quiet_cpu": _median(cpu),
                "requests": _median([r["slowdown_requests"] for r in served]),
                "requests_cpu": _median([r["slowdown_requests_cpu"] for r in served])}

    # what serving cost the method, counted: CPU in the service, and a
    # signal's own cost for each signal handled, over the method's time
    cost: Dict[str, Dict[str, Dict[str, Optional[float]]]] = {}
    for m in MECHANISMS:
        cost[m] = {k: {label: _median([
            (r["service_cpu_s"] + r["signals"] * signal_us * 1e-6) / r["wall_s"]
            for r in pick(m, k, req) if r["wall_s"]]) for label, req in (("quiet", False),
                                                                        ("requests", True))}
            for k in ("python", "numpy")}

    null = {m: _median(nulls[m]) for m in MECHANISMS}
    null_ratio = {m: _median([a / b for a, b in zip(nulls[m], nulls[REFERENCE])]) for m in MECHANISMS}
    default = DEFAULT_SERVICE
    result = {
        "meta": {"suite": "service", "quick": quick, "config": cfg.as_dict(),
                 "python": platform.python_version(), "platform": platform.platform(),
                 "cpus": os.cpu_count(), "numpy": np.__version__, "macroflow": mf.__version__,
                 "transport": "local", "default_mechanism": default,
                 "switch_interval_s": sys.getswitchinterval(),
                 "time": time.strftime("%Y-%m-%d %H:%M:%S"),
                 "loadavg": list(os.getloadavg()),
                 "statistic": "median over rounds"},
        "latency_ms": latency,
        "latency_p90_ms": p90,
        "slowdown": slowdown,
        "cost": cost,
        "signal_cost_us": signal_us,
        "null_call_us": null,
        "null_call_ratio": null_ratio,
        "null_call_rounds_us": nulls,
        "runs": runs,
    }
    result["bars"] = bars(result, default)
    result["meta"]["elapsed_s"] = time.perf_counter() - started
    return result


def bars(res: Dict[str, Any], mechanism: str) -> List[Dict[str, Any]]:
    """The bars, judged for ``mechanism``: latency under 10 ms while the method
    runs Python, under 1 ms while it runs numpy or sleeps; the computation
    slowed by less than 3%, quiet or served, as counted (``cost``: what the
    service spent, over the method's time); on a shared machine, the method's
    measured rates move by more than that between identical runs.

    Example:
        >>> res = {"latency_ms": {"m": {"python": 2.0, "numpy": 0.5, "sleep": 3.0}},
        ...        "cost": {"m": {k: {"quiet": 0.01, "requests": 0.05}
        ...                       for k in ("python", "numpy")}}}
        >>> [b["pass"] for b in bars(res, "m")]
        [True, True, False, True, False, True, False]
    """
    out = []
    for kind, limit in BARS_MS.items():
        v = res["latency_ms"][mechanism][kind]
        out.append({"bar": f"service latency during {kind} < {limit:g} ms", "value": v,
                    "limit": limit, "pass": v is not None and v < limit})
    for kind in ("python", "numpy"):
        for label in ("quiet", "requests"):
            v = res["cost"][mechanism][kind][label]
            out.append({"bar": f"{kind} computation slowed ({label}, counted) "
                               f"< {SLOWDOWN_BAR:.0%}",
                        "value": v, "limit": SLOWDOWN_BAR,
                        "pass": v is not None and v < SLOWDOWN_BAR})
    return out


def _pct(v: Optional[float]) -> Optional[float]:
    return None if v is None else 100 * v


def report(res: Dict[str, Any], out=None) -> None:
    """Print the tables of :func:`run`'s result."""
    meta = res["meta"]
    print(f"macroflow bench service ({'quick' if meta['quick'] else 'full'}): "
          f"{meta['config']['duration']:g} s methods, a request every "
          f"{meta['config']['interval'] * 1e3:g} ms, {meta['config']['rounds']} round(s); "
          f"load average {meta['loadavg'][0]:.2f}", file=out or sys.stdout)
    render_table("Service latency while context 1 computes (ms, median; p90)",
                 ["mechanism"] + list(KINDS) + ["p90 " + k for k in KINDS],
                 [[m] + [res["latency_ms"][m][k] for k in KINDS]
                  + [res["latency_p90_ms"][m][k] for k in KINDS] for m in MECHANISMS], out)
    cols = [(k, label) for k in ("python", "numpy")
            for label in ("quiet_cpu", "requests_cpu", "quiet", "requests")]
    render_table("Computation slowed (%; quiet: against the same method with no service, "
                 "requests: phases with requests against phases without; per CPU second "
                 "of the context, and per wall-clock second)",
                 ["mechanism"] + [f"{k} {label.replace('_cpu', ' (cpu)')}" for k, label in cols],
                 [[m] + [_pct(res["slowdown"][m][k][label]) for k, label in cols]
                  for m in MECHANISMS if m != REFERENCE], out)
    render_table(f"Cost of serving (% of the method's time: CPU spent serving, plus "
                 f"{res['signal_cost_us']:.1f} us per signal handled)",
                 ["mechanism"] + [f"{k} {label}" for k in ("python", "numpy")
                                  for label in ("quiet", "requests")],
                 [[m] + [_pct(res["cost"][m][k][label]) for k in ("python", "numpy")
                         for label in ("quiet", "requests")]
                  for m in MECHANISMS if m != REFERENCE], out)
    render_table("Null call when nobody computes (us, median; ratio to poll, median over rounds)",
                 ["mechanism", "null call", "ratio"],
                 [[m, res["null_call_us"][m], res["null_call_ratio"][m]] for m in MECHANISMS], out)
    render_table(f"Bars ({meta['default_mechanism']})", ["bar", "value", "verdict"],
                 [[b["bar"], b["value"], b["pass"]] for b in res["bars"]], out)


def main(json_path: Optional[str] = None, quick: bool = False) -> int:
    """Run the suite, print it, optionally write the JSON; returns an exit code."""
    progress = progress_printer("service")
    res = run(quick=quick, progress=progress)
    report(res)
    write_json(res, json_path)
    return 0


def markdown(res: Dict[str, Any]) -> str:
    """A saved run's tables (``python -m macroflow.bench.service out.json``)."""
    import io
    out = io.StringIO()
    report(res, out)
    return out.getvalue()


if __name__ == "__main__":
    from macroflow.bench import service as _service  # classes pickle by reference
    from macroflow.bench import suite_main
    sys.exit(suite_main(_service, [], sys.argv))
