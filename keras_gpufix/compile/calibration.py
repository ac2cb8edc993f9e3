"""`steps_per_execution`: the sample runner, the calibration and the value chosen.

`SampleRunner` runs Keras's train function built for `k` steps per
execution on copies of the sample batch; `calibrate` times executions of 1
and of k steps, and `choose_steps` derives the value.

The value is the smallest power of two that brings the measured
per-execution overhead under `THRESHOLDS["spe_overhead_share"]` of the execution's time,
capped so callbacks still fire at least every `THRESHOLDS["spe_max_execution_s"]` seconds
and at `MAX_STEPS_PER_EXECUTION`.
"""

import math
import statistics
import time
from typing import Optional

import numpy as np
import tensorflow as tf

from keras_gpufix._step_shapes import StepShapes
from keras_gpufix.analysis.verdicts import THRESHOLDS
from keras_gpufix.keras_internals import step_jit_compile

__all__ = [
    "MAX_STEPS_PER_EXECUTION",
    "SampleRunner",
    "choose_steps",
    "first_working",
]

MAX_STEPS_PER_EXECUTION = 64
_CALIBRATION_CALLS = (9, 3)  # timed calls of 1 step and of K steps


class SampleRunner:
    """Runs Keras's train function built with `steps_per_execution=k` on
    iterators of n copies of the batch (Keras's loop stops when the iterator
    ends, so one build, one trace and one XLA compile time both 1 and k
    steps per execution).

    The batches carry `element_spec` (the training dataset's, with its
    unknown dimensions) when given, and go through the strategy's
    `experimental_distribute_dataset` as in `fit`, so `fit` calls the step
    traced here."""

    def __init__(self, model, batch, strategy, k, element_spec=None):
        self.model, self.batch, self.strategy, self.k = model, batch, strategy, k
        self.element_spec = element_spec
        try:
            tf.nest.assert_same_structure(tuple(batch), tuple(element_spec or batch))
        except (TypeError, ValueError):
            self.element_spec = None  # the batch's own static shapes then
        model.steps_per_execution = k
        model.make_train_function(force=True)
        if step_jit_compile(model):
            # The sample steps trace the step `fit` reuses: the probe of its
            # input shapes goes in first, or fit's monitors could not see them.
            StepShapes.attach(model)

    def _iterator(self, n):
        ds = tf.data.Dataset.from_tensors(self.batch)
        if self.element_spec is not None:
            ds = ds.map(self._relax)
        ds = ds.repeat(n)
        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = (
            tf.data.experimental.AutoShardPolicy.OFF
        )
        ds = self.strategy.experimental_distribute_dataset(ds.with_options(options))
        return iter(ds)

    def _relax(self, *element):
        return tf.nest.map_structure(
            lambda t, spec: tf.raw_ops.PlaceholderWithDefault(input=t, shape=spec.shape),
            element, tuple(self.element_spec),
        )

    def step(self, n=1, iterator=None):
        logs = self.model.train_function(iterator or self._iterator(n))
        for value in tf.nest.flatten(logs):
            np.asarray(value)  # waits for the device
        return logs

    def _time(self, n, calls):
        iterators = [self._iterator(n) for _ in range(calls)]
        times = []
        for iterator in iterators:
            start = time.perf_counter()
            self.step(iterator=iterator)
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    def calibrate(self):
        k = min(self.k, 16)
        self.step(k)  # warm: the loop with k steps
        t1 = self._time(1, _CALIBRATION_CALLS[0])
        tk = self._time(k, _CALIBRATION_CALLS[1])
        step = max((tk - t1) / (k - 1), 1e-7)
        overhead = max(t1 - step, 0.0)
        return {"t_1": t1, "k": k, "t_k": tk, "overhead_s": overhead, "step_s": step}


def first_working(model, batch, strategy, k: int, element_spec=None) -> tuple:
    """(runner, loop_error, error): a runner whose step ran, trying `k` then 1.

    `loop_error` is the failure of the `k`-step loop when only 1 worked;
    `error` the failure of the last attempt when none did (runner None).
    """
    loop_error = None
    for attempt in dict.fromkeys((k, 1)):
        try:
            run = SampleRunner(model, batch, strategy, attempt, element_spec)
            run.step()
            return run, loop_error, None
        except Exception as exc:  # classified by the caller
            if attempt != 1:
                loop_error = exc
            error = exc
    return None, None, error


def choose_steps(calibration: dict, strategy, epoch_steps: Optional[int] = None) -> int:
    """`steps_per_execution` from a `SampleRunner.calibrate()` measurement."""
    overhead, step = calibration["overhead_s"], calibration["step_s"]
    f = THRESHOLDS["spe_overhead_share"]
    needed = overhead * (1 - f) / (f * step)
    k = 1 if needed <= 1 else 2 ** math.ceil(math.log2(needed))
    cap = max(1, min(MAX_STEPS_PER_EXECUTION, int(THRESHOLDS["spe_max_execution_s"] / step)))
    k = min(k, cap)
    if epoch_steps is not None:
        # Callbacks fire once per execution: keep at least 8 per epoch.
        k = max(1, min(k, 2 ** int(math.log2(max(1, epoch_steps // 8)))))
        calibration["epoch_steps"] = epoch_steps
    if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        k = int(strategy.reduce(
            "MAX", strategy.run(lambda: tf.constant(k, tf.int64)), axis=None
        ))
    return k
