"""kg.watch: monitor your own training loop by wrapping what it iterates.

The tqdm convention, for training loops that do not call `model.fit`:

```python
with kg.watch(train_ds, model=model) as watched:
    for epoch in range(epochs):
        for batch in watched:          # was: for batch in train_ds
            train_step(batch)
print(watched.report()["verdict"])
```

Each `iter()` of the watched object is an epoch. The wrapper fires the
Keras hooks of its callbacks as `fit` would: `on_train_begin` at the first
epoch, `on_epoch_begin` / `on_epoch_end` around each epoch,
`on_train_batch_begin` when `next()` has returned a batch and
`on_train_batch_end` when the loop asks for the next one, and
`on_train_end` when the `with` block exits, however it exits (the data ran
out, `break`, an exception, a `StopIteration` raised to stop the loop).
Without `with` (`batches = iter(kg.watch(ds, model=model))`, then
`next(batches)` in the trainer's own loop) the run ends, and its verdict is
printed, when an epoch's iterator is exhausted or, at the latest, when the
program ends; a later `iter()` starts a new run.

What it measures, per step, on every Keras backend:

| phase            | measured as                                               |
|------------------|-----------------------------------------------------------|
| `input_wait`     | the time spent inside `next()` of the iterable's iterator |
|                  | (an epoch's first step also gets the time taken to create |
|                  | its iterator and to end and release the previous one)     |
| step + between   | the rest of the cycle: the loop body, up to the next `next()` |
|                  | (`step_done()` splits it: the step up to that call, then  |
|                  | `between`)                                                |

Asynchronous devices (a GPU; JAX; TensorFlow's asynchronous eager
execution): a step call returns when its work is queued, and the host waits
only where it reads a value back. So each step's end (the next `next()`,
or `step_done()`) is stamped where the device work queued so far is done
(`sync=True`, the default): on JAX where the step's outputs (what
`step_done(outputs)` was given, else the arrays alive at its end) are
ready, on torch where a CUDA event recorded at its end is reached, on
TensorFlow after `tf.test.experimental.sync_devices()`. On the JAX and torch
backends the wait happens off the loop's thread, in Keras's callback pool
(our callbacks are `async_safe`), so the loop never waits for the monitor;
where a callback in the list is not `async_safe`, and on TensorFlow (whose
callbacks Keras never dispatches off the loop's thread), the loop waits, as
`fit` does. The input wait counted is the part of `next()` in which the
device had nothing to do. With `sync=False` steps are timed at dispatch:
the input wait is not measured (None; the loop's whole cycle is its step)
and the detector judges a loop that reads a value every k steps per k
steps.

Where the loop body stalls: a daemon thread wakes every
`_StallSampler.INTERVAL` (50 ms) and, only while a cycle has run past the
slow-step limit of the recent ones (`analysis.slow_limit`: 1.25x their median;
a plot of 40 ms every 4th 40 ms step makes an 80 ms cycle, never past twice the
median), reads which line of the loop's own frame the
loop is at (`sys._current_frames()`, a few microseconds; no tracing hook, and
nothing on a cycle of normal length). The line that holds most of those
samples is the periodic stall's `where`, as diagnose's stack samples find it
(the loop's `next()` line left out: that is the input's wait).

A `tf.distribute` dataset (`strategy.experimental_distribute_dataset`,
looped over with `strategy.run`): under `MultiWorkerMirroredStrategy` its
`next()` also waits for the other workers (the iterator agrees with them
that each has a batch), so a worker whose input is quick waits there for
one whose input is slow. Where the dataset went through
`kg.data.instrument` (the `kg.data` builder's do), its probe gives this
worker's own wait; the rest of `next()` counts in the step, as the
all-reduce's wait does in `fit`, and the job's report (a monitor with a
shared `log_dir`, and `model=` the model built in `strategy.scope()`)
names the straggler as `fit`'s does (docs/distributed.md).

Releasing a `tf.data` iterator joins its prefetch threads, which took up
to 0.28 s on the 2-core test host: that is input time, not the loop's.

The batch size (for samples/s) is the first leading dimension of the
batch's arrays, and a batch whose shapes were not seen before is a new
shape (what costs an XLA recompile). Over a dataset that went through
`kg.data.instrument` with its feature lengths (the `kg.data` builder's),
the summary also gives `real_frames_per_s` and `audio_seconds_per_s`, read
from the input probe as in `fit`, when the watched iterable is the
`tf.data.Dataset` itself (watch then makes each epoch's iterator, so the
steps are the probe's batches in order); over an iterator, a generator or
a list they are None. Any iterable works: a `tf.data`
dataset, a `keras.utils.PyDataset`, a generator, a list of NumPy arrays.
Nothing here imports TensorFlow: a JAX loop over NumPy batches runs without
it.
"""

import atexit
import functools
import sys
import threading
import time
import weakref
from collections import Counter, deque

import keras

from keras_gpufix.analysis import UNSYNCED_NOTE, slow_limit
from keras_gpufix.callbacks._clock import timed
from keras_gpufix.callbacks._stream import stream_of
from keras_gpufix.callbacks.gpu_oscillation_monitor import GPUOscillationMonitor
from keras_gpufix.exceptions import warn
from keras_gpufix.output import emit

__all__ = ["watch", "Watched"]

_END = object()


def watch(iterable, callbacks=None, model=None, sync=True) -> "Watched":
    """Wraps the iterable of a custom training loop so it is monitored.

    Args:
        iterable: what the loop iterates once per epoch: a `tf.data`
            dataset, a `keras.utils.PyDataset`, a generator, a list of
            batches.
        callbacks: Keras callbacks that get the hooks (keras_gpufix's and
            Keras's own). Defaults to None: one `kg.GPUOscillationMonitor()`.
        model: the model being trained, given to the callbacks
            (`callback.model`). Defaults to None.
        sync: wait at each step's end for the device work queued so far,
            so that a step is timed where its work ends (on a GPU, JAX or
            TensorFlow's asynchronous eager execution; it gives up the
            overlap of the host's next step with the device's work, as
            `fit` does). Defaults to True. False: steps are timed at
            dispatch, the input wait is not measured.

    Returns:
        A `Watched`: iterate it where the loop iterated `iterable`; use it
        as a context manager so the run's end is seen.

    Raises:
        ValueError: `iterable` cannot be iterated, `callbacks` is not a
            list of Keras callbacks, or `sync` is not a bool.

    Example:

    >>> with kg.watch(ds, model=model) as watched:
    ...     for epoch in range(3):
    ...         for x, y in watched:
    ...             train_step(x, y)
    >>> watched.report()["verdict"]
    'input_bound'
    """
    return Watched(iterable, callbacks=callbacks, model=model, sync=sync)


class Watched:
    """An iterable whose epochs and steps drive Keras callbacks.

    Made by `kg.watch(...)`; see there. `callbacks` is the list of
    callbacks it drives, `epoch` the number of epochs begun, `steps` the
    number of batches handed out over the run, `synced` whether the steps
    are timed where their device work ends (False after `sync=False`, or
    once a sync failed).
    """

    def __init__(self, iterable, callbacks=None, model=None, sync=True, locate_stalls=True):
        if not hasattr(iterable, "__iter__"):
            raise ValueError(
                "`iterable` must be iterable (a tf.data.Dataset, a "
                "keras.utils.PyDataset, a generator, a list of batches). "
                f"Received: iterable={type(iterable).__name__}"
            )
        if callbacks is None:
            callbacks = [GPUOscillationMonitor()]
        callbacks = list(callbacks)
        wrong = [c for c in callbacks if not isinstance(c, keras.callbacks.Callback)]
        if wrong:
            raise ValueError(
                "`callbacks` must be a list of keras.callbacks.Callback. "
                f"Received: {type(wrong[0]).__name__}"
            )
        if not isinstance(sync, bool):
            raise ValueError(f"`sync` must be True or False. Received: sync={sync!r}")
        self.iterable = iterable
        self.callbacks = callbacks
        self.model = model
        self.sync = sync
        self.synced = sync
        self._device_sync = None
        self._waited = {}  # id -> weak reference of the JAX arrays alive at the last wait
        self._wait_error = None  # (step, exception) of a wait that failed off the loop's thread
        params = {}
        try:
            params["steps"] = len(iterable)
        except TypeError:  # generators, datasets of unknown length
            pass
        self._hooks = keras.callbacks.CallbackList(callbacks, model=model, **params)
        self.epoch = 0
        self.steps = 0
        self._running = False
        self._open = None
        self._stream = None
        self._carry = 0.0  # input time outside a step's next(), for the next step
        self._failed = False
        self._in_with = False
        self._at_exit = None  # closes a run begun outside `with` at the program's end
        self._eager_probe = None  # undoes the run's eager-gradient probe
        self._distributed = False  # a tf.distribute dataset: next() waits for other workers
        # where a long cycle's loop body is (diagnose samples its loops itself)
        self._stalls = _StallSampler() if locate_stalls else None

    def __enter__(self):
        self._in_with = True
        return self

    def __exit__(self, exc_type, exc, tb):
        self._in_with = False
        self.close(failed=exc_type is not None and not issubclass(exc_type, StopIteration))
        return False

    def __iter__(self):
        self._end_epoch()
        # The hooks come before the iterator, as in `fit`: a tf.data
        # iterator starts producing at once, and the monitors' input probe
        # counts the batches made from `on_train_begin` / `on_epoch_begin`.
        if not self._running:
            self._running = True
            self.synced = self.sync
            self._wait_error = None
            if self.sync:
                self._device_sync = _sync_call(keras.backend.backend())
            self._hooks.on_train_begin()
            self._eager_probe = _probe_eager_gradients(self)
            if not self._in_with:
                self._at_exit = _close_at_exit(self)
                atexit.register(self._at_exit)
            self._stream = stream_of(self.callbacks)
            self._tell_stream()
            if self._stalls is not None:
                self._stalls.start()
            self._distributed = _is_distributed(self.iterable)
            if self._stream is not None and not (_is_dataset(self.iterable)
                                                 or self._distributed):
                # Its batches need not be those an instrumented dataset
                # recorded, in order (an iterator made before the run).
                self._stream.drop_probe()
        self._hooks.on_epoch_begin(self.epoch)
        iterator, took = timed(iter, self.iterable)
        self._carry += took
        self._open = _Epoch(self, iterator, self.epoch)
        self.epoch += 1
        return self._open

    def close(self, failed=False):
        """Ends the run: closes the open step and epoch, fires `on_train_end`.

        `with kg.watch(...)` calls it on exit. After an exception
        (`failed=True`) the open epoch gets no `on_epoch_end`, as in `fit`;
        `on_train_end` always fires, so the callbacks' reports are complete.
        Iterating again afterwards starts a new run.

        Args:
            failed: the loop ended by an error. Defaults to False.
        """
        self._end_epoch(failed=failed)
        if self._at_exit is not None:
            atexit.unregister(self._at_exit)
            self._at_exit = None
        if self._eager_probe is not None:
            self._eager_probe()
            self._eager_probe = None
        if self._running:
            self._running = False
            if self._stalls is not None:
                self._stalls.stop()
                self._tell_stall()
            self._hooks.on_train_end()
            self._said_wait_error()
            self._say_unsynced()

    def step_done(self, outputs=None):
        """Ends the current step here: the rest of the loop body is `between`.

        Call it right after the training step. With `sync=True` it first
        waits for the step's device work: on JAX for `outputs` (what the
        step returned: its loss, its new state), elsewhere, or when
        `outputs` is None, for all work queued. Without it the step ends
        at the next `next()`. A call outside a step does nothing.

        Args:
            outputs: what the step returned. Defaults to None.
        """
        if self._open is not None:
            self._open.end_step(outputs)

    def _wait(self, outputs=None):
        """Has the step's end stamped where its device work is done (never raises).

        With our callbacks in the list the wait is handed to the step
        clock, which waits where Keras runs the end hook (its pool, off the
        loop's thread, where every callback is `async_safe`); else it
        happens here.
        """
        self._said_wait_error()
        if not self.synced or self._device_sync is None:
            return
        try:
            waiter = functools.partial(self._run_waiter, self._waiter(outputs), self.steps)
        except Exception as exc:  # a monitor never stops training
            self._wait_error = (self.steps, exc)
            self._said_wait_error()
            return
        if self._stream is None:
            waiter()
            self._said_wait_error()
        else:
            self._stream.await_step(waiter)

    def _waiter(self, outputs):
        """A function that waits for this step's device work, made on the loop's thread.

        On JAX it waits for `outputs`, or else for the arrays that came alive
        since the previous step's wait was made (this step's outputs, not
        those of steps dispatched after it): a wait that held every live
        array would keep the arrays of earlier steps alive while it is
        pending, and the next step's wait would hold those too (on this
        CPU: 1005 live arrays after 750 steps, the loop 1.23x slower than
        without the monitor). Elsewhere it waits for all work queued when it
        runs (TensorFlow runs it on the loop's thread).
        """
        if keras.backend.backend() == "jax":
            import jax

            if outputs is None:  # by identity: a new array often has a dead one's id
                live, waited = jax.live_arrays(), self._waited
                outputs = [a for a in live if (ref := waited.get(id(a))) is None or ref() is not a]
                self._waited = {id(a): weakref.ref(a) for a in live}
            return functools.partial(_block_on, outputs)
        if keras.backend.backend() == "torch" and self._device_sync is not None:
            import torch

            event = torch.cuda.Event()
            event.record()
            return event.synchronize
        return self._device_sync

    def _run_waiter(self, waiter, step):
        try:
            waiter()
        except Exception as exc:  # a monitor never stops training
            if self._wait_error is None:
                self._wait_error = (step, exc)

    def _said_wait_error(self):
        """On the loop's thread: after a failed wait, steps are unsynced (one warning)."""
        if self._wait_error is None or not self.synced:
            return
        step, exc = self._wait_error
        self.synced = False
        self._tell_stream()
        warn(f"kg.watch could not wait for step {step}'s device work "
             f"({type(exc).__name__}: {exc}); from here steps are timed at dispatch "
             "and the input wait is not measured.")

    def _tell_stall(self):
        """Tells the step stream the loop-body line its long cycles spent their time at."""
        where = self._stalls.where()
        if where is not None and self._stream is not None:
            self._stream.tell(stall_where=where)

    def _tell_stream(self):
        """Lets the step stream (and our monitors' detectors) know whether steps are synced."""
        if self._stream is not None:
            self._stream.tell(synced=self.synced)

    def _say_unsynced(self):
        """Says once how to get per-step times, when steps were judged per period."""
        if self.synced:
            return
        for callback in self.callbacks:
            judgement = getattr(getattr(callback, "detector", None), "last_judgement", None)
            period = (judgement or {}).get("evidence", {}).get("unsynced_period")
            if period:
                emit("kg.watch: " + UNSYNCED_NOTE.format(period=period) + ".",
                     getattr(callback, "verbose", 1))
                return

    def _end_epoch(self, failed=False):
        if self._open is not None:
            epoch, self._open = self._open, None
            epoch.end(failed=failed)

    def report(self) -> dict:
        """The report of the first callback that has a `report()`.

        Readable at any time: during the loop it covers the steps so far.

        Returns:
            A dict (`GPUOscillationMonitor.report()` by default), or an
            empty dict when no callback reports.
        """
        for callback in self.callbacks:
            if hasattr(callback, "report"):
                return callback.report()
        return {}

    def _supply(self, wait, element, split):
        """Hands the shared step log this step's input wait and batch facts."""
        self._said_wait_error()
        wait, self._carry = wait + self._carry, 0.0
        if self._stream is None:
            return
        try:
            samples, shape = _batch_facts(element)
            self._stream.supply(wait if self.synced else None, samples=samples, shape=shape,
                                split=split and self.synced,
                                collective=self._distributed)
        except Exception as exc:  # a monitor never stops training
            if not self._failed:
                self._failed = True
                warn(f"kg.watch could not hand step {self.steps} to the monitors "
                     f"({type(exc).__name__}: {exc}); training continues, unmeasured.")


class _StallSampler:
    """Which line of the loop's frame its long cycles spend their excess at.

    `cycle(frame)` at each `next()` (the loop's frame at the first, else None)
    begins a cycle. A daemon thread wakes every `INTERVAL` seconds; while the
    current cycle has lasted longer than the slow-step limit of the last
    cycles (`analysis.slow_limit` without its spread condition, as the
    detector looks for a period; at least `MIN_CYCLES` of them, the limit
    taken every `RECOUNT` wakes), it reads the loop thread's stack
    and counts the line of the loop's frame, unless that is the line of its
    `next()` (the input's wait). `where()`: that line as `file:line` when it
    holds at least half of at least `MIN_SAMPLES` samples.
    """

    INTERVAL = 0.05
    MIN_CYCLES = 8
    MIN_SAMPLES = 3
    RECOUNT = 20  # wakes between two medians of the recent cycles

    def __init__(self):
        self.code = self.thread = self.next_line = self.begun = None
        self.cycles = deque(maxlen=64)
        self._limit, self._wakes = None, 0
        self.counts = Counter()
        self._stop = threading.Event()
        self._worker = None

    def start(self):
        if self._worker is None:
            self._stop.clear()
            self._worker = threading.Thread(target=self._run, name="kg.watch-stalls",
                                            daemon=True)
            self._worker.start()

    def stop(self):
        if self._worker is not None:
            self._stop.set()
            self._worker.join()
            self._worker = None
        self.begun = None

    def cycle(self, frame):
        now = time.perf_counter()
        if self.begun is not None:
            self.cycles.append(now - self.begun)
        self.begun = now
        if frame is not None:
            self.code, self.thread = frame.f_code, threading.get_ident()
            self.next_line = frame.f_lineno

    def _run(self):
        while not self._stop.wait(self.INTERVAL):
            try:
                self._sample()
            except Exception:  # a monitor never stops training
                return

    def _sample(self):
        self._wakes += 1
        if self._limit is None or self._wakes % self.RECOUNT == 0:
            cycles = list(self.cycles)
            self._limit = (slow_limit(cycles, spread=False)
                           if len(cycles) >= self.MIN_CYCLES else None)
        begun = self.begun
        if begun is None or self._limit is None or time.perf_counter() - begun <= self._limit:
            return
        frame = sys._current_frames().get(self.thread)
        while frame is not None and frame.f_code is not self.code:
            frame = frame.f_back
        if frame is not None and frame.f_lineno != self.next_line:
            self.counts[frame.f_lineno] += 1
        frame = None

    def where(self):
        """`file:line` of the loop-body line most of the long cycles' samples hold, or
        None."""
        total = sum(self.counts.values())
        if total < self.MIN_SAMPLES:
            return None
        line, count = self.counts.most_common(1)[0]
        return f"{self.code.co_filename}:{line}" if 2 * count >= total else None


def _probe_eager_gradients(watched):
    """On TensorFlow, the run's first eager `tf.GradientTape.gradient` (a step outside
    any tf.function) tells the step stream the step runs eagerly, with the loop's line,
    as diagnose's own loop does; returns the function that ends the probe, or None."""
    tf = sys.modules.get("tensorflow")
    if tf is None or keras.backend.backend() != "tensorflow":
        return None
    import os

    library = tuple(os.path.dirname(m.__file__) + os.sep for m in (tf, keras)
                    if getattr(m, "__file__", None))
    original = tf.GradientTape.gradient
    state = {"on": True}

    def gradient(tape, *args, **kwargs):
        if state["on"] and tf.executing_eagerly() and watched._stream is not None:
            state["on"] = False  # once per run
            frame = sys._getframe(1)
            while frame is not None and frame.f_code.co_filename.startswith(library):
                frame = frame.f_back
            where = frame and f"{frame.f_code.co_filename}:{frame.f_lineno}"
            watched._stream.tell(eager=True, eager_where=where)
            frame = None
        return original(tape, *args, **kwargs)

    def undo():
        state["on"] = False
        if tf.GradientTape.gradient is gradient:  # another wrapper on top stays
            tf.GradientTape.gradient = original

    tf.GradientTape.gradient = gradient
    return undo


def _close_at_exit(watched):
    """A function for `atexit` that ends `watched`'s run, if it still lives and runs."""
    ref = weakref.ref(watched)

    def close():
        target = ref()
        if target is not None and target._running:
            try:
                target.close()
            except Exception as exc:  # a monitor never fails the program's exit
                warn(f"kg.watch could not end its run at exit ({type(exc).__name__}: {exc})")

    return close


def _sync_call(backend):
    """The call that waits for the device work queued on `backend`, or None.

    None where steps run synchronously (the NumPy backend, torch without
    CUDA, TensorFlow's synchronous eager execution on CPUs alone): there is
    nothing to wait for.

    Args:
        backend: `keras.backend.backend()`.
    """
    if backend == "tensorflow":
        import tensorflow as tf

        if tf.config.experimental.get_synchronous_execution() and all(
                d.device_type == "CPU" for d in tf.config.list_logical_devices()):
            return None
        return tf.test.experimental.sync_devices
    if backend == "jax":
        import jax

        return lambda: jax.block_until_ready(jax.live_arrays())
    if backend == "torch":
        import torch

        return torch.cuda.synchronize if torch.cuda.is_available() else None
    return None


def _block_on(outputs):
    """Waits for every JAX array in `outputs`; one donated (deleted) since is skipped."""
    for leaf in keras.tree.flatten(outputs):
        if not hasattr(leaf, "block_until_ready"):
            continue
        try:
            leaf.block_until_ready()
        except RuntimeError:
            if not leaf.is_deleted():
                raise


def _is_dataset(iterable):
    """Whether `iterable` is a `tf.data.Dataset` (without importing TensorFlow)."""
    tf = sys.modules.get("tensorflow")
    return tf is not None and isinstance(iterable, tf.data.Dataset)


def _is_distributed(iterable):
    """Whether `iterable` is a `tf.distribute` dataset (`experimental_distribute_dataset`,
    `distribute_datasets_from_function`), whose `next()` also waits for the other workers
    (without importing TensorFlow)."""
    tf = sys.modules.get("tensorflow")
    return tf is not None and isinstance(iterable, tf.distribute.DistributedDataset)


def _batch_facts(element):
    """(samples, shape key) of one batch: the first leading dimension, the leaf shapes."""
    shapes = tuple(tuple(leaf.shape) for leaf in keras.tree.flatten(element)
                   if hasattr(leaf, "shape"))
    samples = next((s[0] for s in shapes if s and isinstance(s[0], int)), None)
    return samples, shapes or None


class _Epoch:
    """One epoch's iterator: times `next()` (the step clock's `timed`) and fires
    the step hooks."""

    def __init__(self, watched, iterator, epoch):
        self.watched = watched
        self.iterator = iterator
        self.epoch = epoch
        self.batch = -1
        self.step_open = False
        self.split = False  # the loop calls step_done()
        self.done = False

    def __iter__(self):
        return self

    def end_step(self, outputs=None, split=True):
        """Ends the open step where its device work ends (`step_done`: split)."""
        if self.step_open:
            self.step_open = False
            self.split = split
            self.watched._wait(outputs)
            self.watched._hooks.on_train_batch_end(self.batch)
            self.watched._said_wait_error()

    def _release(self):
        self.iterator = None

    def end(self, failed=False):
        self.end_step(split=self.split)
        if not self.done:
            self.done = True
            _, took = timed(self._release)  # its cost timed as input
            self.watched._carry += took
            if self.watched._stalls is not None:
                self.watched._tell_stall()
            if not failed:
                self.watched._hooks.on_epoch_end(self.epoch)

    def __next__(self):
        self.end_step(split=False)
        if self.done:
            raise StopIteration
        watched = self.watched
        stalls = watched._stalls
        if stalls is not None:  # the loop's frame is read once, at its first next()
            stalls.cycle(sys._getframe(1) if stalls.code is None else None)
        element, wait = timed(next, self.iterator, _END)
        if element is _END:
            watched._carry += wait
            if watched._open is self:
                watched._open = None
            self.end()
            if not watched._in_with:  # `iter(kg.watch(...))`: the run ends with its data
                watched.close()
            raise StopIteration
        self.batch += 1
        watched.steps += 1
        watched._supply(wait, element, self.split)
        self.step_open = True
        watched._hooks.on_train_batch_begin(self.batch)
        return element
