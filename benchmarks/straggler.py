"""Two workers, one slow: does the job report name it, its cause and the others' loss?

    python benchmarks/straggler.py [--repeats 3] [--out PATH]   (about 6 min on 2 cores)

Runs two `MultiWorkerMirroredStrategy` workers on loopback (TF_CONFIG, CPU),
each pinned to its own CPU with `taskset` (worker 0 on CPU 0, worker 1 on
CPU 1), in three planted cases:

- `slow_input`: worker 1's input sleeps `SLOW_S` per batch (a loader waiting
  on its disk); worker 0's is the same pipeline without the sleep;
- `cpu_shared`: a CPU burner (`while True: pass`) pinned to worker 1's CPU;
- `healthy`: the same pair with nothing planted.

Each repeat runs them as `healthy, slow_input, healthy, cpu_shared`: every
planted case sits beside a healthy run, the truth of what worker 1 costs
(the job's steps/s with worker 1 as fast as worker 0, re-measured beside
it). Per run it keeps the chief's job report (`monitor.report()["job"]`):
the straggler it names, its cause, the others' predicted loss (share of
the job's time) and gain if the straggler matched them, and the measured
truth: `1 - planted steps/s / healthy steps/s` (the healthy runs before
and after it, averaged) and their ratio. `slow_input` also runs once
through a custom loop (`strategy.experimental_distribute_dataset` +
`strategy.run` under `kg.watch`). docs/distributed.md quotes the file
(`benchmarks/results/straggler.json`).

`--worker` runs one worker (what the sweep starts twice per run).
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS, WARMUP, BATCH, FEATURES, SLOW_S = 90, 8, 64, 256, 0.06
CASES = ("slow_input", "cpu_shared", "healthy")


def worker(case, loop, log_dir, out):
    """One worker: `fit` (or a custom loop under `kg.watch`) with the monitor; writes its
    job report, what it printed and its measured steps/s to `out`."""
    import contextlib
    import io

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf
    import keras

    import keras_gpufix as kg

    strategy = kg.setup_strategy()
    task = strategy.cluster_resolver.task_id
    batch = kg.global_batch_size(BATCH // 2, strategy)

    def features(index):  # a log-spectrum of 1/4 s of "audio": CPU work in the input
        audio = tf.random.stateless_normal((batch, 4000), tf.stack([index, index]))
        spectrum = tf.math.log1p(tf.reduce_mean(tf.abs(tf.signal.stft(audio, 400, 160, 512)),
                                                axis=1))[:, :FEATURES // 2]
        x = tf.concat([spectrum, spectrum], axis=1)
        return x, tf.reduce_sum(x, axis=1, keepdims=True)

    def slowed(x, y):
        def sleep(value):
            time.sleep(SLOW_S)
            return value
        x = tf.numpy_function(sleep, [x], tf.float32, stateful=True)
        return tf.ensure_shape(x, (batch, FEATURES)), y

    ds = tf.data.Dataset.range(STEPS).map(features)
    if case == "slow_input" and task == 1:
        ds = ds.map(slowed)
    ds = kg.data.instrument(ds).prefetch(2)
    with strategy.scope():
        model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(512, "relu"),
                                  keras.layers.Dense(512, "relu"), keras.layers.Dense(1)])
    monitor = kg.GPUOscillationMonitor(warmup=WARMUP, log_dir=log_dir, nvml=False)
    ends = []
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        if loop == "fit":
            with strategy.scope():
                kg.compile_model(model, keras.optimizers.SGD(0.01), "mse", mixed_precision=None,
                                 steps_per_execution=1, sample_batch=next(iter(ds)))
            clock = keras.callbacks.LambdaCallback(
                on_train_batch_end=lambda step, logs: ends.append(time.perf_counter()))
            model.fit(ds, epochs=1, verbose=0, callbacks=[monitor, clock])
        else:
            with strategy.scope():
                optimizer = keras.optimizers.SGD(0.01)

            @tf.function
            def train_step(x, y):
                def replica(x, y):
                    with tf.GradientTape() as tape:
                        loss = tf.reduce_mean((model(x, training=True) - y) ** 2)
                    grads = tape.gradient(loss, model.trainable_variables)
                    optimizer.apply_gradients(zip(grads, model.trainable_variables))
                    return loss
                return strategy.run(replica, args=(x, y))

            with kg.watch(strategy.experimental_distribute_dataset(ds), callbacks=[monitor],
                          model=model) as watched:
                for x, y in watched:
                    train_step(x, y)
                    ends.append(time.perf_counter())
    steady = ends[WARMUP:]
    result = {"task": task, "case": case, "loop": loop, "job": monitor.report()["job"],
              "printed": printed.getvalue(),
              "steps_per_s": (len(steady) - 1) / (steady[-1] - steady[0]),
              "cpu": monitor._cpu}
    with open(out, "w") as f:
        json.dump(result, f)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_pair(case, loop="fit", timeout=300):
    """Both workers of one run; returns `(chief's result, worker 1's result)`."""
    work = tempfile.mkdtemp(prefix=f"kg_straggler_{case}_")
    cluster = {"worker": [f"127.0.0.1:{_free_port()}" for _ in range(2)]}
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    burner = None
    if case == "cpu_shared":
        burner = subprocess.Popen(["taskset", "-c", "1", sys.executable, "-c",
                                   "while True: pass"])
    procs = []
    try:
        for index in range(2):
            tf_config = {"cluster": cluster, "task": {"type": "worker", "index": index}}
            pinned = ["taskset", "-c", "1"] if index == 1 else []
            procs.append(subprocess.Popen(
                [*pinned, sys.executable, os.path.abspath(__file__),
                 "--worker", case, loop, os.path.join(work, "logs"),
                 os.path.join(work, f"{index}.json")],
                env=dict(env, TF_CONFIG=json.dumps(tf_config)), cwd=ROOT,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs + [burner]:
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    for p, output in zip(procs, outputs):
        if p.returncode != 0:
            raise SystemExit(f"{case}: a worker exited {p.returncode}\n{output[-3000:]}")
    return [json.load(open(os.path.join(work, f"{i}.json"))) for i in range(2)]


def _figures(chief, truth_per_s):
    job = chief["job"]
    s = job["straggler"]
    loss = None if truth_per_s is None else 1 - chief["steps_per_s"] / truth_per_s
    return {"straggler": None if s is None else s["task"],
            "cause": None if s is None else s["cause"],
            "predicted_loss": None if s is None else s["share"],
            "predicted_gain": None if s is None else s["gain"],
            "true_loss": loss,
            "true_gain": None if truth_per_s is None else truth_per_s / chief["steps_per_s"],
            "steps_per_s": chief["steps_per_s"], "message": job["message"]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--worker", nargs=4, metavar=("CASE", "LOOP", "LOG_DIR", "OUT"),
                        help=argparse.SUPPRESS)
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results",
                                                      "straggler.json"), metavar="PATH")
    args = parser.parse_args(argv)
    if args.worker:
        worker(*args.worker)
        return 0
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _results import write_results

    runs = {case: [] for case in CASES}
    raw = []
    for repeat in range(args.repeats):
        order = ["healthy", "slow_input", "healthy", "cpu_shared"]
        if repeat == args.repeats - 1:
            order.append("healthy")
        pairs = [(case, run_pair(case)) for case in order]
        raw.append([(case, p) for case, p in pairs])
        for k, (case, pair) in enumerate(pairs):
            if case == "healthy":
                runs[case].append(_figures(pair[0], None))
                continue
            near = [pairs[j][1][0]["steps_per_s"] for j in (k - 1, k + 1)
                    if 0 <= j < len(pairs) and pairs[j][0] == "healthy"]
            runs[case].append(_figures(pair[0], statistics.mean(near)))
            print(f"{case}: {runs[case][-1]}", flush=True)
    loop = {"fit": None, "custom": None}
    healthy = run_pair("healthy", "custom")[0]
    custom = run_pair("slow_input", "custom")[0]
    loop["custom"] = _figures(custom, healthy["steps_per_s"])
    loop["fit"] = runs["slow_input"][-1]
    figures = {}
    for case in CASES:
        rs = runs[case]
        figures[f"{case}_worker1_named_of_{len(rs)}"] = sum(
            r["straggler"] == 1 and r["cause"] == {"slow_input": "input",
                                                   "cpu_shared": "cpu_shared"}.get(case)
            for r in rs) if case != "healthy" else None
        if case == "healthy":
            figures[f"healthy_false_alarms_of_{len(rs)}"] = sum(r["straggler"] is not None
                                                                for r in rs)
        else:
            errors = [abs(r["predicted_loss"] / r["true_loss"] - 1) for r in rs
                      if r["predicted_loss"] and r["true_loss"]]
            figures[f"{case}_loss_max_relative_error"] = max(errors) if errors else None
    figures["custom_loop_slow_input_named"] = loop["custom"]["straggler"] == 1 and \
        loop["custom"]["cause"] == "input"
    write_results(args.out, "straggler", figures, {"runs": runs, "loop": loop, "raw": raw})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
