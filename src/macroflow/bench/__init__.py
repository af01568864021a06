"""macroflow's benchmark suites: one module per table.

  baselines  hand-coded socketpair ping-pong, bandwidth and fork start-up (no macroflow)
  micro      Mentat's Table I and II for macroflow, METG(50%), and the performance bars
  peers      the same operations on macroflow, Ray, Dask, ProcessPoolExecutor and mpi4py
  nexus      Nexus's Figure 3: RSR round trip against message size, inline and new
             thread, next to hand-coded sockets and mpi4py, per transport
  service    how fast a context serves while a method computes, and what that costs it
  tulip      Tulip's figures: get against two-sided and plain copies, remote action
             ping-pong in a barrier, barriers against MPI_Barrier, ShmBarrier layouts

``macroflow bench SUITE [--quick] [--json FILE]`` runs :func:`main`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

SUITES = ("micro", "peers", "nexus", "baselines", "service", "tulip")


def json_problem(path: str) -> Optional[str]:
    """Why the results cannot be written to ``path``, or None if they can.

    Tries it: the file is opened for appending (and removed again if it did
    not exist), so what it says holds for this user on this file system.

    Example:
        >>> json_problem("/nonexistent/dir/out.json")
        'cannot write it: No such file or directory'
        >>> json_problem("/")
        'cannot write it: a directory'
    """
    if os.path.isdir(path):
        return "cannot write it: a directory"
    existed = os.path.exists(path)
    try:
        with open(path, "a"):
            pass
    except OSError as e:
        return f"cannot write it: {e.strerror or e}"
    if not existed:
        os.remove(path)
    return None


def cores() -> int:
    """The CPUs this process may run on (a figure with more contexts than
    these is oversubscribed).

    Example:
        >>> cores() >= 1
        True
    """
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def progress_printer(suite: str):
    """The progress callback of a suite: one line on stderr per step.

    Example:
        >>> import contextlib, io
        >>> err = io.StringIO()
        >>> with contextlib.redirect_stderr(err):
        ...     progress_printer("micro")("round 1/3")
        >>> err.getvalue()
        '[bench micro] round 1/3\\n'
    """
    def progress(msg: str) -> None:
        print(f"[bench {suite}] {msg}", file=sys.stderr, flush=True)
    return progress


def write_json(res: dict, path: Optional[str]) -> None:
    """Write a suite's figures to ``path`` (if given) and say so.

    Example:
        >>> import json, os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "out.json")
        >>> write_json({"a": 1}, path)
        <BLANKLINE>
        wrote ...out.json
        >>> json.load(open(path))
        {'a': 1}
    """
    if not path:
        return
    import json
    with open(path, "w") as f:
        json.dump(res, f, indent=1, default=float)
        f.write("\n")
    print(f"\nwrote {path}")


def main(suite: str = "micro", json_path: Optional[str] = None, quick: bool = False,
         peers: Optional[str] = None) -> int:
    """Run a benchmark suite, print its tables, and return an exit code.

    Args:
        suite: "micro" (Mentat's tables, METG, bars), "peers" (macroflow next to
            Ray, Dask, ProcessPoolExecutor and mpi4py), "nexus" (Nexus's Figure 3:
            round trip against message size per transport), "baselines"
            (hand-coded only), "service" (service while a method computes) or
            "tulip" (Tulip's figures: get, remote actions, barriers).
        json_path: also write every figure of the micro, peers, nexus, service or tulip suite to this
            file; one that cannot be written is refused (2) before anything runs.
        quick: far fewer iterations (a smoke run of well under a minute).
        peers: for the peers suite, the peers to try ("ray,dask,mpi4py"; default all).

    Example:
        >>> main("nonesuch")
        2
        >>> main("micro", peers="ray")
        2
        >>> main("micro", json_path="/nonexistent/dir/out.json")
        2
    """
    if peers is not None and suite != "peers":
        print(f"macroflow bench: --peers applies to the peers suite only, not {suite!r}",
              file=sys.stderr)
        return 2
    if json_path is not None:
        problem = json_problem(json_path)
        if problem is not None:  # found now, not after minutes of measuring
            print(f"macroflow bench: --json {json_path}: {problem}", file=sys.stderr)
            return 2
    if suite == "peers":
        from . import peers as peers_suite
        return peers_suite.main(json_path=json_path, quick=quick, peers=peers)
    if suite == "nexus":
        from . import nexus
        return nexus.main(json_path=json_path, quick=quick)
    if suite == "micro":
        from . import micro
        return micro.main(json_path=json_path, quick=quick)
    if suite == "service":
        from . import service
        return service.main(json_path=json_path, quick=quick)
    if suite == "tulip":
        from . import tulip
        return tulip.main(json_path=json_path, quick=quick)
    if suite == "baselines":
        from . import baselines
        baselines.main(json_path=json_path, quick=quick)
        return 0
    print(f"macroflow bench: unknown suite {suite!r}; choose one of {', '.join(SUITES)}",
          file=sys.stderr)
    return 2


def suite_main(module: Any, worker_flags: Sequence[str], argv: Sequence[str]) -> int:
    """What ``python -m macroflow.bench.<suite>`` does: with one of
    ``worker_flags``, be a worker of the suite (its ``_worker_main``); with a
    saved ``.json``, print it as Markdown (its ``markdown``); else run the
    suite (its ``main``, ``--quick`` for a smoke run). ``module`` is the
    importable module, not ``__main__``, so that what a worker sends pickles
    by reference.

    Example:
        >>> import json, tempfile, types
        >>> suite = types.SimpleNamespace(markdown=lambda res: f"ran {res['n']}\\n")
        >>> with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        ...     json.dump({"n": 3}, f)
        >>> suite_main(suite, ["--worker"], ["prog", f.name])
        ran 3
        0
    """
    if any(flag in argv for flag in worker_flags):
        return module._worker_main(list(argv))
    if len(argv) == 2 and argv[1].endswith(".json"):
        with open(argv[1]) as f:
            print(module.markdown(json.load(f)), end="")
        return 0
    return module.main(quick="--quick" in argv)


def spawn_worker(module: str, args: List[str], timeout_s: float, tag: str,
                 mpiexec: Optional[str] = None, ranks: int = 2) -> Dict[str, Any]:
    """Run ``python -m module *args`` in a fresh interpreter (under ``mpiexec
    -n ranks`` if given) and return the JSON it printed after ``tag``, or
    ``{"error": why}``. The worker imports this very macroflow, whatever is
    installed; whatever it leaves in its session is killed with it.

    Example:
        >>> spawn_worker("json.tool", ["/no/such/file"], 30, "RESULT ")["error"][:26]
        'worker exited with code 2:'
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [src_dir()] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    cmd = [sys.executable, "-m", module, *args]
    if mpiexec is not None:
        # python -m mpi4py: an exception on one rank aborts them all instead of leaving one blocked
        cmd = [mpiexec, "-n", str(ranks), sys.executable, "-m", "mpi4py"] + cmd[1:]
    shm_before = None
    if mpiexec is not None:
        from macroflow.transport.mpi import mpich_shm_files
        shm_before = mpich_shm_files()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _end_worker(proc, shm_before)
        proc.communicate()
        return {"error": f"timed out after {timeout_s:g} s"}
    finally:
        _end_worker(proc, shm_before)
    for line in reversed(out.splitlines()):
        if line.startswith(tag):
            return json.loads(line[len(tag):])
    tail = " | ".join((err.strip().splitlines() or ["no output"])[-3:])
    return {"error": f"worker exited with code {proc.returncode}: {tail}"}


def _end_worker(proc: Any, shm_before: Any) -> None:
    """Kill whatever the worker left in its session; for an MPI worker, also
    its process manager's proxy and the ranks, which have sessions of their
    own, and then the shared-memory files of MPICH and of macroflow's ranks
    that they left in /dev/shm (killed, they do not remove them)."""
    tree = _descendants(proc.pid) if shm_before is not None else []
    kill_group(proc.pid)
    if shm_before is None:
        return
    for pid in tree:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        pass
    deadline = time.monotonic() + 5
    while any(os.path.exists(f"/proc/{pid}") for pid in tree) and time.monotonic() < deadline:
        time.sleep(0.02)  # (reaped by their parents, or by init)
    from macroflow.transport.mpi import _sweep_pages, mpich_shm_files, remove_unused
    remove_unused(mpich_shm_files() - shm_before)
    _sweep_pages()


def _descendants(pid: int) -> List[int]:
    from macroflow.transport.mpi import _children
    out, todo = [], [pid]
    while todo:
        for child, _cmd in _children(todo.pop()):
            out.append(child)
            todo.append(child)
    return out


def src_dir() -> str:
    """The directory that holds this macroflow package (for a worker's PYTHONPATH).

    Example:
        >>> os.path.isdir(os.path.join(src_dir(), "macroflow"))
        True
    """
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def kill_group(pgid: int) -> None:
    """Kill process group ``pgid``, if it is still there.

    Example:
        >>> kill_group(2 ** 22 + 12345)   # no such group: nothing happens
    """
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
