"""The environment a script sets at its top is in place before diagnose imports the
frameworks: the script runs under `keras-gpufix diagnose` as it runs alone."""

import json
import os
import subprocess
import sys
import textwrap

from keras_gpufix.script_env import apply, script_environment


def _script(tmp_path, text):
    path = tmp_path / "train.py"
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_constant_settings_before_the_frameworks_imports_are_read(tmp_path):
    path = _script(tmp_path, """\
        import os
        import sys
        os.environ["A"] = os.environ["B"] = "1"
        os.environ.setdefault("C", "two")
        os.environ.update({"D": "3"}, E="4")
        os.environ["F"] = sys.argv[0]          # not a constant: the script sets it itself
        import numpy as np
        os.environ["OMP_NUM_THREADS"] = "1"    # NumPy read it already
        os.environ["KERAS_BACKEND"] = "jax"    # Keras not imported yet
        import keras
        os.environ["G"] = "after keras"        # the script's own moment
        """)
    assert script_environment(path) == [
        ("A", "1", False), ("B", "1", False), ("C", "two", True), ("D", "3", False),
        ("E", "4", False), ("KERAS_BACKEND", "jax", False)]


def test_apply_sets_as_the_script_would(tmp_path, monkeypatch):
    path = _script(tmp_path, """\
        import os
        os.environ["KG_T_SET"] = "mine"
        os.environ.setdefault("KG_T_KEPT", "default")
        os.environ.setdefault("KG_T_NEW", "default")
        """)
    monkeypatch.setenv("KG_T_SET", "shell")
    monkeypatch.setenv("KG_T_KEPT", "shell")
    monkeypatch.delenv("KG_T_NEW", raising=False)
    assert apply(path) == {"KG_T_SET": "mine", "KG_T_NEW": "default"}
    assert os.environ["KG_T_KEPT"] == "shell"


def test_an_unreadable_script_sets_nothing(tmp_path):
    bad = _script(tmp_path, "os.environ['A'] = \n")
    assert script_environment(bad) == []
    assert script_environment(str(tmp_path / "missing.py")) == []


def test_diagnose_runs_the_script_with_the_keras_home_it_sets(tmp_path):
    """Keras reads KERAS_HOME (its keras.json) once, at import: a script that points
    it at its own folder gets that config under diagnose too, as when it runs alone."""
    home = tmp_path / "home"
    home.mkdir()
    (home / "keras.json").write_text(json.dumps({"floatx": "float16", "backend": "tensorflow"}))
    path = _script(tmp_path, f"""\
        import os
        os.environ["KERAS_HOME"] = {str(home)!r}
        import keras
        print("FLOATX", keras.config.floatx())
        """)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("KERAS_HOME", None)
    alone = subprocess.run([sys.executable, path], capture_output=True, text=True, env=env)
    diagnosed = subprocess.run(
        [sys.executable, "-m", "keras_gpufix", "diagnose", "--no-trace", "--no-what-if",
         "--log-dir", str(tmp_path / "log"), "--", sys.executable, path],
        capture_output=True, text=True, env=env, cwd=tmp_path)
    assert "FLOATX float16" in alone.stdout, alone.stderr[-2000:]
    assert "FLOATX float16" in diagnosed.stdout, diagnosed.stderr[-2000:]
