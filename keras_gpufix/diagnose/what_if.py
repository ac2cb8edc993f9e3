"""What-if: how fast the input alone supplies batches vs how fast the step alone consumes them.

After a run (a `fit` or a custom loop) that timed steps, diagnose measures,
with nothing else running:

| figure                  | how                                                  |
|-------------------------|------------------------------------------------------|
| `input_batches_per_s`   | a fresh iterator of the same `tf.data` dataset,      |
|                         | drained for a bounded few seconds (the user's own    |
|                         | iterator is not touched; its first batch, the        |
|                         | pipeline's start-up, is not timed)                   |
| `step_batches_per_s`    | one cached batch replayed through the same step      |
|                         | function (`model.train_function` for fit, the        |
|                         | observed train `tf.function` for a loop); the        |
|                         | weights, optimizer and metric state are restored     |
|                         | afterwards                                           |
| `observed_batches_per_s`| the run's own steady-state cycles (batch start to    |
|                         | batch start, the first cycles of each epoch left out)|

With the input free, a cycle would be the replayed step plus the time the
run spent between steps (callbacks, logging, the loop's own work), so
`speedup_if_input_free` = observed cycle / (replayed step + between). On a
CPU host this also catches the input competing with the step for cores:
the input wait reads 0% while the step runs slower than alone.

A step that cannot be replayed (an eager `GradientTape` step has no
function to call again) is taken as measured in the run (`method`
`in_run`): the speedup is then the share of the cycle spent waiting for
input, nothing more.
"""

import statistics
import time

from keras_gpufix.analysis import THRESHOLDS

__all__ = ["Cycles", "cycle_callback", "input_rate", "fit_replay", "replay_rate", "what_if",
           "format_what_if"]

SECONDS = 1.5  # budget of each of the two measurements
MAX_BATCHES = 2000  # the input drain never reads more than this


class Cycles:
    """Steady-state cycle durations of one run, in seconds.

    Args:
        skip: cycles left out at the start of each epoch (iterator
            start-up, the first call's trace and compile). Defaults to 2.
    """

    def __init__(self, skip=2):
        self.skip = skip
        self.cycle_s = []
        self.between_s = []
        self._left = skip

    def epoch(self):
        """A new epoch begins: its first `skip` cycles are left out."""
        self._left = self.skip

    def add(self, cycle_s, between_s):
        """One cycle: batch start to next batch start, and its host time between steps."""
        if self._left:
            self._left -= 1
            return
        self.cycle_s.append(cycle_s)
        self.between_s.append(between_s)


def cycle_callback(cycles):
    """A Keras callback that feeds `fit`'s cycles into `cycles` (a `Cycles`)."""
    import keras

    class CycleClock(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self._begin = self._end = None

        def on_epoch_begin(self, epoch, logs=None):
            cycles.epoch()
            self._begin = self._end = None

        def on_train_batch_begin(self, batch, logs=None):
            now = time.perf_counter()
            if self._begin is not None:
                cycles.add(now - self._begin, now - self._end)
            self._begin = now

        def on_train_batch_end(self, batch, logs=None):
            self._end = time.perf_counter()

    return CycleClock()


def input_rate(dataset, seconds=SECONDS):
    """Batches/s a fresh iterator of `dataset` supplies alone (None: under two batches).

    The first batch (the pipeline's start-up: shuffle buffers, the first
    file) is not timed.
    """
    iterator = iter(dataset)
    if next(iterator, None) is None:
        return None
    count, t0 = 0, time.perf_counter()
    deadline = t0 + seconds
    for _ in iterator:
        count += 1
        if count >= MAX_BATCHES or time.perf_counter() >= deadline:
            break
    elapsed = time.perf_counter() - t0
    return count / elapsed if count and elapsed > 0 else None


def fit_replay(model, dataset):
    """(call, variables, batches per call): `model.train_function` on one cached batch.

    The batch is the dataset's first, cached (`take(1).cache().repeat()`),
    so the step sees the element spec it was traced for.
    """
    batches = model.distribute_strategy.experimental_distribute_dataset(
        dataset.take(1).cache().repeat())
    iterator = iter(batches)
    function = model.train_function
    variables = {id(v): v for v in (*model.variables, *model.optimizer.variables,
                                     *model.metrics_variables)}
    return (lambda: function(iterator)), list(variables.values()), model.steps_per_execution


def replay_rate(call, variables, batches_per_call=1, seconds=SECONDS):
    """Batches/s of `call()` run alone; the values of `variables` are restored after.

    Args:
        call: runs the step on one cached batch.
        variables: every variable the step writes (weights, optimizer
            slots and iterations, metric totals).
        batches_per_call: steps one call runs (`steps_per_execution`).
        seconds: the timing budget.
    """
    saved = [(v, v.numpy()) for v in variables]
    readable = next((v for v in variables if v.trainable), variables[0] if variables else None)

    def sync():  # a read of a written variable waits for the queued steps
        if readable is not None:
            readable.numpy()

    try:
        call()
        call()  # a trace at the cached batch's shape is not timed
        sync()
        calls, rounds, t0 = 0, 1, time.perf_counter()
        while True:
            for _ in range(rounds):
                call()
            calls += rounds
            sync()
            elapsed = time.perf_counter() - t0
            if elapsed >= seconds or calls >= MAX_BATCHES:
                break
            rounds = max(1, min(MAX_BATCHES - calls,
                                int((seconds - elapsed) / (elapsed / calls))))
    finally:
        for variable, value in saved:
            variable.assign(value)
    return calls * batches_per_call / elapsed


def what_if(cycles, input_per_s, step_per_s, method="replay"):
    """The what-if figures of one run, or None when it had no steady cycles.

    Args:
        cycles: the run's `Cycles`.
        input_per_s: batches/s the input supplies alone (None: not measured).
        step_per_s: batches/s the step consumes alone (`method` "replay"),
            or None when the step could not be replayed: then `cycles`
            holds, as between-step time, all the run's time outside its
            input (`method` "in_run").
        method: how `step_per_s` was measured.

    Returns:
        A dict `input_batches_per_s`, `step_batches_per_s`,
        `observed_batches_per_s`, `between_ms` (mean host time between
        steps), `speedup_if_input_free`, `bound`
        (`input` or `step`), `method`, `cycles` (how many were timed).
    """
    if not cycles.cycle_s:
        return None
    cycle = statistics.fmean(cycles.cycle_s)
    between = statistics.fmean(cycles.between_s)
    if step_per_s is None:  # the loop passed all its time outside next() as `between`
        method, free_cycle = "in_run", between
        step_per_s = 1.0 / between if between > 0 else None
    else:
        free_cycle = 1.0 / step_per_s + between
    speedup = cycle / free_cycle if free_cycle > 0 else None
    bound = None
    if input_per_s and step_per_s:
        bound = "input" if input_per_s < 1.0 / free_cycle else "step"
    return {"input_batches_per_s": input_per_s, "step_batches_per_s": step_per_s,
            "observed_batches_per_s": 1.0 / cycle, "between_ms": 1000 * between,
            "speedup_if_input_free": speedup, "bound": bound, "method": method,
            "cycles": len(cycles.cycle_s)}


def format_what_if(result):
    """The what-if as one sentence for people."""
    x, y = result.get("input_batches_per_s"), result.get("step_batches_per_s")
    z = result.get("speedup_if_input_free")
    if not x or not y or z is None:
        return (f"what-if: not measured ({result.get('reason', 'no steady cycles')}); "
                f"the run went at {result.get('observed_batches_per_s') or 0:.1f} batches/s")
    faster = z >= THRESHOLDS["min_speedup"]
    gain = f"{z:.2f}x faster" if faster else f"no faster ({z:.2f}x)"
    how = "" if result.get("method") == "replay" else " (step as measured in the run)"
    if result["bound"] == "input":
        return (f"what-if: input supplies {x:.1f} batches/s, the step consumes {y:.1f} "
                f"batches/s{how}: with input free the run would be {gain} "
                f"(it ran at {result['observed_batches_per_s']:.1f} batches/s)")
    return (f"what-if: the step consumes {y:.1f} batches/s{how}, input supplies {x:.1f} "
            f"batches/s: the step is the bound (the input could feed a step {x / y:.1f}x "
            f"faster); with input free the run would be {gain}"
            + (" (the input competes with the step for the host)"
               if faster and result.get("method") == "replay" else "")
            + f" (it ran at {result['observed_batches_per_s']:.1f} batches/s)")
