"""The figures file every benchmark writes (`--out PATH`, one JSON object).

    from _results import add_out_argument, write_results

    parser = argparse.ArgumentParser(...)
    add_out_argument(parser, "end_to_end")
    args = parser.parse_args(argv)
    ...
    write_results(args.out, "end_to_end", {"steady_samples_per_s_naive": 196.0, ...})

The file: `{"benchmark", "command", "machine", "load_average", "date_utc",
"figures", "details"}` (the 1/5/15-minute load average when written: other
work on the machine changes absolute figures; ratios come from one run) with
figures as plain numbers (units in the key names, every ratio key naming
which side is on top). `benchmarks/run_all.py` runs each benchmark with
`--out benchmarks/results/<name>.json` and tabulates the files;
docs/benchmarks.md quotes them.
"""

import datetime
import json
import os
import platform
import sys

__all__ = ["RESULTS", "add_out_argument", "machine", "run_stdout", "write_results"]

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def run_stdout(command):
    """The stdout of `command` run from the project root with the project importable and
    TensorFlow's log lines hidden; exits the benchmark with the command's stderr when it
    fails."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True,
                          check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(command)} exited {proc.returncode}\n{proc.stderr[-3000:]}")
    return proc.stdout


def add_out_argument(parser, name):
    """Adds `--out PATH` (default: `benchmarks/results/<name>.json`)."""
    parser.add_argument("--out", default=os.path.join(RESULTS, f"{name}.json"), metavar="PATH",
                        help=f"write the figures as JSON here (default: "
                             f"benchmarks/results/{name}.json)")


def machine():
    """E.g. "x86_64, 2 cores, TensorFlow 2.21.0 (CPU), Keras 3.15.1".

    On the Keras JAX backend (TensorFlow need not be installed): e.g.
    "x86_64, 16 cores, JAX 0.11.2 (gpu), Keras 3.15.1 (jax backend)".
    """
    import keras

    if keras.backend.backend() == "jax":
        import jax

        return (f"{platform.machine()}, {os.cpu_count()} cores, JAX {jax.__version__} "
                f"({jax.default_backend()}), Keras {keras.__version__} (jax backend)")
    import tensorflow as tf

    device = "GPU" if tf.config.list_physical_devices("GPU") else "CPU"
    return (f"{platform.machine()}, {os.cpu_count()} cores, TensorFlow {tf.__version__} "
            f"({device}), Keras {keras.__version__}")


def write_results(path, name, figures, details=None):
    """Writes the figures file and says where; returns the dict written.

    Args:
        path: the file (its folder is created).
        name: the benchmark's name (its file stem).
        figures: named plain numbers (or None where not measured).
        details: anything else worth keeping (settings, per-epoch lists).
    """
    result = {
        "benchmark": name,
        "command": "python " + " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:]),
        "machine": machine(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "figures": figures,
        "details": details or {},
    }
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2, default=str)
        f.write("\n")
    print(f"figures written to {path}", flush=True)
    return result
