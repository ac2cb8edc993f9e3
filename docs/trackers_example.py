"""What the experiment trackers show of a monitored run: the output quoted in
docs/trackers.md.

Two `kg.watch` loops, one with a slow input (12 ms a batch) and one with it
fixed, each inside an MLflow run (a local file store) and a W&B run (offline);
then what each tracker holds, read back through its own API or folder, and
`keras-gpufix compare` of the two MLflow runs and of the two W&B folders.

    pip install -e .[mlflow,wandb]
    python docs/trackers_example.py [--dir DIR]

Nothing leaves the machine (`WANDB_MODE=offline`).
"""

import argparse
import glob
import os
import subprocess
import sys
import tempfile
import time


def _loop(wait_s, steps=48, epochs=2):
    """A custom loop: `wait_s` per batch in next(), 3 ms of 'step'."""
    import numpy as np

    import keras_gpufix as kg

    class Batches:  # iterable once an epoch, as a dataset is
        def __iter__(self):
            for _ in range(steps):
                time.sleep(wait_s)
                yield np.zeros((8, 16), np.float32)

    monitor = kg.GPUOscillationMonitor(nvml=False)
    with kg.watch(Batches(), callbacks=[monitor]) as watched:
        for _ in range(epochs):
            for _ in watched:
                time.sleep(0.003)
    return monitor


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=None, help="work folder (default: a new temp one)")
    args = parser.parse_args(argv)
    work = args.dir or tempfile.mkdtemp(prefix="keras_gpufix_trackers_")
    os.environ.setdefault("MLFLOW_TRACKING_URI", f"file:{os.path.join(work, 'mlruns')}")
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 asks for it
    os.environ.update(WANDB_MODE="offline", WANDB_SILENT="true", WANDB_CONSOLE="off")
    import mlflow
    import wandb

    runs, folders = {}, {}
    for name, wait in (("slow", 0.012), ("fixed", 0.0)):
        print(f"\n$ (the {name} loop, inside mlflow.start_run() and wandb.init())")
        with mlflow.start_run(run_name=name) as run, \
                wandb.init(project="keras-gpufix-example", name=name, dir=work) as wb:
            _loop(wait)
        runs[name], folders[name] = run.info.run_id, os.path.dirname(wb.dir)

    client = mlflow.tracking.MlflowClient()
    run_id = runs["slow"]
    data = client.get_run(run_id).data
    print(f"\nMLflow run {run_id} (slow):\n  tags:")
    for key in ("verdict", "share", "fix", "gain"):
        print(f"    keras_gpufix.{key} = {data.tags[f'keras_gpufix.{key}']}")
    print("  metrics (per epoch, against the steps done):")
    for key in ("cycle_ms", "input_wait_ms", "step_ms", "between_ms"):
        points = client.get_metric_history(run_id, f"keras_gpufix/{key}")
        print(f"    keras_gpufix/{key}: " + ", ".join(f"step {m.step}: {m.value:.1f}"
                                                     for m in points))
    print("  artifacts: " + ", ".join(a.path for a in client.list_artifacts(
        run_id, "keras_gpufix")))
    print(f"\nW&B run folder {folders['slow']}:")
    for path in sorted(glob.glob(os.path.join(folders["slow"], "files", "keras_gpufix", "*"))):
        print(f"  {os.path.relpath(path, folders['slow'])}")

    def run(*cmd):
        print("\n$ " + " ".join(cmd))
        sys.stdout.flush()
        subprocess.run([sys.executable, "-m", "keras_gpufix", *cmd], check=True)

    run("compare", f"runs:/{runs['slow']}", f"runs:/{runs['fixed']}")
    run("compare", folders["slow"], folders["fixed"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
