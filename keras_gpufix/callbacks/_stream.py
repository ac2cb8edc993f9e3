"""The shared step stream: one measurement per hook for all our callbacks.

Parts, one job each: `_clock.py` stamps begin and ready times across
threads; `analysis/phases.py` splits a cycle into its phases;
`_edge.py` holds the markers that frame the callback list;
`_model_facts.py` reads what the model says about the run (jit, eager,
where); `_timed.py` is the base class of our callbacks; this module joins the
members, reads the input probe, makes the records and feeds the run's one
detector (its facts as one `analysis.RunFacts`, `tell`).

All keras_gpufix callbacks in one `fit` (or one `kg.watch` loop) join one
`StepStream`. Its step clock (`callbacks/_clock.py`) is read once per hook
(`time.perf_counter`; wall times come from one offset taken when the stream
opens): the begin on the loop's thread, the end where Keras runs the end
hook, in its thread pool on the JAX, torch and NumPy backends (our callbacks
are `async_safe`, so Keras keeps dispatching asynchronously and the loop
never waits for the device on our account). Records are made in step order
on the loop's thread (at the end hook where it runs there, else at the next
step's begin, before validation and at epoch end); the phases come from
`analysis.phases` (`step = ready(N) - max(begin(N), ready(N-1))`, the
host's time apart). The clock frames the whole callback list: at
`on_train_begin` the stream puts a marker at the front of the running
`keras.callbacks.CallbackList` (it ends the step at `on_train_batch_end`,
before any other callback runs) and one at its back
(it begins the step at `on_train_batch_begin`, after every other callback
ran; `keras_internals.surround_callbacks`), so the span holds the step
alone and every callback's work, the user's wherever they listed them, lies
in `between`. Where no CallbackList runs the hooks, the begin hook of the
last member and the end hook of the first (the leader) frame the step: our
own hooks then fall in `between`, and work that callbacks listed before
ours do in `on_train_batch_end` counts in the step. The stream reads
the input probe of a dataset that went through `kg.data.instrument`
(batched: every `SYNC_SECONDS`, before validation, at epoch end and at the
end of training; each hook once), turns every hook into one
`analysis.StepRecord` with its three phases and hands the records to every
member (`_on_records`), in order. So the recommended trio costs what one
monitor costs.

Phases of a hook (a step, or N steps with `steps_per_execution=N`):

- `between`: the gap from the previous step's end to this begin hook (other
  callbacks, logging, checkpoints, evaluation), where the device had
  nothing to do;
- `input_wait`: the probe's wait, measured from the cycle's start (the
  previous end hook), so it is right whether the batch is fetched inside
  the hook (`fit`) or before it (a `CallbackList` loop); a wait that ends
  before the begin hook lies in the gap and is taken from `between`, one
  that ends after it is taken from the step. A custom-loop wrapper
  (`kg.watch`) measures the wait itself and hands it over with `supply()`
  before the begin hook; the probe's wait is then not used;
- `step`: the rest of begin -> end.

Speech throughput: a dataset instrumented with its feature lengths
(`kg.data.instrument(..., frames=, frames_per_second=)`, as the `kg.data`
builder does) gives each record its real (unpadded) frames and seconds of
audio, read with the rest of the probe (no extra read per step), in `fit`
and under `kg.watch` alike (when watch iterates the dataset itself; over
an iterator or a generator it calls `drop_probe()`); other datasets leave
them None.

Input shapes in `fit` under XLA: on TensorFlow, when the model's step is
XLA-compiled, the leader puts a probe inside `model.train_function`
(`keras_gpufix/_step_shapes.py`) and reads each step's input shapes from it
with the rest (any dataset; an instrumented one's shapes come first).

Every backend (`backends.current()`, chosen once per run): a `PyDataset`,
generator or arrays in `fit` (every source on JAX) are read through a
`BatchClock` (`backends/batch_clock.py`) instead of the probe: each batch's ready time (the
input wait) and shapes. On JAX each record gets the seconds JAX spent
compiling inside it (`jax.monitoring`, `StepRecord.compile_s`). Where
callbacks turned Keras's asynchronous dispatch off, the stream tells the
detector which (`RunFacts.async_blockers`) and stamps each dispatch
(`DispatchClock`, `backends/dispatch_clock.py`; `StepRecord.awaited`) to price it.

One judgement per run: the stream feeds its records to one
`analysis.OscillationDetector` (the `GPUOscillationMonitor`'s in the run,
else one with the default settings) and hands its judgements and events to
every member (`_on_judgement`, `_on_event`), so every callback's report,
console line and Keras `logs` name the run's one verdict
(`OscillationDetector.verdict()`). A `RetracingMonitor` adds what it
counts (traces, whether the step is compiled or eager) to the records and
to the detector.

Keras `logs` (documented keys, every value a number; the batch's `step_ms`
is written by the stream's front marker, so every callback sees it, the
epoch's keys by the first of our callbacks in the list, so History,
CSVLogger, EarlyStopping and Keras's TensorBoard listed after it see them):

| key          | hook                 | value                                     |
|--------------|----------------------|-------------------------------------------|
| `step_ms`    | `on_train_batch_end` | the cycle per step (input wait + step +   |
|              |                      | between), ms                              |
| `step_ms`    | `on_epoch_end`       | the epoch's mean cycle per step, ms       |
| `input_wait` | `on_epoch_end`       | the epoch's share of the cycle spent      |
|              |                      | waiting for input (absent: not measured)  |
| `verdict`    | `on_epoch_end`       | the run's verdict so far, as its index in |
|              |                      | `analysis.VERDICTS` (`VERDICTS[int(v)]`)  |
"""

import weakref

from keras_gpufix._step_shapes import StepShapes
from keras_gpufix.analysis import VERDICTS, OscillationDetector, RunFacts, StepRecord
from keras_gpufix.analysis.phases import split_cycle
from keras_gpufix.backends import current
from keras_gpufix.backends.batch_clock import BatchClock
from keras_gpufix.backends.dispatch_clock import DispatchClock
from keras_gpufix.callbacks._base import UserError
from keras_gpufix.callbacks._clock import StepClock
from keras_gpufix.callbacks._edge import Edge
from keras_gpufix.callbacks._model_facts import model_facts
from keras_gpufix.keras_internals import (
    async_train_dispatch,
    blocks_async_dispatch,
    callback_model,
    running_callback_list,
    surround_callbacks,
)

__all__ = ["StepStream", "stream_of"]

# id(model) -> the StepStream of the running fit on that model. Weak: its
# members hold it while they run; a fit that ended by an exception (no
# on_train_end) must not keep its callbacks alive (a dropped ProfilerTrigger
# stops its trace when it is collected).
_OPEN = weakref.WeakValueDictionary()


class StepStream:
    """The step records of one running `fit` or loop, measured once.

    Attributes:
        hooks: end hooks recorded so far.
        last: `(index, steps, span_s, gap_s)` of the latest end hook, read
            right at that hook (for callbacks that act on the next step).
        input_probe: the `InputProbe` being read, or None.
        detector: the run's one `OscillationDetector`.
        facts: what is known about the run (`analysis.RunFacts`: jit,
            eager, eager_where, synced, thresholds), handed to the detector
            whenever it changes (`tell`): the model's when the run starts
            (`eager_where`: the line of a user's `compile` override that
            hands `run_eagerly` to Keras), refined by a `RetracingMonitor`,
            `kg.watch` (synced), diagnose's loop patch; `synced` becomes
            True once Keras handed logs to an end hook, which it turns into
            numbers first, waiting for the step.
        step_shapes: the `StepShapes` probe of fit's XLA train step (the
            input shapes of a plain `tf.data` dataset), or None;
            `step_shapes_note` says why it could not be attached.
        framed: whether markers at the front and back of the running
            CallbackList time the step (else the members' own hooks do).
    """

    # Reading the probe costs about half a millisecond while fit runs, so it
    # happens at most every SYNC_SECONDS (<= 0.2 % of the time), after at
    # least SYNC_MIN_HOOKS hooks, and at least every SYNC_MAX_HOOKS (well
    # inside the probe's ring of 4096 batches).
    SYNC_SECONDS = 0.25
    SYNC_MIN_HOOKS = 8
    SYNC_MAX_HOOKS = 1024
    # Distinct input shapes remembered for `new_shape` (bounded memory).
    MAX_SHAPES = 4096

    # Seconds the loop waits, before validation, for end hooks still in
    # Keras's pool (so the probe reads training's batches first).
    SETTLE_SECONDS = 2.0

    def __init__(self, key):
        self.key = key
        self.members = []
        self.leader = None
        self.batch_size = None
        self._sampler = None
        self.hooks = 0
        self.last = None
        self.facts = RunFacts()
        self._logs_seen = False  # an end hook got logs (Keras waited for the step)
        self.clock = StepClock()
        self._offset = self.clock.offset
        self._cursor = None
        self._supplied = None
        self._pending = []
        self._last_sync = None
        self._global = 0
        self._epoch = -1
        self._new_epoch = True
        self._shapes = set()
        self._closed = False
        self._failures = []  # end-hook failures in Keras's pool, reported on the loop's thread
        self.detector = OscillationDetector()
        self._own_detector = True
        self.step_shapes = self.step_shapes_note = None
        self.framed = False
        self._unframe = None
        self.backend = None
        self._compiles = None
        self._compiles_read = 0.0
        self._batch_clock = None
        self._dispatch = None
        self._epoch_sums = (-1, 0.0, 0.0, 0.0, 0)  # epoch, cycle, wait, waited cycle, steps

    # -- membership ------------------------------------------------------

    @classmethod
    def join(cls, callback):
        """The stream of `callback`'s running fit (opened by the first joiner)."""
        key = id(callback_model(callback))
        stream = _OPEN.get(key)
        # Members join at on_train_begin, before any step: a stream that has
        # timed a step belongs to an earlier run (one that ended by an
        # exception, so on_train_end never closed it).
        if (stream is None or stream._closed or callback in stream.members
                or stream.hooks or stream.clock.pending):
            stream = _OPEN[key] = cls(key)
        stream.members.append(callback)
        if stream.leader is None:
            stream.leader = callback
            stream._open()
            stream.tell(async_blockers=stream._blockers(callback))
            stream._unframe = surround_callbacks(callback, Edge(stream, end=True),
                                                 Edge(stream, end=False))
            stream.framed = stream._unframe is not None
            model = callback_model(callback)
            stream.tell(**model_facts(model))
            stream._watch_step_shapes(model)
            stream._watch_source()
            stream._watch_dispatch(model)
        detector = getattr(callback, "detector", None)
        if stream._own_detector and isinstance(detector, OscillationDetector):
            stream.detector, stream._own_detector = detector, False
            detector.reset()
            detector.tell(stream.facts)
        size = getattr(callback, "batch_size", None)
        if stream.batch_size is None and size is not None:
            stream.batch_size = size
        return stream

    def _open(self):
        import sys

        self.backend = current()
        self._compiles = self.backend.compile_log()  # compiles before the first hook are
        # never a hook's (`_compile_seconds` reads only those inside a hook's span)
        if "tensorflow" in sys.modules:  # only TF datasets can be instrumented
            from keras_gpufix.data.input_probe import InputCursor

            self._cursor = InputCursor()
            self._cursor.start()

    @property
    def input_probe(self):
        return None if self._cursor is None else self._cursor.probe

    # -- input shapes seen inside fit's train step (issue 22) --------------

    def _watch_step_shapes(self, model):
        """Under XLA, watches each step's input shapes inside `model.train_function`.

        There a new shape compiles the step, and a plain `tf.data` dataset
        (not through `kg.data.instrument`) shows no shape otherwise. Sets
        `step_shapes` (a `StepShapes`, or None) and `step_shapes_note` (why
        they cannot be watched, or None). TensorFlow's train function
        only: the probe is a TensorFlow op.
        """
        self.step_shapes, self.step_shapes_note = None, None
        if (self.backend.tensorflow_step and self.facts.jit and not self.facts.eager
                and model is not None):
            self.step_shapes, self.step_shapes_note = StepShapes.attach(model)

    def _watch_source(self):
        """Times the batches of fit's PyDataset, generator or arrays (`BatchClock`).

        Where it can (every source on JAX, a Python source on TensorFlow), the
        clock replaces the `kg.data.instrument` cursor: it follows the source
        fit actually reads.
        """
        self._batch_clock = BatchClock.attach(self.backend)
        if self._batch_clock is not None:
            self._cursor = self._batch_clock
            self.tell(input_source=self._batch_clock.source,
                      input_workers=self._batch_clock.workers)

    def _watch_dispatch(self, model):
        """Where callbacks stopped asynchronous dispatch, stamps each step's dispatch."""
        self._dispatch = None
        if self.facts.async_blockers and model is not None:
            self._dispatch = DispatchClock.attach(model)

    def _blockers(self, callback):
        """Names of the callbacks that turned Keras's asynchronous dispatch off.

        None where the backend never dispatches callbacks asynchronously
        (TensorFlow), where dispatch is on, or where it cannot be told.
        """
        if not self.backend.async_callbacks:
            return None
        hooks = running_callback_list(callback)
        if hooks is None or async_train_dispatch(hooks) is not False:
            return None
        return tuple(type(c).__name__ for c in hooks.callbacks
                     if blocks_async_dispatch(c)) or None

    def _compile_seconds(self, pending):
        """Per pending hook, seconds JAX spent compiling inside it (None: not counted)."""
        if self._compiles is None:
            return [None] * len(pending)
        events = self._compiles.since(self._compiles_read)
        self._compiles_read = pending[-1][2] + pending[-1][3]
        out = []
        for p in pending:
            begin, end = p[2], p[2] + p[3]
            out.append(sum(e[1] for e in events if begin < e[0] <= end))
        return out

    def _step_shape_keys(self, pending):
        """Per pending hook, the shape key the train step saw (or None)."""
        if self.step_shapes is None:
            return [None] * len(pending)
        return self.step_shapes.take([p[1] for p in pending])

    # -- the custom-loop wrapper's call ------------------------------------

    def supply(self, input_wait, samples=None, shape=None, split=False):
        """Hands over the next step's measured input wait (custom loops).

        Called between `next()` returning the batch and
        `on_train_batch_begin`. The supplied facts replace the probe's wait,
        batch size and shape; real frames and audio seconds still come from
        the probe of an instrumented dataset.

        Args:
            input_wait: seconds spent in `next()`, or None when that time
                is not input alone (steps timed at dispatch: `next()` may
                queue behind the device's pending work); the record's step
                is then the whole cycle.
            samples: the batch's leading dimension, or None.
            shape: a hashable key of the batch's shapes, or None.
            split: whether begin -> end holds only the step (False: the
                whole loop body). Defaults to False.
        """
        wait = None if input_wait is None else float(input_wait)
        self._supplied = (wait, samples, shape, bool(split))

    def tell(self, **facts):
        """Updates what is known about the run (`analysis.RunFacts` fields by
        name; `thresholds` are added to the run's) and hands it to the detector."""
        self.facts = self.facts.merged(**facts)
        self.detector.tell(self.facts)

    def sample_utilisation(self, sampler):
        """Reads each record's GPU utilisation from `sampler` (an `NvmlSampler`, or None)."""
        self._sampler = sampler

    def await_step(self, waiter):
        """Has the step now running end where `waiter()` returns (a custom-loop
        wrapper's wait for the step's device work; called before its end hook)."""
        self.clock.attach(waiter)

    def count_traces(self, counter):
        """Counts traces with `counter()` (total traces so far) at every end hook.

        Each record then holds the traces of its step (`StepRecord.traces`).
        """
        self.clock.count_traces(counter)

    def drop_probe(self):
        """Stops reading the input probe (custom loops).

        For a loop whose batches need not be the probe's, in order (an
        iterator created before the run, a generator): the steps cannot be
        matched to the batches the probe recorded.
        """
        self._cursor = None

    # -- hooks: called by the one member whose hook acts (`TimedCallback`) --

    def epoch_begin(self):
        """At the leader's epoch begin hook."""
        self._new_epoch = True
        self._epoch += 1
        if self._cursor is not None:
            self._cursor.epoch_begin()

    def cycle_begin(self):
        """At the first begin hook of a step (the loop's thread).

        Hands out the hooks whose end ran in Keras's pool meanwhile, and
        reports what failed there.
        """
        self._report_pool_failures()
        self.drain()

    def batch_begin(self, batch):
        """At the last begin hook of a step: stamps its begin."""
        supplied, self._supplied = self._supplied, None
        self.clock.begin(batch, (self._epoch, self._new_epoch, supplied))
        self._new_epoch = False

    def end_hook(self, batch, logs):
        """At the first end hook of the list: ends the step, writes `step_ms` into `logs`.

        Keras runs it in its thread pool where the callbacks are
        `async_safe` (JAX, torch, NumPy backends), else on the loop's
        thread; the records are made on the loop's thread (here when it
        runs there, else at the next step's begin).
        """
        if logs:
            self._logs_seen = True  # Keras made the logs numbers: it waited for the step
        per_step = self.clock.end(batch)
        if isinstance(logs, dict) and per_step is not None:
            logs["step_ms"] = per_step * 1e3
        if self.clock.on_loop_thread():
            self.drain()

    def drain(self):
        """Takes the finished hooks, in order, on the loop's thread; syncs when due."""
        if self._logs_seen and self.facts.synced is None:
            self.tell(synced=True)
        for hook, start, span, gap, traces in self.clock.take():
            epoch, first, supplied = hook.facts
            self._pending.append((self._global, hook.steps, start, span, gap, epoch, first,
                                  supplied, traces))
            self.last = (self._global, hook.steps, span, gap)
            self._global += hook.steps
            self.hooks += 1
            self._deliver("_after_hook")
            if self._last_sync is None:
                self._last_sync = start
            pending = len(self._pending)
            if pending >= self.SYNC_MAX_HOOKS or (
                    pending >= self.SYNC_MIN_HOOKS
                    and start + span - self._last_sync >= self.SYNC_SECONDS):
                self.sync()

    def stall_limit(self):
        """The run's detector's `stall_limit()` over its log and the hooks not yet handed to it."""
        pending = self._pending
        return self.detector.stall_limit(
            len(pending), lambda: [((p[3] + p[4]) / p[1], p[6]) for p in pending])

    def upcoming_index(self) -> int:
        """The global index of the step about to begin (the loop's thread).

        Steps whose end is still in Keras's pool count as many steps as the
        latest finished hook.
        """
        per = 1 if self.last is None else self.last[1]
        return self._global + per * self.clock.pending

    def settle(self):
        """Waits (bounded) for end hooks still in Keras's pool, then drains them."""
        self.clock.settle(self.SETTLE_SECONDS)
        self.drain()

    def fail_off_loop(self, where, exc):
        """Keeps a failure of an end hook in Keras's pool for the loop's thread."""
        if len(self._failures) < 16:
            self._failures.append((where, exc))

    def _report_pool_failures(self):
        failures, self._failures = self._failures, []
        for where, exc in failures:
            self.leader._report_failure(where, exc)

    def train_end(self):
        """At the leader's train end hook: the last records and the final judgement."""
        if self._unframe is not None:
            self._unframe()
            self._unframe = None
        self._report_pool_failures()
        self.drain()
        self.clock.drop_open()
        self.sync()
        if self._batch_clock is not None:
            self._batch_clock.detach()
        if self._dispatch is not None:
            self._dispatch.detach()
        event = self.detector.finish()
        if event is not None:
            self._deliver("_on_event", event)
        self._closed = True
        if _OPEN.get(self.key) is self:
            del _OPEN[self.key]

    # -- records -----------------------------------------------------------

    def sync(self):
        """Reads the probe for the hooks not read yet and hands out their records."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        self._last_sync = pending[-1][2] + pending[-1][3]
        waits = rows = reals = [None] * len(pending)
        if self._cursor is not None:
            off = self._offset
            waits, rows, reals = self._cursor.take(
                [p[2] - p[4] + off for p in pending],   # each cycle's start
                [p[2] + p[3] + off for p in pending],
                [p[1] for p in pending])
        probe = self.input_probe
        per_second = None if probe is None else probe.frames_per_second
        records = []
        seen_in_step = self._step_shape_keys(pending)
        compiled = self._compile_seconds(pending)
        awaited = ([None] * len(pending) if self._dispatch is None else
                   self._dispatch.awaited([(p[2], p[2] + p[3]) for p in pending]))
        for (index, steps, begin, span, gap, epoch, first, supplied, traces), wait, row, \
                frames, in_step, compile_s, device in zip(pending, waits, rows, reals,
                                                          seen_in_step, compiled, awaited):
            split = True
            samples = None if self.batch_size is None else self.batch_size * steps
            shape = None
            audio = None if frames is None or per_second is None else frames / per_second
            if supplied is not None:
                wait, sampled, shape, split = supplied
                samples = sampled if sampled is not None else samples
            elif row is not None:
                shape = probe.shape_key(row)
                size = probe.batch_size(shape)
                samples = size * steps if size else samples
            if shape is None:
                shape = in_step
            input_wait, step, between = split_cycle(
                span, gap, wait, supplied=supplied is not None,
                unsynced=wait is None and supplied is not None)
            new_shape = False
            if shape is not None and shape not in self._shapes:
                new_shape = True
                if len(self._shapes) < self.MAX_SHAPES:
                    self._shapes.add(shape)
            util = None
            if self._sampler is not None:
                util = self._sampler.mean_between(begin + self._offset,
                                                 begin + span + self._offset)
            records.append(StepRecord(
                index=index, steps=steps, input_wait=input_wait, step=step, between=between,
                samples=samples, audio_seconds=audio, real_frames=frames, shape=shape,
                new_shape=new_shape, gpu_util=util, epoch=max(0, epoch), epoch_first=first,
                split=split, traces=traces, compile_s=compile_s, awaited=device))
        for callback in self.members:
            callback._take_records(records)
        self._judge(records)

    def _judge(self, records):
        """Feeds the run's one detector; hands its judgements and events to every member."""
        det = self.detector
        for record in records:
            self._add_to_epoch(record)
            judged = det.judgements
            event = det.update(record)
            if det.judgements != judged:
                self._deliver("_on_judgement", det.last_judgement,
                              record.index + record.steps - 1)
            if event is not None:
                self._deliver("_on_event", event)

    def _deliver(self, name, *args):
        for callback in self.members:
            try:
                getattr(callback, name)(*args)
            except UserError:  # the user's own function raised: Keras lets that propagate
                raise
            except Exception as exc:  # a monitor must never stop training
                callback._report_failure(name, exc)

    def _add_to_epoch(self, record):
        epoch, cycle, wait, waited, steps = self._epoch_sums
        if record.epoch != epoch:
            epoch, cycle, wait, waited, steps = record.epoch, 0.0, 0.0, 0.0, 0
        if record.input_wait is not None:
            wait, waited = wait + record.input_wait, waited + record.cycle
        self._epoch_sums = (epoch, cycle + record.cycle, wait, waited, steps + record.steps)

    def epoch_logs(self, logs):
        """Writes the epoch's `step_ms`, `input_wait` and `verdict` into Keras `logs`."""
        epoch, cycle, wait, waited, steps = self._epoch_sums
        if epoch == max(0, self._epoch) and steps:
            logs["step_ms"] = cycle / steps * 1e3
            if waited > 0:
                logs["input_wait"] = wait / waited
        logs["verdict"] = VERDICTS.index(self.detector.verdict()["verdict"])

    @property
    def shapes_seen(self):
        """Distinct input shapes seen (at most `MAX_SHAPES`)."""
        return len(self._shapes)


def stream_of(callbacks):
    """The `StepStream` our callbacks in `callbacks` joined, or None.

    Args:
        callbacks: a list of callbacks or a `keras.callbacks.CallbackList`,
            after `on_train_begin` was fired.
    """
    for callback in getattr(callbacks, "callbacks", callbacks) or ():
        stream = getattr(callback, "stream", None)
        if isinstance(stream, StepStream) and not stream._closed:
            return stream
    return None
