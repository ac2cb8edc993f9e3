"""The monitor's live input-wait share against XProf's and against `next()` timed alone.

Each test looks at the same steps of one `fit` of a planted dataset:
`ProfilerTrigger` traces steps [START, START + STEPS) with step markers and
XProf reports the input share (the time in the step's `IteratorGetNext`);
a `StepTimer` in the same fit has each step's record with its measured
input wait. In the third way, `NextTimed` hands Keras's TensorFlow train
function the epoch's iterator behind a Python iterator, so each batch is
taken with `next()` in Python, timed by neither the monitor nor the
profiler (less what a `next()` of a ready batch costs: the op's own cost,
0.2-0.7 ms a step here, is no wait). Goal (issue 51): the live share within
10 percentage points of XProf's and of `next()`'s on the input-bound run;
on the healthy run XProf counts the `IteratorGetNext` op's own time, so 15
points there.
"""

import functools
import time

import keras
import pytest

import keras_gpufix as kg
from planted import planted_dataset, tiny_model

START, STEPS = 10, 30
BATCHES = START + STEPS + 4


class NextTimed(keras.callbacks.Callback):
    """Times each `next()` on the iterator `fit` reads, from outside the monitor.

    Keras's TensorFlow train function takes a `tf.data` iterator's batch
    inside its graph, and a Python iterator's with `next()` before it runs
    the step's `tf.function` on the batch: the train function is handed the
    epoch's iterator behind a Python iterator that times each `next()`
    (`seconds`, one per step, in order).
    """

    def __init__(self):
        super().__init__()
        self.seconds = []
        self._original = None

    def on_train_begin(self, logs=None):
        self.model.make_train_function()
        original = self._original = self.model.train_function

        @functools.wraps(original)
        def train_function(iterator):
            return original(_Timed(iterator, self.seconds))

        self.model.train_function = train_function

    def on_train_end(self, logs=None):
        self.model.train_function = self._original


class _Timed:
    def __init__(self, iterator, seconds):
        self._iterator, self._seconds = iterator, seconds

    def __iter__(self):
        return self

    def __next__(self):
        start = time.perf_counter()
        batch = next(self._iterator)
        self._seconds.append(time.perf_counter() - start)
        return batch


def ready_next_seconds(model, repeats=20):
    """What `next()` costs where its batch is ready, on an iterator of `fit`'s kind.

    The median of `repeats` calls on a distributed iterator (as `fit`'s) of
    a dataset in memory, each after a pause that lets its prefetch refill.
    """
    dataset = model.distribute_strategy.experimental_distribute_dataset(
        planted_dataset("healthy", batches=repeats + 1))
    iterator = iter(dataset)
    next(iterator)
    seconds = []
    for _ in range(repeats):
        time.sleep(0.003)
        start = time.perf_counter()
        next(iterator)
        seconds.append(time.perf_counter() - start)
    return sorted(seconds)[repeats // 2]


def shares(kind, tmp_path, third=False):
    """`(live %, XProf's analysis, next() %)` of the traced steps of one fit.

    The third way's wait of a step is its `next()` less what a `next()` of
    a ready batch costs (`ready_next_seconds`).
    """
    timer = kg.StepTimer()
    monitor = kg.GPUOscillationMonitor(verbose=0, nvml=False)
    trigger = kg.ProfilerTrigger(str(tmp_path), trigger=START, steps=STEPS, verbose=0)
    timed = NextTimed()
    model = tiny_model()
    model.fit(planted_dataset(kind, batches=BATCHES, sleep=0.01), epochs=1, verbose=0,
              callbacks=[timer, monitor, trigger] + ([timed] if third else []))
    (trace,) = trigger.traces
    traced = [r for r in timer.records()
              if trace["start_step"] <= r.index <= trace["end_step"]]
    cycle = sum(r.input_wait + r.step for r in traced)
    live = sum(r.input_wait for r in traced) / cycle
    alone = None
    if third:
        cost = ready_next_seconds(model)
        alone = sum(max(0.0, timed.seconds[r.index] - cost) for r in traced) / cycle
    return live * 100, trace["analysis"], None if alone is None else alone * 100


def _check_xprof(live, analysis, expected, points=10.0):
    assert analysis["step_time_ms"] > 0
    if expected:
        assert analysis["classification"] == expected
    assert abs(live - analysis["input_percent"]) <= points


# On the healthy run XProf's input is the IteratorGetNext op's own time
# with its batch ready, 0.05-0.15 ms of a 1 ms step (5-10%, more beside a
# CPU burner): no wait, so 15 points there, as before.
@pytest.mark.flaky(reruns=1)  # a verdict from wall-clock time: a host loaded beside it (another test worker) can move one run
@pytest.mark.parametrize("kind, expected, points", [
    ("slow", "highly_input_bound", 10.0),
    ("healthy", None, 15.0),
])
def test_live_input_wait_matches_xprof(kind, expected, points, tmp_path):
    live, analysis, _ = shares(kind, tmp_path)
    print(f"{kind}: live input wait {live:.1f}% vs XProf input {analysis['input_percent']:.1f}% "
          f"({analysis['classification']}, step {analysis['step_time_ms']:.2f} ms)")
    _check_xprof(live, analysis, expected, points)


@pytest.mark.flaky(reruns=1)  # a verdict from wall-clock time: a host loaded beside it (another test worker) can move one run
def test_live_input_wait_matches_next_timed_alone(tmp_path):
    live, analysis, alone = shares("slow", tmp_path, third=True)
    print(f"slow, next() in Python: live input wait {live:.1f}% vs next() alone {alone:.1f}% "
          f"vs XProf input {analysis['input_percent']:.1f}%")
    assert abs(live - alone) <= 10.0
    _check_xprof(live, analysis, None)
