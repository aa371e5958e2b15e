"""tpamp.plot, the command line that draws a training log (docs/spec.md section 5): what it does
where matplotlib is missing. Its pictures of real logs are checked in tests/test_grad_norm_logs.py."""

from __future__ import annotations


def test_plot_without_matplotlib_prints_one_install_line_and_exits_2(tmp_path):
    """``python -m tpamp.plot`` where matplotlib cannot be imported (hidden by a path entry
    that makes its import fail): exit code 2, one line on stderr naming the install command,
    no traceback, no image written."""
    import os
    import subprocess
    import sys

    log = tmp_path / "log.jsonl"
    log.write_text('{"iteration": 1, "loss": 2.0, "grad_norm": 1.0, "loss_scale": 8.0}\n')
    blocker = tmp_path / "block"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(
        "import sys\nsys.modules['matplotlib'] = None  # import matplotlib -> ModuleNotFoundError\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(blocker), root]))
    res = subprocess.run([sys.executable, "-m", "tpamp.plot", str(log)], env=env,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, (res.returncode, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert lines == ["tpamp.plot needs matplotlib, which is not installed: pip install matplotlib "
                     "(or pip install 'tpamp[plot]')"], res.stderr
    assert not (tmp_path / "log.png").exists()
