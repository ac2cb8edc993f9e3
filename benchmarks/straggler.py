"""Two workers, one slow: does the job report name it, its cause and the others' loss?

    python benchmarks/straggler.py [--repeats 3] [--cases CASE ...] [--out PATH]
    (about 15 min on 2 cores)

Runs two `MultiWorkerMirroredStrategy` workers on loopback (TF_CONFIG, CPU),
each pinned to its own CPU with `taskset` (worker 0 on CPU 0, worker 1 on
CPU 1), training a small MLP on a CPU-heavy input (a log-spectrum made in
TF ops), in four planted cases:

- `slow_input`: worker 1's input sleeps `SLOW_S` per batch (a loader waiting
  on its disk); worker 0's is the same pipeline without the sleep;
- `cpu_shared`: a CPU burner (`while True`) on worker 1's CPU (worker 1
  starts it, so it inherits worker 1's `taskset`);
- `slow_step`: worker 1's step does `EXTRA_PRODUCTS` products of a 256 x
  256 matrix more (a `tf.numpy_function` inside its model: more work in its
  step, as a heavier share or a slower device would give);
- `healthy`: the same pair with nothing planted.

Each case is one pair of processes that trains `2 * repeats + 1` monitored
`fit`s of `STEPS` steps, clean and planted alternated (B A B A ... B). Per
planted block it keeps the chief's job report: the straggler it names, its
cause, the others' predicted loss (`share`: the straggler's lateness over the
job's cycle) and the gain if it matched them. The truth of that block comes
right after it: `PAIRS` unmonitored fits of `SEGMENT` steps, clean and planted
alternated (the job's steps/s with worker 1 as fast as worker 0, and as
planted, a second or two apart): `true_gain` is the median of the pairs'
clean / planted steps/s and `true_loss` is `1 - 1 / true_gain`. (The clean
monitored blocks beside it, 5-10 s away, ran 25.5-31.3 steps/s between
neighbours on the 2-core VM: `beside_loss`, their truth, is kept to compare.)
`healthy`'s blocks are all clean: each must name no straggler. `slow_input`
runs a second time through a custom loop (`strategy.run` over
`strategy.experimental_distribute_dataset`, under `kg.watch`; its truth's
segments the same loop). Each block keeps the load average at its start and
each worker's figures (`per_worker`; the clean blocks' beside it:
`clean_steps_per_s`, `clean_per_worker`).
docs/distributed.md quotes the file (`benchmarks/results/straggler.json`).
A case that hangs past its time is stopped after every thread's Python
stack of both workers is printed (`faulthandler` on SIGUSR1).

`--worker` runs one worker (what a case starts twice).
"""

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS, WARMUP, BATCH, FEATURES, SLOW_S = 96, 8, 64, 256, 0.06
#: the truth: PAIRS clean and planted fits of SEGMENT steps alternated after each planted block
PAIRS, SEGMENT = 6, 24
#: a slow step's extra work: this many products of a 256 x 256 matrix per step
EXTRA_PRODUCTS = 80
CASES = ("slow_input", "cpu_shared", "slow_step", "healthy")
CAUSES = {"slow_input": "input", "cpu_shared": "cpu_shared", "slow_step": "step"}
# burns a CPU until its parent (worker 1) ends
BURNER = "import os\nparent = os.getppid()\nwhile os.getppid() == parent:\n    pass\n"


def worker(case, loop, blocks, work):
    """One worker: `blocks` short `fit`s (or custom loops under `kg.watch`), clean
    (even blocks) and planted alternated; writes each block's job report, what the
    monitor printed and the job's measured steps/s to `work/<task>.json`."""
    import contextlib
    import faulthandler
    import io

    import numpy as np

    import tensorflow as tf
    import keras

    import keras_gpufix as kg

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # where a hung worker waits
    strategy = kg.setup_strategy()
    task = strategy.cluster_resolver.task_id
    batch = kg.global_batch_size(BATCH // 2, strategy)
    extra = [0]  # products of the slow step's extra work, per step
    matrix = np.random.default_rng(0).random((256, 256), dtype=np.float32)

    def heavy(x):  # the slow step's extra work: CPU time inside worker 1's step
        for _ in range(extra[0]):
            matrix @ matrix
        return x

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

    def dataset(planted):
        ds = tf.data.Dataset.range(STEPS).map(features)
        if planted and case == "slow_input" and task == 1:
            ds = ds.map(slowed)
        return kg.data.instrument(ds).prefetch(2)

    class Heavier(keras.layers.Layer):
        """Passes its input on after `heavy` (nothing to learn, no gradient)."""
        def call(self, x):
            done = tf.ensure_shape(tf.numpy_function(heavy, [x[0, 0]], tf.float32,
                                                     stateful=True), ())
            return x + 0.0 * tf.stop_gradient(done)

        def compute_output_shape(self, shape):
            return shape

    with strategy.scope():
        layers = [keras.Input((FEATURES,))] + [Heavier()] * (case == "slow_step")
        model = keras.Sequential(layers + [keras.layers.Dense(512, "relu"),
                                           keras.layers.Dense(512, "relu"),
                                           keras.layers.Dense(1)])
        optimizer = keras.optimizers.SGD(0.01)
        if loop == "fit":
            kg.compile_model(model, optimizer, "mse", mixed_precision=None,
                             steps_per_execution=1, sample_batch=next(iter(dataset(False))))
    if loop == "custom":
        sys.path.insert(0, os.path.join(ROOT, "examples"))
        from two_workers import train_step as step_of  # the example's custom loop

        train_step = step_of(strategy, model, optimizer, keras.losses.MeanSquaredError())
    def plant(planted):
        """Worker 1's planted cause on (its burner started) or off; returns the burner."""
        extra[0] = EXTRA_PRODUCTS if planted and case == "slow_step" and task == 1 else 0
        if planted and case == "cpu_shared" and task == 1:
            return subprocess.Popen([sys.executable, "-c", BURNER])
        return None

    def unplant(burner):
        if burner is not None:
            burner.kill()
            burner.wait()

    def segment(planted):
        """One unmonitored fit of `SEGMENT` steps; its steps/s from its second step."""
        burner = plant(planted)
        ends = []
        if loop == "fit":
            clock = keras.callbacks.LambdaCallback(
                on_train_batch_end=lambda step, logs: ends.append(time.perf_counter()))
            model.fit(dataset(planted).take(SEGMENT), epochs=1, verbose=0, callbacks=[clock])
        else:
            for x, y in strategy.experimental_distribute_dataset(dataset(planted).take(SEGMENT)):
                train_step(x, y)
                ends.append(time.perf_counter())
        unplant(burner)
        return (len(ends) - 2) / (ends[-1] - ends[1])

    results = []
    for block in range(int(blocks)):
        planted = block % 2 == 1 and case != "healthy"
        burner = plant(planted)
        load = os.getloadavg()[0]
        monitor = kg.GPUOscillationMonitor(warmup=WARMUP, nvml=False,
                                           log_dir=os.path.join(work, "logs", str(block)))
        ends = []
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            if loop == "fit":
                clock = keras.callbacks.LambdaCallback(
                    on_train_batch_end=lambda step, logs: ends.append(time.perf_counter()))
                model.fit(dataset(planted), epochs=1, verbose=0, callbacks=[monitor, clock])
            else:
                with kg.watch(strategy.experimental_distribute_dataset(dataset(planted)),
                              callbacks=[monitor], model=model) as watched:
                    for x, y in watched:
                        train_step(x, y)
                        ends.append(time.perf_counter())
        unplant(burner)
        steady = ends[WARMUP:]
        # the truth beside a planted block: clean and planted segments alternated
        pairs = ([[segment(False), segment(True)] for _ in range(PAIRS)]
                 if planted else None)
        results.append({"block": block, "planted": planted, "job": monitor.report()["job"],
                        "load": load,
                        "printed": printed.getvalue(),
                        "steps_per_s": (len(steady) - 1) / (steady[-1] - steady[0]),
                        "pairs": pairs})
    with open(os.path.join(work, f"{task}.json"), "w") as f:
        json.dump(results, f)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_case(case, blocks, loop="fit"):
    """Both workers of one case; returns the chief's blocks."""
    work = tempfile.mkdtemp(prefix=f"kg_straggler_{case}_")
    cluster = {"worker": [f"127.0.0.1:{_free_port()}" for _ in range(2)]}
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    procs = []
    try:
        for index in range(2):
            tf_config = {"cluster": cluster, "task": {"type": "worker", "index": index}}
            procs.append(subprocess.Popen(
                ["taskset", "-c", str(index), sys.executable, os.path.abspath(__file__),
                 "--worker", case, loop, str(blocks), work],
                env=dict(env, TF_CONFIG=json.dumps(tf_config)), cwd=ROOT,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        try:
            outputs = [p.communicate(timeout=120 + 60 * blocks)[0] for p in procs]
        except subprocess.TimeoutExpired:  # every thread's Python stack, then the end
            for p in procs:
                p.send_signal(signal.SIGUSR1)
            time.sleep(2)
            for p in procs:
                p.kill()
            raise SystemExit(f"{case} ({loop}): hung; the workers' stacks:\n" + "\n".join(
                p.communicate()[0][-6000:] for p in procs))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    for p, output in zip(procs, outputs):
        if p.returncode != 0:
            raise SystemExit(f"{case}: a worker exited {p.returncode}\n{output[-3000:]}")
    with open(os.path.join(work, "0.json")) as f:
        return json.load(f)


_SHOWN = ("task", "input_wait_ms", "step_ms", "between_ms", "cpu_ms", "cpu_wait_ms", "compute_ms",
          "collective_wait_ms", "others_mine_share")


def _shown(block):
    """A block's figures per worker (`_SHOWN`), rounded."""
    return [{k: None if w.get(k) is None else round(w[k], 3 if k.endswith("share") else 1)
             for k in _SHOWN} for w in block["job"]["per_worker"]]


def _figures(blocks):
    """Per planted block (every block of a healthy case): what the report said, and the
    truth from the paired segments after it."""
    out = []
    for k, b in enumerate(blocks):
        if not b["planted"] and any(x["planted"] for x in blocks):
            continue
        s = b["job"]["straggler"]
        beside = [blocks[j] for j in (k - 1, k + 1)
                  if 0 <= j < len(blocks) and not blocks[j]["planted"]]
        clean = [c["steps_per_s"] for c in beside]
        # the truth: the median gain of the clean segments over the planted ones after it
        truth = statistics.median(c / p for c, p in b["pairs"]) if b["planted"] else None
        out.append({
            "straggler": None if s is None else s["task"],
            "cause": None if s is None else s["cause"],
            "predicted_loss": None if s is None else round(s["share"], 3),
            "predicted_gain": None if s is None else round(s["gain"], 3),
            "others_wait_share": None if s is None else round(s["others_wait_share"], 3),
            "true_loss": None if truth is None else round(1 - 1 / truth, 3),
            "true_gain": None if truth is None else round(truth, 3),
            "pairs_steps_per_s": b["pairs"] and [[round(v, 2) for v in p] for p in b["pairs"]],
            "beside_loss": (round(1 - b["steps_per_s"] / statistics.mean(clean), 3)
                            if clean and b["planted"] else None),
            "steps_per_s": round(b["steps_per_s"], 2), "load": round(b["load"], 2),
            "clean_steps_per_s": [round(c, 2) for c in clean] if b["planted"] else None,
            "clean_per_worker": [_shown(c) for c in beside] if b["planted"] else None,
            "per_worker": _shown(b),
            "message": b["job"]["message"]})
    return out


def _pct(x):
    return "-" if x is None else f"{x:.0%}"


def _summary(case, runs):
    """The case's figures: named right (worker 1, its cause) of how many, the largest
    relative error of the predicted loss; for `healthy`, the false alarms."""
    if case == "healthy":
        return {f"{case}_false_alarms_of_{len(runs)}": sum(r["straggler"] is not None
                                                           for r in runs)}
    errors = [abs(r["predicted_loss"] / r["true_loss"] - 1) for r in runs
              if r["predicted_loss"] and r["true_loss"]]
    return {f"{case}_named_worker1_and_cause_of_{len(runs)}": sum(
                r["straggler"] == 1 and r["cause"] == CAUSES[case] for r in runs),
            f"{case}_loss_max_relative_error": round(max(errors), 3) if errors else None}


def main(argv=None) -> int:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _results import add_out_argument, write_results

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    every = [*CASES, "slow_input_custom_loop"]
    parser.add_argument("--cases", nargs="+", choices=every, default=every,
                        help="the cases to run (default: all)")
    parser.add_argument("--worker", nargs=4, metavar=("CASE", "LOOP", "BLOCKS", "WORK"),
                        help=argparse.SUPPRESS)
    add_out_argument(parser, "straggler")
    args = parser.parse_args(argv)
    if args.worker:
        worker(*args.worker)
        return 0

    blocks = 2 * args.repeats + 1  # clean, planted, clean, ...: each planted between two
    runs, figures = {}, {}
    for case, loop in [(c, "fit") for c in CASES] + [("slow_input", "custom")]:
        name = case if loop == "fit" else f"{case}_custom_loop"
        if name not in args.cases:
            continue
        runs[name] = _figures(run_case(case, args.repeats if case == "healthy" else blocks,
                                       loop))
        figures.update({k.replace(case, name, 1): v
                        for k, v in _summary(case, runs[name]).items()})
        for k, r in enumerate(runs[name]):
            print(f"{name} #{k + 1} (load {r['load']}): named worker {r['straggler']} "
                  f"({r['cause']}); others' loss predicted {_pct(r['predicted_loss'])}, "
                  f"measured {_pct(r['true_loss'])} (paired; beside "
                  f"{_pct(r['beside_loss'])})", flush=True)
    write_results(args.out, "straggler", figures, {"runs": runs})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
