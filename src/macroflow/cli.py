"""The ``macroflow`` command: run a script, describe the install, run benchmarks.

Examples:
    macroflow run -n 4 examples/fanout.py     # the script's main() on 4 contexts
    macroflow run -n 4 --transport mpi examples/fanout.py   # on 4 ranks of mpiexec
    macroflow info                            # transports and versions
    macroflow bench micro --json out.json     # Mentat's Table I and II, METG
    macroflow bench peers --quick             # macroflow next to Ray, Dask, executors, mpi4py
    macroflow bench nexus                     # Nexus's Figure 3: round trip by message size
    macroflow bench service                   # serving while a method computes
    macroflow bench tulip --quick             # Tulip's figures: get, remote actions, barriers
"""

from __future__ import annotations

import argparse
import os
import platform
import signal
import sys
import threading
import time
import types
from typing import Any, Callable, Dict, List, NoReturn, Optional

from macroflow.core.errors import Terminated


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


def _may_define(source: bytes, name: str) -> bool:
    """Whether a script's top level may bind ``name`` (a def, a class, an
    assignment, an import; anything it cannot tell, a star import say, may).

    Example:
        >>> _may_define(b"def main(): pass", "main"), _may_define(b"x = 1", "main")
        (True, False)
    """
    import ast
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return True
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and \
                node.name == name:
            return True
        if isinstance(node, ast.Name) and node.id == name and isinstance(node.ctx, ast.Store):
            return True
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                if alias.name == "*" or (alias.asname or alias.name.split(".")[0]) == name:
                    return True
        if isinstance(node, ast.Global) and name in node.names:
            return True
    return False


def cmd_run(args: argparse.Namespace) -> int:
    import macroflow as mf
    from macroflow.launch import check_settings, load_transport, spin_us_setting
    from macroflow.transport.mpi import world_from_environment
    # usage errors, all found before the script runs
    launch_mpiexec = args.transport == "mpi" and world_from_environment() is None
    try:
        spin_us_setting()
        module = load_transport(args.transport or "local")
        check_settings(module)
        check = getattr(module, "check_room", None)
        if check is not None:  # (mpiexec -n N starts N ranks here too)
            check(args.n or os.cpu_count() or 1)
    except (ValueError, mf.LimitError) as e:
        args.parser.error(str(e))
    problem = script_problem(args.script)
    if problem is not None:
        args.parser.error(problem)
    world = world_from_environment()
    if world is not None and world[1] > 1:  # started by mpiexec: every rank runs this
        wrong = None
        if args.n is not None and args.n != world[1]:
            wrong = (f"-n {args.n}, but mpiexec started {world[1]} ranks, one context each: "
                     f"give -n {world[1]}, or leave -n out")
        elif args.transport not in (None, "mpi"):
            wrong = (f"--transport {args.transport} under mpiexec: its ranks are one MPI job; "
                     f"give --transport mpi, or leave --transport out")
        if wrong is not None:  # a usage error, said once (by rank 0), before MPI starts
            args.parser.error(wrong)
    if launch_mpiexec:
        try:  # a script that cannot compile fails here, not once per rank
            with open(args.script, "rb") as f:
                source = f.read()
            compile(source, args.script, "exec")
        except SyntaxError:
            import traceback
            traceback.print_exc(limit=0)
            return 1
        if not _may_define(source, args.main):  # (said once, not by every rank)
            # (found in its source: no rank is started for it, so it was not
            # run, and an error its top level would raise is not seen)
            raise SystemExit(f"macroflow run: {args.script} defines no function {args.main}() "
                             f"(found in its source; on mpi the script is not run without one)")
        return _run_under_mpiexec(args)
    # the script's own arguments, already while its top level runs (an
    # argparse parser there, as `python script.py --n 5` would see them)
    sys.argv = [args.script, *args.args]
    from macroflow import launch
    launch.loading_script = args.script
    try:
        mod = _load_script(args.script)
    except (SystemExit, KeyboardInterrupt):
        raise
    except launch.TopLevelStart as e:
        world = world_from_environment()
        if world is not None and world[0] != 0:
            raise SystemExit(1)  # (under mpiexec: said once, by rank 0)
        raise SystemExit(f"macroflow run: {e}")
    except BaseException as e:
        # the script's own error (a SyntaxError, an import that fails), from
        # its frames: this command's say nothing
        import traceback
        tb = e.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
            tb = tb.tb_next
        exc = e
        return _script_fault(lambda: traceback.print_exception(type(exc), exc, tb))
    finally:
        launch.loading_script = None
    main = getattr(mod, args.main, None)
    problem = None
    if main is None:
        problem = f"{args.script} defines no function {args.main}()"
    elif not callable(main):
        problem = f"{args.script} defines {type(main).__name__} {args.main!r}, not a function"
    elif isinstance(main, type):  # (callable, but run it would only make an instance)
        problem = (f"{args.script} defines class {args.main}, not a function: --main names "
                   f"the function to run")
    else:
        try:
            launch._check_main(main, (), {}, "mf.spmd()" if args.spmd else "mf.run()")
        except TypeError as e:
            problem = str(e)
    if problem is not None:
        return _script_fault(lambda: print(f"macroflow run: {problem}", file=sys.stderr))
    try:
        if args.spmd:
            if args.placement:
                args.parser.error("--placement is for calls of parallel objects, not --spmd runs")
            result = mf.spmd(main, n=args.n, transport=args.transport)
        else:
            result = mf.run(main, contexts=args.n, transport=args.transport,
                            placement=args.placement)
    except KeyboardInterrupt:
        return 130  # mf.run has said what happened; the shell's code for SIGINT
    except Exception as e:
        _print_from_script(e)
        from macroflow.transport.mpi import note_job_error
        note_job_error(0)  # under `macroflow run --transport mpi`: the job's cause
        return 1
    if result is not None:
        print(result)
    return 0


def _script_fault(say: Callable[[], None]) -> int:
    """Say what is wrong with the script (``say()``) and return the exit
    code. Under mpiexec every rank finds the same fault: as the MPI
    excepthook does, MPI is started, rank 0 says it and ends the job, and
    the others wait before they would speak (a rank alone in its fault still
    does; and nobody is left waiting in MPI's start for a rank that ended)."""
    from macroflow.transport.mpi import excepthook, world_from_environment
    world = world_from_environment()
    if world is not None and world[1] > 1:
        excepthook(Exception, Exception(), None, previous=lambda *_: say())
    else:
        say()
    return 1


def _print_from_script(e: BaseException) -> None:
    """Print ``e`` as Python would, its traceback starting at the script's
    code: the frames of ``macroflow run`` above it say nothing to its author."""
    import traceback
    here = os.path.dirname(os.path.abspath(__file__))
    tb = e.__traceback__
    while tb is not None and os.path.abspath(tb.tb_frame.f_code.co_filename).startswith(here):
        tb = tb.tb_next
    # (none of the script's frames: the error alone, after its cause, which
    # says where; a traceback of the runtime's frames said nothing more)
    if tb is None:
        traceback.print_exception(type(e), e, tb)
    else:
        from macroflow.core.errors import excepthook
        excepthook(type(e), e, tb)  # (the runtime's frames below the script's too)


def mpiexec_command(args: argparse.Namespace, mpiexec: str) -> List[str]:
    """The command that runs ``macroflow run`` once per rank under mpiexec.

    Example:
        >>> a = build_parser().parse_args(["run", "-n", "4", "--transport", "mpi", "job.py", "x"])
        >>> mpiexec_command(a, "mpiexec")[:3], mpiexec_command(a, "mpiexec")[-6:]
        (['mpiexec', '-n', '4'], ['--transport', 'mpi', '--main', 'main', 'job.py', 'x'])
    """
    n = args.n or os.cpu_count() or 1
    cmd = [mpiexec, "-n", str(n), sys.executable, "-m", "macroflow", "run", "-n", str(n)]
    if args.placement:
        cmd += ["--placement", args.placement]
    if getattr(args, "spmd", False):
        cmd += ["--spmd"]
    return cmd + ["--transport", "mpi", "--main", args.main, args.script, *args.args]


class FirstToEnd:
    """Notes which rank of an mpiexec job on this host died first, and how
    (for ``macroflow run``).

    MPI's process manager ends every rank as soon as one dies, and the
    process it names is not always the one that died. Every rank of this
    host reports to a :class:`~macroflow.transport.mpi.DeathWatch` of this
    process (named in the ranks' environment, ``env``), and says goodbye
    there when it ends in order: the first connection that closes without
    one is the rank that died (its files close before the manager, which
    sees the same closing, can end the others). ``table`` is the file where
    context 0 writes "rank host pid" lines, to name the rank; it waits for
    "<table>.watched" before the computation starts.

    Example:
        >>> w = FirstToEnd("/nonexistent/table")
        >>> w.stop(); w.thread.join(5); w.first
        []
    """

    def __init__(self, table: str):
        import threading
        from macroflow.launch import new_computation_id
        from macroflow.transport.mpi import WATCH_ENV, DeathWatch
        self.table = table
        self.rows: Dict[int, tuple] = {}  # pid -> (context, host)
        self.deaths: List[tuple] = []  # (pid, wait status or None), in the order they died
        self.env: Dict[str, str] = {}
        self.watch = None
        try:
            self.watch = DeathWatch(f"run-{os.getpid()}-{new_computation_id()}",
                                    lambda pid, status: self.deaths.append((pid, status)))
            self.env = {WATCH_ENV: self.watch.name}
        except OSError:
            pass
        self.done = threading.Event()
        from macroflow.core.threads import start_thread
        self.thread = start_thread(self._read_table, "macroflow-contexts-table")

    def stop(self) -> None:
        self.done.set()
        if self.watch is not None:
            self.watch.close()
            self.watch = None

    def _read_table(self) -> None:
        rows = None
        while rows is None and not self.done.is_set():
            try:
                with open(self.table) as f:
                    rows = [r.split() for r in f if r.strip()]
            except OSError:
                self.done.wait(0.001)
        if rows is None:
            return
        self.rows = {int(pid): (int(rank), host) for rank, host, pid in rows}
        try:
            open(self.table + ".watched", "w").close()  # context 0 waits for this
        except OSError:
            pass

    @property
    def first(self) -> List[tuple]:
        """[(context, pid, host, wait status or None)] of the rank that died first."""
        for pid, status in self.deaths:
            if pid not in self.rows:
                self._read_added()
            if pid in self.rows:
                rank, host = self.rows[pid]
                return [(rank, pid, host, status)]
        return []

    def _read_added(self) -> None:
        # contexts added while the job ran (mf.add_contexts): context 0 notes
        # them beside the table (see macroflow.transport.mpi.note_added)
        try:
            with open(self.table + ".added") as f:
                rows = [r.split() for r in f if r.strip()]
        except OSError:
            return
        for rank, host, pid in rows:
            self.rows.setdefault(int(pid), (int(rank), host))

    def exit_code(self, output: str = "") -> Optional[int]:
        """How the rank that died first ended, as a shell's exit status (its
        code, or 128 + a signal's number); None if not known. ``output`` is
        mpiexec's, read when this watcher could not see it (see describe).

        Example:
            >>> w = FirstToEnd("/nonexistent/table")
            >>> w.stop(); w.exit_code() is None
            True
        """
        import signal
        first = self.first
        if not first:
            return None
        _rank, pid, _host, status = first[0]
        if status is None:
            reported = mpiexec_report(output)
            if reported is not None and reported[0] == pid and "signal" in reported[1]:
                return 128 + signal.Signals[reported[1].split()[-1]].value
            return None
        if os.WIFSIGNALED(status):
            return 128 + os.WTERMSIG(status)
        return os.WEXITSTATUS(status) if os.WIFEXITED(status) else None

    def describe(self, output: str = "", code: Optional[int] = None) -> Optional[str]:
        """Words for what ended the job, if a context died (a signal, or an
        exit of its own, before the computation ended).

        ``output`` is mpiexec's: how a process ended is read there when this
        watcher could not see it itself (its parent reaped it first); ``code``
        is mpiexec's exit code.
        """
        from macroflow.transport.base import describe_status, ended_how
        first = self.first
        if not first or os.path.exists(self.table + ".error"):
            return None  # (a rank's uncaught error ended the job: it was printed)
        rank, pid, host, status = first[0]
        reported = mpiexec_report(output)
        if status is not None and os.WIFSIGNALED(status):
            how = ended_how(status)  # as mpiexec_report says it
        elif status is not None:
            how = f"{describe_status(status)} before the computation ended"
        elif reported is not None and reported[0] == pid:
            how = reported[1]
        elif reported is None and code:
            # (MPI exits with the code of a rank that exited; it reports one
            # killed by a signal)
            how = f"exited before the computation ended (mpiexec's exit code: {code})"
        else:
            how = "died first (how is not known: it was reaped before it could be read)"
        return f"context {rank} (pid {pid} on {host}) {how}; MPI ended the job (every rank)"


def mpiexec_report(output: str) -> Optional[tuple]:
    r"""(pid, how it ended) from MPICH mpiexec's report of a failed job, or None.

    Example:
        >>> mpiexec_report("=   PID 4242 RUNNING AT node7\n=   EXIT CODE: 9\n")
        (4242, 'was killed by signal SIGKILL')
        >>> mpiexec_report("all fine") is None
        True
    """
    import re
    import signal
    m = re.search(r"PID (\d+) RUNNING AT \S+\s*=\s*EXIT CODE: (\d+)", output)
    if m is None:
        return None
    code = int(m.group(2))
    try:
        how = f"was killed by signal {signal.Signals(code).name}"
    except ValueError:
        how = f"ended with code {code}"
    return int(m.group(1)), how


def _run_under_mpiexec(args: argparse.Namespace) -> int:
    """Run the script once per rank of ``mpiexec -n N``; rank 0 runs its main.

    If MPI's process manager ends the job because a rank died of a signal,
    the context it was is named.
    """
    import subprocess
    import tempfile
    from macroflow.transport.mpi import _find_mpiexec, CONTEXTS_FILE
    mpiexec = _find_mpiexec()
    if mpiexec is None:
        args.parser.error("--transport mpi needs mpiexec, found neither beside this Python nor "
                          "on PATH (pip install \"macroflow[mpi]\" brings one)")
    from macroflow.transport.mpi import _sweep_pages, mpich_shm_files, remove_unused
    shm_before = mpich_shm_files()
    with tempfile.TemporaryDirectory(prefix="macroflow-") as tmp:
        table = os.path.join(tmp, "contexts")
        watcher = FirstToEnd(table)
        env = dict(os.environ, **{CONTEXTS_FILE: table}, **watcher.env)
        p = subprocess.Popen(mpiexec_command(args, mpiexec), env=env, stdout=subprocess.PIPE)
        report: List[bytes] = []  # mpiexec's report of a failed job, passed on too
        # the job's output is passed on by a thread of its own, so that what
        # the ranks print after a Ctrl-C (main's finally) is passed on too
        # while the job ends
        quiet = threading.Event()  # set once this process ends the job itself
        from macroflow.core.threads import start_thread
        relay = start_thread(_relay_output, "macroflow-mpiexec-output", (p.stdout, report, quiet))
        # a SIGTERM to this process ends the job too (killed outright, this
        # process left mpiexec and its ranks running on: for 30 s here)
        term = signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
        if term:
            signal.signal(signal.SIGTERM, _terminated)
        try:
            code = _wait_for(p)
            interrupted = False
        except KeyboardInterrupt:
            code, interrupted = _end_job(p), True
        except Terminated as e:
            quiet.set()
            _end_job(p, first=signal.SIGTERM)
            print(f"macroflow: terminated (SIGTERM); the job's {args.n or os.cpu_count() or 1} "
                  "ranks were ended",
                  file=sys.stderr)
            code, interrupted = e.code, True
        finally:
            if term:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
            relay.join(5)
            watcher.stop()
            watcher.thread.join(5)
        if code != 0:
            output = b"".join(report[:4]).decode(errors="replace")
            text = None if interrupted else watcher.describe(output, code)
            if text is not None:
                print(f"macroflow: {text}", file=sys.stderr)
                # the status of the context that died, as a shell gives it (mpiexec's
                # is that of whichever rank it saw end badly first: 3 or 9, say, for
                # the same os._exit(3))
                code = watcher.exit_code(output) or code
            # an aborted job leaves MPICH's shared-memory files behind, and the
            # ranks' shared pages: removed once its ranks here are gone (mpiexec
            # may end first: its proxy failed at a Ctrl-C sent to everyone)
            import socket
            _wait_gone([pid for pid, (_rank, host) in watcher.rows.items()
                        if host == socket.gethostname()], 5.0)
            remove_unused(mpich_shm_files() - shm_before)
            _sweep_pages()
        return code


def _wait_gone(pids: List[int], most: float) -> None:
    """Wait until none of ``pids`` runs (or has not been reaped), ``most``
    seconds at most.

    Example:
        >>> _wait_gone([], 1.0)   # nothing to wait for
    """
    deadline = time.monotonic() + most
    for pid in pids:
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except OSError:  # gone (or another user's: not ours to wait for)
                break
            time.sleep(0.01)


def _relay_output(stream: Any, report: List[bytes],
                  quiet: Optional[threading.Event] = None) -> None:
    """Copy an ``mpiexec`` job's output to ours, line by line, until it ends;
    keep its report of a failed job (from "RUNNING AT" on) in ``report``.

    Example:
        >>> import io, contextlib
        >>> report = []
        >>> out = io.TextIOWrapper(io.BytesIO())
        >>> with contextlib.redirect_stdout(out):
        ...     _relay_output(io.BytesIO(b"hello\\n= RUNNING AT host\\nmore\\n"), report)
        >>> report
        [b'= RUNNING AT host\\n', b'more\\n']
    """
    for line in stream:
        if quiet is not None and quiet.is_set() and line.startswith(_BANNER):
            continue  # this process ended the job: mpiexec's report of it is no news
        sys.stdout.buffer.write(line)
        sys.stdout.flush()
        if b"RUNNING AT" in line or report:
            report.append(line)


# how the lines of MPICH mpiexec's report of a job it ended begin
_BANNER = (b"=", b"YOUR APPLICATION TERMINATED", b"This typically refers",
           b"Please see the FAQ")


def _wait_for(p: Any) -> int:
    """``p.wait()``, a moment at a time: a signal that a thread which is not
    the main thread took (one of a library's, which does not block it) runs
    its handler when the main thread looks, not when the job has ended.

    Example:
        >>> import subprocess, sys
        >>> _wait_for(subprocess.Popen([sys.executable, "-c", "pass"]))
        0
    """
    import subprocess
    while True:
        try:
            return p.wait(0.2)
        except subprocess.TimeoutExpired:
            pass


def _terminated(signum: int, frame: Any) -> None:
    raise Terminated(128 + signum)


def _end_job(p: Any, first: Optional[int] = None) -> int:
    """Ctrl-C reached ``macroflow run`` (alone, or with the whole process group):
    pass it on to mpiexec, which passes it on to the ranks, and wait for the
    job to end; SIGTERM and then SIGKILL if it does not within a few seconds
    (or at another Ctrl-C). Returns 130, the shell's code for Ctrl-C.
    ``first=signal.SIGTERM``: a SIGTERM reached this process alone; it is
    passed on at once, then SIGKILL."""
    import subprocess
    # from here a Ctrl-C only hurries the job's end: one raised as an
    # exception could land anywhere here, between two steps, and end this
    # process with a traceback while the job runs on
    again: List[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: again.append(signum))
    try:
        steps = ((None, 1.0), (signal.SIGINT, 5.0), (signal.SIGTERM, 3.0), (signal.SIGKILL, 3.0)) \
            if first is None else ((first, 5.0), (signal.SIGKILL, 3.0))
        for sig, grace in steps:
            # first none: a Ctrl-C at the terminal reached mpiexec too, and a
            # second one while it passes the first on makes its proxy fail
            if p.poll() is not None:
                break
            try:
                if sig is not None:
                    p.send_signal(sig)
            except ProcessLookupError:
                break
            seen, end = len(again), time.monotonic() + grace
            while p.poll() is None and len(again) == seen and time.monotonic() < end:
                try:
                    p.wait(0.05)
                except subprocess.TimeoutExpired:
                    pass
            if p.poll() is not None:
                break
    finally:
        signal.signal(signal.SIGINT, previous)
    return 130


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
    rows.append(("rings", _rings_row()))
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    return 0


def _rings_row() -> str:
    """What ``macroflow info`` says of the rings' common steps: compiled or not, and why.

    Example:
        >>> _rings_row().split(" ")[0] in ("compiled", "in", "off:", "refused")
        True
    """
    from macroflow.transport import ring
    if ring.SETTING_ERROR is not None:
        return f"refused at start: {ring.SETTING_ERROR}"
    why = ring.problem()
    if why is not None:
        return f"off: {why}"
    if ring.COMPILED:
        return "compiled (macroflow.transport._cring)"
    return f"in Python ({ring.IN_PYTHON})"


def cmd_bench(args: argparse.Namespace) -> int:
    from macroflow.bench import main as bench_main
    try:
        return bench_main(args.suite, json_path=args.json, quick=args.quick, peers=args.peers)
    except KeyboardInterrupt:
        # (its processes are ended by then: each measurement reaps its own;
        # a second Ctrl-C, from a terminal pressed twice, is not to cut this)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        print(f"macroflow bench: interrupted (Ctrl-C); "
              f"{'nothing was written to ' + args.json if args.json else 'no table was printed'}",
              file=sys.stderr)
        return 130


def _check_bind(host: str) -> None:
    """OSError naming ``host`` if this host cannot listen there (an address of
    another host, say): said before the worker connects, as a usage error.

    Example:
        >>> _check_bind("127.0.0.1")
        >>> _check_bind("192.0.2.1")  # a documentation address, on no host
        Traceback (most recent call last):
        ...
        OSError: --bind 192.0.2.1: this host cannot listen there ([Errno 99] Cannot assign requested address)
    """
    import socket
    try:
        infos = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)
        family, kind, proto, _, addr = infos[0]
        with socket.socket(family, kind, proto) as s:
            s.bind(addr)
    except OSError as e:
        raise OSError(f"--bind {host}: this host cannot listen there ({e})") from None


def cmd_worker(args: argparse.Namespace) -> int:
    from macroflow.join import tls_contexts, worker_main
    from macroflow.transport.tcp import load_secret, parse_address
    try:
        parse_address(args.connect)
        secret = load_secret(args.secret_file)
        tls = tls_contexts(args.tls_cert, args.tls_key)
        if args.bind is not None:
            _check_bind(args.bind)
    except (ValueError, OSError) as e:
        args.parser.error(str(e))
    if args.secret_file is None and not os.environ.get("MACROFLOW_SECRET") \
            and not os.environ.get("MACROFLOW_SECRET_FILE"):
        args.parser.error("no secret: set MACROFLOW_SECRET (the program that listens printed "
                          "it) or give --secret-file")
    from macroflow.core.errors import LimitError
    from macroflow.transport.tcp import check_room
    try:  # (this process forks the n contexts, as context 0 forks contexts it adds)
        check_room(args.n + 1, adding=True)
    except LimitError as e:
        args.parser.error(f"-n {args.n}: {e}")
    return worker_main(args.connect, args.n, secret, tls, bind=args.bind)


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


def function_name(text: str) -> str:
    """argparse type of the name of a script's function: a Python identifier.

    Example:
        >>> function_name("main")
        'main'
        >>> function_name("")
        Traceback (most recent call last):
        ...
        argparse.ArgumentTypeError: must be the name of a function (a Python identifier); got ''
    """
    if not text.isidentifier():
        raise argparse.ArgumentTypeError(f"must be the name of a function (a Python "
                                         f"identifier); got {text!r}")
    return text


class ArgumentParser(argparse.ArgumentParser):
    """An ``argparse.ArgumentParser`` for scripts that may run under mpiexec,
    where every rank parses the same command line: rank 0 alone prints help,
    version and usage errors; every rank exits as argparse would (0 after
    ``--help``, 2 after an error). Elsewhere it is argparse's own.

    Example:
        >>> from macroflow.cli import ArgumentParser
        >>> p = ArgumentParser(prog="demo")
        >>> _ = p.add_argument("--size", type=int, default=8)
        >>> p.parse_args(["--size", "3"]).size
        3
        >>> try:
        ...     p.error("bad")
        ... except SystemExit as e:
        ...     e.code
        2
    """

    def _print_message(self, message: str, file: Any = None) -> None:
        if not _rank_0():
            return
        super()._print_message(message, file)

    def error(self, message: str) -> "NoReturn":  # type: ignore[override]
        if not _rank_0():
            raise SystemExit(2)
        super().error(message)


def _rank_0() -> bool:
    from macroflow.transport.mpi import world_from_environment
    world = world_from_environment()
    return world is None or world[0] == 0


def build_parser() -> argparse.ArgumentParser:
    from macroflow.core.placement import POLICIES
    from macroflow.transport.base import REGISTRY
    from macroflow import __version__
    p = ArgumentParser(prog="macroflow", description="parallel objects and macro dataflow")
    p.add_argument("--version", action="version", version=f"macroflow {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND", parser_class=ArgumentParser,
                           title="commands (macroflow COMMAND --help for more)")
    r = sub.add_parser("run", help="run a script's main() on N contexts")
    r.add_argument("-n", type=positive_int, default=None, metavar="N",
                   help="number of contexts (default: CPU count)")
    r.add_argument("--transport", default=None, choices=sorted(REGISTRY),
                   help="local (default), inproc, tcp, or mpi (ranks of mpiexec, which it "
                        "launches; the default under mpiexec)")
    r.add_argument("--placement", default=None, choices=POLICIES,
                   help="round-robin (default), random or best-most-recently")
    r.add_argument("--main", default="main", type=function_name,
                   help="the function to run (default: main)")
    r.add_argument("--spmd", action="store_true",
                   help="run main in every context (mf.spmd) and print the list of results "
                        "by rank, instead of main on context 0")
    # (optional to argparse only so that a missing one is named alone: see main)
    r.add_argument("script", nargs="?", help="the Python file whose main() runs")
    r.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    r.set_defaults(fn=cmd_run, parser=r)
    w = sub.add_parser("worker", help="join a computation over TCP with N contexts")
    w.add_argument("--connect", required=True, metavar="HOST:PORT",
                   help="where the computation listens (mf.init(listen=...))")
    w.add_argument("-n", type=positive_int, default=1, metavar="N",
                   help="contexts to add from this host (default 1)")
    w.add_argument("--secret-file", default=None, metavar="FILE",
                   help="file holding the computation's secret (default: MACROFLOW_SECRET)")
    w.add_argument("--tls-cert", default=None, metavar="FILE", help="TLS certificate (PEM)")
    w.add_argument("--tls-key", default=None, metavar="FILE", help="its private key (PEM)")
    w.add_argument("--bind", default=None, metavar="HOST",
                   help="address this host's contexts listen on (default: the one that "
                        "reaches --connect)")
    w.set_defaults(fn=cmd_worker, parser=w)
    i = sub.add_parser("info", help="versions and transports present")
    i.set_defaults(fn=cmd_info, parser=i)
    b = sub.add_parser("bench", help="run the benchmarks")
    b.add_argument("suite", nargs="?", default="micro", help="micro (default), peers, nexus, baselines, service or tulip")
    b.add_argument("--json", default=None, help="also write every figure to this file")
    b.add_argument("--quick", action="store_true", help="fewer iterations (a smoke run)")
    b.add_argument("--peers", default=None, metavar="LIST",
                   help="peers suite: the peers to try, comma-separated (default: ray,dask,mpi4py)")
    b.set_defaults(fn=cmd_bench, parser=b)
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
    p = build_parser()
    args, extra = p.parse_known_args(argv)
    sub = getattr(args, "parser", None) or p
    if extra:  # the command's own usage, not the top level's
        sub.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.cmd == "run" and args.script is None:
        sub.error("the script to run is required: macroflow run [options] script.py [args]")
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
