"""Contexts that die, teardown on every exit path, init/shutdown, the CLI."""

import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

import macroflow as mf
from conftest import MPI_MISSING
from common import Gate, our_processes
from macroflow.core.context import SYSTEM, current_engine
from macroflow.transport import mpi as _mpi

pytestmark = pytest.mark.timeout(60)


@mf.regular
class Work:
    def echo(self, x):
        return x


def _pid_of(ctx):
    eng = current_engine()
    return eng.issue(SYSTEM, "pid", "pid", (), {}, ctx, pinned=True).result()


def test_killed_context_fails_waiting_futures():
    def main():
        g = Gate.create(on=1)
        f = g.wait(1)  # never opens
        os.kill(_pid_of(1), signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(mf.ContextLost) as info:
            f.result(timeout=20)
        took = time.monotonic() - t0
        # later calls to the lost context fail at once
        late = g.open().exception(timeout=5)
        return info.value, took, late

    err, took, late = mf.run(main, contexts=2)
    assert err.context == 1
    assert "SIGKILL" in str(err) and "context 1" in str(err)
    assert took < 5
    assert isinstance(late, mf.ContextLost)


def test_done_says_true_for_a_future_whose_context_was_lost():
    # (a loop on done() and mf.poll() went on for ever: a future nobody had
    # asked for is failed only when asked)
    def main():
        f = Gate.create(on=1).wait(1)  # never opens, and nobody asks for it
        os.kill(_pid_of(1), signal.SIGKILL)
        deadline = time.monotonic() + 20
        while not f.done() and time.monotonic() < deadline:
            mf.poll()
        return f.done(), f.exception(timeout=5)

    done, err = mf.run(main, contexts=2)
    assert done and isinstance(err, mf.ContextLost) and err.context == 1


def test_context_exiting_fails_arcs_on_other_contexts():
    def main():
        g = Gate.create(on=1)
        f = g.wait(1)
        consumer = Work.create(on=2).echo(f)  # an arc from context 1 to context 2
        os.kill(_pid_of(1), signal.SIGKILL)
        return consumer.exception(timeout=20)

    err = mf.run(main, contexts=3)
    assert isinstance(err, mf.ContextLost) and err.context == 1


def test_a_call_fails_once_a_context_of_one_argument_is_lost_not_when_the_others_come():
    # it waited for its other argument (here, for ever) before it said so
    def main():
        held = Gate.create(on=1).wait(1)  # never opens
        doomed = Gate.create(on=2).wait(2)
        consumer = Work.create(on=0).echo([held, doomed])
        os.kill(_pid_of(2), signal.SIGKILL)
        return consumer.exception(timeout=20)

    err = mf.run(main, contexts=3)
    assert isinstance(err, mf.ContextLost) and err.context == 2


def test_context_exit_code_is_reported():
    def main():
        g = Gate.create(on=1)
        f = g.wait(1)
        current_engine().issue(SYSTEM, "exit", "exit", (3,), {}, 1, pinned=True)
        return f.exception(timeout=20)

    err = mf.run(main, contexts=2)
    assert isinstance(err, mf.ContextLost)
    assert "exited with code 3" in str(err)


def test_exception_in_main_tears_down():
    def main():
        Gate.create(on=1).pid().result()
        raise KeyError("main failed")

    with pytest.raises(KeyError, match="main failed"):
        mf.run(main, contexts=3)
    assert our_processes(zombies=True) == []


def test_run_returns_after_teardown():
    pids = mf.run(lambda: [_pid_of(c) for c in (1, 2)], contexts=3)
    for pid in pids:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_init_context_manager_and_nesting():
    with mf.init(contexts=2) as session:
        assert mf.num_contexts() == 2
        assert Work.create(on=1).echo(5).result() == 5
        with pytest.raises(RuntimeError, match="already running"):
            mf.init(contexts=2)
    assert session.closed
    with pytest.raises(RuntimeError, match="not running"):
        mf.context_id()


def test_shutdown_without_context_manager():
    mf.init(contexts=2)
    assert Work().echo(1).result() == 1
    mf.shutdown()
    assert our_processes(zombies=True) == []


def _stop(proc):
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def _script(tmp_path, body):
    path = tmp_path / "prog.py"
    path.write_text(textwrap.dedent(body))
    return str(path)


MAIN_CLASSES = """
import macroflow as mf, os, sys

@mf.regular
class Square:
    def go(self, x):
        return x * x, mf.context_id()

def main():
    vals = mf.gather([Square.create(on=c).go(c + 1) for c in range(mf.num_contexts())])
    return vals

if __name__ == "__main__":
    print(mf.run(main, contexts=3))
    # defined after the first computation: sent by value to the new contexts
    @mf.regular
    class Late:
        def go(self):
            return "late", mf.context_id()
    with mf.init(contexts=2):
        print(Late.create(on=1).go().result())
"""


def test_main_module_classes_work(tmp_path):
    out = subprocess.run([sys.executable, _script(tmp_path, MAIN_CLASSES)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert lines[0] == "[(1, 0), (4, 1), (9, 2)]"
    assert lines[1] == "('late', 1)"


def test_cli_run(tmp_path):
    script = _script(tmp_path, MAIN_CLASSES)
    out = subprocess.run([sys.executable, "-m", "macroflow", "run", "-n", "2", script],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[(1, 0), (4, 1)]"


def test_cli_info():
    out = subprocess.run([sys.executable, "-m", "macroflow", "info"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    assert "transports" in out.stdout and "local" in out.stdout and "inproc" in out.stdout
    # whether the rings' steps run compiled: pip hides the build's warning when it could not
    assert "rings        compiled (macroflow.transport._cring)" in out.stdout
    env = dict(os.environ, MACROFLOW_COMPILED="0")
    out = subprocess.run([sys.executable, "-m", "macroflow", "info"], capture_output=True,
                         text=True, timeout=60, env=env)
    assert "rings        in Python (MACROFLOW_COMPILED=0)" in out.stdout


def test_cli_run_missing_script():
    out = subprocess.run([sys.executable, "-m", "macroflow", "run", "-n", "2", "/nonexistent.py"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "no such file" in out.stderr


@pytest.mark.parametrize("argv, complaint", [
    (["-n", "0"], "argument -n: must be an int >= 1; got '0'"),
    (["-n", "two"], "argument -n: must be an int >= 1; got 'two'"),
    (["--transport", "nope"], "argument --transport: invalid choice: 'nope'"),
    (["--placement", "closest"], "argument --placement: invalid choice: 'closest'"),
    (["--main", ""], "argument --main: must be the name of a function (a Python identifier); "
                     "got ''"),
])
def test_cli_run_bad_arguments_are_usage_errors(tmp_path, argv, complaint):
    script = _script(tmp_path, MAIN_CLASSES)
    out = subprocess.run([sys.executable, "-m", "macroflow", "run", *argv, script],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert f"macroflow run: error: {complaint}" in out.stderr
    assert "Traceback" not in out.stderr and out.stdout == ""


ARGV_AT_TOP = """
import argparse
import macroflow as mf

ap = argparse.ArgumentParser()
ap.add_argument("--n", type=int, default=3)
args = ap.parse_args()  # at the top level, as the script's own arguments


def main():
    return args.n * mf.num_contexts()
"""


@pytest.mark.timeout(120)
def test_cli_run_gives_the_script_its_arguments_while_its_top_level_runs(tmp_path):
    script = tmp_path / "argv_top.py"
    script.write_text(ARGV_AT_TOP)
    out = subprocess.run([sys.executable, "-m", "macroflow", "run", "-n", "2", str(script),
                          "--n", "5"], capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "10"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("source, code, says", [
    ("def main(:\n    pass\n", 1, "SyntaxError: invalid syntax"),
    ("import no_such_module_here\ndef main():\n    pass\n", 1,
     "ModuleNotFoundError: No module named 'no_such_module_here'"),
    ("def main(x):\n    return x\n", 1, "macroflow run: mf.run(): main(x) cannot be called "
                                           "with no arguments"),
    ("main = 5\n", 1, "defines int 'main', not a function"),
    ("class main:\n    pass\n", 1, "defines class main, not a function: --main names the "
                                   "function to run"),
    ("import macroflow as mf\ndef main():\n    return 1\nmf.run(main, contexts=2)\n", 1,
     "starts a computation at its top level (mf.run, mf.init or mf.spmd) while `macroflow "
     "run` loads it"),
    ("import asyncio\nasync def main():\n    await asyncio.sleep(0)\n    return 7\n", 0, ""),
])
def test_cli_run_says_what_is_wrong_with_a_script_in_its_own_words(tmp_path, source, code, says):
    # a script that did not import, or whose main needed arguments, printed
    # macroflow's own frames; one that started a computation at its top level
    # ran twice; an async main was printed as a coroutine, never run
    script = tmp_path / "job.py"
    script.write_text(source)
    out = subprocess.run([sys.executable, "-m", "macroflow", "run", "-n", "2", str(script)],
                         capture_output=True, text=True, timeout=100)
    assert out.returncode == code, out.stderr
    assert says in out.stderr, out.stderr
    assert "macroflow/cli.py" not in out.stderr and "macroflow/launch.py" not in out.stderr
    if code == 0:
        assert out.stdout.strip() == "7"


@pytest.mark.parametrize("name, value, transport", [
    ("MACROFLOW_SPIN_US", "fast", "local"), ("MACROFLOW_SERVICE", "bogus", "local"),
    ("MACROFLOW_PIN", "bogus", "local"), ("MACROFLOW_PIN", "bogus", "mpi"),
    ("MACROFLOW_RINGS", "2", "tcp"), ("MACROFLOW_MPI_INIT_WARN_S", "abc", "mpi"),
    ("MACROFLOW_COMPILED", "2", "local")])
def test_cli_run_bad_environment_is_a_usage_error(tmp_path, name, value, transport):
    # (a bad MACROFLOW_SERVICE printed a traceback; a bad MACROFLOW_PIN ran on
    # mpi, which does not pin, and MACROFLOW_MPI_INIT_WARN_S=abc was taken as 30)
    if transport == "mpi" and MPI_MISSING is not None:
        pytest.skip(MPI_MISSING)
    script = _script(tmp_path, MAIN_CLASSES)
    out = subprocess.run([sys.executable, "-m", "macroflow", "run", "-n", "2", "--transport",
                          transport, script],
                         capture_output=True, text=True, timeout=60,
                         env={**os.environ, name: value})
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert f"macroflow run: error: the {name} environment variable must be" in out.stderr


@pytest.mark.parametrize("spin", [-1, -0.5, float("nan"), float("inf"), "50", True, [50]])
def test_bad_spin_us_is_refused_before_anything_starts(spin):
    with pytest.raises(ValueError, match=r"spin_us must be a finite number of microseconds >= 0 "
                                         r"\(0: never poll before sleeping\); got "):
        mf.run(lambda: None, contexts=2, spin_us=spin)
    with pytest.raises(ValueError, match=f"got {re.escape(repr(spin))}"):
        mf.init(contexts=2, spin_us=spin)
    assert our_processes(zombies=True) == []
    with pytest.raises(RuntimeError, match="not running"):
        mf.context_id()


@pytest.mark.parametrize("env", ["fast", "-5", "nan", "1e400"])
def test_bad_spin_environment_variable_is_refused(monkeypatch, env):
    monkeypatch.setenv("MACROFLOW_SPIN_US", env)
    with pytest.raises(ValueError, match=f"the MACROFLOW_SPIN_US environment variable must be a "
                                         f"finite number .*; got '{env}'"):
        mf.init(contexts=2)
    assert mf.run(lambda: mf.num_contexts(), contexts=2, spin_us=0) == 2  # an argument wins


def test_spin_us_zero_and_numbers_are_accepted(monkeypatch):
    monkeypatch.setenv("MACROFLOW_SPIN_US", "7.5")
    with mf.init(contexts=2) as s:
        assert s.engine.transport.spin_s == 7.5e-6
    with mf.init(contexts=2, spin_us=0) as s:
        assert s.engine.transport.spin_s == 0.0
    # numpy's numbers as Python's (an np.int64 was refused, an np.float64 taken)
    np = pytest.importorskip("numpy")
    with mf.init(contexts=2, spin_us=np.int64(3)) as s:
        assert s.engine.transport.spin_s == 3e-6
    with pytest.raises(ValueError, match="spin_us must be a finite number"):
        mf.init(contexts=2, spin_us=np.bool_(True))


CTRL_C = """
import macroflow as mf, sys

@mf.persistent
class Gate:
    def __init__(self):
        self.open = False
    @mf.guard(lambda self: self.open)
    def wait(self):
        return 1

def main():
    g = Gate.create(on=1)
    f = g.wait()
    print("ready", flush=True)
    f.result()

if __name__ == "__main__":
    try:
        mf.run(main, contexts=3)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
        sys.exit(130)
"""


def test_ctrl_c_tears_everything_down(tmp_path):
    proc = subprocess.Popen([sys.executable, _script(tmp_path, CTRL_C)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        kids = psutil.Process(proc.pid).children(recursive=True)
        assert len(kids) == 3  # two contexts and the fork server
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 130, err
        assert "interrupted" in out
        gone, alive = psutil.wait_procs(kids, timeout=10)
        assert alive == []
    finally:
        _stop(proc)


KILL_PARENT = """
import macroflow as mf, os, sys

@mf.regular
class W:
    def pid(self):
        return os.getpid()

def main():
    pids = mf.gather([W.create(on=c).pid() for c in (1, 2)])
    print(" ".join(map(str, pids)), flush=True)
    sys.stdin.readline()

mf.run(main, contexts=3)
"""


def test_contexts_die_with_a_killed_parent(tmp_path):
    proc = subprocess.Popen([sys.executable, _script(tmp_path, KILL_PARENT)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2
        kids = [psutil.Process(p) for p in pids]
        proc.kill()
        proc.wait(timeout=10)
        gone, alive = psutil.wait_procs(kids, timeout=10)
        assert alive == []
    finally:
        _stop(proc)


def test_calls_from_another_thread_are_refused():
    import threading

    def main():
        errors = []

        def other():
            try:
                Work().echo(1)
            except RuntimeError as e:
                errors.append(str(e))

        t = threading.Thread(target=other)
        t.start()
        t.join()
        return errors

    errs = mf.run(main, contexts=2, transport="inproc")
    assert len(errs) == 1 and "thread" in errs[0]


CTRL_C_COMPUTING = """
import macroflow as mf, os, sys, time

@mf.regular
class Busy:
    def spin(self, seconds):
        print("computing", flush=True)
        end = time.monotonic() + seconds
        while time.monotonic() < end:  # computes without waiting: holds context 0
            pass
        return "finished"

def main():
    pids = [mf.stats()[c]["pid"] for c in range(1, 3)] if sys.argv[1] == "local" else []
    print(" ".join(map(str, pids)), flush=True)
    return Busy.create(on=0).spin(30).result()

print(mf.run(main, contexts=3, transport=sys.argv[1]))
"""


WITH_INIT = """
with mf.init(contexts=3, transport=sys.argv[1]):
    print(main())
"""


@pytest.mark.parametrize("form", ["run", "init"])
@pytest.mark.parametrize("transport", ["local", "inproc"])
def test_ctrl_c_while_context_0_computes_ends_the_program(tmp_path, transport, form):
    code = CTRL_C_COMPUTING
    if form == "init":  # (it said nothing of the contexts it stopped)
        code = code.replace("print(mf.run(main, contexts=3, transport=sys.argv[1]))", WITH_INIT)
    proc = subprocess.Popen([sys.executable, _script(tmp_path, code), transport],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        kids = [psutil.Process(int(p)) for p in proc.stdout.readline().split()]
        assert proc.stdout.readline().strip() == "computing"
        t = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=20)
        took = time.monotonic() - t
        assert "finished" not in out
        assert "KeyboardInterrupt" in err
        assert err.count("macroflow: interrupted (Ctrl-C); all 3 contexts were stopped") == 1, err
        assert took < 3.0, took  # the method's 30 s are not waited for
        gone, alive = psutil.wait_procs(kids, timeout=10)
        assert alive == []
    finally:
        _stop(proc)


def test_ctrl_c_under_macroflow_run_exits_130_without_a_traceback(tmp_path):
    script = _script(tmp_path, CTRL_C_COMPUTING.replace(
        "print(mf.run(main, contexts=3, transport=sys.argv[1]))", ""))
    proc = subprocess.Popen([sys.executable, "-m", "macroflow", "run", "-n", "3", script, "local"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        proc.stdout.readline()
        assert proc.stdout.readline().strip() == "computing"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=20)
        assert proc.returncode == 130
        assert "interrupted" in err and "Traceback" not in err
    finally:
        _stop(proc)


@mf.persistent
class Ender:
    def end(self):
        mf.shutdown()


def test_shutdown_is_refused_inside_a_method_and_inside_main_of_run(run):
    def main():
        with pytest.raises(RuntimeError, match="inside method Ender.end on context 1: code"):
            Ender.create(on=1).end().result(timeout=10)
        with pytest.raises(RuntimeError, match="inside the main function of mf.run"):
            mf.shutdown()
        return mf.context_id()  # still running

    assert run(main, contexts=2) == 0


def _losing_context_1(orig):
    # the transport finds the peer gone in the middle of a send, as it does when
    # a context dies at that moment: it says so, then the send fails (whether
    # the frame was to leave at once or with the rest of a batch)
    def send(self, dest, parts, load):
        if self.ctx == 2 and dest == 1:
            self.lost(1, "connection closed during a send")
            raise ConnectionError("context 1: send failed")
        return orig(self, dest, parts, load)
    return send


from macroflow.transport.local import LocalTransport  # noqa: E402


def test_a_peer_lost_inside_a_send_fails_the_waiting_call_once(monkeypatch):
    monkeypatch.setattr(LocalTransport, "queue", _losing_context_1(LocalTransport.queue))
    monkeypatch.setattr(LocalTransport, "send", _losing_context_1(LocalTransport.send))

    def main():
        g = Gate.create(on=1)
        w = Work.create(on=2)
        err = w.echo(g.wait(1)).exception(timeout=20)  # its arc is pulled from context 1
        # context 2 is unharmed: its load is sane and it still serves
        return err, w.echo(5).result(timeout=20), mf.stats()[2]["load"]

    err, five, load = mf.run(main, contexts=3)
    assert isinstance(err, mf.ContextLost) and err.context == 1
    assert "during a send" in str(err)
    assert (five, load) == (5, 0)  # (mf.stats is no call: it is not counted)
# -- how many contexts the host can hold: refused before anything is forked ------
@pytest.fixture
def no_fork(monkeypatch):
    """A refusal must come before any fork: one would fail the test, not fork."""
    def refuse():
        raise AssertionError("forked although the contexts do not fit")
    monkeypatch.setattr(os, "fork", refuse)


def _host(monkeypatch, mem_mb=None, nproc=None, user_tasks=0, all_tasks=None):
    from macroflow.transport import local
    monkeypatch.setattr(local, "_mem_available", lambda: None if mem_mb is None else mem_mb << 20)
    monkeypatch.setattr(local, "_nproc_limit", lambda: nproc)
    monkeypatch.setattr(local, "_user_tasks", lambda: user_tasks)
    monkeypatch.setattr(local, "_tasks_total", lambda: all_tasks)


@pytest.mark.parametrize("start", ["init", "run"])
def test_more_contexts_than_memory_holds_are_refused(monkeypatch, no_fork, start):
    _host(monkeypatch, mem_mb=100)
    with pytest.raises(mf.LimitError) as e:
        if start == "init":
            mf.init(contexts=50)
        else:
            mf.run(lambda: None, contexts=50)
    assert e.value.limit == "memory"
    msg = str(e.value)
    assert "50 contexts do not fit" in msg and "100 MB is available" in msg
    assert "MemAvailable" in msg and "use at most 11 contexts" in msg
    assert our_processes(zombies=True) == []
    with pytest.raises(RuntimeError, match="not running"):
        mf.context_id()


def test_contexts_that_fit_in_memory_start(monkeypatch):
    from macroflow.transport import local
    _host(monkeypatch, mem_mb=3 * local.CONTEXT_MEMORY >> 20)
    assert mf.run(mf.num_contexts, contexts=4) == 4


def test_inproc_contexts_count_their_own_memory(monkeypatch, no_fork):
    _host(monkeypatch, mem_mb=1)
    assert mf.run(mf.num_contexts, contexts=8, transport="inproc") == 8
    with pytest.raises(mf.LimitError, match=r"on the inproc transport.*use at most 16 contexts"):
        mf.init(contexts=100, transport="inproc")


def test_more_contexts_than_the_process_limit_allows_are_refused(monkeypatch, no_fork):
    _host(monkeypatch, nproc=100, user_tasks=90, all_tasks=300)
    with pytest.raises(mf.LimitError) as e:
        mf.init(contexts=12)
    assert e.value.limit == "RLIMIT_NPROC"
    msg = str(e.value)
    assert "12 contexts need 11 new processes" in msg and "may start only 10 more" in msg
    assert "soft limit 100" in msg and "90 processes and threads" in msg
    assert "use at most 11 contexts" in msg and "ulimit -u" in msg
    assert our_processes(zombies=True) == []


def test_contexts_under_the_process_limit_start(monkeypatch):
    _host(monkeypatch, nproc=100, user_tasks=90, all_tasks=300)
    assert mf.run(mf.num_contexts, contexts=11) == 11


def test_process_limit_is_not_counted_when_the_host_runs_few_tasks(monkeypatch):
    def not_needed():
        raise AssertionError("counted this user's tasks although every task of the host fits")
    _host(monkeypatch, nproc=1000, all_tasks=100)
    from macroflow.transport import local
    monkeypatch.setattr(local, "_user_tasks", not_needed)
    local.check_room(800)
    with pytest.raises(AssertionError, match="counted"):
        local.check_room(950)


def test_readings_of_this_host():
    from macroflow.transport import local
    assert local._user_tasks() >= 1
    assert local._tasks_total() >= 1
    assert local._mem_available() > 0


def test_cli_run_too_many_contexts_is_a_usage_error(monkeypatch, no_fork, tmp_path, capsys):
    from macroflow import cli
    _host(monkeypatch, mem_mb=100)
    script = _script(tmp_path, "raise AssertionError('the script ran')")
    with pytest.raises(SystemExit) as e:
        cli.main(["run", "-n", "100000000", script])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "macroflow run: error: 100000000 contexts do not fit" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("what, complaint", [
    ("dir", "not a file (a directory): "),
    ("missing", "no such file: "),
])
def test_cli_run_script_that_is_no_file_is_a_usage_error(tmp_path, what, complaint):
    path = str(tmp_path) if what == "dir" else str(tmp_path / "missing.py")
    out = subprocess.run([sys.executable, "-m", "macroflow", "run", "-n", "2", path],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert f"macroflow run: error: {complaint}{path}" in out.stderr
    assert "Traceback" not in out.stderr


def test_cli_version():
    out = subprocess.run([sys.executable, "-m", "macroflow", "--version"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == f"macroflow {mf.__version__}"


@pytest.mark.parametrize("where", ["missing dir", "a directory"])
def test_cli_bench_json_that_cannot_be_written_is_refused_before_measuring(
        monkeypatch, tmp_path, capsys, where):
    from macroflow import cli
    from macroflow.bench import micro

    def measure(*a, **k):
        raise AssertionError("measured although the results cannot be written")
    monkeypatch.setattr(micro, "main", measure)
    path = str(tmp_path / "no" / "out.json") if where == "missing dir" else str(tmp_path)
    assert cli.main(["bench", "micro", "--quick", "--json", path]) == 2
    err = capsys.readouterr().err
    assert f"macroflow bench: --json {path}: cannot write it" in err


def test_cli_bench_json_check_leaves_no_file(monkeypatch, tmp_path):
    from macroflow import cli
    from macroflow.bench import micro
    path = tmp_path / "out.json"
    seen = []
    monkeypatch.setattr(micro, "main", lambda json_path, quick: seen.append(os.path.exists(json_path)) or 0)
    assert cli.main(["bench", "micro", "--json", str(path)]) == 0
    assert seen == [False]


def test_counts_computed_with_numpy_are_taken_and_bools_are_not():
    import numpy as np
    assert mf.run(mf.num_contexts, contexts=np.int64(2), transport="inproc") == 2
    assert mf.spmd(mf.rank, n=np.int32(2), transport="inproc") == [0, 1]
    with pytest.raises(TypeError, match="contexts must be a positive int"):
        mf.run(mf.num_contexts, contexts=True, transport="inproc")
    with pytest.raises(TypeError, match="n must be a positive int"):
        mf.spmd(mf.rank, n=2.0, transport="inproc")
    with pytest.raises(TypeError, match="contexts must be a positive int; got '2'"):
        mf.run(mf.num_contexts, contexts="2", transport="inproc")
    with pytest.raises(ValueError, match="contexts must be a positive int; got 0"):
        mf.run(mf.num_contexts, contexts=0, transport="inproc")


def test_contexts_added_by_a_numpy_count():
    import numpy as np

    def main():
        return mf.add_contexts(np.int64(1)), mf.num_contexts()

    assert mf.run(main, contexts=2, transport="local") == ([2], 3)


def _cpus():
    return sorted(os.sched_getaffinity(0))


@pytest.mark.timeout(60)
@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs two CPUs to bind contexts to")
def test_pinning_puts_each_context_on_a_cpu_of_its_own_and_gives_context_0_its_cpus_back(
        monkeypatch):
    cpus = _cpus()
    monkeypatch.setenv("MACROFLOW_PIN", "1")

    def main():
        got = [mf.remote_action(c, _cpus).wait(30) if c else _cpus() for c in range(2)]
        extra = mf.add_contexts(len(cpus) - 1)  # up to one more than the CPUs
        return got, mf.remote_action(extra[-1], _cpus).wait(30)

    got, last = mf.run(main, contexts=2, transport="local")
    assert got == [[cpus[0]], [cpus[1]]]
    assert last == cpus  # beyond the CPUs: anywhere
    assert _cpus() == cpus  # context 0's own again
    monkeypatch.setenv("MACROFLOW_PIN", "maybe")
    with pytest.raises(ValueError, match="MACROFLOW_PIN"):
        mf.run(mf.num_contexts, contexts=2, transport="local")
    assert _cpus() == cpus


@pytest.mark.parametrize("argv, words", [
    ([], "the following arguments are required: COMMAND"),
    (["run", "-n", "2"], "macroflow run: error: the script to run is required"),
    (["run", "--bogus", "job.py"], "macroflow run: error: unrecognized arguments: --bogus"),
    (["bench", "--bogus"], "macroflow bench: error: unrecognized arguments: --bogus"),
])
def test_the_command_line_names_what_is_wrong_in_the_commands_own_words(argv, words):
    r = subprocess.run([sys.executable, "-m", "macroflow", *argv], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and words in r.stderr, r.stderr


@pytest.mark.timeout(60)
def test_macroflow_run_shows_a_lost_context_without_a_traceback_of_runtime_frames(tmp_path):
    # (the error ended with a traceback of one frame: future.py's "raise self._exc")
    script = tmp_path / "lost.py"
    script.write_text("import os\nimport macroflow as mf\n\ndef main():\n"
                      "    if mf.rank() == 1:\n        os._exit(3)\n    mf.barrier()\n")
    r = subprocess.run([sys.executable, "-m", "macroflow", "run", "-n", "2", "--spmd",
                        str(script)], capture_output=True, text=True, timeout=50)
    assert r.returncode == 1
    last = r.stderr.strip().split("The above exception was the direct cause")[-1]
    assert last.strip().splitlines() == [
        "of the following exception:", "",
        last.strip().splitlines()[-1]], r.stderr
    assert "exited with code 3" in last and "ContextLost" in last, r.stderr


def test_macroflow_run_shows_a_scripts_error_from_the_scripts_own_code(tmp_path):
    script = tmp_path / "raises.py"
    script.write_text("def helper():\n    raise ValueError('from the script')\n\n"
                      "def main():\n    helper()\n")
    r = subprocess.run([sys.executable, "-m", "macroflow", "run", "-n", "2", str(script)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert r.stderr.count("Traceback (most recent call last)") == 1, r.stderr
    assert "ValueError: from the script" in r.stderr and "in helper" in r.stderr
    assert "cli.py" not in r.stderr and "launch.py" not in r.stderr, r.stderr


def test_run_refuses_a_main_that_cannot_take_its_arguments_before_starting(monkeypatch):
    from macroflow import launch
    started = []
    monkeypatch.setattr(launch, "init", lambda *a, **k: started.append(1))

    def main(n=1):
        return n

    with pytest.raises(TypeError, match=r"mf\.run\(\): main\(n=1\) cannot be called with "
                                        r"context=4 .*; did you mean contexts=\?"):
        mf.run(main, context=4)
    with pytest.raises(TypeError, match=r"cannot be called with 1, 2 \(too many positional"):
        mf.run(main, 1, 2)
    with pytest.raises(TypeError, match=r"main must be callable \(a function\); got NoneType"):
        mf.run(None)
    assert started == []  # refused before any context started
    monkeypatch.undo()
    assert mf.run(main, 5, contexts=1, transport="inproc") == 5


def test_init_inside_run_says_to_use_the_running_computation():
    # it said "shut it down first (mf.shutdown())", which is refused there
    def main():
        with pytest.raises(RuntimeError, match=r"this is the main function of mf\.run\(\)"):
            mf.init(contexts=1, transport="inproc")
        return "ok"

    assert mf.run(main, contexts=1, transport="inproc") == "ok"
    with mf.init(contexts=1, transport="inproc"):
        with pytest.raises(RuntimeError, match=r"shut it down first \(mf\.shutdown\(\)\)"):
            mf.init(contexts=1, transport="inproc")


def test_run_takes_a_main_whose_decorator_supplies_its_arguments():
    import functools

    def with_size(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            return fn(2, *args, **kwargs)
        return wrapper

    @with_size
    def main(n):
        return n

    assert mf.run(main, contexts=1, transport="inproc") == 2


def test_all_names_every_public_name_and_no_module():
    import re
    import types
    text = open(mf.__file__).read()
    # (the names loaded on first use are imported twice: for type checkers too)
    assert sorted({n for n in re.findall(r" as (\w+)\n", text) if not n.startswith("_")}) == \
        mf.__all__
    assert not [n for n in mf.__all__ if isinstance(getattr(mf, n), types.ModuleType)]
    ns = {}
    exec("from macroflow import *", ns)
    assert {"run", "spmd", "Future", "persistent"} <= set(ns) and "core" not in ns


@mf.persistent
class _Interrupts:
    def raise_it(self):
        raise KeyboardInterrupt("from a method")

    def alive(self):
        return "alive"


@pytest.mark.timeout(60)
def test_an_interrupt_raised_in_a_method_fails_its_call_and_nothing_waits(run, transport):
    # In another process an interrupt ends the context it is raised in (the
    # caller hears of its loss); in one process (inproc) it reaches the main
    # program, and the call it ended fails with it. Either way nothing waits:
    # on inproc the object stayed busy for ever (a later call: DeadlockError),
    # and under MPI the caller slept until its timeout, never told.
    def main():
        p = _Interrupts.create(on=1)
        try:
            p.raise_it().result(30)
        except (KeyboardInterrupt, mf.ContextLost) as e:
            first = type(e).__name__
        try:
            later = p.alive().result(30)
        except mf.ContextLost as e:
            later = str(e)
        return first, later

    first, later = run(main, contexts=2)
    if transport == "inproc":
        assert (first, later) == ("KeyboardInterrupt", "alive")
    else:
        assert first == "ContextLost"
        assert "context 1 was lost" in later
        assert "after KeyboardInterrupt, raised in its user code" in later
        # its traceback starts at the method: the runtime's frames under it
        # (ten of them, from the launcher on) said nothing to its author
        assert "in raise_it" in later and "serve_forever" not in later, later


@pytest.mark.timeout(60)
def test_an_interrupted_call_of_context_0_fails_and_its_dependents_fail_without_interrupting(
        run, transport):
    # A method of context 0 interrupted (its interrupt goes on to main):
    # main may catch it and go on, as a notebook does at a Ctrl-C. The call
    # stayed pending for ever, and so did every call given its future. And
    # on inproc, a call given the future of one an interrupt had failed (on
    # any context) raised that interrupt again when it ran: main got a
    # second KeyboardInterrupt at a later, unrelated wait.
    def main():
        f = _Interrupts.create(on=0).raise_it()
        try:
            f.result(30)
        except KeyboardInterrupt:
            pass
        out = [type(f.exception(timeout=10)).__name__]
        others = _Interrupts.create(on=1)
        dependent = Work.create(on=1).echo(f)
        out.append(type(dependent.exception(timeout=10)).__name__)
        out.append(others.alive().result(30))
        if transport == "inproc":  # (elsewhere context 1's own interrupt ends it)
            g = others.raise_it()
            try:
                g.result(30)
            except KeyboardInterrupt:
                pass
            h = Work.create(on=2).echo(g)
            out.append(type(h.exception(timeout=10)).__name__)
            out.append(Work.create(on=2).echo("unrelated").result(30))
        return out

    got = run(main)
    assert got[:3] == ["KeyboardInterrupt", "KeyboardInterrupt", "alive"], got
    if transport == "inproc":
        assert got[3:] == ["KeyboardInterrupt", "unrelated"], got


FORKED_CHILD = """
    import os, sys
    import macroflow as mf

    @mf.regular
    class S:
        def sq(self, x):
            return x * x

    mf.init(contexts=2, transport=sys.argv[1])
    assert S.create(on=1).sq(2).result(30) == 4
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: a call, then a normal exit (its atexit handlers run)
        os.close(r)
        try:
            S.create(on=1).sq(6).result(5)
            said = "the call ran"
        except RuntimeError as e:
            said = str(e)
        os.write(w, said.encode())
        os.close(w)
        if sys.argv[1] == "mpi":
            # MPI's own finalization at exit (mpi4py's, in C) would run in
            # the child and break the parent's MPI (it then crashed at its
            # exit): see the guide
            os._exit(0)
        sys.exit(0)
    os.close(w)
    said = os.read(r, 4096).decode()
    os.waitpid(pid, 0)
    print("child:", said)
    print("parent:", [S.create(on=1).sq(x).result(30) for x in (8, 9)],
          [c.state for c in mf.contexts()])
    mf.shutdown()
"""


@pytest.mark.parametrize("transport", ["local", "tcp", "mpi"])
def test_a_forked_child_can_neither_use_nor_end_its_parents_computation(tmp_path, transport):
    # The child's call ran on the parent's contexts (the parent's next call
    # then got the child's answer, 36 for 64, and context 1 died of an
    # internal error), and the child's exit stopped the parent's contexts
    if transport == "mpi" and _mpi.available() is not None:
        pytest.skip(str(_mpi.available()))
    out = subprocess.run([sys.executable, _script(tmp_path, FORKED_CHILD), transport], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "child: macroflow is not running in this process: it was forked" in out.stdout, \
        out.stdout
    assert "parent: [64, 81] ['running', 'running']" in out.stdout, out.stdout


FORKED_IN_A_METHOD = """
    import os, sys
    import macroflow as mf

    @mf.regular
    class R:
        def f(self, x):
            return x * x

    @mf.persistent
    class S:
        def __init__(self):
            self.n = 0

        def forker(self, how):
            self.n += 1
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:  # the child, still in this method of context 1
                os.close(r)
                said = []
                for name, fn in [("call", lambda: R.create(on=2).f(3).result(5)),
                                 ("own", lambda: R.create(on=1).f(3).result(5)),
                                 ("stats", lambda: mf.stats(timeout=5)),
                                 ("id", mf.context_id)]:
                    try:
                        fn()
                        said.append(name + " ran")
                    except RuntimeError as e:
                        said.append(name + ": " + str(e)[:27])
                os.write(w, "|".join(said).encode())
                os.close(w)
                if how == "return":
                    return "the child's value"
                if how == "raise":
                    raise ValueError("the child's error")
                sys.exit(5)
            os.close(w)
            said = os.read(r, 65536).decode()
            _, status = os.waitpid(pid, 0)
            return how, os.waitstatus_to_exitcode(status), self.n, said

    def main():
        s = S.create(on=1)
        for how in ("return", "raise", "exit"):
            print(s.forker(how).result(60))
        print("after:", mf.gather([R.create(on=c).f(c) for c in range(3)], timeout=30),
              sorted(mf.stats(timeout=30)))

    mf.run(main, contexts=3, transport=sys.argv[1])
"""


FORKED_CHILD_OWN = """
    import os, sys
    import macroflow as mf

    @mf.persistent
    class Fails:
        def boom(self):
            raise ValueError("the child's own")

    def child_main():
        try:
            Fails.create(on=1).boom().result(30)
        except ValueError as e:
            return f"caught {e}"

    mf.init(contexts=2, transport="local")
    pid = os.fork()
    if pid == 0:  # a computation of its own: its methods' errors are its calls' errors
        print("child:", mf.run(child_main, contexts=2, transport="local"), flush=True)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    print("child status:", os.waitstatus_to_exitcode(status))
    mf.shutdown()
"""


def test_a_child_forked_from_main_runs_a_computation_of_its_own_as_any_program(tmp_path):
    # (a method that raised there ended its context, as if forked in a method)
    out = subprocess.run([sys.executable, _script(tmp_path, FORKED_CHILD_OWN)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines() == ["child: caught the child's own", "child status: 0"], \
        (out.stdout, out.stderr[-2000:])


@pytest.mark.parametrize("transport", ["local", "tcp", "mpi"])
def test_a_child_forked_in_a_method_neither_uses_its_context_nor_answers_for_it(
        tmp_path, transport):
    # A child forked in a method of context 1 ran as context 1: its calls
    # were served (or broke context 0's rings: IndexError in the ring's
    # read), its return answered the parent's call or lost the parent's
    # reply, and its sys.exit(0) failed the parent's call
    if transport == "mpi" and _mpi.available() is not None:
        pytest.skip(str(_mpi.available()))
    out = subprocess.run([sys.executable, _script(tmp_path, FORKED_IN_A_METHOD), transport], capture_output=True,
                         text=True, timeout=90)
    assert out.returncode == 0, out.stderr[-2000:]
    refused = ("call: macroflow is not running in|own: macroflow is not running in|"
               "stats: macroflow is not running in|id: macroflow is not running in")
    lines = out.stdout.splitlines()
    # the child's end is its own: its value or error goes nowhere, its exit status is its own
    assert lines[:3] == [f"({how!r}, {code}, {n}, {refused!r})" for how, code, n in
                         (("return", 0, 1), ("raise", 1, 2), ("exit", 5, 3))], out.stdout
    assert lines[3] == "after: [0, 1, 4] [0, 1, 2]", out.stdout
    assert "ValueError: the child's error" in out.stderr, out.stderr[-2000:]


@pytest.mark.timeout(60)
def test_shutdown_from_another_thread_is_refused():
    # it ended main's computation (tcp, local: main's futures then stale),
    # or broke it (mpi: a signal handler only the main thread may set)
    import threading
    errors = []
    with mf.init(contexts=2, transport="local"):
        t = threading.Thread(target=lambda: errors.append(_raised(mf.shutdown)))
        t.start()
        t.join(30)
        assert Work.create(on=1).echo(5).result(30) == 5
    assert "mf.shutdown() was called from a thread other than" in errors[0], errors


@pytest.mark.timeout(60)
def test_closing_a_computation_from_another_thread_is_refused_and_main_goes_on():
    # close() itself was accepted: main's wait then failed with "I/O
    # operation on closed epoll object", or waited for ever
    import threading
    errors = []
    with mf.init(contexts=2, transport="local") as session:
        f = Work.create(on=1).echo(7)
        t = threading.Thread(target=lambda: errors.append(_raised(session.close)))
        t.start()
        t.join(30)
        assert f.result(30) == 7 and Work.create(on=1).echo(8).result(30) == 8
    assert "close() of a computation was called from a thread other than" in errors[0], errors


@pytest.mark.timeout(60)
def test_another_thread_under_run_is_told_it_is_another_thread():
    # it was told it was "inside the main function of mf.run()"
    import threading

    def main():
        said = []

        def other():
            said.append(_raised(mf.shutdown))
            said.append(_raised(lambda: mf.init(contexts=1, transport="inproc")))

        t = threading.Thread(target=other)
        t.start()
        t.join(30)
        return said

    said = mf.run(main, contexts=2, transport="local")
    assert said[0].startswith("mf.shutdown() was called from a thread other than"), said
    assert "started by another thread" in said[1], said


def _raised(fn):
    try:
        fn()
    except RuntimeError as e:
        return str(e)
    return "no error"


@mf.persistent
class _ExitsSoon:
    def value(self):
        os._exit(7)


@mf.persistent
class _WaitsFor:
    def waits(self, other):
        return other.value().result(30)


@pytest.mark.timeout(60)
def test_a_context_that_loses_another_says_how_its_process_ended():
    # the waiter is a method on context 2, not main: its ContextLost said only
    # "connection closed" (context 0, the parent, could say more)
    def main():
        with pytest.raises(mf.ContextLost) as err:
            _WaitsFor.create(on=2).waits(_ExitsSoon.create(on=1)).result(30)
        return str(err.value)

    text = mf.run(main, contexts=3, transport="local")
    assert re.search(r"context 1 was lost: its process \(pid \d+\) (exited with code 7|has ended)",
                     text), text


FORK_WHILE_SERVED = r"""
import os, signal, threading, time
from macroflow.core import threads

class Service:  # as a service with a thread: one lock, held while it serves
    def __init__(self):
        self.lock, self.stopped = threading.Lock(), False

svc = Service()
threads._live.add(svc)
svc.lock.acquire()  # it serves: a fork waits for the lock
def later():
    time.sleep(0.2)
    os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C while the fork waits
    time.sleep(0.2)
    svc.lock.release()  # (it raised RuntimeError: the fork had released it)
    print("service released its lock", flush=True)
t = threading.Thread(target=later)
t.start()
try:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    for _ in range(5000):
        time.sleep(0.001)
    print("no interrupt")
except KeyboardInterrupt:
    t.join()
    print("interrupted after the fork", flush=True)
"""


@pytest.mark.timeout(60)
def test_a_ctrl_c_while_a_fork_waits_for_a_service_is_raised_after_the_fork():
    # it was dropped (Python reports what a fork hook raises, and goes on), and
    # the parent then released the lock the service held
    out = subprocess.run([sys.executable, "-c", FORK_WHILE_SERVED], capture_output=True,
                         text=True, timeout=50)
    assert out.stdout.splitlines() == ["service released its lock", "interrupted after the fork"]
    assert "Exception ignored" not in out.stderr and "RuntimeError" not in out.stderr, out.stderr


def test_macroflow_run_waits_for_the_ranks_to_end_before_it_removes_their_pages():
    # (it swept them while the ranks still ran, when mpiexec ended first)
    import threading
    from macroflow.cli import _wait_gone
    p = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                         stdin=subprocess.PIPE)
    threading.Timer(0.3, p.stdin.close).start()  # it ends once its input does
    threading.Thread(target=p.wait).start()  # (reaped, as its manager would)
    _wait_gone([p.pid], 30.0)
    assert p.poll() is not None
    t = time.monotonic()
    _wait_gone([p.pid], 30.0)  # gone: at once
    assert time.monotonic() - t < 1.0


FORK_INTERRUPTED = r"""
import os, signal
from macroflow.core.threads import fork

# a Ctrl-C that comes while the runtime forks (here: from a fork hook)
os.register_at_fork(before=lambda: os.kill(os.getpid(), signal.SIGINT))
try:
    pid = fork(lambda p: print("noted", p > 0, flush=True))
    if pid == 0:
        os._exit(7 if signal.getsignal(signal.SIGINT) is signal.SIG_IGN else 8)
    print("no interrupt", flush=True)
except KeyboardInterrupt:
    print("interrupted after the fork", flush=True)
    pid = None
import time
time.sleep(0.2)
for _ in range(50):
    try:
        p, status = os.waitpid(-1, os.WNOHANG)
    except ChildProcessError:
        break
    if p:
        print("child", os.WEXITSTATUS(status), flush=True)
        break
    time.sleep(0.05)
"""


def test_a_ctrl_c_while_the_runtime_forks_is_raised_after_the_fork_and_not_in_the_child():
    # (dropped inside a fork hook: a Ctrl-C as mf.run started was lost 8 times
    # in 40, the program ran to its end; and a child could unwind main's stack)
    out = subprocess.run([sys.executable, "-c", FORK_INTERRUPTED], capture_output=True,
                         text=True, timeout=50)
    assert out.stdout.splitlines() == ["noted True", "interrupted after the fork", "child 7"], \
        out.stderr
    assert "Exception ignored" not in out.stderr, out.stderr


USER_FORK_INTERRUPTED = r"""
import os, signal, threading
from macroflow.core import threads

# a Ctrl-C pending as the fork hook sets its handler: Python runs the handler
# at once (as signal.signal does when a signal came just before)
real = signal.signal
def pending(signum, handler):
    previous = real(signum, handler)
    if handler is threads._hold_interrupt:
        handler(signum, None)
    return previous
signal.signal = pending
import time
t = time.monotonic()
try:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    threading.Event().wait(20)
    print("no interrupt", flush=True)
except KeyboardInterrupt:
    # (at once: not once the wait, on a lock, has timed out)
    print("interrupted after the fork", time.monotonic() - t < 10, flush=True)
signal.signal = real
print(signal.getsignal(signal.SIGINT) is signal.default_int_handler, flush=True)
os.waitpid(pid, 0)
"""


def test_a_ctrl_c_pending_as_user_code_forks_is_raised_after_the_fork():
    # (the hook took the Ctrl-C for a lock to release: every fork after it
    # said "'bool' object has no attribute 'lock'", and Ctrl-C was ignored
    # for the rest of the program: `bench micro` could not be stopped)
    out = subprocess.run([sys.executable, "-c", USER_FORK_INTERRUPTED], capture_output=True,
                         text=True, timeout=50)
    assert out.stdout.splitlines() == ["interrupted after the fork True", "True"], \
        out.stdout + out.stderr
    assert "Exception ignored" not in out.stderr, out.stderr


DROPPED_INTERRUPT = r"""
import os, signal, sys, threading, time, weakref
import macroflow  # noqa: F401

class Finalized:
    def __del__(self):
        os.kill(os.getpid(), signal.SIGINT)  # a Ctrl-C as a finalizer runs

class Target:
    pass

def callback(ref):
    os.kill(os.getpid(), signal.SIGINT)  # a Ctrl-C as a weakref callback runs

for where in ("finalizer", "weakref callback"):
    t = time.monotonic()
    try:
        x = Finalized() if where == "finalizer" else Target()
        r = weakref.ref(x, callback) if where != "finalizer" else None
        del x
        threading.Event().wait(20)
        print(where, "lost", flush=True)
    except KeyboardInterrupt:
        print(where, "interrupted", time.monotonic() - t < 10, flush=True)
"""


def test_a_ctrl_c_that_lands_in_a_finalizer_or_a_weakref_callback_still_interrupts():
    # (Python drops what they raise: a Ctrl-C in a future's release by the
    # garbage collector was lost, and the program ran on)
    out = subprocess.run([sys.executable, "-c", DROPPED_INTERRUPT], capture_output=True,
                         text=True, timeout=50)
    assert out.stdout.splitlines() == ["finalizer interrupted True",
                                       "weakref callback interrupted True"], out.stdout + out.stderr
    assert "Exception ignored" not in out.stderr, out.stderr


TEARDOWN_INTERRUPTED = r"""
import os, signal, sys, threading, time
import macroflow as mf

@mf.persistent
class P:
    def sleep(self, s):
        time.sleep(s)
        return s

def main():
    P.create(on=1).sleep(20)  # computing when main returns: the end waits 2 s for it
    if sys.argv[1] == "drain":
        P.create(on=0).sleep(5)  # left on context 0: run as main's computation ends
    threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
    return "done"

t = time.monotonic()
try:
    mf.run(main, contexts=2)
    print("not interrupted")
except KeyboardInterrupt:
    print("interrupted", round(time.monotonic() - t) < 2)
try:
    mf.contexts()
except RuntimeError:
    print("stopped")
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("when", ["teardown", "drain"])
def test_a_ctrl_c_as_mf_run_ends_raises_and_stops_the_computation(when):
    # at the teardown's wait it was dropped (the program went on); in the end's
    # drain the computation was said stopped and ran on
    out = subprocess.run([sys.executable, "-c", TEARDOWN_INTERRUPTED, when], capture_output=True,
                         text=True, timeout=50)
    assert out.stdout.splitlines() == ["interrupted True", "stopped"], out.stdout + out.stderr
    assert "all 2 contexts were stopped" in out.stderr


DIES_AS_IT_STARTS = r"""
import os, signal, sys, time
import macroflow as mf

forks = [0]
def before():
    forks[0] += 1
def child_after():
    if forks[0] == 1:  # the first process mf.run forks: context 1
        os.kill(os.getpid(), signal.SIGKILL)  # dies at once, as a crash would
os.register_at_fork(before=before, after_in_child=child_after)

@mf.persistent
class P:
    def pid(self):
        return os.getpid()

def main():
    try:
        P.create(on=1).pid().result(timeout=20)
        print("context 1 answered")
    except mf.ContextLost as e:
        print("lost:", "SIGKILL" in str(e))
    except mf.TimeoutError:
        print("no answer, no loss")
    return P.create(on=2).pid().result(timeout=20) > 0

print(mf.run(main, contexts=3, transport="local"))
"""


@pytest.mark.timeout(60)
def test_a_context_that_dies_as_the_computation_starts_is_lost_not_waited_for():
    # local: the loss was heard before the engine listened, and never told:
    # calls to it waited for ever (20 s here, then a TimeoutError)
    out = subprocess.run([sys.executable, "-c", DIES_AS_IT_STARTS], capture_output=True,
                         text=True, timeout=50)
    assert out.stdout.splitlines() == ["lost: True", "True"], out.stdout + out.stderr


@mf.persistent
class _Stage:
    def pid(self):
        return os.getpid()

    def sleep(self, s):
        time.sleep(s)  # killed meanwhile
        return s

    def add(self, a, b):
        return a + b


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", ["local", "tcp"])
def test_calls_that_depended_on_a_killed_context_say_how_it_ended(transport):
    # on tcp the dependents, failed by the contexts that waited for its value,
    # said "connection closed" where the call itself said SIGKILL
    import threading

    def main():
        one, two, three = (_Stage.create(on=c) for c in (1, 2, 3))
        pid = one.pid().result(30)
        a = one.sleep(30)
        b = two.add(a, 1)  # waits for a's value on context 2
        c = three.add(b, 1)  # and for b's on context 3
        threading.Timer(0.3, os.kill, (pid, signal.SIGKILL)).start()
        return [str(f.exception(30)) for f in (a, b, c)]

    said = mf.run(main, contexts=4, transport=transport)
    assert all("killed by signal SIGKILL" in s for s in said), said


def _nested():
    return 1


@mf.persistent
class Starter:
    def nested_run(self):
        return mf.run(_nested, contexts=2)

    def nested_init(self):
        return mf.init(contexts=2)


@pytest.mark.timeout(60)
def test_starting_a_computation_inside_a_method_says_a_method_cannot(run):
    def main():
        out = []
        for on in (0, 1):
            s = Starter.create(on=on)
            for f in (s.nested_run(), s.nested_init()):
                with pytest.raises(RuntimeError) as e:
                    f.result(timeout=20)
                out.append(str(e.value).split(":")[0])
        return out

    assert run(main, contexts=2) == [
        f"mf.run()/mf.init() was called inside method Starter.{m} on context {on}"
        for on in (0, 1) for m in ("nested_run", "nested_init")]


UNCAUGHT = r"""
import sys
import macroflow as mf

def fn():
    if mf.rank() == 1:
        raise ValueError("bad rank")
    return mf.rank()

mf.spmd(fn, n=2, transport=sys.argv[1])
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", ["inproc", "local"])
def test_an_uncaught_error_is_printed_without_the_runtimes_frames(transport):
    # (six frames of mf.spmd, mf.run and result() stood between the script's
    # line and the error)
    out = subprocess.run([sys.executable, "-c", UNCAUGHT, transport], capture_output=True,
                         text=True, timeout=50)
    assert out.returncode == 1
    lines = out.stderr.rstrip().splitlines()
    assert "macroflow/" not in out.stderr.split("direct cause")[-1], out.stderr
    assert lines[-2:] == ["ValueError: bad rank", "(6 frames of macroflow's own code hidden: "
                          "MACROFLOW_TRACEBACK=full shows them)"], out.stderr
    assert 'File "<string>", line 10, in <module>' in out.stderr, out.stderr
    full = subprocess.run([sys.executable, "-c", UNCAUGHT, transport], capture_output=True,
                          text=True, timeout=50, env={**os.environ, "MACROFLOW_TRACEBACK": "full"})
    assert "macroflow/launch.py" in full.stderr and "hidden" not in full.stderr, full.stderr


@mf.regular
class _OnZero:
    def ping(self):
        return mf.context_id()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["inproc", "local"])
def test_a_finished_computation_whose_context_0_ran_a_method_is_freed(transport):
    # Its idle method threads (greenlets parked in the engine's pool) kept
    # the engine, and all it held, for as long as the process lived: one
    # engine more (and 16 MB more, with a value kept) for every computation
    import gc
    import weakref
    from macroflow.core.context import current_engine
    engines = []
    for _ in range(3):
        with mf.init(contexts=2, transport=transport):
            assert _OnZero.create(on=0).ping().result(30) == 0
            engines.append(weakref.ref(current_engine()))
    gc.collect()
    # (the last may live a moment longer: its service thread's last look ends on its own)
    assert [e() for e in engines[:-1]] == [None] * 2
