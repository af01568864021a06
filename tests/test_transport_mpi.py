"""The mpi protocol module: launch under mpiexec and by spawning, teardown, failures.

The object-model suite runs on MPI through the conftest ``transport`` fixture
and the conformance suite through transport_harness.build_mpi; here is what is
MPI's own. Every test that starts ranks has a timeout; the ones under a real
``mpiexec`` run it as a subprocess with a timeout of its own.
"""

import glob
import os
import re
import select
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import psutil
import pytest

import macroflow as mf
from macroflow.core.context import SYSTEM, current_engine
from macroflow.launch import choose_transport
from macroflow.transport import mpi as M

from conftest import MPI_MISSING

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(MPI_MISSING is not None, reason=str(MPI_MISSING))]

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")


@mf.persistent
class Box:
    def __init__(self):
        self.items = []

    def add(self, x):
        self.items.append(x)
        return len(self.items)

    def get(self):
        return self.items

    def pid(self):
        return os.getpid()

    def echo(self, a):
        return a

    def nap_then(self, seconds, x):
        time.sleep(seconds)
        return x

    def forever(self):
        while True:
            time.sleep(0.01)


def _pid_of(ctx):
    return current_engine().issue(SYSTEM, "pid", "pid", (), {}, ctx, pinned=True).result(30)


def _gone(pid):
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


# -- choosing the transport -------------------------------------------------------

def test_transport_and_contexts_follow_mpiexec_when_started_by_it():
    assert choose_transport(None, None, world=(0, 4)) == ("mpi", 4)
    assert choose_transport("mpi", 4, world=(2, 4)) == ("mpi", 4)
    assert choose_transport(None, None, world=(0, 1)) == ("local", os.cpu_count() or 1)
    assert choose_transport("inproc", 2, world=None) == ("inproc", 2)
    with pytest.raises(ValueError, match="contexts=3, but mpiexec started 4 ranks"):
        choose_transport(None, 3, world=(0, 4))
    with pytest.raises(ValueError, match="rank 1 of 4 started by mpiexec.*transport='local'"):
        choose_transport("local", None, world=(1, 4))


def test_mf_init_reads_the_launchers_environment(monkeypatch):
    monkeypatch.setenv("PMI_RANK", "0")
    monkeypatch.setenv("PMI_SIZE", "4")
    with pytest.raises(ValueError, match="contexts=2, but mpiexec started 4 ranks"):
        mf.init(contexts=2)
    # (mf.spmd's own words: it named run's contexts=, which the user never passed)
    with pytest.raises(ValueError, match=r"mf.spmd\(\): n=2, but mpiexec started 4 ranks: .*"
                                         r"pass n=4 or leave it out"):
        mf.spmd(print, n=2)
    with pytest.raises(ValueError, match="transport='inproc'"):
        mf.run(lambda: 1, transport="inproc")


def test_launcher_variables_that_are_not_numbers_are_ignored():
    assert M.world_from_environment({"PMI_RANK": "x", "PMI_SIZE": "4"}) is None
    assert M.world_from_environment({"PMI_RANK": "1", "PMI_SIZE": "2",
                                     "OMPI_COMM_WORLD_RANK": "0"}) == (1, 2)


# -- spawned ranks ------------------------------------------------------------------

@pytest.mark.timeout(90)
def test_spawned_ranks_end_with_their_computation():
    def main():
        return [_pid_of(c) for c in range(mf.num_contexts())]

    pids = mf.run(main, contexts=3, transport="mpi")
    assert pids[0] == os.getpid() and len(set(pids)) == 3
    # not our children (MPI's process manager started them): checked here
    for pid in pids[1:]:
        assert _gone(pid), f"spawned rank {pid} outlived its computation"


@pytest.mark.timeout(90)
def test_teardown_is_a_goodbye_answered_by_every_rank():
    s = mf.init(contexts=3, transport="mpi")
    t = current_engine().transport
    mf.gather([Box.create(on=c).add(c) for c in range(3)])
    s.close()
    assert t.closed and not t.lingered_out  # every peer answered: no waiting it out
    assert t.gone == {1, 2}  # both said goodbye (and were reported lost at no one)
    assert s.launcher.terminated == set()  # none had to be asked to stop


@pytest.mark.timeout(90)
def test_a_rank_that_computes_at_teardown_is_stopped_and_gone():
    def main():
        b = Box.create(on=1)
        pid = b.pid().result(30)
        b.forever()
        b.pid()  # queued behind it: never runs
        return pid

    with mf.init(contexts=2, transport="mpi") as s:
        pid = main()
    assert s.launcher.terminated == {1}  # asked to stop (SIGTERM), and it left in order
    assert _gone(pid)


@pytest.mark.timeout(120)
def test_local_and_mpi_computations_alternate_in_one_process():
    # MPI starts once per process and never again after it ends: it stays up
    # between computations, and forked contexts of the local transport ignore it
    def main():
        return mf.gather([Box.create(on=c).add(c) for c in range(mf.num_contexts())])

    for tr in ("mpi", "local", "mpi", "local"):
        assert mf.run(main, contexts=3, transport=tr) == [1, 1, 1]


@pytest.mark.timeout(90)
def test_classes_of_main_travel_by_value_to_spawned_ranks(tmp_path):
    script = tmp_path / "prog.py"
    script.write_text(textwrap.dedent("""
        import macroflow as mf

        @mf.persistent
        class Here:
            def twice(self, x):
                return 2 * x

        def main():
            return Here.create(on=1).twice(21).result(30)

        print(mf.run(main, contexts=2, transport="mpi"))
    """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=60, env=_env())
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["42"]


@pytest.mark.timeout(90)
def test_large_arrays_arrive_in_pooled_memory_and_are_sent_by_value():
    def main():
        b = Box.create(on=1)
        arr = np.arange(2_000_000, dtype=np.float64)  # 16 MB
        f = b.echo(arr)
        arr[:] = -1  # after the call: the context got the values of the call's time
        back = f.result(30)
        same = []
        for i in range(4):
            a = b.echo(np.full(3 << 20, i, np.uint8)).result(30)
            same.append(bool((a == i).all()))
            del a  # its memory goes back to the pool
        return back, same, mf.stats()

    back, same, st = mf.run(main, contexts=2, transport="mpi")
    assert np.array_equal(back, np.arange(2_000_000, dtype=np.float64))
    assert same == [True] * 4
    # received into pooled memory, not fresh memory each time, on both sides
    assert st[0]["buffers_reused"] >= 2 and st[1]["buffers_reused"] >= 2


@pytest.mark.timeout(90)
def test_the_descriptor_becomes_readable_when_a_frame_comes_from_this_host():
    with mf.init(contexts=2, transport="mpi"):
        t = current_engine().transport
        fd = t.fileno()
        assert isinstance(fd, int)
        b = Box.create(on=1)
        b.pid().result(30)
        t.waker.drain()
        f = b.nap_then(0.2, "late")
        f._engine.request_value(f)  # the value comes unasked for when it is ready
        t.nap(True)  # as a watcher does first: ring frames then wake it too
        assert select.select([fd], [], [], 30)[0] == [fd]
        assert f.result(30) == "late"


@pytest.mark.timeout(60)
def test_an_idle_rank_sleeps():
    # MPI has no descriptor to sleep on: a rank sleeps on its wake-up socket
    # (peers on this host wake it); it does not poll while nothing comes
    with mf.init(contexts=2, transport="mpi", spin_us=50):
        b = Box.create(on=1)
        pid = b.pid().result(30)
        before = psutil.Process(pid).cpu_times()
        time.sleep(1.0)
        after = psutil.Process(pid).cpu_times()
        busy = (after.user + after.system) - (before.user + before.system)
    assert busy < 0.5, f"an idle rank used {busy:.2f} s of CPU in 1 s"


# -- flow control, between spawned ranks (transport_harness drives them) ------------

@pytest.mark.timeout(120)
def test_a_flood_waits_for_its_reader_and_loses_nothing():
    from transport_harness import build_mpi
    e = build_mpi(2)
    try:
        r, s = e.ids
        frames = [[b"h", bytes([i]) * (256 << 10)] for i in range(100)]  # 25 MB: 3 windows
        w = e.background(s, lambda: [e.ends[s].send(r, p, i) for i, p in enumerate(frames)])
        e.pump(lambda: w.done or e.backlogged(s, r), ends=[])
        assert not w.done  # the window is full: the sender waits for its reader
        e.pump(lambda: len(e.got[r]) == 100 and w.done)
        w.result(timeout=10)
        assert [load for _, _, load in e.got[r]] == list(range(100))
        assert all(bytes(bufs[1]) == f[1] for (_, bufs, _), f in zip(e.got[r], frames))
    finally:
        e.close()


@pytest.mark.timeout(120)
def test_two_ranks_flooding_each_other_both_finish():
    from transport_harness import build_mpi
    e = build_mpi(2)
    try:
        a, b = e.ids
        n = 3 * M.WINDOW_MESSAGES  # while both send, neither reads but through its sends
        wa = e.background(a, lambda: [e.ends[a].send(b, [b"a%d" % i], i) for i in range(n)])
        wb = e.background(b, lambda: [e.ends[b].send(a, [b"b%d" % i], i) for i in range(n)])
        # one that finishes first reads again (as a context would) when polled here
        e.pump(lambda: wa.done and wb.done, timeout=90)
        wa.result(timeout=10)
        wb.result(timeout=10)
        e.pump(lambda: len(e.got[a]) == n and len(e.got[b]) == n)
        assert [bytes(bufs[0]) for _, bufs, _ in e.got[a]] == [b"b%d" % i for i in range(n)]
        assert [bytes(bufs[0]) for _, bufs, _ in e.got[b]] == [b"a%d" % i for i in range(n)]
    finally:
        e.close()


# -- under mpiexec --------------------------------------------------------------------

def _mapped_shm() -> set:
    """The /dev/shm files some live process maps."""
    found = set()
    for maps in glob.glob("/proc/[0-9]*/maps"):
        try:
            with open(maps) as f:
                found.update(line.split(None, 5)[5].strip() for line in f if "/dev/shm/" in line)
        except (OSError, IndexError):
            pass
    return found


def _job_files() -> set:
    """MPICH's segments and the ranks' shared pages in /dev/shm."""
    return set(glob.glob("/dev/shm/mpich_shm_*")) | set(glob.glob("/dev/shm/macroflow-mpi-*"))


def _sweep(before: set) -> None:
    for path in _job_files() - before - _mapped_shm():
        try:
            os.unlink(path)
        except OSError:
            pass


@pytest.fixture(autouse=True, scope="module")
def _no_mpich_segments_left_by_the_module():
    before = _job_files()
    yield
    _sweep(before)  # those a test's ending job still mapped when the test ended


@pytest.fixture(autouse=True)
def _no_mpich_segments_left():
    # a job that MPI_Abort or a killed rank ends leaves MPICH's shared-memory
    # segment behind (MPICH unlinks it only when the job ends in order), and
    # the ranks' shared pages (context 0 removes them when it ends in order):
    # the suite removes what its own jobs left
    before = _job_files()
    yield
    _sweep(before)


def _env(extra=None):
    env = dict(os.environ, **(extra or {}))
    env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _mpiexec(tmp_path, n, body, *args, timeout=90, cli=False, env=None):
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(body))
    if cli:
        cmd = [sys.executable, "-m", "macroflow", "run", "-n", str(n), "--transport", "mpi",
               str(script), *args]
    else:
        cmd = [M._find_mpiexec(), "-n", str(n), sys.executable, str(script), *args]
    # a session of its own: whatever happens, the test can end the whole job
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=_env(env), start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        raise AssertionError(f"the job did not end within {timeout} s:\n{out}\n{err}")
    return p.returncode, out, err


RANK_0_ALONE = """
    import os
    import macroflow as mf

    def main():
        return 1

    if os.environ.get("PMI_RANK") == "0":  # the other rank never starts MPI
        mf.run(main)
"""


@pytest.mark.timeout(60)
def test_a_rank_left_waiting_for_mpi_to_start_says_why(tmp_path):
    # (a script that started macroflow on rank 0 alone waited in MPI_Init for
    # ever, saying nothing)
    import psutil
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(RANK_0_ALONE))
    p = subprocess.Popen([M._find_mpiexec(), "-n", "2", sys.executable, str(script)],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                         env=_env({"MACROFLOW_MPI_INIT_WARN_S": "1"}), start_new_session=True)
    try:
        line = p.stderr.readline()  # (the job waits on)
        # a SIGTERM still ends it, while MPI starts (Python's signals are
        # blocked meanwhile: MPI's own threads must not take them)
        rank0 = []
        for q in psutil.Process(p.pid).children(recursive=True):
            try:  # (the rank, not its watcher, which it forked)
                if q.cmdline()[-1:] == [str(script)] and q.parent().cmdline() != q.cmdline():
                    rank0.append(q)
            except psutil.NoSuchProcess:
                pass  # (rank 1, which ended)
        assert len(rank0) == 1, rank0
        rank0[0].terminate()
        assert p.wait(30) != 0
    finally:
        tree = psutil.Process(p.pid).children(recursive=True) if p.poll() is None else []
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for q in tree:
            try:
                q.kill()
            except psutil.NoSuchProcess:
                pass
        p.communicate()
        psutil.wait_procs(tree, timeout=10)
        M.remove_unused(M.mpich_shm_files())
    assert line.startswith("macroflow: rank 0 of 2 has waited 1 s for MPI to start: "), line
    assert "every rank must run macroflow" in line, line


SIGTERM_WHILE_SLEEPING = """
    import os, signal, time
    import macroflow as mf

    @mf.persistent
    class P:
        def pid(self):
            return os.getpid()

        def sleep(self, s):
            time.sleep(s)
            return s

    def main():
        for c in (1, 2):
            p = P.create(on=c)
            pid = p.pid().result()
            f = p.sleep(60)
            time.sleep(0.3)
            t = time.monotonic()
            os.kill(pid, signal.SIGTERM)
            try:
                f.result(timeout=20)
            except mf.ContextLost:
                print("lost", c, time.monotonic() - t < 10, flush=True)
            except mf.TimeoutError:
                print("not told", c, flush=True)

    mf.run(main)
"""


@pytest.mark.timeout(120)
def test_a_rank_sigtermed_while_its_method_sleeps_is_lost_at_once(tmp_path):
    # (MPI's own thread took the signal half the time: its handler waited for
    # the method's sleep to end, and the caller was not told for 60 s)
    code, out, err = _mpiexec(tmp_path, 3, SIGTERM_WHILE_SLEEPING)
    assert out.split("\n")[:2] == ["lost 1 True", "lost 2 True"], out + err


PROGRAM = """
    import os
    import macroflow as mf

    @mf.regular
    class Where:
        def am_i(self, x):
            return mf.context_id(), os.getpid()

    def main():
        w = Where()
        return sorted(set(mf.gather([Where.create(on=c).am_i(c) for c in range(mf.num_contexts())])))

    places = mf.run(main{args})
    print("result", len(places), len({{p for _, p in places}}), mf.num_contexts() if False else "")
    print("after mf.run on pid", os.getpid())
"""


@pytest.mark.timeout(120)
def test_mpiexec_runs_the_same_script_main_on_rank_0_once(tmp_path):
    code, out, err = _mpiexec(tmp_path, 3, PROGRAM.format(args=", contexts=3"))
    assert code == 0, err
    lines = out.split("\n")
    assert [l.split()[:3] for l in lines if l.startswith("result")] == [["result", "3", "3"]]
    assert len([l for l in lines if l.startswith("after mf.run")]) == 1  # not once per rank


@pytest.mark.timeout(120)
def test_mpiexec_with_contexts_left_out_uses_every_rank(tmp_path):
    code, out, err = _mpiexec(tmp_path, 2, PROGRAM.format(args=""))
    assert code == 0, err
    assert [l.split()[:3] for l in out.split("\n") if l.startswith("result")] == [["result", "2", "2"]]


@pytest.mark.timeout(120)
def test_mpiexec_with_the_wrong_number_of_contexts_is_a_clear_error(tmp_path):
    code, out, err = _mpiexec(tmp_path, 2, PROGRAM.format(args=", contexts=5"))
    assert code != 0
    assert "contexts=5, but mpiexec started 2 ranks" in err
    assert err.count("Traceback") == 1  # printed once, not once per rank


@pytest.mark.timeout(120)
def test_an_uncaught_error_in_main_ends_every_rank_printed_once(tmp_path):
    before = set(glob.glob("/dev/shm/mpich_shm_*"))
    code, out, err = _mpiexec(tmp_path, 3, """
        import macroflow as mf

        @mf.persistent
        class Bad:
            def boom(self):
                raise ValueError("boom on a rank")

        def main():
            return Bad.create(on=2).boom().result(30)

        mf.run(main)
        print("never")
    """)
    assert code != 0
    assert "never" not in out
    assert err.count("ValueError: boom on a rank") == 2  # the remote traceback and main's, once
    assert err.count("Traceback (most recent call last)") == 2
    # the job's MPICH shared-memory file is unlinked before MPI_Abort: each
    # aborted job left one (2 MB) in /dev/shm
    assert not set(glob.glob("/dev/shm/mpich_shm_*")) - before - _mapped_shm()


@pytest.mark.timeout(120)
def test_an_error_on_one_rank_before_mf_run_ends_the_job_printed_once(tmp_path):
    code, out, err = _mpiexec(tmp_path, 3, """
        import os
        import macroflow as mf
        if os.environ["PMI_RANK"] == "1":
            raise RuntimeError("rank 1 cannot start")
        print(mf.run(lambda: 1))
    """)
    assert code != 0
    assert err.count("RuntimeError: rank 1 cannot start") == 1


@pytest.mark.timeout(120)
def test_a_rank_killed_by_a_signal_ends_the_job(tmp_path):
    code, out, err = _mpiexec(tmp_path, 3, """
        import os, signal, sys
        import macroflow as mf

        @mf.persistent
        class Victim:
            def die(self):
                print("victim pid", os.getpid(), flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

        def main():
            v = Victim.create(on=2)
            v.die().result(60)

        mf.run(main)
        print("never")
    """)
    assert code != 0
    assert "never" not in out
    # MPI's process manager ends the job; it names a process of the job,
    # not always the one that died (macroflow run names the context)
    assert "BAD TERMINATION" in out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("death, how, status", [
    ("os.kill(os.getpid(), signal.SIGKILL)", "was killed by signal SIGKILL", 128 + 9),
    ("os._exit(3)", r"exited with code 3 before the computation ended|exited before the "
                    r"computation ended \(mpiexec's exit code: 3\)", 3),
])
def test_macroflow_run_names_the_context_that_died_and_how(tmp_path, death, how, status):
    before = _job_files()
    code, out, err = _mpiexec(tmp_path, 3, f"""
        import os, signal
        import macroflow as mf

        @mf.persistent
        class Victim:
            def die(self):
                {death}

        def main():
            Victim.create(on=2).die().result(60)
    """, cli=True)
    assert code != 0
    line, = [l for l in err.splitlines() if l.startswith("macroflow:")]
    # each rank reports to a watcher of macroflow run: the first whose
    # connection closes without its goodbye is the one that died, before MPI
    # ended the others; how is read from /proc unless MPI reaped it first
    assert re.match(rf"macroflow: context 2 \(pid \d+ on \S+\) ({how}|died first \(how is "
                    rf"not known: it was reaped before it could be read\)); MPI ended the job "
                    rf"\(every rank\)$", line), err
    if "how is not known" not in line:
        assert code == status  # as a shell gives it, whichever rank mpiexec saw end first
    assert not _job_files() - before - _mapped_shm()  # MPICH's files and the ranks' pages


@pytest.mark.timeout(120)
def test_macroflow_run_with_the_mpi_transport_launches_mpiexec(tmp_path):
    code, out, err = _mpiexec(tmp_path, 3, """
        import os
        import macroflow as mf

        @mf.regular
        class Pid:
            def pid(self):
                return os.getpid()

        def main():
            return len(set(mf.gather([Pid.create(on=c).pid() for c in range(3)]))), \\
                os.environ.get("PMI_SIZE")
    """, cli=True)
    assert code == 0, err
    assert out.strip().splitlines() == ["(3, '3')"]


@pytest.mark.timeout(120)
def test_a_second_computation_under_mpiexec_is_refused_clearly(tmp_path):
    code, out, err = _mpiexec(tmp_path, 2, """
        import macroflow as mf
        print("first", mf.run(lambda: 1))
        try:
            mf.run(lambda: 2)
        except RuntimeError as e:
            print("refused:", e)
    """)
    assert code == 0, err
    assert "first 1" in out and "refused: this mpiexec job's other ranks ended" in out


# -- contexts added while running (MPI_Comm_spawn, then a communicator with the live ones) --

@pytest.mark.timeout(120)
def test_mpiexec_adds_contexts_that_call_the_old_ones_and_get_main_classes_by_value(tmp_path):
    code, out, err = _mpiexec(tmp_path, 2, """
        import os
        import macroflow as mf

        @mf.persistent
        class Where:
            def here(self):
                return mf.context_id(), os.getpid()

            def ask(self, other):
                return mf.context_id(), other.here().result()[0]

        def main():
            new = mf.add_contexts(2)
            old = Where.create(on=1)
            calls = [Where.create(on=c).ask(old).result() for c in new]
            calls.append(old.ask(Where.create(on=new[1])).result())
            pids = {Where.create(on=c).here().result()[1] for c in range(mf.num_contexts())}
            return new, calls, len(pids), [c.protocols[0][0] for c in mf.contexts()]

        print("result", mf.run(main))
    """)
    assert code == 0, err
    assert "result ([2, 3], [(2, 1), (3, 1), (1, 3)], 4, ['mpi', 'mpi', 'mpi', 'mpi'])" in out


@pytest.mark.timeout(90)
def test_an_old_context_sends_a_large_array_to_a_new_one_and_back():
    def main():
        (new,) = mf.add_contexts(1)
        arr = np.arange(1_500_000, dtype=np.float64)  # large buffers: messages of their own
        old, fresh = Box.create(on=1), Box.create(on=new)
        there = fresh.echo(old.echo(arr))  # from context 1 to the new one, by dataflow
        back = old.echo(there).result(30)
        return bool(np.array_equal(back, arr)), len(current_engine().transport.links)

    same, links = mf.run(main, contexts=2, transport="mpi")
    assert same
    assert links == 2  # the spawn's communicator, and the one made with the new rank


def test_a_process_manager_that_cannot_spawn_is_a_clear_error(monkeypatch):
    def cannot(count, entry, timeout=120.0):
        raise M.mpi().Exception(M.mpi().ERR_SPAWN)

    def main():
        monkeypatch.setattr(M, "spawn", cannot)
        with pytest.raises(RuntimeError, match="cannot add contexts here: MPI_Comm_spawn failed"):
            mf.add_contexts(1)
        monkeypatch.undo()
        return mf.num_contexts(), mf.add_contexts(1), Box.create(on=2).pid().result(30) > 0

    assert mf.run(main, contexts=2, transport="mpi") == (2, [2], True)


def test_one_context_starts_without_spawning_and_grows():
    # (asked to spawn no rank, MPICH's process manager used to kill this process)
    with mf.init(contexts=1, transport="mpi"):
        assert mf.num_contexts() == 1
        assert mf.add_contexts(1) == [1]
        assert Box.create(on=1).pid().result(30) != os.getpid()


def test_spawning_no_rank_is_refused():
    with pytest.raises(ValueError, match="count must be a positive int; got 0"):
        M.spawn(0, "macroflow.transport.mpi:_hello_only")


def test_a_rank_that_polls_is_not_sent_wake_ups_and_one_that_does_not_is():
    name = f"wake-{os.getpid()}"
    t = M.MpiTransport(M.mpi().COMM_SELF.Dup(), wake=(name, {0: "here"}))
    got = []
    t.attach(lambda src, bufs, load: got.append(bytes(bufs[0])), None)
    t.wakes = {0: M.Waker.address(name, 0)}  # this rank stands in for a peer of its host
    own = t.waker.state
    try:
        own[M.POLLING] = 1  # as while it spins
        before = own[M.SENT]
        t.send(0, [b"a"], 0)
        assert t.wakeups == 0 and own[M.SENT] != before  # no wake-up, but the frame is told of
        assert t.waker.sleep(0.0) is False
        own[M.POLLING] = 0  # as while it sleeps, or runs user code (its service thread waits)
        t.send(0, [b"b"], 0)
        assert t.wakeups == 1 and t.waker.sleep(1.0) is True
        assert t.poll(5.0) and got[:1] == [b"a"]
    finally:
        t.close()
    assert not os.path.exists(M.Waker.state_path(name, 0))  # its page goes with it


def test_the_page_of_a_rank_that_ended_without_closing_is_removed_by_the_next_one():
    name = f"stale-{os.getpid()}"
    gone = M.Waker(name, 0)
    pid = os.fork()
    if pid == 0:  # pragma: no cover - a process that ends at once
        os._exit(0)
    os.waitpid(pid, 0)
    gone.state[M.OWNER] = pid  # as if that process had made it and been killed
    path = gone.path
    gone.path = None  # it never closes
    alive = M.Waker(name, 1)
    try:
        assert not os.path.exists(path)
        assert os.path.exists(alive.path) and alive.state[M.OWNER] == os.getpid()
    finally:
        gone.close()
        alive.close()


SIGTERMED = """
    import sys, time
    import macroflow as mf
    with mf.init(contexts=2, transport="mpi"):
        open(sys.argv[1], "w").write("started")
        time.sleep(120)
"""


def _terminated_from_a_shell(tmp_path, body: str, then: str = "") -> subprocess.CompletedProcess:
    """Run ``body`` (its argv[1]: a file it writes once started) from a shell
    that leads a process group of its own, as a script does; SIGTERM it once
    started; the shell prints its exit status, then runs ``then``."""
    script, flag = tmp_path / "job.py", tmp_path / "started"
    script.write_text(textwrap.dedent(body))
    shell = (f'"{sys.executable}" "{script}" "{flag}" & P=$!; '
             f'while [ ! -s "{flag}" ]; do sleep 0.05; done; '
             f'kill -TERM $P; wait $P; echo "rc=$?"{then}')
    return subprocess.run(["sh", "-c", shell], capture_output=True, text=True, timeout=100,
                          env=_env(), start_new_session=True)


@pytest.mark.timeout(120)
def test_sigterm_ends_a_program_that_spawned_ranks_in_order_and_spares_its_process_group(tmp_path):
    # a shell leads a process group of its own and starts the program in it, as
    # a script does; killed outright, the program would leave MPICH's process
    # manager to kill the whole group, the shell included
    p = _terminated_from_a_shell(tmp_path, SIGTERMED, then="; echo alive")
    assert p.returncode == 0, (p.returncode, p.stderr)
    assert p.stdout.split() == ["rc=143", "alive"], p.stderr


SIGTERMED_AT_START = """
    import os, signal, sys, time
    import macroflow as mf
    from macroflow.transport import mpi

    spawn = mpi.spawn

    def spawn_then_terminated(*args, **kwargs):
        inter, comm, hosts = spawn(*args, **kwargs)
        with open(sys.argv[1], "w") as f:
            f.write(" ".join(str(pid) for _, pid in hosts.values()))
        os.kill(os.getpid(), signal.SIGTERM)  # while the ranks wait for their setup
        return inter, comm, hosts

    mpi.spawn = spawn_then_terminated
    with mf.init(contexts=3, transport="mpi"):
        print("never here")
"""


@pytest.mark.timeout(120)
def test_sigterm_while_spawned_ranks_start_ends_them_too(tmp_path):
    script, pids = tmp_path / "job.py", tmp_path / "pids"
    script.write_text(textwrap.dedent(SIGTERMED_AT_START))
    p = subprocess.run([sys.executable, str(script), str(pids)], capture_output=True, text=True,
                       timeout=100, env=_env(), start_new_session=True)
    assert p.returncode == 143, p.stderr
    assert "never here" not in p.stdout
    spawned = [int(x) for x in pids.read_text().split()]
    assert len(spawned) == 2

    def alive():
        out = []
        for q in spawned:
            try:
                if psutil.Process(q).status() != psutil.STATUS_ZOMBIE:
                    out.append(q)
            except psutil.NoSuchProcess:
                pass
        return out

    deadline = time.monotonic() + 10
    while alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    left = alive()
    for q in left:  # the suite leaves no process behind, even when this fails
        os.kill(q, signal.SIGKILL)
    assert not left


SIGTERMED_IN_RUN = """
    import sys, time
    import macroflow as mf

    def main():
        if mf.rank() == 0:
            open(sys.argv[1], "w").write("started")
        time.sleep(60)  # every rank computes: SIGTERM comes meanwhile

    mf.spmd(main, n=2, transport="mpi")
"""


@pytest.mark.timeout(120)
def test_sigterm_during_an_spmd_run_ends_the_program_not_the_run(tmp_path):
    t = time.monotonic()
    p = _terminated_from_a_shell(tmp_path, SIGTERMED_IN_RUN)
    assert p.stdout.split() == ["rc=143"], p.stderr
    assert "sys.exit" not in p.stderr  # not taken for context 0's function calling sys.exit
    assert time.monotonic() - t < 50  # not after the ranks' functions end by themselves


SIGINTED = """
    import os, sys, time
    import macroflow as mf
    with mf.init(contexts=2, transport="mpi"):
        open(sys.argv[1], "w").write(str(os.getpid()))
        time.sleep(60)
"""


@pytest.mark.timeout(120)
def test_ctrl_c_to_a_program_that_spawned_ranks_ends_it_in_order_and_spares_its_shell(tmp_path):
    # SIGINT to the program alone, which a shell script runs in the script's own
    # process group: MPICH's process manager, started outside that group,
    # neither kills the program nor, when the job ends, the group
    script, flag = tmp_path / "job.py", tmp_path / "pid"
    script.write_text(textwrap.dedent(SIGINTED))
    shell = f'"{sys.executable}" "{script}" "{flag}"; echo "rc=$?"; echo alive'
    p = subprocess.Popen(["sh", "-c", shell], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=_env(), start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not (flag.exists() and flag.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(int(flag.read_text()), signal.SIGINT)
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert p.returncode == 0, (p.returncode, err)
    assert out.split() == ["rc=130", "alive"], err
    assert "KeyboardInterrupt" in err


FLOODS_LARGE_VALUES = """
    import sys
    import numpy as np
    import macroflow as mf

    @mf.persistent
    class W:
        def echo(self, x):
            return x

    def main():
        ws = [W.create(on=1), W.create(on=2)]
        x = np.ones(200_000, np.uint8)
        mf.gather([w.echo(x) for w in ws])
        open(sys.argv[1], "w").write("flooding")
        while True:
            mf.gather([ws[i % 2].echo(x) for i in range(2000)])

    try:
        mf.run(main, transport="mpi")
    except KeyboardInterrupt:
        print("interrupted")
"""


@pytest.mark.timeout(180)
def test_ctrl_c_during_a_flood_of_large_values_ends_every_rank_in_order(tmp_path):
    # Ctrl-C at the terminal (the job's whole group) while ranks wait for
    # room to send large values: they crashed in MPI_Cancel of those sends
    # (a segmentation fault, 3 jobs of 4); without the cancel, context 0 took
    # their frames one per 5 ms until it gave up and aborted the job
    script, flag = tmp_path / "job.py", tmp_path / "flag"
    script.write_text(textwrap.dedent(FLOODS_LARGE_VALUES))
    before = M.mpich_shm_files()
    for _ in range(2):
        flag.unlink(missing_ok=True)
        p = subprocess.Popen([M._find_mpiexec(), "-n", "3", sys.executable, str(script), str(flag)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=_env(), start_new_session=True)
        try:
            deadline = time.monotonic() + 60
            while not (flag.exists() and flag.read_text()) and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.5)  # well into the flood
            os.killpg(p.pid, signal.SIGINT)
            out, err = p.communicate(timeout=60)
        finally:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
        assert p.returncode == 0, (p.returncode, out, err)
        assert out.split()[-1:] == ["interrupted"], (out, err)
        assert "macroflow: interrupted (Ctrl-C); all 3 contexts were stopped" in err, err
        assert "Segmentation" not in out + err and "MPI_Abort" not in err, err
    assert not [f for f in M.mpich_shm_files() - before if not M.in_use(f)]


def _interrupt_macroflow_run(tmp_path, body, options, whom, sig=signal.SIGINT):
    """Run ``body`` under `macroflow run -n 2 --transport mpi` (it writes the
    file named by its first argument when it is ready), Ctrl-C it (``whom``:
    "macroflow run alone", "its process group" or "it twice"); returns
    (exit code, stdout, stderr, seconds from the Ctrl-C to the end)."""
    script, flag = tmp_path / "job.py", tmp_path / "flag"
    script.write_text(textwrap.dedent(body))
    cmd = [sys.executable, "-m", "macroflow", "run", "-n", "2", *options, "--transport", "mpi",
           str(script), str(flag)]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=_env(), start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not (flag.exists() and flag.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        t = time.monotonic()
        if whom == "its process group":
            os.killpg(p.pid, sig)
        else:
            os.kill(p.pid, sig)
            if whom == "it twice":
                os.kill(p.pid, sig)
        out, err = p.communicate(timeout=60)
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)  # (its group: a job it left running too)
        except ProcessLookupError:
            pass
        p.wait()
    return p.returncode, out, err, time.monotonic() - t


WAITS_AN_HOUR = """
    import sys, time
    import macroflow as mf

    def main():
        if mf.rank() == 0:
            open(sys.argv[1], "w").write("waiting")
            mf.remote_action(1, time.sleep, 3600).wait()
        mf.barrier()
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("whom", ["macroflow run alone", "its process group"])
def test_ctrl_c_to_macroflow_run_under_mpiexec_ends_the_job_cleanly(tmp_path, whom):
    # SIGINT to `macroflow run` alone is passed on to mpiexec; at the terminal
    # (the whole group) mpiexec has it too. Either way the job ends at once
    # with 130, and no rank calls MPI after it ended (a service thread of a
    # rank that leaves is stopped before MPI_Finalize)
    code, out, err, took = _interrupt_macroflow_run(tmp_path, WAITS_AN_HOUR, ["--spmd"], whom)
    assert code == 130, (code, out, err)
    assert took < 30  # not when the handler's hour is over
    assert "after finalizing" not in out + err and "assert" not in err, err


@pytest.mark.timeout(120)
@pytest.mark.parametrize("whom", ["macroflow run alone", "its process group"])
def test_sigterm_to_macroflow_run_under_mpiexec_ends_the_job(tmp_path, whom):
    # (killed outright, it left mpiexec and its ranks running: for an hour
    # here; to the group, as `timeout` sends it, a thread of numpy's took it
    # and the command ended with mpiexec, before it could sweep /dev/shm)
    import psutil
    before = M.mpich_shm_files()
    code, out, err, took = _interrupt_macroflow_run(tmp_path, WAITS_AN_HOUR, ["--spmd"],
                                                    whom, signal.SIGTERM)
    assert code == 143, (code, out, err)
    assert took < 30
    assert "macroflow: terminated (SIGTERM); the job's 2 ranks were ended" in err, err
    assert "BAD TERMINATION" not in out, out  # (it ended the job: no news)
    ranks = [p for p in psutil.process_iter(["cmdline"])
             if str(tmp_path / "job.py") in (p.info["cmdline"] or [])]
    assert ranks == []
    assert not [f for f in M.mpich_shm_files() - before if not M.in_use(f)]


SLEEPS_IN_A_BARRIER = """
    import sys, time
    import macroflow as mf

    def main():
        if mf.rank() == 1:
            open(sys.argv[1], "w").write("waiting")
            time.sleep(60)
        mf.barrier()
"""


@pytest.mark.timeout(180)
def test_ctrl_c_at_the_terminal_under_macroflow_run_mpi_leaves_no_shared_pages(tmp_path):
    # mpiexec's proxy, hit by the same Ctrl-C as mpiexec, may fail and end
    # before the ranks it kills: the pages were swept while they still ran,
    # and stayed (3 runs in 5)
    import glob
    before = set(glob.glob("/dev/shm/macroflow-mpi-*"))
    for _ in range(3):
        code, out, err, took = _interrupt_macroflow_run(tmp_path, SLEEPS_IN_A_BARRIER,
                                                        ["--spmd"], "its process group")
        assert code == 130 and took < 30, (code, err)
        assert set(glob.glob("/dev/shm/macroflow-mpi-*")) <= before, err
        (tmp_path / "flag").unlink()


ADDS_A_CONTEXT = """
    import macroflow as mf

    SCALE = 3

    def helper(x):
        return x * SCALE

    @mf.persistent
    class K:
        def f(self, x):
            return helper(x)

    def main():
        [c] = mf.add_contexts(1)
        k = K.create(on=c)
        print("on", c, k.f(5).result(timeout=60), flush=True)
"""


@pytest.mark.timeout(180)
def test_a_context_added_under_macroflow_run_mpi_serves_the_scripts_classes(tmp_path):
    # the script is a module (__mf_script__) that the added rank never
    # loaded: its classes went by name, and the rank could not unpickle them
    code, out, err = _mpiexec(tmp_path, 2, ADDS_A_CONTEXT, cli=True, timeout=150)
    assert code == 0, (out, err)
    assert "on 2 15" in out, (out, err)


def test_macroflow_run_can_name_a_context_added_while_the_job_ran(tmp_path):
    # the table context 0 writes names the ranks the job began with; a rank
    # added later is noted beside it (note_added), and named when it dies
    from macroflow.cli import FirstToEnd
    table = str(tmp_path / "contexts")
    with open(table, "w") as f:
        f.write("0 h 100\n1 h 101\n")
    w = FirstToEnd(table)
    try:
        assert w.thread.join(10) is None and w.rows == {100: (0, "h"), 101: (1, "h")}
        old = os.environ.get(M.CONTEXTS_FILE)
        os.environ[M.CONTEXTS_FILE] = table
        try:
            M.note_added({2: ("h", 102)})
        finally:
            if old is None:
                del os.environ[M.CONTEXTS_FILE]
            else:
                os.environ[M.CONTEXTS_FILE] = old
        w.deaths[:] = [(102, 9), (101, None)]  # (pid, wait status: SIGKILL)
        assert w.first == [(2, 102, "h", 9)]
        assert w.describe().startswith("context 2 (pid 102 on h) was killed by signal SIGKILL")
    finally:
        w.stop()


PRINTS_IN_FINALLY = """
    import sys, time

    def main():
        try:
            open(sys.argv[1], "w").write("waiting")
            print("main started", flush=True)
            time.sleep(3600)
        finally:
            print("main's finally ran", flush=True)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("whom", ["macroflow run alone", "its process group", "it twice"])
def test_what_main_prints_after_ctrl_c_under_macroflow_run_mpi_is_passed_on(tmp_path, whom):
    # the job's output was read in the main thread, which stopped reading at
    # the Ctrl-C: what main's finally printed was lost; a second Ctrl-C while
    # the job ended ended macroflow run with a traceback
    code, out, err, _ = _interrupt_macroflow_run(tmp_path, PRINTS_IN_FINALLY, [], whom)
    assert code == 130, (code, out, err)
    assert "main started" in out and "main's finally ran" in out, (out, err)
    assert "Traceback" not in err, err


def test_a_frame_over_4_kib_keeps_its_sender_looking_at_mpi_until_it_has_left():
    # MPICH may need the sender's progress to send such a frame (the first to a
    # peer): a sender that went to sleep held it until it woke
    t = M.MpiTransport(M.mpi().COMM_SELF.Dup())
    got = []
    t.attach(lambda src, bufs, load: got.append(len(bytes(bufs[0]))), None)
    try:
        t.send(0, [b"x" * 4000], 0)
        assert t.pushing == 0
        t.send(0, [b"x" * 5000], 0)
        assert t.pushing == 1
        deadline = time.monotonic() + 10
        while len(got) < 2 and time.monotonic() < deadline:
            t.poll(0.01)
        assert got == [4000, 5000]
    finally:
        t.close()



@pytest.mark.timeout(120)
def test_macroflow_run_blames_the_error_in_main_not_the_ranks_mpi_killed_and_cleans_up(tmp_path):
    before = set(glob.glob("/dev/shm/mpich_shm_*"))
    code, out, err = _mpiexec(tmp_path, 2, """
        def main():
            raise ValueError("boom in main")
    """, cli=True)
    assert code == 1
    assert err.count("ValueError: boom in main") == 1
    assert "killed by signal" not in err and "MPI ended the job" not in err, err
    # the aborted job's shared-memory segment is gone (macroflow run removed it)
    assert set(glob.glob("/dev/shm/mpich_shm_*")) - before == set()


@pytest.mark.timeout(120)
def test_macroflow_run_reports_a_syntax_error_once_before_any_rank_starts(tmp_path):
    code, out, err = _mpiexec(tmp_path, 2, """
        def main(:
            pass
    """, cli=True)
    assert code == 1
    assert err.count("SyntaxError") == 1 and "MPI_Abort" not in err, err


TOP_LEVEL_RUN = """
    import macroflow as mf

    def main():
        return mf.rank()

    print(mf.spmd(main, n=2))  # at the top level: it runs as the script loads
"""


@pytest.mark.timeout(120)
def test_a_script_that_starts_a_computation_as_it_loads_is_told_where_it_went_wrong(tmp_path):
    code, out, err = _mpiexec(tmp_path, 2, TOP_LEVEL_RUN, cli=True)
    assert code != 0, (out, err)
    # refused as the script loads, by rank 0 alone
    assert err.count("starts a computation at its top level (mf.run, mf.init or mf.spmd) "
                     "while `macroflow run` loads it") == 1, err
    assert 'if __name__ == "__main__":' in err, err


# -- a spawned rank that dies ------------------------------------------------------

DYING = """
    import glob, os, signal, sys, time
    import macroflow as mf

    how = sys.argv[1]

    @mf.persistent
    class Victim:
        def pid(self):
            return os.getpid()

        def die(self):
            if how == "exit":
                os._exit(3)
            os.kill(os.getpid(), signal.SIGKILL)

    def main():
        victim, other = Victim.create(on=1), Victim.create(on=2)
        pids = victim.pid().result(30), other.pid().result(30)
        print("pids", *pids, flush=True)
        t = time.monotonic()
        try:
            victim.die().result(timeout=30)
        except mf.ContextLost as e:
            print("victim", e.context, round(time.monotonic() - t, 1), e, flush=True)
        # MPI's process manager ends the other spawned ranks too (they may
        # answer a call or two first)
        while time.monotonic() - t < 30:
            try:
                other.pid().result(timeout=30)
            except mf.ContextLost as e:
                print("other", e.context, round(time.monotonic() - t, 1), e, flush=True)
                break
        print("states", *[c.state for c in mf.contexts()], *sorted(mf.stats(timeout=30)),
              flush=True)
        if sys.argv[2] == "uncaught":
            victim.pid().result(30)
        return "main ended"

    print(mf.run(main, contexts=3, transport="mpi"), flush=True)
    try:
        mf.run(main, contexts=2, transport="mpi")
    except RuntimeError as e:
        print("second:", e, flush=True)
    print("python", mf.run(lambda: 7, contexts=2, transport="local"), flush=True)
"""


def _dying(tmp_path, how, then="caught"):
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(DYING))
    before = _job_files()
    # a process group of its own, led by the program, as a shell with job
    # control starts it (which the process manager's kill must spare)
    p = subprocess.run([sys.executable, str(script), how, then], capture_output=True,
                       text=True, timeout=90, env=_env(), preexec_fn=os.setpgrp)
    left = _job_files() - before
    lines = p.stdout.splitlines()
    pids = [int(x) for x in lines[0].split()[1:]] if lines and lines[0].startswith("pids") else []
    return p, lines, left, pids


# how a rank ended is read from /proc between its end and its reaping by MPI's
# process manager, which may come first (about 1 run in 8 here): then it is not known
UNREAD = r"ended while the computation ran \(killed, or os._exit\)"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how, said", [("exit", "exited with code 3|" + UNREAD),
                                       ("kill", "was killed by signal SIGKILL|" + UNREAD)])
def test_a_spawned_rank_that_dies_fails_the_futures_of_every_rank_mpi_ends_then(tmp_path, how, said):
    p, lines, left, pids = _dying(tmp_path, how)
    assert p.returncode == 0, (lines, p.stderr)
    victim, other = lines[1].split(maxsplit=3), lines[2].split(maxsplit=3)
    assert victim[:2] == ["victim", "1"] and float(victim[2]) < 10, lines
    assert re.search(rf"context 1 was lost: its process \(pid {pids[0]}\) ({said})", victim[3])
    # MPI's process manager ends every spawned rank then: the others are lost too, and say why
    assert other[:2] == ["other", "2"] and float(other[2]) < 10, lines
    # (killed both, or how the first ended not read: which died first cannot
    # be told, and each says so)
    assert f"(pid {pids[1]}) was ended by MPI after context 1's died" in other[3] or \
        re.search(rf"\(pid {pids[1]}\) (was killed by signal SIGKILL|{UNREAD}); context 1 "
                  rf"ended at the same moment: one died first, and MPI's process manager ended "
                  rf"the others", other[3]), other[3]
    assert lines[3] == "states running lost lost 0"  # mf.stats leaves the lost ones out
    assert lines[4] == "main ended"
    # MPI here can spawn no more; other transports go on; the process ends in order
    assert lines[5].startswith("second: the mpi transport cannot start ranks in this process "
                               "any more: context 1, a rank this process spawned, died") or (
        lines[5].startswith("second: the mpi transport cannot start ranks in this process any "
                            "more: contexts 1, 2, ranks this process spawned, died at the same "
                            "moment")), lines[5]
    assert lines[6] == "python 7"
    assert "did not stop" not in p.stderr and "Abort" not in p.stderr, p.stderr
    assert not left, left  # MPICH's segments and the ranks' pages are removed
    assert all(_gone(pid) for pid in pids)


@pytest.mark.timeout(120)
def test_a_program_that_does_not_catch_a_dead_rank_ends_with_its_error(tmp_path):
    p, lines, left, pids = _dying(tmp_path, "exit", then="uncaught")
    assert p.returncode == 1, (lines, p.stderr)
    assert "main ended" not in lines
    assert p.stderr.count("Traceback") == 1
    assert re.search(r"ContextLost: context 1 was lost: its process \(pid \d+\) (exited with "
                     r"code 3|" + UNREAD + ")", p.stderr), p.stderr
    assert not left, left


@pytest.mark.timeout(120)
def test_an_spmd_run_whose_spawned_rank_dies_raises_at_once(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""
        import os, time
        import macroflow as mf

        def fn():
            if mf.rank() == 1:
                os._exit(4)
            mf.barrier()

        t = time.monotonic()
        try:
            mf.spmd(fn, n=3, transport="mpi")
        except mf.ContextLost as e:
            print(e.context, round(time.monotonic() - t, 1), e)
    """))
    before = _job_files()
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                       timeout=90, env=_env())
    assert p.returncode == 0, p.stderr
    ctx, took, text = p.stdout.split(maxsplit=2)
    assert ctx == "1" and float(took) < 10, p.stdout
    assert re.search(f"its process \\(pid \\d+\\) (exited with code 4|{UNREAD})", text), text
    assert not _job_files() - before


class _Comm:
    """A communicator whose Disconnect ends at once, or never."""

    def __init__(self, stuck):
        self.stuck = stuck
        self.calls = 0

    def Disconnect(self):
        self.calls += 1
        if self.stuck:
            import threading
            threading.Event().wait()


def test_a_disconnection_that_never_ends_is_given_up(capfd):
    # a spawned rank that died before its death was heard of held the
    # closing rank in MPI_Comm_disconnect for good (a hang of the suite)
    ended = []
    done = _Comm(stuck=False)
    assert M.disconnect(done, 3, wait=5, stuck=lambda: ended.append(True)) is True
    assert done.calls == 1 and ended == []
    t0 = time.monotonic()
    assert M.disconnect(_Comm(stuck=True), 3, wait=0.2, stuck=lambda: ended.append(True)) is False
    assert time.monotonic() - t0 < 5
    assert ended == [True]
    assert "context 3: disconnecting from spawned ranks did not end within 0.2 s" in \
        capfd.readouterr().err


def test_a_process_that_gave_up_a_disconnection_ends_before_mpi_finalize():
    code = textwrap.dedent("""
        import threading
        from macroflow.transport import mpi as m

        class Stuck:
            def Disconnect(self):
                threading.Event().wait()

        print(m.disconnect(Stuck(), 0, wait=0.1), flush=True)
        m._at_exit()  # what Python's exit runs: ends here, without MPI_Finalize
        print("went on to MPI_Finalize", flush=True)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.stdout.split() == ["False"], r.stdout + r.stderr
    assert r.returncode == 0


KILLED_WHILE_SENT_TO = """
    import os, signal, threading
    import numpy as np
    import macroflow as mf

    @mf.persistent
    class Sink:
        def take(self, a):
            return float(a[-1])

    def main():
        pid = mf.stats()[1]["pid"]
        s = Sink.create(on=1)
        big = np.ones(20 * 2**20 // 8)
        threading.Timer(0.05, os.kill, (pid, signal.SIGKILL)).start()
        try:
            for i in range(50):
                s.take(big).result(timeout=30)
        except mf.ContextLost as e:
            return "lost: " + str(e)
        return "not lost"

    print(mf.run(main, contexts=2, transport="mpi"))
"""


def _lost_at_once(tmp_path, body):
    """Run ``body`` (a program whose main kills its context 1 and prints
    what its wait said): the wait must say context 1 was lost, soon."""
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(body))
    t = time.monotonic()
    # (not a session of its own: a session leader cannot leave its process
    # group, which MPICH's process manager kills when a spawned rank dies)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=90, env=_env())
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("lost: context 1 was lost"), (out.stdout, out.stderr[-2000:])
    assert time.monotonic() - t < 60


def test_a_spawned_rank_killed_while_a_large_argument_goes_to_it_is_lost_at_once(tmp_path):
    # (context 0 waited for MPI to take the array for ever, its wait's timeout
    # never reached: the death its watcher heard was not looked at there)
    _lost_at_once(tmp_path, KILLED_WHILE_SENT_TO)


KILLED_WITH_A_FULL_WINDOW = """
    import os, signal, threading
    import macroflow as mf

    @mf.persistent
    class Sink:
        def pid(self):
            return os.getpid()
        def take(self, x):
            return x

    def main():
        s = Sink.create(on=1)
        pid = s.pid().result(30)
        threading.Timer(0.2, os.kill, (pid, signal.SIGKILL)).start()
        fs = [s.take(i) for i in range(30000)]  # more than its window holds
        try:
            mf.gather(fs, timeout=30)
        except mf.ContextLost as e:
            return "lost: " + str(e)
        return "not lost"

    print(mf.run(main, contexts=2, transport="mpi"))
"""


def test_a_spawned_rank_killed_while_calls_wait_for_room_in_its_window_is_lost_at_once(tmp_path):
    # (a send waiting for credits that a dead rank never gives waited for
    # ever: in main's calls, then in the shutdown's; SIGTERM and Ctrl-C
    # were taken there and the shutdown went back to the same wait)
    _lost_at_once(tmp_path, KILLED_WITH_A_FULL_WINDOW)


def test_a_script_without_main_under_macroflow_run_mpi_is_said_once(tmp_path):
    # (every rank said it: three lines for -n 3)
    script = tmp_path / "nomain.py"
    script.write_text("raise ValueError('at the top level')\n")
    out = subprocess.run([sys.executable, "-m", "macroflow", "run", "-n", "3", "--transport",
                          "mpi", str(script)], capture_output=True, text=True, timeout=60,
                         env=_env())
    assert out.returncode == 1
    assert out.stderr.count("defines no function main()") == 1, out.stderr
    # (on local the script runs first, and its error is what is said: here it is
    # not run, and the message says so, not leaving the error a mystery)
    assert "on mpi the script is not run without one" in out.stderr, out.stderr


@pytest.mark.parametrize("given, said", [
    (["-n", "3"], "-n 3, but mpiexec started 2 ranks"),
    (["--transport", "local"], "--transport local under mpiexec"),
])
def test_macroflow_run_options_that_contradict_mpiexec_are_said_once(tmp_path, given, said):
    # (every rank printed a traceback from inside mf.spmd: "mf.spmd(): n=3, ...")
    script = tmp_path / "job.py"
    script.write_text("import macroflow as mf\ndef main():\n    return mf.rank()\n")
    out = subprocess.run([M._find_mpiexec(), "-n", "2", sys.executable, "-m", "macroflow", "run",
                          *given, "--spmd", str(script)], capture_output=True, text=True,
                         timeout=60, env=_env())
    assert out.returncode == 2  # (a usage error's, not MPI_Abort's 1)
    assert out.stderr.count(said) == 1 and "Traceback" not in out.stderr, out.stderr
    assert "MPI_Abort" not in out.stderr, out.stderr


@pytest.mark.parametrize("given, said", [
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["missing.py"], "missing.py"),
])
def test_macroflow_run_usage_errors_under_mpiexec_are_said_once(tmp_path, given, said):
    # (every rank printed the usage and the error)
    out = subprocess.run([M._find_mpiexec(), "-n", "2", sys.executable, "-m", "macroflow", "run",
                          *given], capture_output=True, text=True, timeout=60, env=_env(),
                         cwd=tmp_path)
    assert out.returncode == 2
    assert out.stderr.count("error:") == 1 and said in out.stderr, out.stderr


@pytest.mark.parametrize("given", [["run", "--help"], ["--help"], ["--version"]])
def test_macroflow_help_and_version_under_mpiexec_are_said_once(given):
    out = subprocess.run([M._find_mpiexec(), "-n", "2", sys.executable, "-m", "macroflow",
                          *given], capture_output=True, text=True, timeout=60, env=_env())
    assert out.returncode == 0, out.stderr
    said = "macroflow 0." if given == ["--version"] else "usage: macroflow"
    assert out.stdout.count(said) == 1, out.stdout


def test_contexts_added_under_mpiexec_are_checked_against_the_hosts_memory(monkeypatch):
    # (mf.add_contexts(100000) in an mpiexec job spawned interpreters until the
    # host had 84 MB left: the job's ranks exist, the added ones are spawned)
    monkeypatch.setenv("PMI_RANK", "0")
    monkeypatch.setenv("PMI_SIZE", "2")
    M.check_room(10 ** 6)  # the job's own ranks: nothing to start
    with pytest.raises(mf.LimitError, match="do not fit in this host's memory"):
        M.check_room(10 ** 6 + 1, adding=True)


def test_macroflow_run_mpi_refuses_more_ranks_than_the_host_can_hold(tmp_path):
    # (it started mpiexec -n 100000000)
    script = tmp_path / "job.py"
    script.write_text("def main():\n    return 1\n")
    out = subprocess.run([sys.executable, "-m", "macroflow", "run", "-n", "100000000",
                          "--transport", "mpi", str(script)], capture_output=True, text=True,
                         timeout=60, env=_env())
    assert out.returncode == 2, out.stderr
    assert "100000000 contexts do not fit in this host's memory" in out.stderr


ADDED_UNDER_MPIEXEC = """
    import macroflow as mf

    def mark(cid):
        import os
        os.environ["MF_TEST_INIT"] = str(cid)

    @mf.persistent
    class Probe:
        def seen(self):
            import os
            return os.environ.get("MF_TEST_INIT")

    def main():
        new = mf.add_contexts(1, init=mark)
        return new, Probe.create(on=new[0]).seen().result(60)

    print(mf.run(main))
"""


def test_a_context_added_under_mpiexec_runs_an_init_of_the_script(tmp_path):
    # (the new rank runs none of the script: the init, sent by name, was not
    # found there, AttributeError: Can't get attribute 'mark' on __main__)
    rc, out, err = _mpiexec(tmp_path, 2, ADDED_UNDER_MPIEXEC)
    assert rc == 0, err[-2000:]
    assert out.strip() == "([2], '2')", err[-2000:]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("source, says, options", [
    ("import no_such_module_here\ndef main():\n    pass\n",
     "ModuleNotFoundError: No module named 'no_such_module_here'", []),
    ("def main(a, b):\n    return a\n", "macroflow run: mf.run(): main(a, b) cannot be called", []),
    ("def main(a, b):\n    return a\n", "macroflow run: mf.spmd(): main(a, b) cannot be called",
     ["--spmd"]),
])
def test_a_fault_of_the_script_under_macroflow_run_mpi_is_said_once(tmp_path, source, says,
                                                                     options):
    # found as each rank loads the script: every rank said it (three
    # tracebacks for -n 3); with --spmd it named mf.run()
    script = tmp_path / "job.py"
    script.write_text(source)
    out = subprocess.run([sys.executable, "-m", "macroflow", "run", "-n", "3", *options,
                          "--transport", "mpi", str(script)], capture_output=True, text=True,
                         timeout=100, env=_env())
    assert out.returncode != 0
    assert out.stderr.count(says) == 1, out.stderr


INTERRUPTED_WHILE_ADDING = """
    import os, signal, sys, threading
    import macroflow as mf

    def main():
        threading.Timer(float(sys.argv[1]), os.kill, (os.getpid(), signal.SIGINT)).start()
        mf.add_contexts(1)
        threading.Event().wait(30)

    try:
        mf.run(main, contexts=1, transport="mpi")
    except KeyboardInterrupt:
        sys.exit(130)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("after", ["0.1", "0.3"])
def test_a_ctrl_c_while_adding_a_rank_leaves_no_rank_behind(tmp_path, after):
    # (interrupted between MPI's spawn and its merge, the program ended and
    # the new rank waited in the merge for ever, spinning a core)
    import psutil
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(INTERRUPTED_WHILE_ADDING))
    before = M.mpich_shm_files()
    p = subprocess.Popen([sys.executable, str(script), after], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=_env())
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130, err

    def spawned_by_it():  # (a spawned rank's command line ends with its spawner's pid)
        out = []
        for q in psutil.process_iter(["cmdline"]):
            line = " ".join(q.info["cmdline"] or [])
            if "_spawned(" in line and line.endswith(f", {p.pid})"):
                out.append(q)
        return out

    deadline = time.monotonic() + 10
    while spawned_by_it() and time.monotonic() < deadline:
        time.sleep(0.1)
    left = spawned_by_it()
    for q in left:
        q.kill()
    assert left == []
    assert not [f for f in M.mpich_shm_files() - before if not M.in_use(f)]


class _Req:
    """A request of the recording communicator: done at its ``after``-th Test."""

    def __init__(self, after: int = 1):
        self.after = after

    def Test(self) -> bool:
        self.after -= 1
        return self.after <= 0


class _RecordingComm:
    """Records the collectives a rank starts, in order; the duplicate is
    ready at its second Test, the signature at its first."""

    def __init__(self, calls):
        self.calls = calls

    def Idup(self):
        return _RecordingComm(self.calls), _Req(2)

    def Get_size(self) -> int:
        return 3

    def Ibarrier(self):
        self.calls.append("Ibarrier")
        return _Req()

    def Iallreduce(self, send, recv, op=None):
        if len(send) == 3:  # the signature: every rank the same
            recv[:] = send
            self.calls.append("Iallreduce signature")
        else:
            recv[:] = send
            self.calls.append("Iallreduce values")
        return _Req()


class _FakeMPI:
    SUM = PROD = MIN = MAX = object()


@pytest.mark.parametrize("tested_first", ["barrier", "allreduce", "both in turn"])
def test_native_collectives_call_mpi_in_the_order_they_were_started(tested_first):
    # MPI matches a communicator's collectives by the order each rank calls
    # them: they were called at each one's first test, so a rank that tested
    # an allreduce before the barrier started ahead of it (its duplicate
    # communicator not ready at the barrier's first test) called them in
    # another order than its peers, and every rank waited for ever
    calls = []
    natives = M.MpiCollectives(_FakeMPI, _RecordingComm(calls))
    barrier = natives.start("barrier", None, None)
    first = natives.start("allreduce", np.ones(4, np.int64), "sum")  # (floats: see _reducible)
    barrier.test()  # (the duplicate is not ready yet)
    second = natives.start("allreduce", np.ones(2), "max")
    order = {"barrier": [first, barrier, second], "allreduce": [second, first, barrier],
             "both in turn": [first, second, barrier]}[tested_first]
    while not all(op.done for op in order):
        for op in order:
            op.test()
    assert calls == ["Ibarrier", "Iallreduce signature", "Iallreduce values",
                     "Iallreduce signature", "Iallreduce values"]
    assert first.result().tolist() == [1] * 4 and second.result().tolist() == [1.0] * 2
    assert barrier.result() is None


STOPPED_IN_A_COLLECTIVE = """
    import os, sys, time
    import macroflow as mf

    def main(flags):
        if mf.rank() == 1:
            open(os.path.join(flags, "1"), "w").close()
            time.sleep(60)  # computes: never joins the barrier
        f = mf.barrier_async()  # MPI's own (MACROFLOW_SHM_BARRIER=0)
        open(os.path.join(flags, str(mf.rank())), "w").close()
        f.result()

    try:
        mf.spmd(main, sys.argv[1], n=2, transport="mpi")
    finally:
        print("finally ran", flush=True)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig, status", [(signal.SIGTERM, 143), (signal.SIGINT, -signal.SIGINT)])
def test_a_signal_while_a_rank_waits_in_an_mpi_collective_another_never_joins(tmp_path, sig,
                                                                                status):
    # the disconnection waited 10 s for the collective to end (it cannot),
    # and the process then ended with status 0 after SIGTERM (130 after Ctrl-C)
    script, flags = tmp_path / "job.py", tmp_path / "flags"
    flags.mkdir()
    script.write_text(textwrap.dedent(STOPPED_IN_A_COLLECTIVE))
    p = subprocess.Popen([sys.executable, str(script), str(flags)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True,
                         env=_env({"MACROFLOW_SHM_BARRIER": "0"}))
    try:
        deadline = time.monotonic() + 60
        while sorted(os.listdir(flags)) != ["0", "1"] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert sorted(os.listdir(flags)) == ["0", "1"]
        t = time.monotonic()
        p.send_signal(sig)
        out, err = p.communicate(timeout=60)
        took = time.monotonic() - t
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert p.returncode == status, err
    assert "finally ran" in out
    assert "collective that another context never joined is still pending" in err, err
    assert took < 8.0, (took, err)


INTERRUPTED_AT_SPAWN = """
    import contextlib, os, signal, time
    import macroflow as mf
    from macroflow.transport import mpi

    def ranks():  # the ranks this process spawned
        out = []
        for d in os.listdir("/proc"):
            try:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    line = f.read()
            except OSError:
                continue
            if b"_spawned(" in line and f", {os.getpid()})".encode() in line:
                out.append(int(d))
        return out

    before = mpi.mpich_shm_files()
    real = mpi._own_process_group

    @contextlib.contextmanager
    def ctrl_c_as_spawned():
        with real():
            yield
        os.kill(os.getpid(), signal.SIGINT)  # as if Ctrl-C came while MPI started them

    mpi._own_process_group = ctrl_c_as_spawned
    try:
        mf.init(contexts=3, transport="mpi")
        print("not interrupted")
    except KeyboardInterrupt:
        print("interrupted")
    mpi._own_process_group = real
    deadline = time.monotonic() + 20
    while ranks() and time.monotonic() < deadline:
        time.sleep(0.02)
    print("ranks left:", len(ranks()))
    own = {f"/dev/shm/mpich_shm_{os.getpid():x}_0"}
    print("files left:", sorted(mpi.mpich_shm_files() - before - own))
    print("then:", mf.run(mf.num_contexts, contexts=2, transport="mpi"))
"""


@pytest.mark.timeout(120)
def test_a_ctrl_c_while_mpi_spawns_the_ranks_sends_them_away(tmp_path):
    # the Ctrl-C was raised as MPI's spawn returned, its intercommunicator
    # lost: the ranks waited as long as the process lived, and MPI's process
    # manager killed them at its end, leaving 2 MB in /dev/shm each time
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(INTERRUPTED_AT_SPAWN))
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                       timeout=100, env=_env(), start_new_session=True)
    assert p.returncode == 0, p.stderr
    said = [line for line in p.stdout.splitlines() if "UCX" not in line]  # (MPI's own warnings)
    assert said == ["interrupted", "ranks left: 0", "files left: []", "then: 2"], p.stderr



SLOW_IMPORT = """
    import sys, time

    class Slow:  # importing macroflow takes 2 s longer in a spawned rank (python -c)
        def find_spec(self, name, path=None, target=None):
            if name == "macroflow" and sys.argv[0] == "-c":
                time.sleep(2.0)
            return None

    sys.meta_path.insert(0, Slow())
"""

SPAWN_CPU = """
    import resource, sys
    import macroflow as mf

    def cpu():
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    before = cpu()
    with mf.init(contexts=3, transport="mpi"):
        used = cpu() - before
    print(f"{used:.3f}")
"""


def _run_with_site(tmp_path, site_code, body):
    """Run ``body`` as a script whose processes (the spawned ranks too) first
    run ``site_code`` as their sitecustomize; the finished process."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(textwrap.dedent(site_code))
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(body))
    env = _env()
    env["PYTHONPATH"] = str(site) + os.pathsep + env["PYTHONPATH"]
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          env=env, timeout=90)


def test_spawned_ranks_merge_before_they_import_macroflow(tmp_path):
    # MPI's spawn and merge return in the spawner once every new rank has
    # merged, and MPICH spins a core meanwhile: ranks that imported
    # macroflow first (here 2 s slower) kept it spinning that long
    out = _run_with_site(tmp_path, SLOW_IMPORT, SPAWN_CPU)
    assert out.returncode == 0, out.stderr
    used = float([line for line in out.stdout.splitlines() if "UCX" not in line][-1])
    # (through the ranks' 2 s import it used about 1.2 s of CPU; 0.12 to 0.15 s now)
    assert used < 0.6, used


def test_a_spawn_removes_the_segments_a_killed_job_left():
    # a program whose ranks it spawned, killed outright, left MPICH's files
    # (3 MB) for good: the next spawn removes those nobody uses
    tag = f"/dev/shm/mpich_shm_mftest_{os.getpid()}"
    left, fresh, held = tag + "_left", tag + "_fresh", tag + "_held"
    for path in (left, fresh, held):
        with open(path, "wb") as f:
            f.write(b"x" * 4096)
    hour_ago = time.time() - 3600
    os.utime(left, (hour_ago, hour_ago))
    os.utime(held, (hour_ago, hour_ago))
    keep = open(held, "rb")
    try:
        with mf.init(contexts=2, transport="mpi"):
            pass
        assert not os.path.exists(left)
        assert os.path.exists(fresh) and os.path.exists(held)  # just made; in use
    finally:
        keep.close()
        for path in (left, fresh, held):
            if os.path.exists(path):
                os.unlink(path)


INIT_TIMES_OUT = """
    import time
    import macroflow as mf

    def hang(cid):
        if cid % 2 == 0:  # context 2 never ends its init; context 3 does
            time.sleep(1000)

    @mf.regular
    class Where:
        def where(self):
            return mf.context_id()

    def main():
        try:
            mf.add_contexts(2, init=hang, timeout=2)
        except mf.TimeoutError as e:
            assert e.added == [3], e.added
        return sorted(set(mf.gather([Where().where() for _ in range(20)])))

    print(mf.run(main, contexts=2, transport="mpi"))
"""


def test_a_rank_asked_to_leave_as_it_leaves_calls_no_mpi_after_finalizing(tmp_path):
    # the SIGTERM that asks a slow rank to leave came while it was in
    # MPI_Finalize, and its handler called MPI: "Attempting to use an MPI
    # routine (internal_Improbe) ... after finalizing MPICH" (5 runs in 6)
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(INIT_TIMES_OUT))
    for _ in range(2):
        out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                             timeout=90, env=_env())
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.splitlines()[-1] == "[0, 1, 3]", out.stdout
        assert "after finalizing" not in out.stderr, out.stderr[-2000:]


BROKEN_IN_RANKS = """
    import sys

    class Broken:  # macroflow cannot be imported in a spawned rank (python -c)
        def find_spec(self, name, path=None, target=None):
            if name == "macroflow" and sys.argv[0] == "-c":
                raise ImportError("macroflow is broken in this rank")
            return None

    sys.meta_path.insert(0, Broken())
"""

BROKEN_JOB = """
    import macroflow as mf
    try:
        mf.init(contexts=2, transport="mpi")
    except RuntimeError as e:
        print(str(e).splitlines()[0])
        print(str(e).splitlines()[-1])
"""


def test_a_spawned_rank_that_cannot_import_macroflow_says_why_and_leaves_in_order(tmp_path):
    # it imports macroflow after it has started MPI and merged (rank_start):
    # it still says why, and ends MPI in order, leaving no MPICH file
    before = M.mpich_shm_files()
    out = _run_with_site(tmp_path, BROKEN_IN_RANKS, BROKEN_JOB)
    assert out.returncode == 0, out.stderr
    said = [line for line in out.stdout.splitlines() if "UCX" not in line]
    assert said == ["spawned rank 1 could not start (macroflow.transport.mpi:_serve_spawned):",
                    "ImportError: macroflow is broken in this rank"], out.stdout
    assert not [f for f in M.mpich_shm_files() - before if not M.in_use(f)]


def test_deaths_heard_together_with_none_of_its_own_accord_are_said_to_be_unordered():
    # two ranks killed (SIGKILL) at once: the one heard first is no more
    # likely the one that died first (a watch hears both in one pass), so
    # the watch marks them together; an exit of its own accord goes first
    told = []
    w = M.DeathWatch(f"test-together-{os.getpid()}", lambda pid, status: told.append(pid))
    try:
        killed, exited = signal.SIGKILL, 3 << 8  # wait statuses
        w._tell([(11, killed), (12, killed)])
        assert told == [11, 12] and w.together == {11, 12}
        w._tell([(21, killed), (22, exited)])
        assert told[2:] == [22, 21] and w.together == set()
        w._tell([(31, None)])
        assert told[4:] == [31] and w.together == set()
    finally:
        w.close()


def test_a_spawned_rank_that_kills_itself_is_not_said_to_be_ended_for_another(tmp_path):
    # context 2 dies while 0 waits for it; MPI ends context 1 then: 2's
    # error must not say 1 died first (it did, now and then)
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""
        import os, signal, time
        import macroflow as mf

        def slow(x):
            time.sleep(0.5)
            return x

        def fn():
            r = mf.rank()
            if r == 0:
                return mf.remote_action(2, slow, 5).wait(timeout=30)
            if r == 2:
                time.sleep(0.2)
                os.kill(os.getpid(), signal.SIGKILL)
            mf.barrier(timeout=30)

        if __name__ == "__main__":
            try:
                mf.spmd(fn, n=3, transport="mpi")
            except mf.ContextLost as e:
                print("lost", e.context, e, flush=True)
    """))
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                       timeout=90, env=_env(), preexec_fn=os.setpgrp)
    line = next((x for x in p.stdout.splitlines() if x.startswith("lost")), None)
    assert line is not None, (p.stdout, p.stderr)
    assert line.startswith("lost 2 context 2 was lost: its process"), line
    assert "after context 1's died" not in line, line


def test_a_program_that_catches_a_spawned_ranks_interrupt_exits_as_it_would_anywhere(tmp_path):
    # rank 1's function raises KeyboardInterrupt while 0 and 2 wait in MPI's
    # own barrier, which then never ends: the process ends without
    # MPI_Finalize, with the status Python gives it (it was 1, from the
    # error the program caught); uncaught, the error's status
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent("""
        import sys
        import macroflow as mf

        def f():
            if mf.rank() == 1:
                raise KeyboardInterrupt
            mf.barrier()

        if __name__ == "__main__":
            if sys.argv[1] == "caught":
                try:
                    mf.spmd(f, n=3, transport="mpi")
                except mf.ContextLost as e:
                    print("caught", e.context, flush=True)
                print("finished", flush=True)
            else:
                mf.spmd(f, n=3, transport="mpi")
    """))
    for how, code in (("caught", 0), ("uncaught", 1)):
        p = subprocess.run([sys.executable, str(script), how], capture_output=True, text=True,
                           timeout=90, env=_env(), preexec_fn=os.setpgrp)
        assert p.returncode == code, (how, p.stdout, p.stderr)
        if how == "caught":
            ours = [x for x in p.stdout.splitlines() if "UCX" not in x]  # (UCX warns here)
            assert ours == ["caught 1", "finished"], p.stdout
        else:
            assert "ContextLost" in p.stderr, p.stderr


@pytest.mark.parametrize("name, value", [("MACROFLOW_PIN", "bogus"), ("MACROFLOW_RINGS", "yes"),
                                         ("MACROFLOW_MPI_INIT_WARN_S", "abc"),
                                         ("MACROFLOW_MPI_INIT_WARN_S", "-1")])
def test_a_bad_setting_is_refused_on_mpi_as_anywhere(monkeypatch, name, value):
    # (MACROFLOW_PIN, which mpi does not read, was taken; the MPI start's
    # warning time fell back to 30 s)
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=f"the {name} environment variable must be .*"
                                         f"got {re.escape(repr(value))}"):
        mf.run(mf.num_contexts, contexts=2, transport="mpi")
