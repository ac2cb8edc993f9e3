"""Which Keras 3 minors and TensorFlow versions keras_gpufix installs and runs on.

For each (Keras, TensorFlow) pair this makes a fresh venv under `--root`,
runs `pip install <this repository> keras==K.* tensorflow==T.*` (pip's
resolver must accept the package's `install_requires` beside that Keras:
the install column), then a smoke subset in that venv, on this checkout's
code (`PYTHONPATH` is the repository, so a venv made before an edit tests
the edit):

- import: `import keras_gpufix`, the versions really installed;
- compile: `kg.compile_model` on a tiny model with `jit_compile=True` and a
  sample batch: XLA verified in the traced step, the policy, the measured
  `steps_per_execution` an int;
- fit: a short `fit` with `GPUOscillationMonitor`, `RetracingMonitor`,
  `StepTimer` and `ProfilerTrigger` (no warning, History gets the loss);
- builder: `kg.data.SpeechDatasetBuilder` on a few generated WAVs, one
  bucketed batch.

Pairs run one after another (TensorFlow wheels are large; pip's download
cache is shared). Prints one table row per pair; the figures file
(`--out`, default `benchmarks/results/compat.json`) holds the counts and,
in `details`, every row (`reused`: the venv and its install came from an
earlier run).

    python benchmarks/compat.py [--keras 3.12,3.13,3.14,3.15] [--tensorflow 2.19,2.20,2.21]
                                [--root /tmp/kg_compat] [--reuse] [--out PATH]
"""

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from _results import add_out_argument, write_results  # noqa: E402 (beside this file)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = ("import", "compile", "fit", "builder")


def smoke() -> dict:
    """The smoke subset in this interpreter: {step: "ok" | the error's first line}."""
    import tempfile
    import warnings

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    result = {}

    def step(name, fn):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", kg.exceptions.GpufixWarning)
                result[name] = fn() or "ok"
        except Exception as exc:  # a row of the table, not a crash
            result[name] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:160]}"

    import keras
    import numpy as np
    import tensorflow as tf

    import keras_gpufix as kg
    import keras_gpufix.exceptions  # noqa: F401  (kg.exceptions above)

    result["versions"] = {"keras": keras.__version__, "tensorflow": tf.__version__,
                          "python": platform.python_version()}
    result["import"] = "ok"
    x = np.random.default_rng(0).normal(size=(64, 8)).astype("float32")
    y = x.sum(axis=1, keepdims=True)

    def model():
        inputs = keras.Input((8,))
        return keras.Model(inputs, keras.layers.Dense(1)(keras.layers.Dense(16)(inputs)))

    def compile_check():
        m = model()
        report = kg.compile_model(m, "adam", "mse", jit_compile=True, mixed_precision="float32",
                                  sample_batch=(x[:16], y[:16]))
        if not (report.jit_compile and report.verified and report.xla_devices):
            return f"XLA not verified: {report.reason.splitlines()[0]}"
        if not isinstance(report.steps_per_execution, int) or report.steps_per_execution < 1:
            return f"steps_per_execution={report.steps_per_execution!r}"
        return None

    def fit_check():
        m = model()
        kg.compile_model(m, "adam", "mse", mixed_precision="float32", steps_per_execution=1)
        with tempfile.TemporaryDirectory() as logs:
            history = m.fit(x, y, batch_size=4, epochs=2, verbose=0, callbacks=[
                kg.GPUOscillationMonitor(verbose=0), kg.RetracingMonitor(verbose=0),
                kg.StepTimer(), kg.ProfilerTrigger(logs, verbose=0)])
        if "loss" not in history.history:
            return f"History has no loss: {sorted(history.history)}"
        return None

    def builder_check():
        with tempfile.TemporaryDirectory() as folder:
            corpus = kg.data.make_synthetic_corpus(os.path.join(folder, "corpus"), 6,
                                                   max_seconds=1.0)
            builder = kg.data.SpeechDatasetBuilder(
                corpus, audio=kg.data.AudioConfig(n_mels=20), verbose=0)
            (ids, _), (mel, _) = next(iter(builder.build(batch_size=2, num_buckets=2)))
            if mel.shape[-1] != 20 or ids.shape[0] != 2:
                return f"batch shapes {ids.shape}, {mel.shape}"
        return None

    step("compile", compile_check)
    step("fit", fit_check)
    step("builder", builder_check)
    return result


def _run(cmd, **kwargs):
    return subprocess.run(cmd, capture_output=True, text=True, **kwargs)


def pair(keras_minor, tf_minor, root, reuse) -> dict:
    """Install and smoke-test one pair; a row of the table."""
    row = {"keras": keras_minor, "tensorflow": tf_minor}
    venv = os.path.join(root, f"keras{keras_minor}-tf{tf_minor}")
    python = os.path.join(venv, "bin", "python")
    start = time.perf_counter()
    row["reused"] = reuse and os.path.exists(python)
    if not row["reused"]:
        shutil.rmtree(venv, ignore_errors=True)
        _run([sys.executable, "-m", "venv", venv], check=True)
        done = _run([python, "-m", "pip", "install", "-q", REPO,
                     f"keras=={keras_minor}.*", f"tensorflow=={tf_minor}.*"])
        if done.returncode != 0:
            lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
            row["install"] = "no: " + " ".join(lines[-2:])[:300]
            shutil.rmtree(venv, ignore_errors=True)
            return row
    row["install"] = "ok"
    row["install_s"] = None if row["reused"] else round(time.perf_counter() - start, 1)
    env = dict(os.environ, PYTHONPATH=REPO, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
    start = time.perf_counter()
    done = _run([python, os.path.abspath(__file__), "--smoke"], env=env, cwd=root)
    row["smoke_s"] = round(time.perf_counter() - start, 1)
    try:
        row.update(json.loads(done.stdout.strip().splitlines()[-1]))
    except (IndexError, ValueError):
        row["import"] = f"no: {(done.stderr.strip().splitlines() or ['?'])[-1][:300]}"
    return row


def _cell(value):
    return "ok" if value == "ok" else ("-" if value is None else "FAIL")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keras", default="3.12,3.13,3.14,3.15")
    parser.add_argument("--tensorflow", default="2.19,2.20,2.21")
    parser.add_argument("--root", default="/tmp/kg_compat", help="folder for the venvs")
    parser.add_argument("--reuse", action="store_true",
                        help="keep a venv made by an earlier run (smoke only)")
    parser.add_argument("--smoke", action="store_true", help=argparse.SUPPRESS)
    add_out_argument(parser, "compat")
    args = parser.parse_args(argv)
    if args.smoke:
        print(json.dumps(smoke()))
        return 0
    os.makedirs(args.root, exist_ok=True)
    load = os.getloadavg()
    rows = []
    print("| Keras | TensorFlow | install | import | compile (XLA) | fit + monitors | builder |")
    print("|---|---|---|---|---|---|---|")
    for tf_minor in args.tensorflow.split(","):
        for keras_minor in args.keras.split(","):
            row = pair(keras_minor, tf_minor, args.root, args.reuse)
            rows.append(row)
            got = row.get("versions", {})
            print(f"| {got.get('keras', keras_minor)} | {got.get('tensorflow', tf_minor)} | "
                  f"{'ok' if row['install'] == 'ok' else 'no'} | "
                  + " | ".join(_cell(row.get(s)) for s in STEPS) + " |", flush=True)
    for row in rows:
        for name in ("install",) + STEPS:
            if row.get(name) not in ("ok", None):
                print(f"{row['keras']} x {row['tensorflow']} {name}: {row[name]}")
    passing = [r for r in rows if all(r.get(s) == "ok" for s in ("install",) + STEPS)]
    write_results(args.out, "compat", {"pairs_tested": len(rows), "pairs_passing": len(passing)},
                  {"load_average_at_start": [round(x, 2) for x in load],
                   "python": platform.python_version(), "rows": rows})
    return 0 if len(passing) == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
