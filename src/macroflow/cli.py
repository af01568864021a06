"""The ``macroflow`` command: run a script, describe the install, run benchmarks.

Examples:
    macroflow run -n 4 examples/fanout.py     # the script's main() on 4 contexts
    macroflow info                            # transports and versions
    macroflow bench micro --json out.json     # Mentat's Table I and II, METG
    macroflow bench peers --quick             # macroflow next to Ray, Dask, executors, mpi4py
    macroflow bench service                   # serving while a method computes
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import types
from typing import List, Optional


def script_problem(path: str) -> Optional[str]:
    """Why ``path`` cannot be run as a script, or None if it can be read.

    Example:
        >>> script_problem("/nonexistent.py")
        'no such file: /nonexistent.py'
        >>> script_problem("/")
        'not a file (a directory): /'
    """
    if not os.path.exists(path):
        return f"no such file: {path}"
    if os.path.isdir(path):
        return f"not a file (a directory): {path}"
    try:
        with open(path, "rb"):
            pass
    except OSError as e:
        return f"cannot read {path}: {e.strerror or e}"
    return None


def _load_script(path: str) -> types.ModuleType:
    # The script becomes a real module, registered before any context is
    # forked, so its classes pickle by reference like any library's.
    mod = types.ModuleType("__mf_script__")
    mod.__file__ = os.path.abspath(path)
    sys.modules["__mf_script__"] = mod
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    with open(path, "rb") as f:
        code = compile(f.read(), path, "exec")
    exec(code, mod.__dict__)
    return mod


def cmd_run(args: argparse.Namespace) -> int:
    import macroflow as mf
    from macroflow.launch import spin_us_setting
    from macroflow.launch import load_transport
    # usage errors, all found before the script runs
    try:
        spin_us_setting()
        check = getattr(load_transport(args.transport), "check_room", None)
        if check is not None:
            check(args.n or os.cpu_count() or 1)
    except (ValueError, mf.LimitError) as e:
        args.parser.error(str(e))
    problem = script_problem(args.script)
    if problem is not None:
        args.parser.error(problem)
    mod = _load_script(args.script)
    main = getattr(mod, args.main, None)
    if not callable(main):
        raise SystemExit(f"macroflow run: {args.script} defines no function {args.main}()")
    sys.argv = [args.script, *args.args]
    try:
        result = mf.run(main, contexts=args.n, transport=args.transport, placement=args.placement)
    except KeyboardInterrupt:
        return 130  # mf.run has said what happened; the shell's code for SIGINT
    if result is not None:
        print(result)
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    import macroflow as mf
    from macroflow.transport.base import REGISTRY
    rows = [("macroflow", mf.__version__), ("python", platform.python_version()),
            ("platform", platform.platform()), ("cpus", str(os.cpu_count()))]
    for mod in ("numpy", "greenlet", "cloudpickle", "mpi4py"):
        try:
            m = __import__(mod)
            rows.append((mod, getattr(m, "__version__", "present")))
        except ImportError:
            rows.append((mod, "not installed"))
    rows.append(("transports", ", ".join(sorted(REGISTRY)) + " (default: local)"))
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from macroflow.bench import main as bench_main
    return bench_main(args.suite, json_path=args.json, quick=args.quick, peers=args.peers)


def positive_int(text: str) -> int:
    """argparse type of a number of contexts: an int >= 1.

    Example:
        >>> positive_int("4")
        4
        >>> positive_int("0")
        Traceback (most recent call last):
        ...
        argparse.ArgumentTypeError: must be an int >= 1; got '0'
    """
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be an int >= 1; got {text!r}")
    return n


def build_parser() -> argparse.ArgumentParser:
    from macroflow.core.placement import POLICIES
    from macroflow.transport.base import REGISTRY
    from macroflow import __version__
    p = argparse.ArgumentParser(prog="macroflow", description="parallel objects and macro dataflow")
    p.add_argument("--version", action="version", version=f"macroflow {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run a script's main() on N contexts")
    r.add_argument("-n", type=positive_int, default=None, metavar="N",
                   help="number of contexts (default: CPU count)")
    r.add_argument("--transport", default="local", choices=sorted(REGISTRY),
                   help="local (default) or inproc")
    r.add_argument("--placement", default=None, choices=POLICIES,
                   help="round-robin (default), random or best-most-recently")
    r.add_argument("--main", default="main", help="the function to run (default: main)")
    r.add_argument("script")
    r.add_argument("args", nargs=argparse.REMAINDER)
    r.set_defaults(fn=cmd_run, parser=r)
    i = sub.add_parser("info", help="versions and transports present")
    i.set_defaults(fn=cmd_info)
    b = sub.add_parser("bench", help="run the benchmarks")
    b.add_argument("suite", nargs="?", default="micro", help="micro (default), peers, baselines or service")
    b.add_argument("--json", default=None, help="also write every figure to this file")
    b.add_argument("--quick", action="store_true", help="fewer iterations (a smoke run)")
    b.add_argument("--peers", default=None, metavar="LIST",
                   help="peers suite: the peers to try, comma-separated (default: ray,dask,mpi4py)")
    b.set_defaults(fn=cmd_bench)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of the ``macroflow`` command; returns its exit code.

    Usage errors (bad options, a script that is not a readable file, more
    contexts than this host can hold, a --json file that cannot be written)
    end it with exit code 2 and a message, before anything runs.

    Example:
        >>> main(["info"])  # doctest: +ELLIPSIS
        macroflow ...
        0
    """
    args = build_parser().parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
