"""Contexts created while the program runs (mf.add_contexts) and the list of
contexts (mf.contexts), on every transport."""

import os
import re
import signal
import threading

import pytest

import macroflow as mf

pytestmark = pytest.mark.timeout(60)


TAGS = {}  # context -> what its init left (one process holds them all on inproc)


def set_tag(cid):
    TAGS[mf.context_id()] = f"initialised-{cid}"


def failing_init(cid):
    raise ValueError(f"no room on {cid}")


@mf.persistent
class Where:
    def here(self):
        return mf.context_id()

    def pid(self):
        return os.getpid()

    def tag(self):
        return TAGS.get(mf.context_id())

    def ask(self, other):
        # a new context calls an old one (and the other way round)
        return (mf.context_id(), other.here().result())


def test_new_contexts_get_ids_after_the_old_ones_and_are_used_by_placement(run):
    def main():
        before = mf.num_contexts()
        new = mf.add_contexts(2)
        places = sorted({Where.create().here().result() for _ in range(8)})
        return before, new, mf.num_contexts(), places

    before, new, after, places = run(main, contexts=2)
    assert (before, new, after) == (2, [2, 3], 4)
    assert places == [1, 2, 3]  # round-robin over every context but 0, new ones included


def test_init_runs_in_each_new_context_before_it_serves(run):
    def main():
        new = mf.add_contexts(2, init=set_tag)
        return [Where.create(on=c).tag().result() for c in new]

    assert run(main, contexts=2) == ["initialised-2", "initialised-3"]


def set_sum(values, cid):
    TAGS[mf.context_id()] = float(values.sum())


def test_an_init_that_holds_a_large_array_is_run(run):
    # (a partial over 1 MiB of numpy: "init must be a function (it pickled
    # with out-of-band buffers)"; a closure over it, on local: "Message too
    # long", said as the end of the fork server, which had not ended)
    import functools
    import numpy as np

    def main():
        new = mf.add_contexts(1, init=functools.partial(set_sum, np.ones(131072)))
        return [Where.create(on=c).tag().result() for c in new]

    assert run(main, contexts=2) == [131072.0]


def test_new_and_old_contexts_call_each_other(run):
    def main():
        (new,) = mf.add_contexts(1)
        old_obj, new_obj = Where.create(on=1), Where.create(on=new)
        return new_obj.ask(old_obj).result(), old_obj.ask(new_obj).result()

    assert run(main, contexts=2) == ((2, 1), (1, 2))


def test_contexts_can_be_added_more_than_once(run):
    def main():
        a = mf.add_contexts(1)
        b = mf.add_contexts(2)
        return a, b, [c.id for c in mf.contexts()]

    assert run(main, contexts=1) == ([1], [2, 3], [0, 1, 2, 3])


def test_init_that_raises_is_reported_with_its_traceback_and_that_context_is_not_used(run):
    def main():
        with pytest.raises(mf.MacroflowError) as err:
            mf.add_contexts(1, init=failing_init)
        states = [(c.id, c.state) for c in mf.contexts()]
        more = mf.add_contexts(1)  # the computation goes on
        places = {Where.create().here().result() for _ in range(6)}
        return str(err.value), states, more, places

    text, states, more, places = run(main, contexts=2)
    assert "init of new context 2 raised" in text
    assert "ValueError: no room on 2" in text and "Traceback" in text
    assert "launch.py" not in text and "failing_init" in text, text  # init's frames, not ours
    assert states == [(0, "running"), (1, "running"), (2, "failed")]
    assert more == [3]
    assert places == {1, 3}


def fails_on_even(cid):
    if cid % 2 == 0:
        raise ValueError(f"no room on {cid}")


def test_when_several_inits_raise_one_error_names_them_all_and_the_contexts_in_use(run):
    # (the first failure alone was said, without the new contexts in use, and
    # the second failed context was left to placement until its end was seen)
    def main():
        with pytest.raises(mf.MacroflowError) as err:
            mf.add_contexts(3, init=fails_on_even)  # contexts 2, 3 and 4
        places = {Where.create().here().result() for _ in range(8)}
        states = [(c.id, c.state) for c in mf.contexts()]
        return str(err.value), err.value.added, places, states

    text, added, places, states = run(main, contexts=2)
    assert text.startswith("init of new context 2 raised (the context is not used); "
                           "contexts [4] failed too (contexts [3] were added and are used):")
    assert "ValueError: no room on 2" in text
    assert added == [3]
    assert places == {1, 3}
    assert states == [(0, "running"), (1, "running"), (2, "failed"), (3, "running"),
                      (4, "failed")]


@mf.persistent
class Placer:
    def places(self, n):
        return sorted({Where.create().here().result(10) for _ in range(n)})


def test_other_contexts_place_nothing_on_a_context_whose_init_raised(run):
    # (context 0 marked such a context unused only after it had told the
    # others of the new contexts: they could place work there until its end
    # reached them, and that work failed with ContextLost)
    def main():
        placer = Placer.create(on=1)
        placer.places(2).result()
        with pytest.raises(mf.MacroflowError):
            mf.add_contexts(3, init=fails_on_even)  # contexts 2, 3 and 4
        return placer.places(24).result()

    places = run(main, contexts=2)
    assert not {2, 4} & set(places), places
    assert 3 in places, places


@pytest.mark.parametrize("n, init, error, match, timeout", [
    (0, None, ValueError, "n must be a positive int; got 0", 60),
    ("2", None, TypeError, "n must be a positive int; got '2'", 60),
    (True, None, TypeError, "n must be a positive int; got True", 60),
    (1, 42, TypeError, "init must be a function of the context id, or None; got 42", 60),
    (1, None, ValueError, r"timeout must be a positive number of seconds; got -1", -1),
    (1, None, ValueError, r"timeout must be a positive number of seconds; got 0", 0),
    (1, None, TypeError, r"timeout must be a positive number of seconds; got 'x'", "x"),
])
def test_bad_arguments_are_refused(run, n, init, error, match, timeout):  # noqa: D103
    # (a bad timeout is refused before a context is started: one was started
    # and used, and the call then said it had not reported in)
    def main():
        with pytest.raises(error, match=match):
            mf.add_contexts(n, init=init, timeout=timeout)
        return mf.num_contexts()

    assert run(main, contexts=2) == 2


def test_more_contexts_than_the_host_holds_are_refused_before_any_starts(run):
    def main():
        with pytest.raises(mf.LimitError, match=r"mf.add_contexts\(1000000\): this host "
                                                 r"cannot hold 1000000 more") as info:
            mf.add_contexts(1000000)
        return (info.value.limit, mf.num_contexts(), [c.state for c in mf.contexts()],
                str(info.value))

    limit, n, states, text = run(main, contexts=2)
    assert limit == "memory"  # 1,000,000 contexts need more than 24 GB on any transport
    assert re.search(r"; add at most \d+ contexts, or free memory$", text), text
    assert n == 2 and states == ["running", "running"]  # nothing was started


@mf.persistent
class Adder:
    def add(self):
        return mf.add_contexts(1)


def test_only_main_can_add_contexts(run):
    def main():
        with pytest.raises(RuntimeError, match=r"mf.add_contexts\(\) was called inside "
                                               r"method Adder.add on context 1: only the"):
            Adder.create(on=1).add().result()
        return mf.num_contexts()

    assert run(main, contexts=2) == 2


def _adds_on_rank_0():
    if mf.rank() == 0:
        try:
            mf.add_contexts(1)
        except RuntimeError as e:
            return str(e)


def test_an_spmd_function_cannot_add_contexts_and_is_named_for_what_it_is(run):
    # (it was told it "was called inside a method")
    said = run(lambda: mf.spmd(_adds_on_rank_0, n=2), contexts=2)[0]
    assert said.startswith("mf.add_contexts() was called inside SPMD function _adds_on_rank_0 "
                           "on context 0: only the program that started"), said


def test_no_computation_no_contexts():
    with pytest.raises(RuntimeError, match="no computation is running"):
        mf.add_contexts(1)
    with pytest.raises(RuntimeError, match="no computation is running"):
        mf.contexts()


def test_contexts_lists_node_pid_and_protocols(run, transport):
    def main():
        new = mf.add_contexts(1)
        pids = [Where.create(on=c).pid().result() for c in (1, *new)]
        return mf.contexts(), pids

    infos, pids = run(main, contexts=2)
    assert [c.id for c in infos] == [0, 1, 2]
    assert [c.pid for c in infos] == [os.getpid(), *pids]
    assert all(c.node == infos[0].node and c.state == "running" for c in infos)
    assert all(c.protocols[0][0] == transport for c in infos)
    if transport == "local":
        assert len({c.pid for c in infos}) == 3  # three processes


def test_local_adds_contexts_while_main_has_threads():
    # fork() in a multithreaded process copies one thread and every lock the
    # others held; the fork server forks instead, so a held lock is harmless
    held = threading.Lock()
    release = threading.Event()

    def hold():
        with held:
            release.wait(30)

    t = threading.Thread(target=hold)

    def main():
        t.start()
        try:
            (new,) = mf.add_contexts(1)
            return Where.create(on=new).here().result()
        finally:
            release.set()
            t.join()

    assert mf.run(main, contexts=2, transport="local") == 2


@pytest.mark.timeout(60)
def test_local_fork_server_killed_makes_add_contexts_say_so_and_the_rest_goes_on():
    # it raised a bare BrokenPipeError
    from macroflow.launch import _main_session

    def main():
        server = _main_session("test").launcher.server
        os.kill(server.pid, signal.SIGKILL)
        os.waitpid(server.pid, 0)  # (it is this process's child)
        with pytest.raises(RuntimeError, match=r"the fork server that makes this computation's "
                                               r"new contexts \(process \d+\) has ended"):
            mf.add_contexts(1)
        return [c.id for c in mf.contexts()], Where.create(on=1).here().result(timeout=30)

    assert mf.run(main, contexts=2, transport="local") == ([0, 1], 1)


def test_local_new_context_killed_fails_its_futures_and_the_rest_goes_on():
    def main():
        (new,) = mf.add_contexts(1)
        victim = Where.create(on=new)
        os.kill(victim.pid().result(), signal.SIGKILL)
        with pytest.raises(mf.ContextLost) as err:
            victim.here().result()
        survivor = Where.create(on=1).here().result()
        return str(err.value), survivor, [(c.id, c.state) for c in mf.contexts()]

    text, survivor, states = mf.run(main, contexts=2, transport="local")
    assert "context 2" in text and "killed by signal SIGKILL" in text
    assert survivor == 1
    assert states == [(0, "running"), (1, "running"), (2, "lost")]


NOFILE_SCRIPT = """
import os, sys
import macroflow as mf

def main():
    before = len(os.listdir("/proc/self/fd"))
    try:
        mf.add_contexts(60)
    except mf.LimitError as e:
        print("refused:", e.limit)
    print("descriptors kept:", len(os.listdir("/proc/self/fd")) - before)
    print("contexts:", [c.id for c in mf.contexts()], "stats:", sorted(mf.stats()))
    print("added:", mf.add_contexts(1))

mf.run(main, contexts=2, transport=sys.argv[1])
"""


@pytest.mark.parametrize("transport", ["local", "tcp"])
def test_too_few_file_descriptors_are_found_before_any_context_is_added(tmp_path, transport):
    # (with 60 descriptors, adding 60 failed at the 52nd: those made so far
    # stayed half added, their descriptors taken, and every later add failed)
    import resource
    import subprocess
    import sys
    script = tmp_path / "nofile.py"
    script.write_text(NOFILE_SCRIPT)

    def limit():
        resource.setrlimit(resource.RLIMIT_NOFILE, (60, 60))

    out = subprocess.run([sys.executable, str(script), transport], capture_output=True,
                         text=True, timeout=50, preexec_fn=limit)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["refused: RLIMIT_NOFILE", "descriptors kept: 0",
                                       "contexts: [0, 1] stats: [0, 1]", "added: [2]"]


def init_for_an_hour(cid):
    import time
    time.sleep(3600)


@pytest.mark.parametrize("transport", ["local", "tcp"])
def test_a_context_whose_init_outlives_the_timeout_is_stopped_and_never_used(transport):
    # it was shown "running" and given work, which waited behind its init
    # (for ever, if init never returned), and could not be removed
    def main():
        with pytest.raises(mf.TimeoutError, match=r"add_contexts: contexts \[2\] did not report "
                                                  r"in within 0.5 s \(their init had not returned"
                                                  r"\); they were stopped; no work is placed"):
            mf.add_contexts(1, init=init_for_an_hour, timeout=0.5)
        states = [(c.id, c.state) for c in mf.contexts()]
        places = sorted({Where.create().here().result(timeout=20) for _ in range(6)})
        with pytest.raises(mf.ContextLost, match="did not report in within 0.5 s"):
            mf.remove_context(2)
        new = mf.add_contexts(1, init=set_tag)  # the next ones come after it, and work
        return states, places, new, Where.create(on=new[0]).tag().result(timeout=20)

    states, places, new, tag = mf.run(main, contexts=2, transport=transport)
    assert states == [(0, "running"), (1, "running"), (2, "lost")]
    assert places == [1]
    assert new == [3] and tag == "initialised-3"


def exits_on_even(cid):
    if cid % 2 == 0:
        os._exit(3)


@pytest.mark.parametrize("transport", ["local", "tcp"])
def test_when_new_contexts_die_in_init_the_error_says_how_and_names_the_others(transport):
    # (the other failed contexts and those in use were added to ``how``,
    # which is said to be how that context ended)
    def main():
        with pytest.raises(mf.ContextLost) as err:
            mf.add_contexts(3, init=exits_on_even)  # contexts 2, 3 and 4
        e = err.value
        places = {Where.create().here().result(timeout=20) for _ in range(8)}
        return e.context, e.how, e.also, str(e), e.added, places

    context, how, also, text, added, places = mf.run(main, contexts=2, transport=transport)
    assert context == 2
    assert "failed" not in how and "used" not in how, how
    assert also == "; contexts [4] failed too (contexts [3] were added and are used)"
    assert text == f"context 2 was lost: {how}{also}"
    assert added == [3] and places == {1, 3}


def test_an_init_that_cannot_be_pickled_is_refused_before_any_context_starts(run):
    # (a raw TypeError from the pickler, naming neither add_contexts nor init)
    def main():
        lock = threading.Lock()

        def init(cid):
            with lock:
                pass

        with pytest.raises(mf.CallError, match=r"add_contexts: init .*init cannot be sent to the "
                                               r"new contexts: cannot pickle '_thread.lock'"):
            mf.add_contexts(1, init=init)
        return mf.num_contexts()

    assert run(main, contexts=2) == 2


def test_a_context_whose_init_raised_may_end_before_its_report_is_read(run, transport):
    # (on tcp its end could be seen first: the report that came after it
    # announced a context that was gone, and add_contexts raised ValueError
    # from the transport instead of the init's error)
    def main():
        errors = []
        for _ in range(8 if transport == "tcp" else 3):  # (the race was tcp's)
            with pytest.raises(mf.MacroflowError) as err:
                mf.add_contexts(2, init=fails_on_even)
            errors.append(type(err.value).__name__)
        return errors, Placer.create(on=1).places(40).result()

    errors, places = run(main, contexts=2)
    assert set(errors) <= {"MacroflowError", "ContextLost"}, errors
    assert not {2, 4, 6, 8, 10, 12, 14, 16} & set(places), places


def _interrupted_init(cid):
    raise KeyboardInterrupt  # as a Ctrl-C that comes while init runs


def test_a_ctrl_c_during_init_on_inproc_interrupts_the_program(capsys):
    # init runs in the program's own thread there: the Ctrl-C was taken for
    # init's error (MacroflowError), and main went on
    def main():
        mf.add_contexts(1, init=_interrupted_init)
        return "went on"

    with pytest.raises(KeyboardInterrupt):
        mf.run(main, contexts=2, transport="inproc")
    assert "macroflow: interrupted (Ctrl-C)" in capsys.readouterr().err


def _adds_more(cid):
    mf.add_contexts(1, timeout=20)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", ["inproc", "local"])
def test_add_contexts_inside_an_added_contexts_init_is_refused(transport):
    # on inproc, where the init runs in main's own thread, it returned the
    # id of the context being set up, and added nothing
    with mf.init(contexts=2, transport=transport):
        with pytest.raises(mf.MacroflowError) as e:
            mf.add_contexts(1, init=_adds_more, timeout=30)
        assert "is for the program that started the computation (context 0); this is " \
               "context 2" in str(e.value), e.value
        assert mf.num_contexts() == 3 and [c.state for c in mf.contexts()][2] == "failed"
