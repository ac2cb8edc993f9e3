"""kg.watch on asynchronous execution: steps timed where their work ends (issue 26).

Two asynchronous modes stand in for a GPU on this CPU, each in a subprocess
(the backend and TensorFlow's execution mode are per process): the Keras JAX
backend with a `jax.jit` step (JAX dispatches asynchronously), and
TensorFlow with asynchronous eager execution and a `tf.function` step. A
Keras MLP trains in the user's own loop (on JAX it computes its step, on
one thread; on TensorFlow it is tiny and its step's first op sleeps
`DEVICE_S`, the device's share, as in `custom_loops.py`); the loss is read
every `EVERY`-th step, as a loop that logs every few steps does. Each mode
runs its loops one after the other. The reference for a loop's step time is
its own wall time per step, read around the loop (the monitor's cost beside
the same loop without it is a benchmark's figure, not a test's: the script
prints it, `bare` and `bare_after`, one run either side of the others; their
step time, between two reads of the loss, is the low bound's floor).
Run as a script (`KERAS_BACKEND=jax python tests/test_watch_async.py`) it
prints the runs' figures as one JSON line.
"""

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from keras_gpufix.analysis import StepRecord, judge
from keras_gpufix.analysis.dispatch import fold_unsynced

EVERY = 5
STEPS = 60  # shorter than the monitor's window: judged once, at the end
BATCH = 128
FEATURES = 256
HIDDEN = {"jax": 1024, "tensorflow": 32}  # JAX computes its step, TensorFlow sleeps
DEVICE_S = 0.01  # TensorFlow: the step's stand-in device time
INPUT_S = 0.05  # slow input: per batch
WORK_S = 0.06  # work in the loop body every EVERY steps


# -- the detector on planted step times (pure NumPy) ------------------------

def _records(own, waits=None):
    """One-step records: `own` (step) seconds each, `waits` input waits."""
    return [StepRecord(i, 1, None if waits is None else float(waits[i]), float(s), 0.0,
                       split=False) for i, s in enumerate(own)]


def _planted(pattern, n=96, seed=0):
    """`pattern` (ms per position of a period) repeated, +-10% noise, in seconds."""
    noise = np.random.default_rng(seed).uniform(0.9, 1.1, n)
    return np.resize(np.array(pattern) / 1e3, n) * noise


# JAX: 4 dispatches of 0.2 ms, then the read waits for 5 steps of 5 ms.
JAX_UNSYNCED = [0.2, 0.2, 0.2, 0.2, 24.2]
# TF async eager: the read waits for its step; the next() after it finds no
# queue (dispatch cost); the other next()s queue behind one pending step.
TF_UNSYNCED = [0.8, 4.1, 4.0, 4.2, 8.0]


@pytest.mark.parametrize("pattern", [JAX_UNSYNCED, TF_UNSYNCED], ids=["jax", "tf"])
def test_unsynced_steps_are_judged_per_period_not_as_a_stall(pattern):
    records = _records(_planted(pattern))
    folded = fold_unsynced(records)
    assert {r.steps for r in folded} == {EVERY}
    # each period ends with the read that waited for it
    assert all(records[r.index + EVERY - 1].cycle > 0.007 for r in folded)
    judgement = judge(records)
    assert judgement["verdict"] == "healthy", judgement
    assert judgement["evidence"]["unsynced_period"] == EVERY
    assert "unsynced_dispatch" in judgement["evidence"]["signals"]
    true_ms = sum(pattern) / EVERY
    assert judgement["evidence"]["median_ms"] == pytest.approx(true_ms, rel=0.1)
    # Known synced, the same times are a stall every 5 steps.
    assert judge(records, synced=True)["verdict"] == "periodic_stall"


def test_work_every_k_synced_steps_stays_a_stall_and_slow_input_is_named():
    # 5 ms steps and 40 ms every 5th: no step at dispatch cost.
    stall = judge(_records(_planted([5, 5, 5, 5, 45])))
    assert (stall["verdict"], stall["period"]) == ("periodic_stall", EVERY)
    assert "unsynced_period" not in stall["evidence"]
    # Unsynced JAX steps behind a 20 ms input: judged per period, input-bound.
    waits = np.full(96, 0.02)
    slow = judge(_records(_planted(JAX_UNSYNCED), waits))
    assert (slow["verdict"], slow["evidence"]["unsynced_period"]) == ("input_bound", EVERY)
    # Records of several steps each (steps_per_execution) are never folded.
    several = [r._replace(steps=2) for r in _records(_planted(JAX_UNSYNCED))]
    assert fold_unsynced(several) is None


def test_an_input_bound_loop_reading_its_loss_every_k_steps_is_input_bound():
    # Waited for off the loop's thread, a 30 ms step behind 50 ms of input:
    # the device idles 20 ms in each next(), 50 ms in the one after a read.
    waits = _planted([20, 20, 20, 20, 50], seed=1)
    judgement = judge(_records(_planted([30] * EVERY), waits), synced=True)
    assert judgement["verdict"] == "input_bound", judgement
    # Input waited for on the k-th batch alone is a periodic stall.
    judgement = judge(_records(_planted([30] * EVERY), _planted([0, 0, 0, 0, 40], seed=1)),
                      synced=True)
    assert (judgement["verdict"], judgement["period"]) == ("periodic_stall", EVERY), judgement


@pytest.mark.parametrize("logs", [{"loss": 0.5}, None], ids=["logs", "no_logs"])
def test_a_callback_list_loop_with_logs_is_synced_one_without_is_not_known(logs):
    keras = pytest.importorskip("keras")
    import keras_gpufix as kg

    # Steps of 0.5 ms in the hooks' span, 40 ms more every 5th: a stall when
    # the steps are synced, the signature of unsynced ones when not known.
    monitor = kg.GPUOscillationMonitor(nvml=False, verbose=0)
    hooks = keras.callbacks.CallbackList([monitor])
    hooks.on_train_begin()
    hooks.on_epoch_begin(0)
    for step in range(60):
        hooks.on_train_batch_begin(step)
        time.sleep(0.04005 if step % EVERY == EVERY - 1 else 0.0005)
        hooks.on_train_batch_end(step, logs)
    hooks.on_epoch_end(0)
    hooks.on_train_end()
    judged = monitor.detector.last_judgement
    if logs:  # Keras turned the logs into numbers: it waited for the step
        assert monitor.detector.synced is True
        assert (judged["verdict"], judged["period"]) == ("periodic_stall", EVERY)
    else:
        assert monitor.detector.synced is None
        assert (judged["verdict"], judged["evidence"]["unsynced_period"]) == ("healthy", EVERY)


# -- real loops on both asynchronous modes ---------------------------------

def _loop_runs(backend):
    """Runs the loops of `_main` under `backend` in a subprocess; its figures."""
    env = dict(os.environ, KERAS_BACKEND=backend, PYTHONPATH=os.getcwd(),
               TF_CPP_MIN_LOG_LEVEL="2",
               # one compute thread: a step's time swings less on a shared host
               XLA_FLAGS="--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1")
    out = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module", params=["jax", "tensorflow"])
def runs(request):
    if request.param == "jax":
        pytest.importorskip("jax")
    return _loop_runs(request.param)


def test_reading_the_loss_every_k_steps_is_healthy_at_the_loops_step_time(runs):
    # Each loop's judged step time is its wall time per step (read around the
    # loop), not the dispatch's time nor the wait of the read for EVERY steps.
    # The median lies under the mean where the host's load added outliers,
    # and a TensorFlow loop's wall time sometimes doubles at the same step
    # time (the loop without the monitor too, `bare_after`: 21.2 ms per step
    # at 12.4 ms between reads): the low bound is the lower of the wall time
    # and the step of the loop without the monitor.
    bare = min(runs["bare"]["median_ms"], runs["bare_after"]["median_ms"])

    def near_wall(run, judged):
        return 0.6 * min(run["wall_ms"], bare) <= judged <= 1.25 * run["wall_ms"]

    assert runs["read_every_step"]["verdict"] == "healthy", runs["read_every_step"]
    for synced in (runs["read_every_step"], runs["read_every_k"], runs["read_every_k_step_done"]):
        assert synced["verdict"] == "healthy", synced
        assert near_wall(synced, synced["median_ms"]), synced
        assert synced["input_wait"] < 0.2  # next() did not queue behind the device
    # Unsynced: not measured per step, judged per period of EVERY steps.
    unsynced = runs["read_every_k_unsynced"]
    assert unsynced["verdict"] == "healthy", unsynced
    assert unsynced["input_wait"] is None
    assert unsynced["unsynced_period"] == EVERY
    assert near_wall(unsynced, unsynced["judged_ms"]), unsynced


def test_slow_input_and_work_every_k_steps_are_named(runs):
    assert runs["slow_input"]["verdict"] == "input_bound", runs["slow_input"]
    stall = runs["work_every_k"]
    assert (stall["verdict"], stall["period"]) == ("periodic_stall", EVERY), stall


def _main():
    """The loops, on the backend of KERAS_BACKEND; prints their figures as JSON."""
    backend = os.environ["KERAS_BACKEND"]
    if backend == "tensorflow":
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(1)
        tf.config.experimental.set_synchronous_execution(False)
    import keras

    import keras_gpufix as kg

    if backend == "jax":  # the benchmark's `jax.jit` step (Keras's JAX custom-loop guide)
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(
            os.path.abspath(__file__))), "benchmarks"))
        from gpu_checks import jit_step as _jax_step
    hidden = HIDDEN[backend]
    model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(hidden, activation="relu"),
                              keras.layers.Dense(hidden, activation="relu"), keras.layers.Dense(1)])
    optimizer = keras.optimizers.SGD(0.01)
    loss_fn = keras.losses.MeanSquaredError()
    rng = np.random.default_rng(0)
    x = rng.random((STEPS * BATCH, FEATURES), dtype=np.float32)
    y = x[:, :1] * 2.0
    train_step = _jax_step(model, optimizer, loss_fn) if backend == "jax" else \
        _tf_step(model, optimizer, loss_fn)

    def batches(slow):
        if backend == "jax":
            for i in range(STEPS):
                if slow:
                    time.sleep(INPUT_S)
                yield x[i * BATCH:(i + 1) * BATCH], y[i * BATCH:(i + 1) * BATCH]
            return
        import tensorflow as tf

        ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
        if slow:
            ds = ds.map(lambda a, b: (tf.ensure_shape(tf.numpy_function(
                lambda v: time.sleep(INPUT_S) or v, [a], tf.float32), [None, FEATURES]), b))
        yield from ds.cache().prefetch(2)

    def run(read_every, sync=True, slow=False, work=False, done=False):
        monitor = kg.GPUOscillationMonitor(nvml=False, verbose=0)
        with kg.watch(batches(slow), callbacks=[monitor], sync=sync) as watched:
            for step, (xb, yb) in enumerate(watched):
                if step == 1:
                    started = time.perf_counter()  # steps 1.. (the first's begin holds the setup)
                loss = train_step(xb, yb)
                if done:
                    watched.step_done(loss)  # on JAX: waits for the loss alone
                if step % read_every == read_every - 1:
                    float(loss)  # logging the loss
                if work and step % EVERY == EVERY - 1:
                    time.sleep(WORK_S)  # a plot written every 5th step
            wall_ms = (time.perf_counter() - started) / (STEPS - 1) * 1e3
        report = monitor.report()
        judged = monitor.detector.last_judgement["evidence"]
        events = report["events"]
        return {"verdict": report["verdict"], "events": [e["message"] for e in events], "median_ms": report["step_time"]["p50_ms"],
                "input_wait": report["input_wait"], "judged_ms": judged.get("median_ms"),
                "unsynced_period": judged.get("unsynced_period"),
                "period": events[-1]["period"] if events else None, "wall_ms": wall_ms}

    def bare():
        """The loop without the monitor: its step time, the median of the
        spans between two reads of the loss (each waits for its step) per step."""
        reads, started = [], time.perf_counter()
        for step, (xb, yb) in enumerate(batches(False)):
            loss = train_step(xb, yb)
            if step % EVERY == EVERY - 1:
                float(loss)
                reads.append(time.perf_counter())
        spans = np.diff(reads[1:]) / EVERY  # the first span holds the compile
        return {"median_ms": float(np.median(spans)) * 1e3,
                "wall_ms": (time.perf_counter() - started) / STEPS * 1e3}

    runs = {"bare": bare(), "read_every_step": run(1), "read_every_k": run(EVERY),
            "read_every_k_unsynced": run(EVERY, sync=False),
            "read_every_k_step_done": run(EVERY, done=True)}
    runs["bare_after"] = bare()  # the host's load drifts: a reference either side
    runs["slow_input"] = run(EVERY, slow=True)
    runs["work_every_k"] = run(EVERY, work=True)
    print(json.dumps(runs))


def _tf_step(model, optimizer, loss_fn):
    """A `tf.function` step with a GradientTape; its first op sleeps `DEVICE_S`.

    The sleep stands in for the accelerator's share of the step, as in
    `custom_loops.py`: asynchronous eager execution runs the whole step,
    sleep included, on its executor's thread, and a sleep's time does not
    swing with the host's load as computing does.
    """
    import tensorflow as tf

    def device(v):
        time.sleep(DEVICE_S)
        return v

    @tf.function
    def train_step(xb, yb):
        xb = tf.ensure_shape(tf.numpy_function(device, [xb], tf.float32), xb.shape)
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        grads = tape.gradient(loss, model.trainable_weights)
        optimizer.apply(grads, model.trainable_weights)
        return loss

    return train_step


if __name__ == "__main__":
    _main()
