"""The checks to run where a GPU is lent (../shared/GPU_CHECKS.md), on the Keras JAX backend.

    python benchmarks/gpu_checks.py [--small] [--rounds 3] [--parts a,b] [--out PATH]

Runs without TensorFlow (the lent machine has jax with CUDA and
`nvidia-ml-py`, not TensorFlow). `--small` is a CPU mode: a small model and
short runs, to try the script anywhere. What it does:

1. Planted cases with known verdicts, in `fit` and in a `jax.jit` loop
   under `kg.watch`:

   | run                                   | planted                      | verdict          |
   |---------------------------------------|------------------------------|------------------|
   | `fit`, in-memory `PyDataset`          | nothing                      | `healthy`        |
   | `fit`, slow `PyDataset`               | each batch sleeps 2x a step  | `input_bound`    |
   | `fit`, a callback                     | sleeps 3x a step every 5th   | `periodic_stall` |
   | loop, loss read every step            | nothing                      | `healthy`        |
   | loop, loss read every 5th step        | nothing                      | `healthy`        |
   | the same, `kg.watch(..., sync=False)` | nothing                      | `healthy`        |
   | loop, slow input                      | each batch sleeps 2x a step  | `input_bound`    |
   | loop, work every 5th step             | sleeps 3x a step every 5th   | `periodic_stall` |

   A `fit` measures the wait for a `PyDataset`'s batches on the JAX backend
   too (`backends/batch_clock.py`), with or without NVML.
2. Beside every planted run, `nvidia-smi --query-gpu=utilization.gpu -lms
   100` runs in the same time, and its mean is put beside the monitor's
   NVML reading (skipped, with a note, where there is no GPU).
3. Overhead: steps/s of `fit` with every keras_gpufix callback ÷ the same
   `fit` with none, at a long (~30 ms on an H100) and a short (~4 ms) step,
   in interleaved rounds (median of the rounds' ratios; goal >= 0.98), with
   whether Keras kept its asynchronous callback dispatch; and steps/s of a
   `jax.jit` loop (loss read every 5th step) under `kg.watch` ÷ the bare
   loop, both timed from their first batch, with the watched run's
   start-up and close (once a loop) beside it. `watch_host_cost`: the host
   time `kg.watch` adds to each step, on a `jax.jit` step so small that the
   loop is all host work (on a CPU too: its mechanism, where no GPU is lent).
4. Variable-length batches: a Conv1D `fit` on a `PyDataset` whose every
   batch has a new length (an unbucketed speech loader), two epochs: the verdict
   (`recompiling` planted), the distinct shapes, the XLA compile seconds JAX
   reported (`jax.monitoring`) and the fit's wall time.
5. Keras's `TensorBoard` callback (`update_freq="epoch"`, no profiling) in a
   `fit` with our callbacks, at the short step: the finding
   (`sync_callbacks`, naming it) and its price (share of the time) beside
   the slowdown measured against the same `fit` without it, interleaved.
   Keras's TensorBoard needs TensorFlow; where it is not installed (the lent
   GPU machine) `TerminateOnNaN`, which also overrides a batch-end hook, is
   used instead and the `note` says so.
6. `keras-gpufix diagnose` of unchanged JAX scripts, each in a fresh
   process (`diagnosed`): a `fit` over a slow `PyDataset` (with and without
   workers) -> `input_bound`; a `jax.jit` loop with work every 5th step ->
   `periodic_stall` at that line; the loop at a new length each step ->
   `recompiling` with JAX's compile seconds; `--steps 30` stops the loop;
   `tensorflow` never in the diagnosed process's `sys.modules`.

Figures are written as JSON to `--out` (default
`benchmarks/results/gpu_checks.json`) and, where `$OUT` is set (the lent
machine's folder that comes back), to `$OUT/gpu_checks.json`, after every
part, so a run cut short still leaves what it measured.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_gpufix as kg  # noqa: E402
from _results import add_out_argument, write_results  # noqa: E402
from keras_gpufix.keras_internals import async_train_dispatch  # noqa: E402
from keras_gpufix.nvml import nvml_status  # noqa: E402

EVERY = 5
# model and batch sizes per mode: ~30 ms and ~4 ms steps on an H100 (Dense
# 8 x 4096, 118 M parameters), a few to tens of ms on a CPU
SIZES = {
    "gpu": {"features": 256, "width": 4096, "depth": 8, "long": 12288, "short": 1024,
            "steps": 200, "distinct": 8, "lengths": 10, "conv_batch": 64},
    "small": {"features": 64, "width": 256, "depth": 3, "long": 2048, "short": 256,
              "steps": 120, "distinct": 4, "lengths": 8, "conv_batch": 8},
}


class Batches(keras.utils.PyDataset):
    """`steps` batches cycling over a few made in memory; `sleep` seconds each (slow input)."""

    def __init__(self, batches, steps, sleep=0.0):
        super().__init__()
        self.batches, self.steps, self.sleep = batches, steps, sleep

    def __len__(self):
        return self.steps

    def __getitem__(self, index):
        if self.sleep:
            time.sleep(self.sleep)
        return self.batches[index % len(self.batches)]


class SleepEvery(keras.callbacks.Callback):
    """Sleeps `seconds` at the end of every `k`-th step (a checkpoint-like callback)."""

    def __init__(self, k, seconds):
        super().__init__()
        self.k, self.seconds = k, seconds

    def on_train_batch_end(self, batch, logs=None):
        if batch % self.k == self.k - 1:
            time.sleep(self.seconds)


class EpochTime(keras.callbacks.Callback):
    """Seconds of the last epoch (no batch-end hook: Keras's dispatch stays asynchronous)."""

    def on_epoch_begin(self, epoch, logs=None):
        self.t0 = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.seconds = time.perf_counter() - self.t0


class SmiReader:
    """`nvidia-smi --query-gpu=utilization.gpu -lms 100` in the background; its mean, %."""

    def __init__(self):
        self.values, self._proc, self._thread = [], None, None

    def __enter__(self):
        self._proc = subprocess.Popen(
            ["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits",
             "-lms", "100"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()
        return self

    def _read(self):
        for line in self._proc.stdout:
            first = line.strip().split(",")[0].strip()
            if first.isdigit():
                self.values.append(float(first))

    def __exit__(self, *exc):
        self._proc.terminate()
        self._proc.wait(timeout=10)
        self._thread.join(timeout=10)

    def mean(self):
        return statistics.fmean(self.values) if self.values else None


class _NoSmi:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def mean(self):
        return None


def build_model(size):
    layers = [keras.Input((size["features"],))]
    layers += [keras.layers.Dense(size["width"], activation="relu") for _ in range(size["depth"])]
    model = keras.Sequential(layers + [keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(1e-4), "mse")
    return model


def make_batches(size, batch, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(size["distinct"]):
        x = rng.random((batch, size["features"]), dtype=np.float32)
        out.append((x, x[:, :1] * 2.0))
    return out


def our_callbacks(log_dir, verbose=0):
    """Every public keras_gpufix callback (the monitor first: the reports' source)."""
    return [kg.GPUOscillationMonitor(verbose=verbose), kg.StepTimer(),
            kg.ProfilerTrigger(log_dir, analyze=False, verbose=verbose),
            kg.RetracingMonitor(verbose=verbose)]


def _judged(report, planted, expected, smi, note=None, **extra):
    period = None
    for event in report.get("events", []):
        if event["verdict"] == report["verdict"]:
            period = event.get("period")
    step = report.get("step_time") or {}
    nvml = report.get("gpu_util")
    ok = report["verdict"] == expected[0] and (expected[1] is None or period == expected[1])
    return {"run": planted, "verdict": report["verdict"], "period": period,
            "expected": expected[0], "expected_period": expected[1], "as_planted": ok,
            "median_step_ms": step.get("p50_ms"), "input_wait": report.get("input_wait"),
            "gpu_util_nvml_pct": None if nvml is None else 100.0 * nvml,
            "gpu_util_smi_pct": smi.mean(), "note": note, **extra}


def step_seconds(model, batches, rounds=3):
    """Median seconds per step of `fit` with no callbacks (after a warm-up fit)."""
    times = []
    for _ in range(rounds):
        clock = EpochTime()
        model.fit(Batches(batches, 20), epochs=1, verbose=0, callbacks=[clock])
        times.append(clock.seconds / 20)
    return statistics.median(times)


def planted_fits(size, smi_on, log_dir):
    model = build_model(size)
    batches = make_batches(size, size["long"])
    model.fit(Batches(batches, 10), epochs=1, verbose=0)  # compile
    step = step_seconds(model, batches)
    steps = size["steps"]
    cases = [
        ("fit: in-memory", Batches(batches, steps), [], ("healthy", None), None),
        ("fit: slow PyDataset", Batches(batches, steps, sleep=2 * step), [],
         ("input_bound", None), None),
        ("fit: callback sleeping every 5th step", Batches(batches, steps),
         [SleepEvery(EVERY, 3 * step)], ("periodic_stall", EVERY), None),
    ]
    out = []
    for name, data, user, expected, note in cases:
        callbacks = our_callbacks(log_dir)
        hooks = keras.callbacks.CallbackList(callbacks + user, add_history=True, model=model)
        with (SmiReader() if smi_on else _NoSmi()) as smi:
            model.fit(data, epochs=1, verbose=0, callbacks=hooks)
        out.append(_judged(callbacks[0].report(), name, expected, smi, note,
                           async_dispatch=async_train_dispatch(hooks),
                           planted_step_ms=step * 1e3))
    return out


def jit_step(model, optimizer, loss_fn):
    """A `jax.jit` train step over the model's state (Keras's JAX custom-loop guide).

    Returns `train_step(xb, yb) -> loss` (also used by tests/test_watch_async.py).
    """
    import jax

    optimizer.build(model.trainable_variables)

    def compute_loss(trainable, non_trainable, xb, yb):
        pred, non_trainable = model.stateless_call(trainable, non_trainable, xb, training=True)
        return loss_fn(yb, pred), non_trainable

    grad_fn = jax.value_and_grad(compute_loss, has_aux=True)

    @jax.jit
    def step(state, xb, yb):
        trainable, non_trainable, opt_vars = state
        (loss, non_trainable), grads = grad_fn(trainable, non_trainable, xb, yb)
        trainable, opt_vars = optimizer.stateless_apply(opt_vars, grads, trainable)
        return loss, (trainable, non_trainable, opt_vars)

    state = [[v.value for v in model.trainable_variables],
             [v.value for v in model.non_trainable_variables],
             [v.value for v in optimizer.variables]]

    def train_step(xb, yb):
        loss, state[:] = step(tuple(state), xb, yb)
        return loss

    return train_step


def loop_step(size):
    return jit_step(build_model(size), keras.optimizers.SGD(1e-4),
                    keras.losses.MeanSquaredError())


def device_batches(batches):
    import jax

    return [tuple(jax.device_put(a) for a in batch) for batch in batches]


def feed(batches, steps, sleep=0.0):
    for i in range(steps):
        if sleep:
            time.sleep(sleep)
        yield batches[i % len(batches)]


def loop_seconds(train_step, batches, steps, read_every=EVERY):
    """Seconds per step of the bare loop (loss read every `read_every` steps),
    timed from its first batch, as `watch_overhead` times the watched loop."""
    loss = t0 = None
    for i, (xb, yb) in enumerate(feed(batches, steps)):
        t0 = t0 or time.perf_counter()
        loss = train_step(xb, yb)
        if i % read_every == read_every - 1:
            float(loss)
    float(loss)
    return (time.perf_counter() - t0) / steps


def planted_loops(size, smi_on):
    train_step = loop_step(size)
    batches = device_batches(make_batches(size, size["long"]))
    loop_seconds(train_step, batches, 10)  # compile
    step = statistics.median(loop_seconds(train_step, batches, 20, read_every=1)
                             for _ in range(3))
    steps = size["steps"]
    cases = [  # name, read every, sync, input sleep, body sleep every EVERY, expected
        ("loop: loss read every step", 1, True, 0.0, 0.0, ("healthy", None)),
        ("loop: loss read every 5th step", EVERY, True, 0.0, 0.0, ("healthy", None)),
        ("loop: loss read every 5th step, sync=False", EVERY, False, 0.0, 0.0,
         ("healthy", None)),
        ("loop: slow input", 1, True, 2 * step, 0.0, ("input_bound", None)),
        ("loop: work every 5th step", 1, True, 0.0, 3 * step, ("periodic_stall", EVERY)),
    ]
    out = []
    for name, read_every, sync, input_sleep, body_sleep, expected in cases:
        monitor = kg.GPUOscillationMonitor(verbose=0)
        with (SmiReader() if smi_on else _NoSmi()) as smi:
            with kg.watch(feed(batches, steps, input_sleep), callbacks=[monitor],
                          sync=sync) as watched:
                for i, (xb, yb) in enumerate(watched):
                    loss = train_step(xb, yb)
                    if i % read_every == read_every - 1:
                        float(loss)
                    if body_sleep and i % EVERY == EVERY - 1:
                        time.sleep(body_sleep)
        out.append(_judged(monitor.report(), name, expected, smi,
                           planted_step_ms=step * 1e3))
    return out


def fit_overhead(size, rounds, log_dir):
    """Steps/s with every keras_gpufix callback ÷ none, long and short steps, interleaved."""
    model = build_model(size)
    out = {}
    for label in ("long", "short"):
        batches = make_batches(size, size[label])
        model.fit(Batches(batches, 10), epochs=1, verbose=0)  # compile this shape
        ratios, bare_ms, async_on, traces = [], [], [], 0
        for _ in range(rounds):
            none = EpochTime()
            model.fit(Batches(batches, size["steps"]), epochs=1, verbose=0, callbacks=[none])
            timed, callbacks = EpochTime(), our_callbacks(log_dir)
            hooks = keras.callbacks.CallbackList([timed, *callbacks], add_history=True,
                                                 model=model)
            model.fit(Batches(batches, size["steps"]), epochs=1, verbose=0, callbacks=hooks)
            ratios.append(none.seconds / timed.seconds)
            bare_ms.append(none.seconds / size["steps"] * 1e3)
            async_on.append(async_train_dispatch(hooks))
            traces += len(callbacks[2].traces)
        out[label] = {"batch": size[label], "step_ms_without_callbacks": statistics.median(bare_ms),
                      "steps_per_s_ratio_ours_over_none": statistics.median(ratios),
                      "ratios": ratios, "async_dispatch": async_on,
                      "profiler_traces_taken": traces}
    return out


def watch_overhead(size, rounds):
    """Steps/s of a jax.jit loop under kg.watch ÷ the bare loop (loss read every 5th)."""
    train_step = loop_step(size)
    batches = device_batches(make_batches(size, size["short"]))
    loop_seconds(train_step, batches, 10)
    steps, ratios, bare_ms, start_ms = size["steps"], [], [], []
    for _ in range(rounds):
        bare = loop_seconds(train_step, batches, steps)
        opened = time.perf_counter()
        with kg.watch(feed(batches, steps),
                      callbacks=[kg.GPUOscillationMonitor(verbose=0)]) as watched:
            loss = t0 = None
            for i, (xb, yb) in enumerate(watched):
                t0 = t0 or time.perf_counter()  # from the first batch, as the bare loop
                loss = train_step(xb, yb)
                if i % EVERY == EVERY - 1:
                    float(loss)
            float(loss)
            seconds = time.perf_counter() - t0
        ratios.append(bare / (seconds / steps))
        bare_ms.append(bare * 1e3)
        # once a loop: the run's start-up (first batch included) and its close
        start_ms.append((time.perf_counter() - opened - seconds) * 1e3)
    return {"batch": size["short"], "step_ms_bare": statistics.median(bare_ms),
            "steps_per_s_ratio_watch_over_bare": statistics.median(ratios), "ratios": ratios,
            "start_and_close_ms": statistics.median(start_ms)}


def watch_host_cost(rounds, steps=3000):
    """The host time kg.watch adds to each step: a `jax.jit` step so small (a 16-float
    add) that the loop is all host work, bare and under `kg.watch` (loss read every
    5th step, as `watch_overhead`), in interleaved rounds; each way's fastest round.
    A loop whose host work and device work overlap (a GPU's) keeps
    `step / (step + cost)` of its steps/s at most where the host is its bound, and
    all of them where the device is: the ratios at the H100/H200 checks' steps."""
    import jax
    import jax.numpy as jnp

    tiny = jax.jit(lambda x: x + 1.0)
    batches = [(jnp.zeros(16), None)] * 8

    def bare():
        loss = None
        t0 = time.perf_counter()
        for i, (xb, _) in enumerate(feed(batches, steps)):
            loss = tiny(xb)
            if i % EVERY == EVERY - 1:
                float(loss[0])
        float(loss[0])
        return (time.perf_counter() - t0) / steps

    def watched():
        loss = None
        t0 = time.perf_counter()
        with kg.watch(feed(batches, steps),
                      callbacks=[kg.GPUOscillationMonitor(verbose=0)]) as loop:
            for i, (xb, _) in enumerate(loop):
                loss = tiny(xb)
                if i % EVERY == EVERY - 1:
                    float(loss[0])
            float(loss[0])
        return (time.perf_counter() - t0) / steps

    bare(), watched()  # compile, warm
    ways = {"bare": [], "watch": []}
    for _ in range(rounds):
        ways["bare"].append(bare())
        ways["watch"].append(watched())
    bare_s, watch_s = min(ways["bare"]), min(ways["watch"])
    cost = watch_s - bare_s
    return {"steps": steps, "bare_us_per_step": bare_s * 1e6, "watch_us_per_step": watch_s * 1e6,
            "watch_host_cost_us_per_step": cost * 1e6,
            "rounds_us": {k: [v * 1e6 for v in vs] for k, vs in ways.items()},
            "host_bound_ratio_at_step_ms": {ms: ms / (ms + cost * 1e3)
                                            for ms in (3.1, 3.8, 29.8, 33.0)}}


class NewLengths(keras.utils.PyDataset):
    """`steps` batches an epoch of `(batch, T, 80)` features, T new at every batch."""

    def __init__(self, batch, steps):
        super().__init__()
        self.batch, self.steps, self.made = batch, steps, 0

    def __len__(self):
        return self.steps

    def __getitem__(self, index):
        self.made += 1
        x = np.zeros((self.batch, 64 + 8 * self.made, 80), np.float32)
        return x, np.zeros((self.batch, 1), np.float32)


def variable_length(size, smi_on):
    """A Conv1D fit on batches of a new length each (issue 30): recompiling, priced."""
    model = keras.Sequential([
        keras.Input((None, 80)), keras.layers.Conv1D(256, 5, padding="same", activation="relu"),
        keras.layers.Conv1D(256, 5, padding="same", activation="relu"),
        keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(1e-4), "mse")
    monitor = kg.GPUOscillationMonitor(verbose=0)
    counted = kg.RetracingMonitor(verbose=0, warn=False)
    data = NewLengths(size["conv_batch"], size["lengths"])
    started = time.perf_counter()
    with (SmiReader() if smi_on else _NoSmi()) as smi:
        model.fit(data, epochs=2, verbose=0, callbacks=[monitor, counted])
    wall = time.perf_counter() - started
    retraced = counted.report()
    compiles = [e["compile_s"] for e in retraced["shape_events"] if e["compile_s"]]
    return _judged(monitor.report(), "fit: a new batch length every step",
                   ("recompiling", None), smi, fit_seconds=wall,
                   new_shapes=retraced["new_shapes"], compiles=len(compiles),
                   compile_seconds_measured=sum(compiles),
                   recompile_ms_priced=retraced["recompile_ms"])


def keras_tensorboard(size, rounds, log_dir):
    """Keras's TensorBoard in a fit with ours: the finding and its price vs the slowdown."""
    import importlib.util

    with_tf = importlib.util.find_spec("tensorflow") is not None
    note = None if with_tf else ("TensorFlow is not installed: Keras's TensorBoard cannot "
                                 "run, TerminateOnNaN (also a batch-end hook) stands in")

    def blocker():
        if with_tf:
            return keras.callbacks.TensorBoard(os.path.join(log_dir, "keras_tb"),
                                               update_freq="epoch", profile_batch=0,
                                               write_graph=False)
        return keras.callbacks.TerminateOnNaN()

    model = build_model(size)
    batches = make_batches(size, size["short"])
    model.fit(Batches(batches, 10), epochs=1, verbose=0)  # compile this shape
    ratios, prices, verdicts, named = [], [], [], []
    for _ in range(rounds):
        alone, ours = EpochTime(), our_callbacks(log_dir)
        model.fit(Batches(batches, size["steps"]), epochs=1, verbose=0,
                  callbacks=[alone, *ours])
        timed, ours = EpochTime(), our_callbacks(log_dir)
        model.fit(Batches(batches, size["steps"]), epochs=1, verbose=0,
                  callbacks=[timed, blocker(), *ours])
        ratios.append(alone.seconds / timed.seconds)
        report = ours[0].report()
        verdicts.append(report["verdict"])
        prices.append(report["cost_share"])
        named.append(report["fix"].split(" override ")[0]
                     if report["verdict"] == "sync_callbacks" else None)
    return {"callback": "TensorBoard" if with_tf else "TerminateOnNaN", "note": note,
            "batch": size["short"], "verdicts": verdicts, "named": named,
            "price_cost_share": prices,
            "measured_slowdown": [1.0 - r for r in ratios],
            "steps_per_s_ratio_with_over_without": statistics.median(ratios)}


DIAGNOSED_FIT = """
import time

import keras
import numpy as np


class Slow(keras.utils.PyDataset):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        rng = np.random.default_rng(0)
        self.x = rng.random(({batch}, {features}), dtype=np.float32)

    def __len__(self):
        return {steps}

    def __getitem__(self, i):
        time.sleep({sleep})
        return self.x, self.x[:, :1]


layers = [keras.Input(({features},))]
layers += [keras.layers.Dense({width}, activation="relu") for _ in range({depth})]
model = keras.Sequential(layers + [keras.layers.Dense(1)])
model.compile(keras.optimizers.SGD(1e-4), "mse")
model.fit(Slow({workers}), epochs=1, verbose=0)
"""

DIAGNOSED_LOOP = """
import time

import jax
import jax.numpy as jnp
import numpy as np


@jax.jit
def step(params, x):
    def loss_of(params):
        h = x
        for w in params:
            h = jax.nn.relu(h @ w)
        return jnp.mean(h ** 2)

    loss, grads = jax.value_and_grad(loss_of)(params)
    return [w - 1e-4 * g for w, g in zip(params, grads)], loss


rng = np.random.default_rng(0)
params = [jnp.asarray(rng.random(({width}, {width}), dtype=np.float32) / {width})
          for _ in range({depth})]
lengths = {lengths}
batches = [jax.device_put(rng.random((n, {width}), dtype=np.float32)) for n in lengths]
for i in range({steps}):
    params, loss = step(params, batches[i % len(batches)])
    if i % 5 == 4:
        float(loss); time.sleep({stall})  # work every 5th step
float(loss)
"""

DIAGNOSE_RUNNER = (
    "import json, sys; from keras_gpufix.cli import main; "
    "code = main(['diagnose', '--json', '--log-dir', sys.argv[1], *sys.argv[3:]]); "
    "open(sys.argv[2], 'w').write(json.dumps({'code': code, "
    "'tensorflow_in_sys_modules': 'tensorflow' in sys.modules}))")


def diagnosed(size, log_dir):
    """`keras-gpufix diagnose` of unchanged JAX scripts, each in a fresh process (issue 41):

    | script                                            | planted               | verdict          |
    |---------------------------------------------------|-----------------------|------------------|
    | `fit`, `PyDataset` sleeping 3x a step             | slow input            | `input_bound`    |
    | the same with `workers=2`, sleeping 5x a step     | slow input            | `input_bound`    |
    | `jax.jit` loop over a list, sleeping every 5th    | host work every 5th   | `periodic_stall` |
    | the same loop at a new batch length each of 30    | recompiles            | `recompiling`    |
    | the first loop with `--steps 30`                  | -                     | stopped at 30    |

    Each row: the verdict, the stall's line (the loop's), the compile seconds,
    the steps run, and whether `tensorflow` was in the diagnosed process's
    `sys.modules` (it must not be). The diagnosed process does not take the
    GPU's memory up front (`XLA_PYTHON_CLIENT_PREALLOCATE=false`): this one
    holds most of it. The sleeps are multiples of a step of the same fit in
    this process (`step_seconds`)."""
    model, batches = build_model(size), make_batches(size, size["long"])
    model.fit(Batches(batches, 10), epochs=1, verbose=0)  # compile
    step_s = step_seconds(model, batches)  # this process's fit, as the script's will run
    fit = dict(features=size["features"], width=size["width"], depth=size["depth"],
               batch=size["long"], steps=size["steps"])
    loop = dict(width=size["width"], depth=size["depth"], steps=size["steps"])
    same = [size["long"] // 4] * 4
    new = [size["long"] // 4 + 8 * i for i in range(30)]  # 30 compiles
    cases = [
        ("diagnose: fit, slow PyDataset", DIAGNOSED_FIT.format(sleep=3 * step_s, workers="",
                                                               **fit), (), "input_bound"),
        ("diagnose: fit, slow PyDataset, workers=2",
         DIAGNOSED_FIT.format(sleep=5 * step_s, workers="workers=2, max_queue_size=2", **fit),
         (), "input_bound"),
        ("diagnose: jax.jit loop, work every 5th step",
         DIAGNOSED_LOOP.format(lengths=same, stall=3 * step_s, **loop), (), "periodic_stall"),
        ("diagnose: jax.jit loop, a new batch length each step",
         DIAGNOSED_LOOP.format(lengths=new, stall=0.0, **dict(loop, steps=len(new))), (),
         "recompiling"),
        ("diagnose: jax.jit loop, --steps 30",
         DIAGNOSED_LOOP.format(lengths=same, stall=3 * step_s, **loop), ("--steps", "30"),
         None),
    ]
    out = []
    for i, (name, code, options, expected) in enumerate(cases):
        folder = os.path.join(log_dir, f"diagnose_{i}")
        os.makedirs(folder)
        script, said = os.path.join(folder, "train.py"), os.path.join(folder, "said.json")
        with open(script, "w") as f:
            f.write(code)
        started = time.perf_counter()
        run = subprocess.run([sys.executable, "-c", DIAGNOSE_RUNNER, folder, said, *options,
                              "--", "python", script], capture_output=True, text=True,
                             timeout=300,
                             env=dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false"))
        row = {"run": name, "expected": expected, "seconds": time.perf_counter() - started,
               "planted_step_ms": step_s * 1e3}
        try:
            with open(said) as f:
                row.update(json.load(f))
            result = json.loads(run.stdout[run.stdout.index("{"):])
        except (OSError, ValueError) as exc:
            out.append({**row, "error": f"{exc}; stderr: {run.stderr[-2000:]}",
                        "as_planted": False})
            continue
        entry = (result["fits"] or [{}])[0]
        stall_line = next(n for n, text in enumerate(code.splitlines(), 1) if "every 5th" in text
                          ) if "every 5th" in code else None
        retracing = entry.get("retracing") or {}
        row.update({
            "verdict": result["verdict"], "kind": entry.get("kind"),
            "steps_timed": entry.get("steps"), "steps_run": entry.get("steps_run"),
            "stopped_by_diagnose": entry.get("stopped_by_diagnose"),
            "stall_where": (entry.get("step") or {}).get("stall_where"),
            "stall_line_expected": stall_line and f"{script}:{stall_line}",
            "gain": (result["fixes"] or [{}])[0].get("predicted", {}).get("speedup"),
            "compile_seconds": sum(e.get("compile_s") or 0.0
                                   for e in retracing.get("shape_events", [])),
            "shapes": len(retracing.get("shapes", [])),
            "what_if": (entry.get("what_if") or {}).get("reason"), "notes": result["notes"],
            "environment": {k: result["environment"].get(k)
                            for k in ("jax", "tensorflow", "devices", "gpus")}})
        if expected is None:
            row["as_planted"] = bool(row["stopped_by_diagnose"]) and row["code"] == 0
        else:
            row["as_planted"] = (row["verdict"] == expected and not row["tensorflow_in_sys_modules"]
                                 and (expected != "periodic_stall"
                                      or row["stall_where"] == row["stall_line_expected"]))
        out.append(row)
    return out


def device_name():
    import jax

    device = jax.devices()[0]
    return f"{device.platform}: {getattr(device, 'device_kind', device)}"


PARTS = ("planted", "fit_overhead", "watch_overhead", "watch_host_cost", "variable_length",
         "keras_tensorboard", "diagnose")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true",
                        help="a CPU mode: a small model and short runs")
    parser.add_argument("--rounds", type=int, default=3,
                        help="interleaved rounds of each overhead ratio (default 3)")
    parser.add_argument("--parts", type=lambda text: text.split(","), default=None,
                        metavar="a,b", help=f"run only these parts (of {', '.join(PARTS)})")
    add_out_argument(parser, "gpu_checks")
    args = parser.parse_args(argv)
    if keras.backend.backend() != "jax":
        parser.error(f"runs on the Keras JAX backend (KERAS_BACKEND=jax); "
                     f"this is {keras.backend.backend()}")
    size = SIZES["small" if args.small else "gpu"]
    nvml = nvml_status()
    smi_on = nvml["available"] and shutil.which("nvidia-smi") is not None
    paths = [args.out] + ([os.path.join(os.environ["OUT"], "gpu_checks.json")]
                          if os.environ.get("OUT") else [])
    details = {"mode": "small" if args.small else "gpu", "device": device_name(),
               "sizes": size, "rounds": args.rounds, "nvml": nvml,
               "utilisation_note": None if smi_on else
               f"no GPU utilisation compared: {nvml['reason'] or 'nvidia-smi not found'}"}
    figures = {}

    def save():
        for path in paths:
            write_results(path, "gpu_checks", figures, details)

    log_dir = tempfile.mkdtemp(prefix="gpu_checks_")
    parts = [(name, part) for name, part in [("planted", lambda: planted_fits(size, smi_on, log_dir)
              + planted_loops(size, smi_on)),
             ("fit_overhead", lambda: fit_overhead(size, args.rounds, log_dir)),
             ("watch_overhead", lambda: watch_overhead(size, args.rounds)),
             ("watch_host_cost", lambda: watch_host_cost(args.rounds)),
             ("variable_length", lambda: variable_length(size, smi_on)),
             ("keras_tensorboard", lambda: keras_tensorboard(size, args.rounds, log_dir)),
             ("diagnose", lambda: diagnosed(size, log_dir))]
             if args.parts is None or name in args.parts]
    for name, part in parts:
        started = time.perf_counter()
        details[name] = part()
        details[f"{name}_seconds"] = round(time.perf_counter() - started, 1)
        if name == "planted":
            figures["planted_as_planted"] = sum(r["as_planted"] for r in details[name])
            figures["planted_runs"] = len(details[name])
            gaps = [abs(r["gpu_util_nvml_pct"] - r["gpu_util_smi_pct"]) for r in details[name]
                    if r["gpu_util_nvml_pct"] is not None and r["gpu_util_smi_pct"] is not None]
            figures["gpu_util_max_gap_nvml_vs_smi_points"] = max(gaps) if gaps else None
        elif name == "fit_overhead":
            for label, row in details[name].items():
                figures[f"fit_steps_per_s_ratio_ours_over_none_{label}"] = row[
                    "steps_per_s_ratio_ours_over_none"]
                figures[f"fit_step_ms_{label}"] = row["step_ms_without_callbacks"]
        elif name == "watch_overhead":
            figures["watch_steps_per_s_ratio_over_bare"] = details[name][
                "steps_per_s_ratio_watch_over_bare"]
            figures["watch_start_and_close_ms"] = details[name]["start_and_close_ms"]
        elif name == "watch_host_cost":
            figures["watch_host_cost_us_per_step"] = details[name]["watch_host_cost_us_per_step"]
        elif name == "variable_length":
            row = details[name]
            figures["variable_length_verdict"] = row["verdict"]
            figures["variable_length_compile_seconds"] = row["compile_seconds_measured"]
        elif name == "diagnose":
            figures["diagnose_as_planted"] = sum(r["as_planted"] for r in details[name])
            figures["diagnose_runs"] = len(details[name])
        else:
            row = details[name]
            figures["keras_tensorboard_finding"] = row["verdicts"][-1]
            figures["keras_tensorboard_price_share"] = row["price_cost_share"][-1]
            figures["keras_tensorboard_measured_slowdown"] = (
                1.0 - row["steps_per_s_ratio_with_over_without"])
        save()
        print(f"{name}: done in {details[f'{name}_seconds']} s", flush=True)
    if args.parts is not None:
        print(json.dumps(figures, indent=1))
        return 0
    for row in details["planted"]:
        print(f"{row['run']}: {row['verdict']}"
              + ("" if row["period"] is None else f" period {row['period']}")
              + ("" if row["as_planted"] else f" (planted: {row['expected']})")
              + ("" if row["median_step_ms"] is None else
                 f", median step {row['median_step_ms']:.1f} ms")
              + ("" if row["gpu_util_nvml_pct"] is None else
                 f", GPU {row['gpu_util_nvml_pct']:.1f}% (nvidia-smi "
                 f"{row['gpu_util_smi_pct']}%)"), flush=True)
    row = details["variable_length"]
    print(f"{row['run']}: {row['verdict']}, {row['new_shapes']} shapes, {row['compiles']} "
          f"compiles, {row['compile_seconds_measured']:.1f} s compiling of a "
          f"{row['fit_seconds']:.1f} s fit", flush=True)
    row = details["keras_tensorboard"]
    price = row["price_cost_share"][-1]
    print(f"fit with Keras's {row['callback']}: {row['verdicts'][-1]} naming {row['named'][-1]}, "
          f"price {'-' if price is None else f'{price:.2f}'} of the time, measured slowdown "
          f"{1.0 - row['steps_per_s_ratio_with_over_without']:.2f}", flush=True)
    for row in details["diagnose"]:
        print(f"{row['run']}: {row.get('verdict', row.get('error'))}"
              + ("" if row["as_planted"] else f" (planted: {row['expected']})")
              + f", tensorflow imported: {row.get('tensorflow_in_sys_modules')}"
              + f", {row['seconds']:.0f} s", flush=True)
    planted_ok = (figures["planted_as_planted"] == figures["planted_runs"]
                  and figures["diagnose_as_planted"] == figures["diagnose_runs"])
    return 0 if planted_ok and figures["variable_length_verdict"] == "recompiling" else 1


if __name__ == "__main__":
    sys.exit(main())
