"""benchmarks/run_all.py runs each listed benchmark with --out and tabulates the files."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCHMARKS = os.path.join(ROOT, "benchmarks")


@pytest.fixture
def run_all(monkeypatch):
    monkeypatch.syspath_prepend(BENCHMARKS)
    spec = importlib.util.spec_from_file_location("run_all", os.path.join(BENCHMARKS, "run_all.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_listed_benchmark_exists_and_writes_its_figures_file(run_all):
    for name in run_all.BENCHMARKS:
        with open(os.path.join(BENCHMARKS, f"{name}.py")) as f:
            source = f.read()
        assert f'add_out_argument(parser, "{name}")' in source, name
        assert "write_results(args.out" in source, name


def test_run_all_runs_each_with_out_and_writes_the_summary(run_all, tmp_path, monkeypatch,
                                                           capsys):
    scripts, results = tmp_path / "scripts", tmp_path / "results"
    scripts.mkdir()
    (scripts / "good.py").write_text(
        "import argparse, json, sys\n"
        "p = argparse.ArgumentParser(); p.add_argument('--quick', action='store_true')\n"
        "p.add_argument('--out'); a = p.parse_args()\n"
        "json.dump({'benchmark': 'good', 'command': 'python good.py', 'machine': 'm',\n"
        "           'load_average': [1.5, 1, 1], 'date_utc': 'd',\n"
        "           'figures': {'ratio_fast_over_slow': 2.0 if a.quick else 3.0}},\n"
        "          open(a.out, 'w'))\n")
    (scripts / "bad.py").write_text("import sys; sys.exit(3)\n")
    monkeypatch.setattr(run_all, "HERE", str(scripts))
    monkeypatch.setattr(run_all, "RESULTS", str(results))
    monkeypatch.setattr(run_all, "BENCHMARKS", {"good": (["--quick"], []), "bad": ([], [])})
    results.mkdir()
    assert run_all.main([]) == 1  # bad failed, good still ran
    out = capsys.readouterr().out
    assert "== bad: exit 3" in out and "failed: bad" in out
    assert json.loads((results / "good.json").read_text())["figures"] == {
        "ratio_fast_over_slow": 2.0}
    summary = (results / "SUMMARY.md").read_text()
    assert "## good\n\n`python good.py` on m, load average 1.5, d UTC" in summary
    assert "| `ratio_fast_over_slow` | 2.0 |" in summary and "## bad" not in summary
    assert run_all.main(["good", "--full"]) == 0
    assert "| `ratio_fast_over_slow` | 3.0 |" in (results / "SUMMARY.md").read_text()
    (results / "SUMMARY.md").unlink()
    capsys.readouterr()
    assert run_all.main(["--summary"]) == 0  # runs nothing, tabulates the files
    assert "== good" not in capsys.readouterr().out
    assert "| `ratio_fast_over_slow` | 3.0 |" in (results / "SUMMARY.md").read_text()
    with pytest.raises(SystemExit):
        run_all.main(["nope"])


def test_gpu_checks_imports_on_the_jax_backend_without_tensorflow():
    # The lent GPU machine has jax and no TensorFlow (../shared/GPU_CHECKS.md).
    pytest.importorskip("jax")
    code = ("import sys; sys.modules['tensorflow'] = None; sys.path.insert(0, 'benchmarks'); "
            "import gpu_checks, keras; from _results import machine; "
            "gpu_checks.our_callbacks('logs'), gpu_checks.kg.watch([]); "
            "print(keras.backend.backend(), sorted(gpu_checks.SIZES), machine())")
    env = dict(os.environ, KERAS_BACKEND="jax", PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[:3] == ["jax", "['gpu',", "'small']"]
    assert "(jax backend)" in out.stdout
