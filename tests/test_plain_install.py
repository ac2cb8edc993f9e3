"""The main job on a plain install: `pip install` of the package without extras, then
`keras-gpufix demo`, in a fresh virtual environment (no librosa, no test tools).

Slow (a TensorFlow install; minutes with pip's download cache warm): run with
`-m slow`. The default suite runs the demo with librosa blocked instead
(`tests/test_demo.py`).
"""

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_demo_runs_after_a_plain_install_into_a_fresh_venv(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "TF_CPP_MIN_LOG_LEVEL", "VIRTUAL_ENV")}
    install = subprocess.run([python, "-m", "pip", "install", "-q", REPO], env=env,
                             capture_output=True, text=True, timeout=1800)
    assert install.returncode == 0, install.stderr[-3000:]
    # the extras were not installed: the demo's naive loader must not need them
    probe = subprocess.run([python, "-c", "import librosa"], env=env, capture_output=True)
    assert probe.returncode != 0
    demo = subprocess.run([str(venv / "bin" / "keras-gpufix"), "demo", "--dir",
                           str(tmp_path / "demo"), "--utterances", "24", "--epochs", "2"],
                          env=env, cwd=str(tmp_path), capture_output=True, text=True,
                          timeout=1200)
    assert demo.returncode == 0, demo.stdout[-2000:] + demo.stderr[-3000:]
    assert "Traceback" not in demo.stderr
    assert "24 utterances kept, 1 skipped" in demo.stdout
    result = next(line for line in demo.stdout.splitlines() if line.startswith("result:"))
    assert "faster than" in result or "equally fast" in result
