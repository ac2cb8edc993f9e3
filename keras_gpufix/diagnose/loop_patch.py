"""Custom training loops: Python iteration over tf.data datasets and the steps between.

While the script runs, three TensorFlow entry points are wrapped (the
`tf.function` class is not exported: `keras_internals.tf_function_class`):

| entry point                 | what diagnose learns                                   |
|-----------------------------|--------------------------------------------------------|
| `tf.data.Dataset.__iter__`  | the script iterates a dataset itself (its own loop)    |
| `tf.GradientTape.gradient`  | a training step: eager (direct evidence of `eager_step`)|
|                             | or traced inside a `tf.function` (that function trains)|
| `tf.function` calls         | each call of a function that computes gradients is a   |
|                             | step                                                   |

While a custom loop trains, a sampler thread looks at the main thread's
stack every `_StackSampler.INTERVAL` seconds during the loop body (from
`next()` returning a batch to the next `next()` call: never while the loop
waits for input) and counts, per cycle, the line of the loop's own frame it
was at. When the run's verdict is `periodic_stall`,
`analysis.locate_periodic` names the line where the slow cycles spend their
extra time (`entry["step"]["stall_where"]`): the work the loop body runs
every k steps.

An iterator becomes a training loop at the first `next()` after which a
step was seen; from then on its batches come through `kg.watch` (each
training iterator is one of its epochs), which fires the monitors' Keras
hooks (`on_train_begin`, `on_epoch_begin/end`, `on_train_batch_begin/end`,
`on_train_end`) and hands the time in `next()` to the step stream as the
input wait. With
`steps=N` the iterator ends (`StepsReached`, a `StopIteration`, like an
exhausted dataset) after N training cycles, so a `for` loop stops cleanly;
later epochs over the same dataset end at once. A loop that calls `next()`
itself gets the exception: diagnose ends the script there, cleanly
(`run_diagnosis` says where). Iteration inside
`fit`, `evaluate` or `predict`, or inside a `tf.function`, is left alone.
"""

import os
import sys
import threading
import time
from collections import Counter, deque

from keras_gpufix.analysis import locate_periodic
from keras_gpufix.diagnose.what_if import Cycles, input_rate, replay_rates, what_if

__all__ = ["LoopPatch", "StepsReached"]


class StepsReached(StopIteration):
    """`diagnose --steps N`: the custom loop ran its N steps."""


def _library_prefixes():
    import keras
    import tensorflow

    import keras_gpufix

    return tuple(os.path.dirname(m.__file__) + os.sep for m in (keras, tensorflow, keras_gpufix))


def _where(frame):
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"


class _StackSampler:
    """Samples which line of the loop's frame the main thread is at, per cycle.

    A daemon thread wakes every `INTERVAL` seconds; while a cycle's loop
    body runs (`begin` .. `end`) it reads the main thread's stack
    (`sys._current_frames()`, a few microseconds, no tracing hook) and
    counts the line of the loop's own frame. The last `MAX_CYCLES`
    cycles are kept: their loop-body seconds and their counts.
    """

    INTERVAL = 0.002
    MAX_CYCLES = 4096

    def __init__(self):
        self.main = threading.main_thread().ident
        self.cycles = deque(maxlen=self.MAX_CYCLES)  # (seconds, Counter of "file:line")
        self._code = None
        self._counts = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="keras-gpufix-sampler",
                                        daemon=True)
        self._thread.start()

    def begin(self, code):
        """A loop body starts in the frame running `code` (the loop's)."""
        self._code = code
        self._counts = Counter()

    def end(self, seconds):
        """The loop body of `seconds` ended (the loop asks for the next batch)."""
        counts, self._counts = self._counts, None
        if counts is not None:
            self.cycles.append((seconds, counts))

    def stop(self):
        self._stop.set()
        self._thread.join()

    def _run(self):
        while not self._stop.wait(self.INTERVAL):
            counts, code = self._counts, self._code
            if counts is None:
                continue
            frame = sys._current_frames().get(self.main)
            while frame is not None and frame.f_code is not code:
                frame = frame.f_back
            if frame is not None:
                counts[_where(frame)] += 1
            frame = None

    def locate(self, period):
        """`(file:line, share)` of the work every `period` cycles, or None."""
        cycles = list(self.cycles)
        return locate_periodic([c[0] for c in cycles], [c[1] for c in cycles], period)


def _steps_on(fn, args, kwargs, loop):
    """(cached, real) calls of the train function `fn` on the loop's dataset, as
    `replay_rates` takes them, or None when the step was not called on its
    batches as they came (`step(x, y)` for `for x, y in ds`, or `step(batch)`)."""
    element = loop.last_element
    if kwargs or element is None:
        return None
    if isinstance(element, tuple) and len(args) == len(element) and all(
            a is e for a, e in zip(args, element)):
        unpack = True
    elif len(args) == 1 and args[0] is element:
        unpack = False
    else:
        return None

    def on(batches):
        iterator = iter(batches)
        return (lambda: fn(*next(iterator))) if unpack else (lambda: fn(next(iterator)))

    dataset = loop.dataset
    return on(dataset.take(1).cache().repeat().prefetch(2)), lambda: on(dataset.repeat())


class _Current:
    """What `kg.watch` iterates: each epoch, the iterator the script already holds.

    Its iterator ends (`StopIteration`) once `--steps` was reached, inside
    watch's epoch, so watch closes the step and the epoch itself.
    """

    def __init__(self, patch):
        self.patch = patch
        self.iterator = None
        self.wait_s = 0.0  # the last next()'s own time, without watch's hooks around it

    def __iter__(self):
        return self

    def __next__(self):
        if self.patch.stopped:
            raise StopIteration
        t0 = time.perf_counter()
        try:
            return next(self.iterator)
        finally:
            self.wait_s = time.perf_counter() - t0


class _Loop:
    """One custom-loop run: its monitors, driven through `kg.watch`."""

    def __init__(self, patch):
        import keras

        from keras_gpufix.watched import Watched

        self.patch = patch
        self.mine = patch.fits_patch.monitors(patch.fits_patch.steps, "loop", retracing=False)
        self.source = _Current(patch)
        # ProfilerTrigger weak-refs its model: a placeholder stands for the user's
        self.watched = Watched(self.source, callbacks=list(self.mine.values()),
                               model=keras.Sequential(name="custom_loop"))
        self.entry = {"index": len(patch.fits_patch.fits) + 1, "kind": "loop",
                      "x": "tf.data.Dataset (iterated by the script)", "epochs": 0,
                      "step": dict(patch.step_info)}
        patch.fits_patch.fits.append(self.entry)
        self.cycles = 0
        self.clock = Cycles()
        self.dataset = None  # the first training dataset, for the what-if
        self.sampler = _StackSampler()
        self.last_element = None  # the last batch it handed out
        self.wait_s = 0.0  # time in next() of the training iterators
        self.busy_s = 0.0  # from next() returning to the next call: step + between
        self.t0 = time.perf_counter()

    def open_epoch(self, iterator):
        """`iterator` trains from now on: a new epoch of the watched loop."""
        if self.dataset is None:
            self.dataset = iterator.dataset
        self.clock.epoch()
        self.source.iterator = iterator.iterator
        from keras_gpufix.callbacks._stream import stream_of

        epoch = iter(self.watched)  # ends the previous epoch, if open
        stream = stream_of(self.watched.callbacks)
        if stream is not None and self.patch.step_info["eager"]:
            # the run's judgement gets the direct evidence of eager_step
            stream.tell(eager=True, eager_where=self.patch.step_info["eager_where"])
        return epoch

    def finish(self):
        self.sampler.stop()
        self.watched.close()
        self.entry["epochs"] = self.watched.epoch
        self.entry["wall_s"] = time.perf_counter() - self.t0
        self.entry["stopped_by_diagnose"] = self.patch.stopped
        self.entry["step"] = dict(self.patch.step_info)
        cycle = self.wait_s + self.busy_s
        self.entry["phases"] = {"input_wait_s": self.wait_s, "step_and_between_s": self.busy_s,
                                "input_share": self.wait_s / cycle if cycle else None}
        self.patch.fits_patch.collect(self.entry, self.mine)
        self.entry["step"]["stall_where"] = self._stall_where()

    def _stall_where(self):
        """The loop-body line of the run's periodic stall (stack samples), or None."""
        monitor = self.entry.get("monitor") or {}
        periods = [e.get("period") for e in monitor.get("events") or ()
                   if e.get("verdict") == "periodic_stall" and e.get("period")]
        if monitor.get("verdict") != "periodic_stall" or not periods:
            return None
        found = self.sampler.locate(periods[-1])
        return found and found[0]


class _WatchedIterator:
    """A dataset iterator whose `next()` calls delimit the loop's cycles."""

    def __init__(self, patch, iterator, dataset):
        self.patch = patch
        self.iterator = iterator
        self.dataset = dataset
        self.key = id(dataset)
        self.mark = None  # the patch's step count at the last next()
        self.epoch = None  # watch's epoch iterator, once this iterator trains
        self.open = False  # a batch was handed out and its cycle not yet timed
        self.called = None  # perf_counter when next() was last called
        self.returned = None  # perf_counter when next() last returned a batch
        self.in_step = 0.0  # the patch's time in step functions when it returned
        self.input_s = 0.0  # the last batch's own time in the dataset's next()

    def __iter__(self):
        return self

    def __getattr__(self, name):  # element_spec, get_next, ...
        return getattr(self.iterator, name)

    def __next__(self):
        patch = self.patch
        if patch.stopped and self.key in patch.trained_datasets:
            raise StepsReached(patch.steps)  # a later epoch of a loop --steps stopped
        if self.mark is not None and patch.step_calls > self.mark and self.epoch is None:
            patch.trained_datasets.add(self.key)
            self.epoch = patch.start_loop().open_epoch(self)
        if self.epoch is None:
            self.mark = patch.step_calls
            return next(self.iterator)
        loop = patch.loop
        now = time.perf_counter()
        if self.open:
            self.open = False
            loop.cycles += 1
            busy = now - self.returned
            loop.sampler.end(busy)
            loop.busy_s += busy
            step = patch.step_s - self.in_step if patch.step_info["functions"] else 0.0
            loop.clock.add(now - self.called, self.input_s, step)
            if patch.steps and loop.cycles >= patch.steps:
                patch.stopped = True  # the source ends: watch closes the step and epoch
        self.mark = patch.step_calls
        self.called = now
        try:
            element = next(self.epoch)
        except StopIteration:
            self.epoch = None
            if patch.stopped:
                raise StepsReached(patch.steps) from None
            raise
        self.returned = time.perf_counter()
        self.input_s = loop.source.wait_s  # the batch's own wait: watch's hooks stay
        if self.dataset is loop.dataset:
            loop.last_element = element
        self.in_step = patch.step_s
        loop.wait_s += self.returned - now
        self.open = True
        loop.sampler.begin(sys._getframe(1).f_code)  # the loop's own frame asked
        return element

    next = __next__


class LoopPatch:
    """Context manager: custom training loops get the diagnostic callbacks.

    Args:
        fits_patch: the run's `FitPatch` (its monitors, its list of runs,
            its depth: iteration inside `fit` is `fit`'s).
    """

    def __init__(self, fits_patch):
        self.fits_patch = fits_patch
        self.steps = fits_patch.steps
        self.step_s = 0.0  # time inside calls of train functions
        self.last_step = None  # (function, args, kwargs) of the last train-function call
        self.loop = None
        self.stopped = False
        self.trained_datasets = set()
        self.step_calls = 0
        self.step_info = {"eager": False, "eager_where": None, "functions": []}
        self._train_functions = {}
        self._named = set()
        self._stack = []
        self._saved = []

    def start_loop(self):
        if self.loop is None:
            self.loop = _Loop(self)
        return self.loop

    def _patch(self, cls, name, make):
        original = cls.__dict__[name]
        self._saved.append((cls, name, original))
        setattr(cls, name, make(original))

    def __enter__(self):
        import tensorflow as tf

        from keras_gpufix.keras_internals import tf_function_class

        library = _library_prefixes()
        patch = self
        function_cls = tf_function_class()

        def user_frame(depth):
            frame = sys._getframe(depth)
            while frame is not None and frame.f_code.co_filename.startswith(library):
                frame = frame.f_back
            return frame

        def make_iter(original):
            def __iter__(dataset):
                caller = sys._getframe(1).f_code.co_filename
                if (patch.fits_patch._depth or caller.startswith(library)
                        or not tf.executing_eagerly()):
                    return original(dataset)
                # the input wait is the time in next(), handed to the step stream: no probe
                return _WatchedIterator(patch, original(dataset), dataset)
            return __iter__

        def make_gradient(original):
            def gradient(tape, *args, **kwargs):
                if not patch.fits_patch._depth:
                    if tf.executing_eagerly():
                        patch.step_calls += 1
                        if not patch.step_info["eager"]:
                            frame = user_frame(2)
                            patch.step_info["eager"] = True
                            patch.step_info["eager_where"] = frame and _where(frame)
                    elif patch._stack:
                        patch._train_functions.setdefault(id(patch._stack[0]), patch._stack[0])
                return original(tape, *args, **kwargs)
            return gradient

        def make_call(original):
            def __call__(fn, *args, **kwargs):
                if patch.fits_patch._depth or not tf.executing_eagerly():
                    return original(fn, *args, **kwargs)
                patch._stack.append(fn)
                t0 = time.perf_counter()
                try:
                    return original(fn, *args, **kwargs)
                finally:
                    patch._stack.pop()
                    if not patch._stack and id(fn) in patch._train_functions:
                        patch.step_s += time.perf_counter() - t0
                        patch.last_step = (fn, args, kwargs)
                        patch._step_function_called(fn)
            return __call__

        self._patch(tf.data.Dataset, "__iter__", make_iter)
        self._patch(tf.GradientTape, "gradient", make_gradient)
        self._patch(function_cls, "__call__", make_call)
        return self

    def _step_function_called(self, fn):
        self.step_calls += 1
        if id(fn) not in self._named:
            self._named.add(id(fn))
            code = getattr(getattr(fn, "python_function", None), "__code__", None)
            self.step_info["functions"].append({
                "name": getattr(fn, "__name__", "?"),
                "where": code and f"{code.co_filename}:{code.co_firstlineno}"})

    def __exit__(self, *exc):
        for cls, name, original in reversed(self._saved):
            setattr(cls, name, original)
        self._saved.clear()
        if self.loop is not None:
            self.loop.finish()
            if self.fits_patch.what_if:
                self.loop.entry["what_if"] = self._what_if()
                stages = self.fits_patch.input_stages(self.loop.entry, self.loop.dataset)
                if stages is not None:
                    self.loop.entry["stages"] = stages
        return False

    def _what_if(self):
        """The loop's what-if (`what_if.py`), or a dict with the reason it was not measured."""
        loop = self.loop
        try:
            input_per_s = input_rate(loop.dataset)
            rates = None
            if self.last_step is not None:  # replay the train tf.function
                fn, args, kwargs = self.last_step
                variables = list(fn.get_concrete_function(*args, **kwargs).variables)
                cached, real = _steps_on(fn, args, kwargs, loop) or (
                    lambda: fn(*args, **kwargs), None)
                rates = replay_rates(cached, variables, real=real)
            result = what_if(loop.clock, input_per_s, rates)
        except Exception as exc:  # never break the user's run
            return {"reason": f"{type(exc).__name__}: {exc}"}
        return result or {"reason": "no steady cycles were timed"}
