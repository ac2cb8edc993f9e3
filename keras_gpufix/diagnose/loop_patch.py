"""Custom training loops: Python iteration over datasets and the steps between.

While the script runs, these entry points are wrapped (the `tf.function`
class is not exported: `keras_internals.tf_function_class`); the TensorFlow
ones only on the TensorFlow backend, `jax.jit` only on JAX:

| entry point                 | what diagnose learns                                   |
|-----------------------------|--------------------------------------------------------|
| `tf.data.Dataset.__iter__`, | the script iterates a dataset itself (its own loop)    |
| `keras.utils.PyDataset.__iter__` |                                                   |
| `Strategy.experimental_distribute_dataset`, | the distributed dataset it returns: its  |
| `Strategy.distribute_datasets_from_function` | class's `__iter__` is wrapped too (a    |
|                             | loop over it, `strategy.run` in the step); the what-if |
|                             | replays the step on the distributed input dataset      |
| `tf.GradientTape.gradient`  | a training step: eager (direct evidence of `eager_step`)|
|                             | or traced inside a `tf.function` (that function trains)|
| `tf.gradients`, an optimizer's `apply` | traced inside a `tf.function` (in         |
|                             | `strategy.run` too): that function trains, whatever    |
|                             | computed the gradient                                  |
| `tf.function` calls         | each call of a function that computes gradients is a   |
|                             | step                                                   |
| `jax.jit` (JAX backend)     | the script's jitted functions (`jax_steps.py`): each   |
|                             | call of one whose outputs come back as its next call's |
|                             | arguments (updated parameters) is a step;              |
|                             | over a Python iterable each such call begins a cycle   |

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
input wait. The loop's cycles, input waits and loop-body seconds are the
stream's records (its `StepTimer`'s), read when the loop ends: nothing here
times a cycle again. Only the calls of the train functions are timed
(the step clock's `timed`), as the what-if's step of each cycle. With
`steps=N` the iterator ends (`StepsReached`, a `StopIteration`, like an
exhausted dataset) once the run's N training steps ran (a `fit`'s before
it count), so a `for` loop stops cleanly and the script runs on; where it
asks to train again (a batch of a dataset it trained on: the next epoch of
`while True: train_epoch()`; a train step call; a `fit`) the script ends
there (`StepsEnded`), as a finished run does, before an epoch that yields
nothing reaches the code after its loop. A loop that calls `next()` itself
gets `StepsEnded` there too, a BaseException: an `except Exception` around
the call (a trainer's "Training failed" handler) does not take it for a
failure (`run_diagnosis` says where). Iteration inside
`fit`, `evaluate` or `predict`, inside a `tf.function`, or inside the body
of a loop over another live iterator (a step that iterates its
micro-batches: `LoopPatch.nested`) is left alone.
When no step was seen, `LoopPatch.seen()` lists what was: the iterables
the script iterated and the tf.functions it called.
"""

import dis
import functools
import inspect
import os
import statistics
import sys
import threading
import time
import weakref
from collections import Counter, deque

from keras_gpufix.analysis import (locate_periodic, sampled_share, sampled_stall, stall_located,
                                   stall_period)
from keras_gpufix.callbacks._clock import timed
from keras_gpufix.diagnose.what_if import (Cycles, compile_step, input_rate, replay_rates,
                                           what_if_until_known)

__all__ = ["LoopPatch", "StepsEnded", "StepsReached"]


class StepsReached(StopIteration):
    """`diagnose --steps N`: the custom loop ran its N steps; its iterator ends, as an
    exhausted dataset does, so a `for` loop over it stops cleanly."""


class StepsEnded(BaseException):
    """`diagnose --steps N`: the run's N training steps ran and the script asked to
    train again (`asked`: a batch of a dataset it trained on, a train step call,
    a `fit`); the script ends there as a finished run does (exit 0), its own
    `finally` and `with` clean-up run on the way out. A BaseException, so the
    script's `except Exception` does not take it; `run_diagnosis` does."""

    def __init__(self, steps, asked, own_next=False):
        super().__init__(f"--steps {steps} reached; the script asked for {asked}")
        self.steps = steps
        self.asked = asked
        self.own_next = own_next  # raised in the loop's own next() call


def _for_loop(frame):
    """Whether `frame` asks for the next item in a `for` loop (directly, or through
    `zip`/`enumerate`), not in a call such as `next(it)`."""
    return dis.opname[frame.f_code.co_code[frame.f_lasti]] == "FOR_ITER"


def _library_prefixes():
    """The folders of Keras, keras_gpufix and the imported backends (TensorFlow, JAX)."""
    import keras

    import keras_gpufix

    modules = [keras, keras_gpufix] + [sys.modules[n] for n in ("tensorflow", "jax", "jaxlib")
                                       if n in sys.modules]
    return tuple(os.path.dirname(m.__file__) + os.sep for m in modules)


def _where(frame):
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"


def _function_of(frame):
    """The Python function running in `frame` (the user's step), or None.

    Looked up by its name where its call could have found it: the class (or the
    object) of its first argument for a method, its module's globals, its caller's
    locals and globals, each unwrapped (bound methods, decorators' `__wrapped__`);
    else among the interpreter's objects (`gc.get_objects`, which lists them and
    traverses none). Never `gc.get_referrers`, which runs every object's traversal
    and crashed the interpreter (SIGSEGV) in a real trainer's run."""
    import gc
    import types

    code, name = frame.f_code, frame.f_code.co_name
    places = []
    if code.co_argcount and code.co_varnames[0] in frame.f_locals:
        first = frame.f_locals[code.co_varnames[0]]
        owner = first if isinstance(first, type) else type(first)
        places += [getattr(c, "__dict__", {}).get(name) for c in owner.__mro__]
    places.append(frame.f_globals.get(name))
    if frame.f_back is not None:
        places += [frame.f_back.f_locals.get(name), frame.f_back.f_globals.get(name)]
    for place in places:
        for _ in range(8):  # a method, its decorators' wrappers
            if isinstance(place, types.FunctionType) and place.__code__ is code:
                return place
            inner = getattr(place, "__func__", None) or getattr(place, "__wrapped__", None)
            if inner is None:
                break
            place = inner
    return next((f for f in gc.get_objects()
                 if isinstance(f, types.FunctionType) and f.__code__ is code), None)


def _arguments(frame):
    """(args, kwargs) the function running in `frame` was called with (its parameters'
    current values)."""
    code, values = frame.f_code, frame.f_locals
    names = code.co_varnames
    positional, kwonly = code.co_argcount, code.co_kwonlyargcount
    args = [values[n] for n in names[:positional]]
    kwargs = {n: values[n] for n in names[positional:positional + kwonly]}
    extra = positional + kwonly
    if code.co_flags & 0x04:  # *args
        args += list(values[names[extra]])
        extra += 1
    if code.co_flags & 0x08:  # **kwargs
        kwargs.update(values[names[extra]])
    return args, kwargs


class _StackSampler:
    """Samples which line of the loop's frame the main thread is at, per cycle.

    A daemon thread wakes every `INTERVAL` seconds, or every `SAMPLES`-th of
    the last loop body's time where that is longer (at most `MAX_INTERVAL`);
    while a cycle's loop body runs (`begin` .. `end`) it reads the main
    thread's stack (`sys._current_frames()`, a few microseconds, no tracing
    hook) and counts the line of the loop's own frame, by the seconds its
    sample stands for (the interval it waited). Each wake takes the
    GIL from the step: MyXTTSModel's eager 3 s step ran 11% slower beside
    a 2 ms sampler (2833 -> 3155 ms a step, one alternated pair), and as
    fast beside a 30 ms one (2831 -> 2829 ms), so a long cycle is sampled
    less often. The last `MAX_CYCLES` cycles are kept: their step index and
    their counts; their loop-body seconds come from the step stream's
    records (`locate`).
    """

    INTERVAL = 0.002
    SAMPLES = 100
    MAX_INTERVAL = 0.05
    MAX_CYCLES = 4096

    def __init__(self):
        self.main = threading.main_thread().ident
        self.cycles = deque(maxlen=self.MAX_CYCLES)  # (step index, Counter "file:line" -> s)
        self._code = None
        self._index = None
        self._counts = None
        self._began = None
        self._interval = self.INTERVAL
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="keras-gpufix-sampler",
                                        daemon=True)
        self._thread.start()

    def begin(self, code, index):
        """The loop body of step `index` starts in the frame running `code` (the loop's)."""
        self._code = code
        self._index = index
        self._counts = Counter()
        self._began = time.perf_counter()

    def end(self):
        """The loop body ended (the loop asks for the next batch)."""
        counts, self._counts = self._counts, None
        if counts is not None:
            self.cycles.append((self._index, counts))
            body = time.perf_counter() - self._began
            self._interval = min(self.MAX_INTERVAL, max(self.INTERVAL, body / self.SAMPLES))

    def stop(self):
        self._stop.set()
        self._thread.join()

    def _run(self):
        interval = self._interval
        while not self._stop.wait(interval):
            counts, code = self._counts, self._code
            if counts is not None:
                frame = sys._current_frames().get(self.main)
                while frame is not None and frame.f_code is not code:
                    frame = frame.f_back
                if frame is not None:  # a sample stands for the time since the last
                    counts[_where(frame)] += interval
                frame = None
            interval = self._interval

    def locate(self, period, body_s):
        """`(file:line, share, period)` of the work every `period` cycles, or None.

        Args:
            period: the stall's period, in cycles; None for stalls with no period
                (the period the samples hold is looked for).
            body_s: step index -> seconds of its loop body (the stream's
                record: its cycle less its input wait); cycles without
                one are left out.
        """
        cycles = [(body_s[i], counts) for i, counts in self.cycles if i in body_s]
        return locate_periodic([c[0] for c in cycles], [c[1] for c in cycles], period)

    def share(self, location, body_s):
        """The loop-body time `location` holds beyond its median cycle's, over the
        sampled cycles of `body_s` (`analysis.sampled_share`)."""
        return sampled_share([counts for i, counts in self.cycles if i in body_s], location)


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

    dataset, remake = loop.dataset, loop.remake
    if not hasattr(dataset, "take"):  # a PyDataset: its last batch is replayed
        return None
    return (on(remake(dataset.take(1).cache().repeat().prefetch(2))),
            lambda: on(remake(dataset.repeat())))


class _Current:
    """What `kg.watch` iterates: each epoch, the iterator the script already holds.

    Its iterator ends (`StopIteration`) once `--steps` was reached, inside
    watch's epoch, so watch closes the step and the epoch itself.
    """

    def __init__(self, patch):
        self.patch = patch
        self.iterator = None

    def __iter__(self):
        return self

    def __next__(self):
        if self.patch.stopped:
            raise StopIteration
        return next(self.iterator)


class _Loop:
    """One custom-loop run: its monitors, driven through `kg.watch`."""

    def __init__(self, patch):
        import keras

        from keras_gpufix.watched import Watched

        self.patch = patch
        # a jax.jit step's compiles are counted by RetracingMonitor (jax.monitoring)
        self.mine = patch.fits_patch.monitors(patch.fits_patch.steps, "loop",
                                              retracing=bool(patch.train_jits),
                                              functions=list(patch.train_jits) or None)
        self.source = _Current(patch)
        # ProfilerTrigger weak-refs its model: a placeholder stands for the user's
        self.watched = Watched(self.source, callbacks=list(self.mine.values()),
                               model=keras.Sequential(name="custom_loop"),
                               locate_stalls=False).__enter__()  # `_StackSampler` does
        self.entry = {"index": len(patch.fits_patch.fits) + 1, "kind": "loop",
                      "x": "tf.data.Dataset (iterated by the script)", "epochs": 0,
                      "step": dict(patch.step_info)}
        patch.fits_patch.fits.append(self.entry)
        self.cycles = 0
        self.step_s = deque(maxlen=_StackSampler.MAX_CYCLES)  # (step index, train functions' s)
        self.dataset = None  # the first training dataset (tf.data, PyDataset), for the what-if
        self.remake = None  # dataset -> what the loop iterated (its distributed dataset)
        self.sampler = _StackSampler()
        self.last_element = None  # the last batch it handed out
        self.t0 = time.perf_counter()

    def open_epoch(self, iterator):
        """`iterator` trains from now on: a new epoch of the watched loop."""
        if self.dataset is None:
            self.dataset, self.remake = iterator.dataset, iterator.remake
            self.entry["x"] = f"{iterator.kind} (iterated by the script)"
            self.entry["tf_data"] = hasattr(self.dataset, "take")  # else a PyDataset
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
        timer = self.mine.get("timer")
        self.records = [] if timer is None else timer.records()
        summary = {} if timer is None else timer.summary()  # after its warm-up steps
        total, share = summary.get("total_s"), summary.get("input_wait")
        wait = None if total is None or share is None else share * total
        self.entry["phases"] = {"input_wait_s": wait,
                                "step_and_between_s": None if wait is None else total - wait,
                                "input_share": share}
        self.patch.fits_patch.collect(self.entry, self.mine)
        self.entry["step"]["stall_where"] = self._stall_where()

    def cycles_timed(self):
        """The loop's steady cycles for the what-if: the stream's records (cycle,
        input wait), each step the time in the train functions diagnose saw
        (0 for an eager step: none was seen)."""
        return Cycles.of(self.records, steps=dict(self.step_s))

    def _stall_where(self):
        """The loop-body line of the run's periodic stall, its verdict or a cause beside
        it, or of its stalls with no period (stack samples), or None. Where the run
        judged no stall (a noisy step, an eager one under load, hides the period in
        the cycles' times), the samples alone may hold work every k cycles: its line,
        with `stall_sampled` (`period`, `share` of the run) in the step facts, where it
        holds `THRESHOLDS["cost_share"]` of the run (`analysis.sampled_stall`)."""
        monitor = self.entry.get("monitor")
        body = {r.index: r.cycle - (r.input_wait or 0.0) for r in self.records}
        if stall_located(monitor):  # the verdict or a cause beside it
            # an irregular stall's period: the one its samples hold, where they hold one
            found = self.sampler.locate(stall_period(monitor), body)
            return found and found[0]
        found = self.sampler.locate(None, body)
        if found is None:
            return None
        cycles = sum(r.cycle for r in self.records if r.index in body) or 0.0
        share = sampled_stall(self.sampler.share(found[0], body),
                              sum(body.values()) / cycles if cycles else 0.0)
        if share is None:
            return None
        self.entry["step"]["stall_sampled"] = {"period": found[2], "share": share}
        return found[0]


class _WatchedIterator:
    """A dataset iterator whose `next()` calls delimit the loop's cycles."""

    def __init__(self, patch, iterable, iterator, dataset, remake=None):
        self.patch = patch
        self.iterator = iterator
        self.dataset = dataset  # the tf.data dataset (a distributed one's input) or PyDataset
        self.remake = remake or (lambda d: d)  # a tf.data dataset -> what the loop iterates
        self.kind = type(iterable).__name__
        self.key = id(dataset)
        self.mark = None  # the patch's step count at the last next()
        self.epoch = None  # watch's epoch iterator, once this iterator trains
        self.open = False  # a batch was handed out and its cycle not yet closed
        self.index = None  # the step index (the stream's) of the batch handed out last
        self.in_step = 0.0  # the patch's time in step functions when it returned
        self.consumer = None  # id of the frame that took its last batch (the loop's)
        patch.iterators.add(self)

    def __iter__(self):
        return self

    def __getattr__(self, name):  # element_spec, get_next, ...
        return getattr(self.iterator, name)

    def __next__(self):
        patch = self.patch
        patch.fits_patch.raise_pending()
        if self.key in patch.trained_datasets:  # a later epoch, once --steps was reached
            patch.fits_patch.end_if_reached("a batch of the dataset it trained on")
        if self.mark is not None and patch.step_calls > self.mark and self.epoch is None:
            patch.trained_datasets.add(self.key)
            self.epoch = patch.start_loop().open_epoch(self)
        if self.epoch is None:
            self.mark = patch.step_calls
            try:
                element = next(self.iterator)
            except StopIteration:
                self.consumer = None
                raise
            self.consumer = id(sys._getframe(1))
            return element
        loop = patch.loop
        if self.open:
            self.open = False
            loop.cycles += 1
            loop.sampler.end()
            step = patch.step_s - self.in_step if patch.step_info["functions"] else 0.0
            loop.step_s.append((self.index, step))
            patch.fits_patch.steps_done += 1
            if patch.fits_patch.steps_reached():
                patch.stopped = True  # the source ends: watch closes the step and epoch
        self.mark = patch.step_calls
        try:
            element = next(self.epoch)
        except StopIteration:
            self.epoch = self.consumer = None
            if patch.stopped:
                if not _for_loop(sys._getframe(1)):  # past its `except Exception`
                    raise StepsEnded(patch.steps, "a batch in its own next() call",
                                     own_next=True) from None
                raise StepsReached(patch.steps) from None
            raise
        if self.dataset is loop.dataset:
            loop.last_element = element
        self.in_step = patch.step_s
        self.index = loop.watched.steps - 1  # watch's run: one record per batch, in order
        self.open = True
        frame = sys._getframe(1)  # the loop's own frame asked
        self.consumer = id(frame)
        loop.sampler.begin(frame.f_code, self.index)
        frame = None
        return element

    next = __next__


class _Calls:
    """The loop over a Python iterable, as `_Loop.open_epoch` takes an iterator: each
    `next()` hands out the batch of the step call being made."""

    kind = "Python iterable"
    dataset = remake = None

    def __init__(self):
        self.iterator = self
        self.epoch = None  # watch's epoch over it
        self.element = None  # the batch of the call being made
        self.index = None  # the step index (the stream's) of the call being made
        self.in_step = 0.0  # the patch's time in step functions when it began

    def __next__(self):
        return self.element


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
        self._distributed = {}  # id(distributed dataset) -> (its input, remake, itself)
        self._seen_iterables = {}  # "Type (file:line)" -> iterators made there
        self.iterators = weakref.WeakSet()  # the script's live watched iterators
        self._seen_functions = {}  # id(tf.function) -> {"name", "where", "calls"}
        self._eager_functions = {}  # code -> the Python function of an eager gradient step
        self.eager_step = None  # (function, args, kwargs) of the last eager step call
        self.eager_calls = 0  # its calls while a loop ran (several a cycle: micro-batches)
        self.gradient_s = []  # each eager gradient's seconds while a loop ran (the run's clock)
        self._eager_frame = None  # the frame of its last call
        self._undo = []  # undoes the patches that are not a class attribute (jax.jit)
        self._jit_trains = {}  # id(Jitted) -> its first call's outputs, then whether it trains
        self.train_jits = []  # the jitted functions that train, in order
        self._calls = None  # a loop over a Python iterable: its cycles are step calls
        self._updated = set()  # (shape, dtype) of the arrays the train steps returned first
        self._watches = []  # (the script's kg.watch, its entry, our monitors, start time)

    def start_loop(self):
        if self.loop is None:
            self.loop = _Loop(self)
        return self.loop

    def _patch(self, cls, name, make):
        original = cls.__dict__[name]
        self._saved.append((cls, name, original))
        setattr(cls, name, make(original))

    def seen(self):
        """What the script did that diagnose could see, for a run where no step was seen.

        Returns:
            A dict `iterables` ("Type (file:line): N iterator(s)") and
            `functions` ("name (file:line): N call(s)"), each the
            tf.data datasets, distributed datasets and PyDatasets the
            script iterated itself and the tf.functions it called.
        """
        return {"iterables": [f"{k}: {n} iterator{'s' * (n != 1)}"
                              for k, n in self._seen_iterables.items()],
                "functions": [f"{f['name']} ({f['where']}): {f['calls']} call"
                              + "s" * (f["calls"] != 1) for f in self._seen_functions.values()]}

    def nested(self, frame):
        """Whether `frame` (the one calling `iter()`) runs inside the body of a loop over
        a live iterator: its frame, a strict ancestor of `frame`, took that iterator's
        last batch (a step that iterates its micro-batches is part of the step)."""
        consumers = {it.consumer for it in list(self.iterators) if it.consumer is not None}
        frame = frame.f_back if consumers else None
        while frame is not None:
            if id(frame) in consumers:
                return True
            frame = frame.f_back
        return False

    def _saw(self, iterable, frame):
        key = f"{type(iterable).__name__} ({_where(frame)})"
        self._seen_iterables[key] = self._seen_iterables.get(key, 0) + 1

    def _called(self, fn):
        seen = self._seen_functions.get(id(fn))
        if seen is None:
            code = getattr(getattr(fn, "python_function", None), "__code__", None)
            seen = self._seen_functions[id(fn)] = {
                "name": getattr(fn, "__name__", "?"), "calls": 0,
                "where": code and f"{code.co_filename}:{code.co_firstlineno}"}
        seen["calls"] += 1

    def _patch_iter(self, cls, make_iter):
        """Patches `cls.__iter__` (once) where `cls` defines it."""
        owner = next((c for c in cls.__mro__ if "__iter__" in c.__dict__), None)
        if owner is not None and owner is not object and not any(
                c is owner and n == "__iter__" for c, n, _ in self._saved):
            self._patch(owner, "__iter__", make_iter)

    def __enter__(self):
        import keras

        library = self._library = _library_prefixes()
        patch = self
        # tf.data, tf.function and tapes on TensorFlow; a script's jax.jit steps on JAX
        backend = keras.backend.backend()
        tf = sys.modules.get("tensorflow") if backend == "tensorflow" else None
        eager = tf.executing_eagerly if tf is not None else (lambda: True)

        def user_frame(depth):
            frame = sys._getframe(depth)
            while frame is not None and frame.f_code.co_filename.startswith(library):
                frame = frame.f_back
            return frame

        def make_iter(original):
            def __iter__(iterable):
                caller = sys._getframe(1)
                if (patch.fits_patch._depth or caller.f_code.co_filename.startswith(library)
                        or not eager() or patch.nested(caller)):
                    return original(iterable)
                patch._saw(iterable, caller)
                dataset, remake, _ = patch._distributed.get(id(iterable), (iterable, None, None))
                # the input wait is the time in next(), handed to the step stream: no probe
                return _WatchedIterator(patch, iterable, original(iterable), dataset, remake)
            return __iter__

        def make_distribute(original):  # a tf.distribute strategy's distributed dataset
            def distribute(strategy, dataset, *args, **kwargs):
                result = original(strategy, dataset, *args, **kwargs)
                if result is not dataset:
                    patch._patch_iter(type(result), make_iter)
                    if isinstance(dataset, tf.data.Dataset):
                        patch._distributed[id(result)] = (
                            dataset, lambda d: original(strategy, d, *args, **kwargs), result)
                return result
            return distribute

        def traced_training():
            """A gradient or a weight update traced inside the outermost tf.function the
            script called (in `strategy.run` too): that function trains."""
            if not patch.fits_patch._depth and not tf.executing_eagerly() and patch._stack:
                patch._train_functions.setdefault(id(patch._stack[0]), patch._stack[0])

        def make_gradient(original):
            def gradient(tape, *args, **kwargs):
                if not patch.fits_patch._depth and tf.executing_eagerly():
                    patch.fits_patch.end_if_reached("a train step")
                    patch.step_calls += 1
                    frame = user_frame(2)
                    if not patch.step_info["eager"]:
                        patch.step_info["eager"] = True
                        patch.step_info["eager_where"] = frame and _where(frame)
                    patch._eager_call(frame)
                    frame = None
                    if patch.loop is not None:
                        result, took = timed(original, tape, *args, **kwargs)
                        patch.gradient_s.append(took)
                        return result
                else:
                    traced_training()
                return original(tape, *args, **kwargs)
            return gradient

        def make_traced(original):  # tf.gradients, an optimizer's apply: graph-mode training
            @functools.wraps(original)
            def traced(*args, **kwargs):
                traced_training()
                return original(*args, **kwargs)
            return traced

        def make_call(original):
            def __call__(fn, *args, **kwargs):
                if patch.fits_patch._depth or not tf.executing_eagerly():
                    return original(fn, *args, **kwargs)
                if not patch._stack:
                    patch._called(fn)
                    if id(fn) in patch._train_functions:
                        patch.fits_patch.end_if_reached("a train step")
                patch._stack.append(fn)
                try:
                    result, took = timed(original, fn, *args, **kwargs)
                finally:
                    patch._stack.pop()
                if not patch._stack and id(fn) in patch._train_functions:
                    patch.step_s += took
                    patch.last_step = (fn, args, kwargs)
                    patch._step_function_called(fn)
                return result
            return __call__

        self._patch_iter(keras.utils.PyDataset, make_iter)
        if backend == "jax":
            from keras_gpufix.diagnose.jax_steps import patch_jit

            self._undo.append(patch_jit(self.jit_call,
                                        lambda f: f.f_code.co_filename.startswith(library)))
            from keras_gpufix.watched import Watched

            def make_watch_iter(original):
                def __iter__(watched):
                    if (not watched._running and not patch.fits_patch._depth
                            and (patch.loop is None or watched is not patch.loop.watched)):
                        patch._attach(watched)
                    return original(watched)
                return __iter__

            self._patch(Watched, "__iter__", make_watch_iter)
        if tf is None:
            return self
        from keras_gpufix.keras_internals import tf_function_class

        self._patch(tf.data.Dataset, "__iter__", make_iter)
        for name in ("experimental_distribute_dataset", "distribute_datasets_from_function"):
            owner = next(c for c in tf.distribute.Strategy.__mro__ if name in c.__dict__)
            self._patch(owner, name, make_distribute)
        self._patch(tf.GradientTape, "gradient", make_gradient)
        for module in (tf, tf.compat.v1):  # gradients without a tape (a TF1-style trainer)
            self._patch(module, "gradients", make_traced)
        self._patch(next(c for c in keras.optimizers.Optimizer.__mro__ if "apply" in c.__dict__),
                    "apply", make_traced)
        self._patch(tf_function_class(), "__call__", make_call)
        return self

    def _eager_call(self, frame):
        """Keeps the eager step's function and its last arguments, for `compile_step`."""
        if frame is None or frame.f_code.co_name == "<module>":
            return
        code = frame.f_code
        if code not in self._eager_functions:
            self._eager_functions[code] = _function_of(frame)
        fn = self._eager_functions[code]
        if fn is not None:
            try:
                self.eager_step = (fn, *_arguments(frame))
            except KeyError:  # a parameter deleted in the body
                pass
            if self.loop is not None and frame is not self._eager_frame:
                self.eager_calls += 1  # a call of the function, not each gradient in it
            self._eager_frame = frame  # held: a later call's frame is a new object

    def jit_call(self, fn, args, kwargs):
        """A call of a `jax.jit` function the script made (`jax_steps.Jitted`).

        Its second call decides whether it trains (`jax_steps.fed_back`: an
        array its first call returned comes back as an argument). A train
        step's calls are timed as the loop's steps. Where no watched iterator
        handed out the batch (a loop over a list or a generator: no `next()`
        diagnose can see), each call begins a cycle of the loop (`_call_cycle`).
        """
        from keras_gpufix.diagnose.jax_steps import arrays, fed_back, signatures

        # None: never called; a list: its first call's output arrays; then True or False
        state = self._jit_trains.get(id(fn))
        if isinstance(state, list) and not self.fits_patch._depth:
            first, state = state, fed_back(state, args, kwargs)
            self._jit_trains[id(fn)] = state
            if state:
                self.train_jits.append(fn.jitted)
                self._updated |= set(signatures(first))
            first = None
        if self.fits_patch._depth or state is False or isinstance(state, list):
            return fn.jitted(*args, **kwargs)
        if state is None:
            result = fn.jitted(*args, **kwargs)
            self._jit_trains[id(fn)] = arrays(result) or False
            return result
        self.fits_patch.raise_pending()
        self.fits_patch.end_if_reached("a train step")
        watch = next((w for w, *_ in self._watches if w._open is not None), None)
        if watch is not None:  # the script's kg.watch loop: its steps count
            if self.steps and watch.steps > self.steps:
                self.stopped = True
                raise StepsEnded(self.steps, "a train step")
        elif not any(it.consumer is not None for it in list(self.iterators)):
            self._call_cycle(args, kwargs)
        result, took = timed(fn.jitted, *args, **kwargs)
        self.step_s += took
        self._step_function_called(fn)
        return result

    def _attach(self, watched):
        """The script's own `kg.watch` run starts: diagnose's monitors join its callbacks
        (a run of kind `loop`, its cycles watch's own; a watch without a model gets
        a placeholder, which `ProfilerTrigger` needs)."""
        import keras

        mine = self.fits_patch.monitors(self.steps, "loop", user=watched.callbacks,
                                        retracing=bool(self.train_jits),
                                        functions=list(self.train_jits) or None)
        ours = [cb for cb in mine.values() if not any(cb is u for u in watched.callbacks)]
        if watched.model is None:
            watched.model = keras.Sequential(name="custom_loop")
        watched.callbacks = watched.callbacks + ours
        watched._hooks = keras.callbacks.CallbackList(watched.callbacks, model=watched.model,
                                                      **(watched._hooks.params or {}))
        entry = {"index": len(self.fits_patch.fits) + 1, "kind": "loop",
                 "x": f"kg.watch({type(watched.iterable).__name__}) in the script",
                 "epochs": 0, "step": dict(self.step_info),
                 "what_if": {"reason": "the script's own kg.watch loop: its step is not "
                                       "replayed, its input not drained alone"}}
        self.fits_patch.fits.append(entry)
        self._watches.append((watched, entry, mine, time.perf_counter()))

    def _call_cycle(self, args, kwargs):
        """A train step's call in a loop over a Python iterable: ends the previous
        cycle (at `--steps` the script ends here: `StepsEnded`) and begins the next,
        as `_WatchedIterator.__next__` does at `next()`; its input wait is 0 (it is
        part of the cycle)."""
        from keras_gpufix.diagnose.jax_steps import batch_of

        loop = self.start_loop()
        calls = self._calls
        if calls is None:
            calls = self._calls = _Calls()
            calls.epoch = loop.open_epoch(calls)
            loop.entry["x"] = ("a Python iterable (iterated by the script; its cycles run from "
                               "one jax.jit step call to the next)")
        elif calls.index is not None:
            loop.cycles += 1
            loop.sampler.end()
            loop.step_s.append((calls.index, self.step_s - calls.in_step))
            self.fits_patch.steps_done += 1
            if self.fits_patch.steps_reached():
                self.stopped = True
                raise StepsEnded(self.steps, "a train step")
        calls.element = batch_of(args, kwargs, self._updated)
        next(calls.epoch)
        calls.in_step = self.step_s
        calls.index = loop.watched.steps - 1
        frame = sys._getframe(2)
        while frame is not None and frame.f_code.co_filename.startswith(self._library):
            frame = frame.f_back
        if frame is not None:
            loop.sampler.begin(frame.f_code, calls.index)
        frame = None

    def _step_function_called(self, fn):
        self.step_calls += 1
        if id(fn) not in self._named:
            self._named.add(id(fn))
            code = getattr(inspect.unwrap(getattr(fn, "python_function", None) or fn),
                           "__code__", None)
            self.step_info["functions"].append({
                "name": getattr(fn, "__name__", "?"),
                "where": code and f"{code.co_filename}:{code.co_firstlineno}"})

    def __exit__(self, *exc):
        for cls, name, original in reversed(self._saved):
            setattr(cls, name, original)
        self._saved.clear()
        while self._undo:
            self._undo.pop()()
        self._jit_trains.clear()  # first outputs of functions called once
        for watched, entry, mine, t0 in self._watches:
            watched.close()  # a run the script left open (no `with`)
            entry.update(epochs=watched.epoch, wall_s=time.perf_counter() - t0,
                         stopped_by_diagnose=self.stopped, step=dict(self.step_info))
            self.fits_patch.collect(entry, mine)
        if self.loop is not None:
            self.loop.finish()
            self.fits_patch.bill_traces(self.loop.entry, self.loop.mine.get("timer"))
            if self.fits_patch.what_if:
                with self.fits_patch.timing("what-if"):
                    self.loop.entry["what_if"] = self._what_if()
                    if self.eager_step is not None:
                        self.loop.entry["compiled_step"] = self._compiled_step()
                    stages = self.fits_patch.input_stages(self.loop.entry, self.loop.dataset)
                    if stages is not None:
                        self.loop.entry["stages"] = stages
        return False

    def _compiled_step(self):
        """`compile_step` of the loop's eager step, or a dict with the reason it was not
        measured."""
        fn, args, kwargs = self.eager_step
        self.eager_step = self._eager_frame = None  # its batch is not kept past the what-if
        try:
            compiled = compile_step(fn, args, kwargs, library=_library_prefixes(),
                                    log_dir=self.fits_patch.log_dir)
        except Exception as exc:  # never break the user's run
            return {"reason": f"{type(exc).__name__}: {exc}"}
        if self.loop.cycles:
            compiled["calls_per_step"] = self.eager_calls / self.loop.cycles
        if self.gradient_s:
            compiled["run_gradient_ms"] = 1000 * statistics.median(self.gradient_s)
        return compiled

    def _what_if(self):
        """The loop's what-if (`what_if.py`), or a dict with the reason it was not measured."""
        loop = self.loop
        if loop.dataset is None:
            return {"reason": "the loop iterates a Python iterable: there is no input to drain "
                              "alone"}
        try:
            input_per_s = input_rate(loop.dataset,
                                     budget=self.fits_patch.what_if_budget(loop.entry))
            measure = None  # no function to replay: the step as measured in the run
            if self.last_step is not None:  # replay the train tf.function
                fn, args, kwargs = self.last_step
                variables = list(fn.get_concrete_function(*args, **kwargs).variables)
                cached, real = _steps_on(fn, args, kwargs, loop) or (
                    lambda: fn(*args, **kwargs), None)
                measure = functools.partial(replay_rates, cached, variables, real=real,
                                            budget=self.fits_patch.what_if_budget(loop.entry))
            result = what_if_until_known(loop.cycles_timed(), input_per_s, measure,
                                         budget=self.fits_patch.what_if_budget(loop.entry))
        except Exception as exc:  # never break the user's run
            return {"reason": f"{type(exc).__name__}: {exc}"}
        return result or {"reason": "no steady cycles were timed"}
