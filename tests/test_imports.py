"""What `import macroflow` loads: not numpy, which a program that makes no
array need not pay for; numpy loaded later, by anyone, still starts its
threads with the handled signals blocked, and arrays still travel out of
band."""

import os
import subprocess
import sys
import textwrap

import pytest

from conftest import TRANSPORTS

TIMEOUT = 120


def python(code: str, **env: str) -> str:
    """Run ``code`` in a fresh interpreter; its stdout, stripped."""
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                         text=True, timeout=TIMEOUT, env={**os.environ, **env})
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@pytest.mark.timeout(TIMEOUT)
def test_importing_macroflow_does_not_import_numpy():
    out = python("""
        import sys
        import macroflow as mf
        print("numpy" in sys.modules)
        names = {"Collection", "shared_zeros", "MemoryPointer", "get", "put", "register"}
        print(names <= set(mf.__all__), names <= set(dir(mf)), "numpy" in sys.modules)
        print(mf.shared_zeros.__module__, "numpy" in sys.modules)
        from macroflow import *  # (every name of __all__ is there)
        print(callable(register), callable(get))
    """)
    assert out.splitlines() == ["False", "True True False", "macroflow.spmd.memory True",
                                "True True"]


@pytest.mark.timeout(TIMEOUT)
def test_an_unknown_name_of_macroflow_is_an_attribute_error():
    import macroflow as mf
    with pytest.raises(AttributeError, match="module 'macroflow' has no attribute 'gett'"):
        mf.gett


@pytest.mark.timeout(TIMEOUT)
def test_numpy_imported_after_macroflow_starts_threads_that_block_signals():
    # numpy's BLAS starts threads as it loads: one that took a SIGTERM kept
    # the main thread's wait from being interrupted
    code = """
        import os, signal, sys
        if sys.argv[-1] == "macroflow":
            import macroflow
        import numpy
        blocked = []
        for tid in os.listdir("/proc/self/task"):
            if int(tid) != os.getpid():
                with open(f"/proc/self/task/{tid}/status") as f:
                    mask = next(line for line in f if line.startswith("SigBlk:"))
                blocked.append(bool(int(mask.split()[1], 16) & (1 << (signal.SIGTERM - 1))))
        print(blocked)
    """
    def threads(first: str) -> list:
        out = subprocess.run([sys.executable, "-c", textwrap.dedent(code), first],
                             capture_output=True, text=True, timeout=TIMEOUT,
                             env={**os.environ, "OPENBLAS_NUM_THREADS": "2"})
        assert out.returncode == 0, out.stderr
        return eval(out.stdout)
    without = threads("numpy alone")
    if not without:
        pytest.skip("this numpy starts no thread as it loads")
    assert without == [False] * len(without)  # (what the finder changes)
    assert threads("macroflow") == [True] * len(without)


@pytest.mark.timeout(TIMEOUT)
def test_the_threads_a_module_of_a_quiet_package_starts_block_signals(tmp_path):
    # scipy starts its own BLAS's threads as scipy.linalg loads, not as
    # scipy does: every module of the package loads with the signals blocked
    # (a stand-in scipy here, whose scipy.linalg starts a thread)
    linalg = tmp_path / "scipy" / "linalg"
    linalg.mkdir(parents=True)
    (tmp_path / "scipy" / "__init__.py").write_text("")
    (linalg / "__init__.py").write_text(textwrap.dedent("""
        import signal, threading
        blocked = []
        def note():
            blocked.append(signal.SIGTERM in signal.pthread_sigmask(signal.SIG_BLOCK, []))
        t = threading.Thread(target=note)
        t.start()
        t.join()
    """))
    code = """
        import sys
        sys.path.insert(0, {!r})
        if {}:
            import macroflow
        import scipy.linalg
        print(scipy.linalg.blocked, signal_now())
    """
    code = "from signal import SIGTERM, pthread_sigmask, SIG_BLOCK\n" \
           "def signal_now(): return SIGTERM in pthread_sigmask(SIG_BLOCK, [])\n" \
           + textwrap.dedent(code)
    assert python(code.format(str(tmp_path), False)) == "[False] False"  # (what the finder changes)
    # and the main thread's mask is as it was once the module has loaded
    assert python(code.format(str(tmp_path), True)) == "[True] False"


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize("finder", ["with the finder", "without it"])
def test_an_array_made_after_import_travels_out_of_band(finder):
    out = python(f"""
        import sys
        import macroflow
        from macroflow.core import marshal, threads
        if {finder == "without it"}:  # (numpy loaded by a way that does not tell macroflow)
            sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, threads.QuietFinder)]
        import numpy as np
        data, bufs = marshal.dumps({{"a": np.arange(100_000.0)}})
        args, abufs = marshal.dumps_args((np.arange(100_000.0), 1))
        back = marshal.loads_args(args, [bytearray(b.raw()) for b in abufs])
        print(len(bufs), len(data) < 1000, len(abufs), float(back[0].sum()), back[1])
    """)
    # (numpy's own reduction would have carried it too, in a pickle with a
    # copy of the array, a little slower)
    assert out == "1 True 1 4999950000.0 1"


@pytest.mark.timeout(TIMEOUT)
@pytest.mark.parametrize("transport", [t for t in TRANSPORTS if t != "inproc"])
def test_contexts_load_numpy_only_when_an_array_reaches_them(tmp_path, transport):
    script = tmp_path / "late_numpy.py"
    script.write_text(textwrap.dedent("""
        import sys
        import macroflow as mf

        @mf.persistent
        class Probe:
            def loaded(self):
                return "numpy" in sys.modules
            def total(self, a):
                return "numpy" in sys.modules, float(a.sum()), a.dtype.str, a.shape

        def main():
            p = Probe.create(on=1)
            before = (p.loaded().result(), "numpy" in sys.modules)
            import numpy as np  # (main's process only)
            small = p.total(np.ones((2, 3), dtype=np.int32)).result()
            big = p.total(np.ones(200_000)).result()
            return before, small, big

        print(mf.run(main, contexts=2, transport=sys.argv[1]))
    """))
    out = subprocess.run([sys.executable, str(script), transport], capture_output=True,
                         text=True, timeout=TIMEOUT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ("((False, False), (True, 6.0, '<i4', (2, 3)), "
                                  "(True, 200000.0, '<f8', (200000,)))")
