"""The examples, the README's example and every Python snippet of docs/guide.md, run
as the user would run them: each in a fresh interpreter, with small sizes.

Each run carries a unique token in its environment, which every context it forks
inherits; after it ends, no process with that token may be left.
"""

import math
import os
import re
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import psutil
import pytest

from conftest import MPI_MISSING

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


def leftovers(token):
    left = []
    for p in psutil.process_iter(["pid"]):
        try:
            if p.environ().get("MF_EXAMPLE_TOKEN") == token and p.status() != psutil.STATUS_ZOMBIE:
                left.append(p)
        except (psutil.Error, OSError):
            continue
    return left


def run(cmd, timeout=100):
    """Run ``cmd`` from the repository root; return its stdout, or fail with its output."""
    token = uuid.uuid4().hex
    env = dict(os.environ, MF_EXAMPLE_TOKEN=token, PYTHONUNBUFFERED="1")
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    finally:
        left = leftovers(token)
        for p in left:
            p.kill()
    assert proc.returncode == 0, f"{cmd} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    assert not left, f"{cmd} left processes behind: {left}"
    return proc.stdout


def macroflow_command():
    script = Path(sys.executable).parent / "macroflow"
    if script.exists():
        return [str(script)]
    found = shutil.which("macroflow")
    return [found] if found else [sys.executable, "-m", "macroflow"]


def check_fanout(out, contexts):
    pi = float(re.search(r"pi ~= ([0-9.]+)", out).group(1))
    assert abs(pi - math.pi) < 0.02, out
    assert "match serial: yes" in out, out
    assert re.search(r"speedup [0-9.]+x", out), out
    rows = re.findall(r"^\s+(\d+)\s+(\d+)\s", out, re.M)
    assert [int(c) for c, _ in rows] == list(range(contexts)), out
    assert sum(int(n) for _, n in rows) >= 1, out


@pytest.mark.timeout(120)
def test_fanout():
    out = run([sys.executable, "examples/fanout.py", "--contexts", "3",
               "--tasks-per-worker", "3", "--samples", "200000"])
    check_fanout(out, 3)


@pytest.mark.timeout(120)
def test_fanout_under_macroflow_run():
    out = run(macroflow_command() + ["run", "-n", "2", "examples/fanout.py",
                                     "--tasks-per-worker", "2", "--samples", "100000", "--arity", "2"])
    assert "k=2 contexts, 4 tasks" in out, out
    check_fanout(out, 2)


@pytest.mark.timeout(120)
@pytest.mark.skipif(MPI_MISSING is not None, reason=str(MPI_MISSING))
@pytest.mark.parametrize("example, options", [
    ("fanout.py", ["--tasks-per-worker", "2", "--samples", "100000", "--arity", "2"]),
    ("stencil.py", ["--size", "20", "--iterations", "5"]),
])
def test_examples_under_mpiexec_take_a_context_per_rank(example, options):
    # `mpiexec -n N python examples/X.py` (the README's and the guide's
    # commands) with --contexts left out: one context per rank, whatever N
    # (a default of 4 was refused by mf.run under 2 ranks)
    from macroflow.transport.mpi import _find_mpiexec
    out = run([_find_mpiexec(), "-n", "2", sys.executable, f"examples/{example}", *options])
    if example == "fanout.py":
        assert "k=2 contexts, 4 tasks" in out, out
        check_fanout(out, 2)
    else:
        assert "2 bands on 2 contexts" in out and "match serial: yes" in out, out


def test_examples_default_to_the_runtimes_number_of_contexts():
    # --contexts left out: the runtime's default (a context per core, or
    # per rank), not a number of the example's own
    import importlib.util
    for name in ["fanout", "matmul", "matvec", "pipeline", "stencil"]:
        spec = importlib.util.spec_from_file_location(f"_example_{name}", EXAMPLES / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        assert mod.parse_args([]).contexts is None, name
        assert mod.parse_args(["--contexts", "3"]).contexts == 3, name


@pytest.mark.timeout(60)
@pytest.mark.parametrize("command, says", [
    ("stencil.py --size 4 --contexts 3", "at most one band per row"),
    ("fanout.py --contexts 0", "--contexts must be at least 1"),
    ("fanout.py --wait-for 5", "--wait-for N needs --listen"),
    ("pipeline.py --min-size 10 --max-size 5", "--max-size at least --min-size"),
    ("pipeline.py --items 0", "--items and --min-size must be at least 1"),
    ("pipeline.py --placement bogus", "invalid choice: 'bogus'"),
    ("matmul.py --size 0", "--size and --contexts must be at least 1"),
    ("matmul.py --blocks 0", "--blocks from 1 to --size"),
    ("matmul.py --size 5 --blocks 6", "--blocks from 1 to --size"),
    ("matvec.py --contexts 0", "--contexts and --blocks must be at least 1"),
    ("matvec.py --blocks 0", "--contexts and --blocks must be at least 1"),  # (it ran)
    ("fanout.py --seed -1", "--seed must be at least 0"),
])
def test_an_example_given_a_bad_option_says_which(command, says):
    # a usage error (exit 2, one line), not a traceback from numpy or from
    # the runtime, nor a run that does nothing (--items 0)
    name, *options = command.split()
    proc = subprocess.run([sys.executable, f"examples/{name}", *options], cwd=ROOT,
                          capture_output=True, text=True, timeout=50)
    assert proc.returncode == 2 and says in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.timeout(120)
def test_pipeline():
    out = run([sys.executable, "examples/pipeline.py", "--contexts", "3", "--items", "6",
               "--min-size", "20000", "--max-size", "100000"])
    assert "match serial: yes" in out, out
    rows = re.findall(r"^\s+(\d+)\s+[\d,]+\s+\d+\s+\d+\s+[0-9.]+$", out, re.M)
    assert [int(i) for i in rows] == list(range(6)), out
    assert re.search(r"dataflow\s+[0-9.]+ s\s+speedup", out), out


@pytest.mark.timeout(120)
def test_matmul():
    out = run([sys.executable, "examples/matmul.py", "--contexts", "3", "--size", "300", "--blocks", "3"])
    assert "k=3 row blocks on 3 contexts" in out, out
    assert "verified against numpy: yes" in out, out
    assert re.search(r"C fetched to main\s+[0-9.]+ s", out), out


@pytest.mark.timeout(120)
def test_matmul_more_blocks_than_contexts():
    # more blocks than contexts, and a size that does not divide evenly
    out = run([sys.executable, "examples/matmul.py", "--contexts", "2", "--size", "101", "--blocks", "4"])
    assert "verified against numpy: yes" in out, out


@pytest.mark.timeout(120)
def test_matmul_of_fewer_rows_than_contexts_makes_a_block_a_row():
    out = run([sys.executable, "examples/matmul.py", "--contexts", "2", "--size", "1"])
    assert "k=1 row blocks on 2 contexts" in out and "verified against numpy: yes" in out, out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("rank, shown", [("0", True), ("1", False)])
@pytest.mark.parametrize("options, code", [(["--help"], 0), (["--seed", "-1"], 2)])
def test_an_examples_help_and_usage_errors_are_said_by_rank_0_alone(rank, shown, options, code):
    # every rank of mpiexec parses the command line: one text, not one a rank
    env = dict(os.environ, PMI_RANK=rank, PMI_SIZE="2")
    proc = subprocess.run([sys.executable, "examples/fanout.py", *options], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=50)
    assert proc.returncode == code, proc.stderr
    assert ("usage: fanout.py" in proc.stdout + proc.stderr) == shown, (proc.stdout, proc.stderr)


@pytest.mark.timeout(120)
def test_stencil():
    out = run([sys.executable, "examples/stencil.py", "--contexts", "3", "--size", "41",
               "--iterations", "25"])
    assert "41x41 grid, 25 Jacobi iterations, 3 bands on 3 contexts" in out, out
    assert "match serial: yes" in out, out
    # two inner borders, a row each way per iteration, copied directly or served
    m = re.search(r"halo rows read: (\d+) copied by the reader, (\d+) served", out)
    assert m and int(m[1]) + int(m[2]) == 2 * 2 * 25, out


@pytest.mark.timeout(120)
def test_matvec():
    # more blocks than contexts, and a size the blocks do not divide evenly
    out = run([sys.executable, "examples/matvec.py", "--contexts", "2", "--size", "101",
               "--blocks", "5", "--steps", "3"])
    assert "5 row blocks on contexts [0, 1]" in out, out
    assert "verified against numpy's A @ x: yes" in out, out


def python_blocks(path):
    return re.findall(r"```python\n(.*?)```", path.read_text(), re.S)


@pytest.mark.timeout(120)
def test_readme_example(tmp_path):
    (block,) = python_blocks(ROOT / "README.md")
    script = tmp_path / "readme_example.py"
    script.write_text(block)
    assert run([sys.executable, str(script)]).strip() == "51"


def test_readme_quick_start_matches_ci():
    readme = (ROOT / "README.md").read_text()
    assert "pip install -e . && python examples/fanout.py" in readme
    assert 'pip install -e ".[test,mpi]" && python -m pytest -q' in readme
    ci = (ROOT / ".ci" / "run").read_text()
    assert '-e ".[test,mpi]"' in ci and "-m pytest -q" in ci


GUIDE = ROOT / "docs" / "guide.md"
GUIDE_BLOCKS = python_blocks(GUIDE)


def test_guide_has_snippets():
    assert len(GUIDE_BLOCKS) >= 10


@pytest.mark.timeout(120)
@pytest.mark.parametrize("index", range(len(GUIDE_BLOCKS)))
def test_guide_snippet_runs(index, tmp_path):
    script = tmp_path / f"guide_snippet_{index}.py"
    script.write_text(GUIDE_BLOCKS[index])
    run([sys.executable, str(script)])
