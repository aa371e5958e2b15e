"""The documentation's complete examples run as written, and README's commands fit together.

A Python block of README.md or docs/**/*.md that is a complete, single-process example carries
the line ``<!-- example: runs as written ... -->`` (invisible on GitHub) right above its fence;
each such block runs here in a fresh interpreter, from an empty directory, with this tree first
on the path. The Quick start also runs with a loss scale that overflows, so that its loop meets
skipped steps (grad_norm None). Fragments (``model`` defined elsewhere, several ranks) carry no
marker. README's lint command runs a tool that README's own set-up installs.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARKER = re.compile(r"^<!-- example: runs as written\b.*-->\s*$")
# the blocks that must be marked (removing a marker must not silently drop its block's test)
EXPECTED = {"README.md#Quick start", "docs/guide/param_groups.md#Param-group overrides: lr and "
            "weight decay per parameter"}


def _markdown_files():
    yield "README.md"
    for root, dirs, names in os.walk(os.path.join(ROOT, "docs")):
        dirs.sort()
        for name in sorted(names):
            if name.endswith(".md"):
                yield os.path.relpath(os.path.join(root, name), ROOT)


def marked_examples():
    """[(id "file#heading", code)] of every marked Python block."""
    out = []
    for rel in _markdown_files():
        with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
            lines = f.read().splitlines()
        heading, i = None, 0
        while i < len(lines):
            line = lines[i]
            if line.startswith("#"):
                heading = line.lstrip("#").strip()
            if MARKER.match(line):
                assert i + 1 < len(lines) and lines[i + 1].strip() == "```python", (
                    f"{rel}:{i + 1}: the marker must stand right above a ```python fence")
                end = lines.index("```", i + 2)
                out.append((f"{rel}#{heading}", "\n".join(lines[i + 2:end]) + "\n"))
                i = end
            i += 1
    return out


EXAMPLES = marked_examples()


def run_python(code: str, cwd, timeout: float = 120.0) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_the_complete_examples_are_marked():
    ids = [name for name, _ in EXAMPLES]
    assert len(ids) == len(set(ids)), ids
    assert EXPECTED <= set(ids), f"unmarked: {EXPECTED - set(ids)}"


@pytest.mark.parametrize("name, code", EXAMPLES, ids=[name for name, _ in EXAMPLES])
def test_a_marked_example_runs_as_written(name, code, tmp_path):
    proc = run_python(code, tmp_path)
    assert proc.returncode == 0, f"{name} failed:\n{code}\n{proc.stdout[-2000:]}{proc.stderr[-4000:]}"
    assert os.listdir(tmp_path) == [], "an example left files behind"


def test_the_quick_start_survives_skipped_steps(tmp_path):
    """With a loss scale of 2**40 the fp16 grads overflow until the scaler has backed off, and
    with every iteration logged the Quick start's loop meets steps whose grad_norm is None:
    it reports each iteration (skipped or its loss and norm) and goes on."""
    code = dict(EXAMPLES)["README.md#Quick start"]
    assert code.count("initial_scale=2.0**16") == 1 and code.count("it % 25 == 0") == 1, code
    code = code.replace("initial_scale=2.0**16", "initial_scale=2.0**40")
    proc = run_python(code.replace("it % 25 == 0", "it % 1 == 0"), tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.splitlines()
    assert [int(line.split(":")[0]) for line in lines] == list(range(1, 101)), proc.stdout
    assert lines[0].startswith("1: skipped"), proc.stdout
    assert lines[-1].startswith("100: loss"), proc.stdout  # trains once the scale is down


def _readme():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        return f.read()


def test_readmes_lint_command_runs_a_tool_its_set_up_installs():
    """README's lint command names a program of the venv that README's test set-up makes;
    that set-up's extra brings it (pyproject.toml), and CI runs the same command."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    readme = _readme()
    lint = re.search(r"Lint\b[^`]*`([^`]+)`", readme)
    assert lint, "README has no lint command"
    command = shlex.split(lint.group(1))
    assert command[0].startswith(".venv/bin/"), command
    tool = command[0][len(".venv/bin/"):]
    setups = [line for line in readme.splitlines() if line.startswith("python3 -m venv .venv")]
    extras = set()
    for line in setups:
        for m in re.finditer(r'-e "\.\[([\w,]+)\]"', line):
            extras.update(m.group(1).split(","))
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        optional = tomllib.load(f)["project"]["optional-dependencies"]
    brought = {re.split(r"[<>=!~\[; ]", req, maxsplit=1)[0] for e in extras for req in optional[e]}
    assert tool in brought, (tool, extras, brought)
    with open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8") as f:
        ci = f.read().splitlines()
    assert lint.group(1) in ci, "CI does not run README's lint command as written"
