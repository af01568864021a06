"""Workers that join over TCP (mf.init(listen=...), `macroflow worker`), several
protocols in one program, and separate hosts made of network namespaces."""

import functools
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import macroflow as mf

import netns

pytestmark = pytest.mark.timeout(120)

SECRET = "a secret of sixteen bytes or more"
HERE = os.path.dirname(os.path.abspath(__file__))


def start_worker(address, n=1, secret=SECRET, extra=()):
    """`macroflow worker` in a new process, finding this module's classes."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([HERE, *sys.path]),
           "MACROFLOW_SECRET": secret}
    return subprocess.Popen([sys.executable, "-m", "macroflow", "worker", "--connect", address,
                             "-n", str(n), *extra], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def serve_until_done(worker, timeout=60):
    """Let context 0 serve (the worker's handshake needs it) until the worker ends."""
    import time
    deadline = time.monotonic() + timeout
    while worker.poll() is None and time.monotonic() < deadline:
        try:
            mf.wait_contexts(10 ** 6, timeout=0.05)
        except mf.TimeoutError:
            pass
    return finish(worker)


def finish(worker, timeout=30):
    try:
        out, err = worker.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        worker.kill()
        out, err = worker.communicate()
    return worker.returncode, err


@mf.persistent
class Where:
    def here(self):
        return mf.context_id(), os.getpid()

    def ask(self, other):
        return other.here().result()[0]


def protocol_counts(stats, ctx, proto):
    return stats[ctx]["protocols"][proto]["messages_sent"]


def test_a_worker_joins_and_its_contexts_are_full_contexts():
    with mf.init(contexts=2, listen="127.0.0.1:0", secret=SECRET) as s:
        w = start_worker(s.launcher.address, n=2)
        assert mf.wait_contexts(4, timeout=60) == 4
        # both have reported in (they do in any order): each is described whole
        first = [(c.pid is not None, {p for p, _ in c.protocols}) for c in mf.contexts()[2:]]
        here = {c: Where.create(on=c).here().result() for c in (1, 2, 3)}
        before = mf.stats()  # context 1 has talked to context 0 only
        new2, new3, old1 = Where.create(on=2), Where.create(on=3), Where.create(on=1)
        asked = (new2.ask(old1).result(), old1.ask(new3).result(), new2.ask(new3).result())
        infos = mf.contexts()
        stats = mf.stats()
    code, err = finish(w)
    assert code == 0, err
    assert "joined computation" in err and "as contexts 2, 3" in err
    assert sorted(here) == [1, 2, 3] and all(here[c][0] == c for c in here)
    assert asked == (1, 3, 3)
    assert [(c.id, c.state) for c in infos] == [(c, "running") for c in range(4)]
    assert [c.pid for c in infos[2:]] == [here[2][1], here[3][1]]
    assert first == [(True, {"local", "tcp"})] * 2
    assert all({p for p, _ in c.protocols} == {"local", "tcp"} for c in infos)
    # contexts started together never used TCP; the worker's contexts reach the
    # others over TCP, and each other by their own local path
    assert protocol_counts(before, 1, "tcp") == 0 and protocol_counts(before, 1, "local") > 0
    assert protocol_counts(before, 2, "tcp") > 0 and protocol_counts(before, 3, "tcp") > 0
    assert protocol_counts(before, 2, "local") == 0
    assert protocol_counts(stats, 1, "tcp") > 0  # it called a worker's context since
    assert protocol_counts(stats, 2, "local") > 0  # new2 asked new3, on its own host


def test_placement_uses_joined_contexts_and_a_second_worker_joins_later():
    with mf.init(contexts=2, listen="127.0.0.1:0", secret=SECRET) as s:
        w1 = start_worker(s.launcher.address)
        mf.wait_contexts(3, timeout=60)
        first = sorted({Where.create().here().result()[0] for _ in range(6)})
        w2 = start_worker(s.launcher.address)
        mf.wait_contexts(4, timeout=60)
        second = sorted({Where.create().here().result()[0] for _ in range(9)})
    assert first == [1, 2] and second == [1, 2, 3]
    assert finish(w1)[0] == 0 and finish(w2)[0] == 0


def test_a_worker_that_dies_fails_exactly_what_depended_on_it():
    with mf.init(contexts=2, listen="127.0.0.1:0", secret=SECRET) as s:
        w = start_worker(s.launcher.address)
        mf.wait_contexts(3, timeout=60)
        victim, survivor = Where.create(on=2), Where.create(on=1)
        pid = victim.here().result()[1]
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(mf.ContextLost) as err:
            victim.here().result(timeout=30)
        assert err.value.context == 2
        # a worker's context of this host: its process and how it ended are
        # named (it said "connection closed", as for one of another host;
        # then "has ended" when its worker had reaped it already)
        assert f"its process (pid {pid}) was killed by signal SIGKILL" in str(err.value), \
            str(err.value)
        assert survivor.here().result()[0] == 1  # the computation goes on
        assert {Where.create().here().result()[0] for _ in range(4)} == {1}
        assert [c.state for c in mf.contexts()] == ["running", "running", "lost"]
    code, err_text = finish(w)
    assert code == 1 and "context 2 was killed by signal SIGKILL" in err_text


@mf.persistent
class Busy:
    def pid(self):
        return os.getpid()

    def compute(self, seconds):
        import time
        end = time.monotonic() + seconds  # no call into macroflow: it cannot leave when told
        while time.monotonic() < end:
            pass
        return "done"


@pytest.mark.parametrize("ending", ["main returns", "Ctrl-C"])
def test_a_workers_context_that_computes_when_the_computation_ends_ends_with_it(ending, capsys):
    import time
    pids = []

    def main():
        from macroflow.launch import _main_session
        w = start_worker(_main_session("test").launcher.address, n=2)
        pids.append(w)
        mf.wait_contexts(4, timeout=60)
        busy = Busy.create(on=3)
        pids.extend([busy.pid().result(30), Busy.create(on=2).pid().result(30)])
        busy.compute(60)  # still computing when main ends
        if ending == "Ctrl-C":
            raise KeyboardInterrupt
        return "main ended"

    t = time.monotonic()
    try:
        result = mf.run(main, contexts=2, listen="127.0.0.1:0", secret=SECRET)
    except KeyboardInterrupt:
        result = "interrupted"
    worker, busy_pid, idle_pid = pids
    code, err = finish(worker)
    took = time.monotonic() - t
    # as context 0 ends the contexts it forked (after a grace of 2 s), it ends
    # the workers' (which leave by themselves when told, unless they compute)
    assert code == 0, err
    assert "was lost" not in err
    assert took < 30  # not the 60 s the method would compute
    for pid in (busy_pid, idle_pid):
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    if ending == "Ctrl-C":
        assert result == "interrupted"
        assert "interrupted (Ctrl-C); all 4 contexts were stopped" in capsys.readouterr().err
    else:
        assert result == "main ended"


def test_a_worker_with_tls_at_a_computation_without_it_is_said_to_use_tls(caplog):
    # (the computation said it sent garbage, and the worker that TLS failed)
    from transport_harness import certificate
    cert, key = certificate()
    with mf.init(contexts=2, listen="127.0.0.1:0", secret=SECRET) as s:
        w = start_worker(s.launcher.address, extra=("--tls-cert", cert, "--tls-key", key))
        code, err = serve_until_done(w)
        assert code == 1 and "could not join" in err and "TLS handshake failed" in err, err
        assert mf.num_contexts() == 2
    assert "(a TLS handshake: it uses TLS and this context does not)" in caplog.text, caplog.text


def test_a_worker_with_the_wrong_secret_is_refused_and_the_computation_is_unharmed(caplog):
    with mf.init(contexts=2, listen="127.0.0.1:0", secret=SECRET) as s:
        w = start_worker(s.launcher.address, secret="another secret of sixteen bytes")
        code, err = serve_until_done(w)
        assert code == 1
        assert "could not join" in err and "secret" in err
        assert err.count("does not know this context's secret") == 1, err  # said once
        assert "TLS" not in err, err  # (the reason is known: no guess besides it)
        assert mf.num_contexts() == 2
        assert Where.create(on=1).here().result()[0] == 1


def _join_with(code):
    """(exit code, stderr) of a worker run as ``python -c code ADDRESS``,
    joining a computation of 2 contexts, which must be left as it was."""
    with mf.init(contexts=2, listen="127.0.0.1:0", secret=SECRET) as s:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([HERE, *sys.path]),
               "MACROFLOW_SECRET": SECRET}
        w = subprocess.Popen([sys.executable, "-c", code, s.launcher.address], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        rc, err = serve_until_done(w)
        assert mf.num_contexts() == 2
    return rc, err


def test_a_worker_with_another_python_or_cloudpickle_is_refused_saying_which():
    # classes of __main__ travel by value (pickled code): another Python or
    # cloudpickle may not read them, and would fail calls one by one
    rc, err = _join_with(("import sys, macroflow.join as j; "
                          "j.runtime_versions = lambda: {'python': '3.10', 'cloudpickle': '2.1'}; "
                          "sys.exit(j.worker_main(sys.argv[1], 1))"))
    from macroflow.join import runtime_versions
    ours = runtime_versions()
    assert rc == 1
    assert (f"refused to let us join: the worker runs Python 3.10 with cloudpickle 2.1, and "
            f"this computation Python {ours['python']} with cloudpickle {ours['cloudpickle']}"
            in err), err
    assert "run the worker with the same versions" in err


def test_a_worker_of_another_macroflow_version_is_refused_once_by_what_it_is():
    # (the worker said it twice, once through its log; named itself by its
    # guest id, "context 2225219069"; and guessed at TLS)
    rc, err = _join_with(("import sys, macroflow.transport.tcp as t; t._version = lambda: (9, 9); "
                          "import macroflow.join as j; sys.exit(j.worker_main(sys.argv[1], 1))"))
    assert rc == 1
    assert err.count("same major.minor version") == 1, err
    assert "and a joining worker runs 9.9" in err, err
    assert "TLS" not in err, err


@pytest.mark.timeout(120)
def test_the_counts_per_protocol_add_up_to_the_totals_once_a_worker_joined():
    # (the transports' own frames, a join's welcome and the descriptors it
    # sends, were counted per protocol and not in the totals: context 0 had
    # sent 1,686 bytes, and 6,084 by its protocols)
    with mf.init(contexts=2, listen="127.0.0.1:0", secret=SECRET) as s:
        w = start_worker(s.launcher.address)
        mf.wait_contexts(3, timeout=60)
        for c in (1, 2):
            assert Where.create(on=c).here().result(30)[0] == c
        st = mf.stats()
    finish(w)
    for c in (0, 1, 2):
        for key in ("bytes_received", "bytes_sent", "messages_received", "messages_sent"):
            assert sum(p[key] for p in st[c]["protocols"].values()) == st[c][key], (c, key, st[c])
    assert st[0]["protocols"]["tcp"]["messages_sent"] > 0 < st[0]["protocols"]["local"]["messages_sent"]


def test_garbage_at_the_door_is_closed_and_the_computation_is_unharmed():
    import socket
    with mf.init(contexts=2, listen="127.0.0.1:0", secret=SECRET) as s:
        host, port = s.launcher.address.rsplit(":", 1)
        junk = socket.create_connection((host, int(port)), timeout=10)
        junk.sendall(b"\x80\x04GET / HTTP/1.0\r\n\r\n" * 10)
        assert Where.create(on=1).here().result()[0] == 1
        w = start_worker(s.launcher.address)
        assert mf.wait_contexts(3, timeout=60) == 3
        junk.close()
    assert finish(w)[0] == 0


@pytest.mark.parametrize("kwargs, match", [
    (dict(listen="nowhere"), 'listen must be "HOST:PORT"'),
    (dict(listen=":0", secret="short"), "at least 16"),
    (dict(secret=SECRET), "give listen= too"),
    (dict(listen=":0", transport="inproc"), "listen= works with the local transport"),
    (dict(listen=":0", secret=SECRET, tls=("only-a-cert",)), "tls must be"),
])
def test_bad_listen_arguments_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        mf.init(contexts=2, **kwargs)


def test_a_secret_made_for_you_is_printed_with_the_command_to_join(tmp_path):
    script = tmp_path / "listen.py"
    script.write_text(textwrap.dedent("""
        import macroflow as mf
        with mf.init(contexts=1, listen="127.0.0.1:0"):
            pass
    """))
    env = {k: v for k, v in os.environ.items() if not k.startswith("MACROFLOW_SECRET")}
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                       timeout=60, env=env)
    assert r.returncode == 0, r.stderr
    assert "join with: MACROFLOW_SECRET=" in r.stderr and "macroflow worker --connect 127.0.0.1:" in r.stderr


def test_the_worker_command_refuses_to_start_without_a_secret():
    env = {k: v for k, v in os.environ.items() if not k.startswith("MACROFLOW_SECRET")}
    r = subprocess.run([sys.executable, "-m", "macroflow", "worker", "--connect", "127.0.0.1:1"],
                       capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 2 and "no secret" in r.stderr


@pytest.mark.parametrize("extra,said", [
    (("--bind", "192.0.2.1"), "--bind 192.0.2.1: this host cannot listen there"),
    (("--tls-cert", "no-such.pem", "--tls-key", "no-such.key"),
     "TLS certificate file 'no-such.pem' not found"),
])
def test_the_worker_command_names_a_bad_option_as_a_usage_error(extra, said):
    # a --bind address of another host printed a traceback; a missing TLS file
    # an error that named no file
    env = {**os.environ, "MACROFLOW_SECRET": SECRET}
    r = subprocess.run([sys.executable, "-m", "macroflow", "worker", "--connect", "127.0.0.1:1",
                        *extra], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 2 and f"macroflow worker: error: {said}" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_a_worker_that_cannot_reach_the_computation_says_so():
    r = subprocess.run([sys.executable, "-m", "macroflow", "worker", "--connect", "127.0.0.1:1"],
                       capture_output=True, text=True, timeout=60,
                       env={**os.environ, "MACROFLOW_SECRET": SECRET})
    assert r.returncode == 1 and "cannot reach 127.0.0.1:1" in r.stderr


# -- strangers at the door ------------------------------------------------------
def short_handshakes(monkeypatch, seconds):
    """Contexts started from here on (forked, so they inherit it) close a
    connection that stalls in its handshake after ``seconds``, not 10."""
    from macroflow.transport import tcp
    original = tcp.TcpTransport.__init__

    def short(self, *args, **kw):
        kw["handshake_timeout"] = seconds
        original(self, *args, **kw)

    monkeypatch.setattr(tcp.TcpTransport, "__init__", short)


def closed_within(socks, seconds):
    """How long after now each of ``socks`` was closed by the other end (what
    it sent first is read), None for those still open after ``seconds``."""
    import select
    start = time.monotonic()
    when = [None] * len(socks)
    while None in when and time.monotonic() - start < seconds:
        open_ = [s for s, w in zip(socks, when) if w is None]
        for s in select.select(open_, [], [], 0.5)[0]:
            try:
                data = s.recv(4096)
            except OSError:
                data = b""
            if not data:
                when[socks.index(s)] = time.monotonic() - start
    return when


def watch_then_end_the_call(watched, fifo, socks):
    """``closed_within(socks, 20)`` into ``watched["when"]``; then the long
    call (a Blocks.until_told(fifo)) ends, whatever happened."""
    try:
        watched["when"] = closed_within(socks, 20)
    finally:
        with open(fifo, "w") as f:
            f.write("over")


def stranger_watch(monkeypatch, tmp_path):
    """Handshakes that stall after 1 s; a fifo a Blocks.until_told call
    waits on; and the watch (call it with the strangers' sockets) that
    fills ``watched["when"]`` and then ends that call."""
    short_handshakes(monkeypatch, 1.0)
    fifo = str(tmp_path / "fifo")
    os.mkfifo(fifo)
    watched = {}
    return fifo, watched, functools.partial(watch_then_end_the_call, watched, fifo)


@mf.persistent
class Blocks:
    def until_told(self, fifo):
        with open(fifo) as f:  # until the test opens it to write, and closes it
            return f.read()


@pytest.mark.timeout(90)
def test_a_silent_stranger_is_closed_after_the_handshake_timeout_while_main_waits(
        monkeypatch, tmp_path):
    # A connection that sends nothing wakes no descriptor: while main waited in
    # result() (and while context 1 waited for calls), the stranger was closed
    # only when something else woke the context, here never.
    import socket
    import threading
    fifo, watched, watch = stranger_watch(monkeypatch, tmp_path)
    with mf.init(contexts=3, listen="127.0.0.1:0", secret=SECRET) as s:
        long_call = Blocks.create(on=2).until_told(fifo)
        doors = [s.launcher.address, dict(mf.contexts()[1].protocols)["tcp"]]
        strangers = [socket.create_connection(tuple(a.rsplit(":", 1)), timeout=10) for a in doors]
        watcher = threading.Thread(target=watch, args=(strangers,))
        watcher.start()
        try:
            assert long_call.result(timeout=60) == "over"
        finally:
            watcher.join()
            for sock in strangers:
                sock.close()
        assert Where.create(on=1).here().result()[0] == 1  # nothing else disturbed
    when = watched["when"]
    assert None not in when, when  # context 0's door, then context 1's own port
    assert all(0.5 < w < 5.0 for w in when), when


@pytest.mark.timeout(90)
def test_a_silent_stranger_is_closed_after_the_handshake_timeout_while_main_awaits(
        monkeypatch, tmp_path):
    # asyncio: the loop watched the transport's descriptor, which a silent
    # stranger never makes readable, and came back only when the call ended
    import asyncio
    import socket
    import threading
    fifo, watched, watch = stranger_watch(monkeypatch, tmp_path)
    with mf.init(contexts=2, listen="127.0.0.1:0", secret=SECRET) as s:
        blocks = Blocks.create(on=1)
        stranger = socket.create_connection(tuple(s.launcher.address.rsplit(":", 1)), timeout=10)
        watcher = threading.Thread(target=watch, args=([stranger],))
        watcher.start()

        async def long_call():
            return await blocks.until_told(fifo)

        try:
            assert asyncio.run(long_call()) == "over"
        finally:
            watcher.join()
            stranger.close()
    when = watched["when"]
    assert when[0] is not None and 0.5 < when[0] < 5.0, when


@pytest.mark.timeout(120)
def test_a_worker_joins_while_as_many_strangers_as_are_admitted_at_once_stay_silent(
        monkeypatch):
    # With the door's every place taken by strangers that send nothing, the
    # worker waited in the backlog for ever: they were closed only when
    # something else woke context 0, and mf.wait_contexts woke it for nothing.
    import inspect
    import socket
    from macroflow.transport.tcp import TcpTransport
    places = inspect.signature(TcpTransport).parameters["max_handshakes"].default
    short_handshakes(monkeypatch, 2.0)
    with mf.init(contexts=2, listen="127.0.0.1:0", secret=SECRET) as s:
        host, port = s.launcher.address.rsplit(":", 1)
        strangers = [socket.create_connection((host, int(port)), timeout=10)
                     for _ in range(places)]
        w = start_worker(s.launcher.address)
        try:
            start = time.monotonic()
            assert mf.wait_contexts(3, timeout=20) == 3
            took = time.monotonic() - start
            assert Where.create(on=2).here().result()[0] == 2
            when = closed_within(strangers, 10)
        finally:
            for sock in strangers:
                sock.close()
    assert finish(w)[0] == 0
    assert None not in when  # each was closed (after its challenge)
    assert took < 15  # one handshake timeout, and the worker's start


# -- separate hosts ---------------------------------------------------------------
MAIN = """
import json, os, sys
sys.path.insert(0, {here!r})
import macroflow as mf
from test_join import Where

with mf.init(contexts=2, listen="198.18.0.1:0", secret={secret!r}) as s:
    print(s.launcher.address, flush=True)
    mf.wait_contexts(2 + {joining}, timeout=60)
    objs = {{c: Where.create(on=c) for c in range(1, mf.num_contexts())}}
    here = {{c: o.here().result()[0] for c, o in objs.items()}}
    cross = objs[2].ask(objs[mf.num_contexts() - 1]).result()
    infos = [(c.id, [a for p, a in c.protocols if p == "tcp"][0]) for c in mf.contexts()]
    every = mf.stats()
    stats = {{c: st["protocols"]["tcp"]["messages_sent"] for c, st in every.items()}}
    local = {{c: st["protocols"].get("local", {{}}).get("messages_sent", 0) for c, st in every.items()}}
print(json.dumps(dict(here=here, cross=cross, infos=infos, tcp=stats, local=local)), flush=True)
"""


@pytest.mark.skipif(netns.unavailable() is not None, reason=str(netns.unavailable()))
def test_workers_on_separate_hosts_join_and_talk_to_each_other(tmp_path):
    script = tmp_path / "main.py"
    script.write_text(MAIN.format(here=HERE, secret=SECRET, joining=2))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([HERE, *sys.path]),
           "MACROFLOW_SECRET": SECRET}
    with netns.hosts(3) as (hub, a, b):
        main = hub.python(str(script), env=env)
        address = main.stdout.readline().strip()
        assert address.startswith("198.18.0.1:"), main.stderr.read()
        workers = [h.popen([sys.executable, "-m", "macroflow", "worker", "--connect", address],
                           env=env) for h in (a, b)]
        out, err = main.communicate(timeout=90)
        assert main.returncode == 0, err
        for w in workers:
            assert w.wait(timeout=30) == 0, w.stderr.read()
    got = json.loads(out.strip().splitlines()[-1])
    assert got["here"] == {"1": 1, "2": 2, "3": 3}
    assert got["cross"] == 3  # a worker of one host called one of the other
    hosts = {cid: addr.split(":")[0] for cid, addr in got["infos"]}
    assert hosts[0] == hosts[1] == "198.18.0.1"
    assert {hosts[2], hosts[3]} == {"198.18.1.2", "198.18.2.2"}
    assert got["tcp"]["1"] == 0 and got["tcp"]["2"] > 0 and got["tcp"]["3"] > 0
    # contexts of different hosts never take the local path, not even to each other
    assert got["local"]["2"] == 0 and got["local"]["3"] == 0 and got["local"]["1"] > 0


def test_workers_join_over_tls_with_the_shared_certificate(caplog):
    import logging
    from transport_harness import certificate
    cert, key = certificate()
    with mf.init(contexts=2, listen="127.0.0.1:0", secret=SECRET, tls=(cert, key)) as s:
        w = start_worker(s.launcher.address, extra=("--tls-cert", cert, "--tls-key", key))
        assert mf.wait_contexts(3, timeout=60) == 3
        assert Where.create(on=2).here().result()[0] == 2
    assert finish(w)[0] == 0
    # the worker's probe of the route (connected, then closed) is no failure:
    # each join warned "the TLS handshake failed: ... UNEXPECTED_EOF"
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


def test_a_worker_without_tls_cannot_join_a_computation_that_speaks_it():
    from transport_harness import certificate
    cert, key = certificate()
    with mf.init(contexts=2, listen="127.0.0.1:0", secret=SECRET, tls=(cert, key)) as s:
        w = start_worker(s.launcher.address)
        code, err = serve_until_done(w)
        assert code == 1 and "could not join" in err
        assert "(if the computation uses TLS, give --tls-cert and --tls-key)" in err, err
        assert mf.num_contexts() == 2
        assert Where.create(on=1).here().result()[0] == 1


def test_a_joined_worker_is_removed_and_ends():
    with mf.init(contexts=2, listen="127.0.0.1:0", secret=SECRET) as s:
        w = start_worker(s.launcher.address, n=1)
        assert mf.wait_contexts(3, timeout=60) == 3
        obj = Where.create(on=2)
        held = obj.here()
        mf.wait([held])
        mf.remove_context(2)
        got = held.result()[0]  # handed over to context 0
        states = [c.state for c in mf.contexts()]
        code, err = serve_until_done(w)  # its only context left: the worker ends
        with pytest.raises(mf.ObjectDestroyed):
            obj.here().result()
    assert got == 2 and states == ["running", "running", "removed"]
    assert code == 0, err


LISTENER = """
import os, sys, time
import macroflow as mf
with mf.init(contexts=1, listen="127.0.0.1:0") as s:
    print(s.launcher.address, flush=True)
    mf.wait_contexts(2, timeout=60)
    print("joined", flush=True)
    time.sleep(120)  # killed before this ends
"""


def test_a_worker_whose_computation_dies_says_so_and_exits_non_zero():
    env = {**os.environ, "MACROFLOW_SECRET": SECRET}
    main = subprocess.Popen([sys.executable, "-c", LISTENER], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        address = main.stdout.readline().strip()
        worker = start_worker(address)
        assert main.stdout.readline().strip() == "joined"
        main.kill()  # context 0's process, outright
        main.wait(30)
        code, err = finish(worker, timeout=60)
    finally:
        if main.poll() is None:
            main.kill()
        main.communicate()
    assert code == 1, err
    assert "context 1: the computation's context 0 was lost" in err


@mf.persistent
class Computes:
    def until_killed(self, path):
        open(path, "w").close()  # it has started
        deadline = time.monotonic() + 100
        while time.monotonic() < deadline:  # pure Python, for longer than the test
            sum(range(1000))


BUSY_LISTENER = """
import os, sys, time
import macroflow as mf
from test_join import Computes
with mf.init(contexts=1, listen="127.0.0.1:0") as s:
    print(s.launcher.address, flush=True)
    mf.wait_contexts(2, timeout=60)
    f = Computes.create(on=1).until_killed(sys.argv[1])
    while not os.path.exists(sys.argv[1]):
        mf.poll()
    print("computing", flush=True)
    f.result()
"""


def test_a_worker_computing_when_its_computation_dies_leaves_at_once(tmp_path):
    # before, it left only when its method ended
    env = {**os.environ, "MACROFLOW_SECRET": SECRET,
           "PYTHONPATH": os.pathsep.join([HERE, *sys.path])}
    started = str(tmp_path / "started")
    main = subprocess.Popen([sys.executable, "-c", BUSY_LISTENER, started], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        address = main.stdout.readline().strip()
        worker = start_worker(address)
        assert main.stdout.readline().strip() == "computing"
        main.kill()
        main.wait(30)
        t0 = time.monotonic()
        code, err = finish(worker, timeout=60)
        took = time.monotonic() - t0
    finally:
        if main.poll() is None:
            main.kill()
        main.communicate()
    assert code == 1, err
    assert "context 1: the computation's context 0 was lost (connection closed (tcp)) " \
           "while a method computed here; leaving" in err
    assert took < 30  # the method would have computed for 100 s


@pytest.mark.timeout(60)
def test_waiting_for_contexts_a_computation_that_does_not_listen_cannot_get_is_refused(run):
    # it waited for ever on local (DeadlockError on inproc, blaming a guard or a cycle)
    def main():
        with pytest.raises(ValueError, match=r"wait_contexts\(3\): the computation has 2 "
                                             r"contexts and does not listen"):
            mf.wait_contexts(3)
        return mf.wait_contexts(2)

    assert run(main, contexts=2) == 2


@pytest.mark.timeout(120)
def test_a_secret_given_as_bytes_is_the_same_secret_as_that_text():
    # it was made str(b'...'), so a worker with the same secret was refused
    with mf.init(contexts=2, listen="127.0.0.1:0", secret=SECRET.encode()) as s:
        w = start_worker(s.launcher.address)
        assert mf.wait_contexts(3, timeout=60) == 3
        assert Where.create(on=2).here().result(30)[0] == 2
    assert finish(w)[0] == 0


@pytest.mark.timeout(120)
def test_a_secret_with_surrounding_white_space_is_the_secret_the_workers_read():
    # (a worker drops it from MACROFLOW_SECRET or its file; secret= kept it,
    # and that worker was refused)
    with mf.init(contexts=2, listen="127.0.0.1:0", secret=f"  {SECRET}\n") as s:
        w = start_worker(s.launcher.address)
        assert mf.wait_contexts(3, timeout=60) == 3
    assert finish(w)[0] == 0


@pytest.mark.parametrize("secret, error, match", [
    (12345678901234567890, TypeError, r"secret= must be a str \(or UTF-8 bytes\); got int"),
    (b"\xff" * 20, ValueError, r"secret= as bytes must be UTF-8 text"),
    (b"short", ValueError, r"secret= holds a secret of 5 characters"),
])
def test_a_secret_that_is_no_text_is_refused(secret, error, match):
    with pytest.raises(error, match=match):
        mf.init(contexts=2, listen="127.0.0.1:0", secret=secret)


@pytest.mark.timeout(60)
def test_the_worker_command_checks_the_hosts_limits_before_it_starts():
    # (it opened sockets until the descriptors ran out, then printed a traceback)
    import resource

    def few_descriptors():
        resource.setrlimit(resource.RLIMIT_NOFILE, (60, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))

    r = subprocess.run([sys.executable, "-m", "macroflow", "worker", "--connect", "127.0.0.1:1",
                        "-n", "100"], env={**os.environ, "MACROFLOW_SECRET": SECRET},
                       preexec_fn=few_descriptors, capture_output=True, text=True, timeout=50)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "macroflow worker: error: -n 100:" in r.stderr and "RLIMIT_NOFILE" in r.stderr, r.stderr


def test_a_certificate_and_key_given_the_wrong_way_round_are_named():
    # ("[SSL] PEM lib (_ssl.c:3905)" named neither file)
    from transport_harness import certificate
    cert, key = certificate()
    with pytest.raises(ValueError, match=r"cannot use .* as a TLS certificate with .* as its key"):
        mf.init(contexts=2, listen="127.0.0.1:0", secret=SECRET, tls=(key, cert))
    with pytest.raises(ValueError, match=r"TLS needs a certificate and its key .*tls=\(cert, key\)"):
        mf.init(contexts=2, listen="127.0.0.1:0", secret=SECRET, tls=(cert, None))


def test_wait_contexts_does_not_count_a_context_that_died_before_it_was_called():
    import psutil
    w = None
    try:
        with mf.init(contexts=2, listen="127.0.0.1:0", secret=SECRET) as s:
            w = start_worker(s.launcher.address, n=2)
            mf.wait_contexts(4, timeout=60)
            pid = mf.contexts()[3].pid
            proc = psutil.Process(pid)
            os.kill(pid, signal.SIGKILL)
            try:
                proc.wait(30)  # gone: its connection is closed
            except psutil.NoSuchProcess:
                pass  # (gone, and reaped by its worker, as it was looked at)
            with pytest.raises(mf.TimeoutError, match="3 contexts after 0.2 s, not 4"):
                mf.wait_contexts(4, timeout=0.2)
            states = [c.state for c in mf.contexts()]
    finally:
        if w is not None:
            finish(w)  # (its worker ends with the computation)
    assert states == ["running"] * 3 + ["lost"]


def test_a_ctrl_c_to_a_program_and_its_worker_stops_the_worker_without_a_traceback(tmp_path):
    # one Ctrl-C in a terminal reaches the program and the worker it started
    # (one process group): the worker stops its contexts and says so (it
    # printed a KeyboardInterrupt traceback from its own cleanup, exit -2)
    script = tmp_path / "prog.py"
    script.write_text(textwrap.dedent(f"""
        import os, subprocess, sys, time
        import macroflow as mf

        @mf.persistent
        class P:
            def slow(self, s):
                time.sleep(s)
                return s

        try:
            with mf.init(contexts=2, listen="127.0.0.1:0", secret={SECRET!r}) as session:
                w = subprocess.Popen([sys.executable, "-m", "macroflow", "worker", "--connect",
                                      session.launcher.address, "-n", "2"],
                                     env={{**os.environ, "MACROFLOW_SECRET": {SECRET!r}}})
                mf.wait_contexts(4, timeout=60)
                print("ready", flush=True)
                P.create(on=3).slow(60).result()
        except KeyboardInterrupt:
            print("worker exit code", w.wait(timeout=30), flush=True)
    """))
    # (under timeout(1), as a harness runs it: it passes the Ctrl-C on to
    # the program, which so gets two)
    proc = subprocess.Popen(["timeout", "120", sys.executable, str(script)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(0.3)  # (the call reaches context 3; the outcome is the same either way)
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert "worker exit code 130" in out, (out, err)
    assert "macroflow worker: interrupted; its contexts were stopped" in out + err
    assert "Traceback" not in err, err


def test_a_worker_with_more_contexts_than_the_host_holds_names_its_own_count():
    # (it said "100000001 contexts do not fit": its count and context 0's)
    r = subprocess.run([sys.executable, "-m", "macroflow", "worker", "--connect", "127.0.0.1:1",
                        "-n", "100000000"], env={**os.environ, "MACROFLOW_SECRET": SECRET},
                       capture_output=True, text=True, timeout=50)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "macroflow worker: error: -n 100000000: 100000000 more contexts do not fit in this " \
           "host's memory" in r.stderr, r.stderr
