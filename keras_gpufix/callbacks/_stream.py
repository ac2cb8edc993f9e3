"""The shared step stream: one measurement per hook for all our callbacks.

`StepStream` is the coordinator of one run's parts, each in its own module
with one job; they talk through method calls and arguments only:

| part                           | its job                                            |
|--------------------------------|----------------------------------------------------|
| `_clock.py` `StepClock`        | begin and ready times of each hook, across threads |
| `_members.py` `Members`        | our callbacks in the run; hands them records,      |
|                                | judgements, events; failures in Keras's pool       |
| `_inputs.py` `CycleInputs`     | what fed each cycle: input wait, samples, shapes,  |
|                                | real frames, compile seconds                       |
| `_records.py` `RecordMaker`    | finished hooks numbered in order, made             |
|                                | `StepRecord`s when due (`analysis.phases`)         |
| `_feed.py` `DetectorFeed`      | the run's one detector: its facts, its judgements  |
| `_epoch.py` `EpochLog`         | which epoch a step is in; the epoch's Keras `logs` |
| `_dispatch.py` `SyncCallbacks` | callbacks that stopped asynchronous dispatch       |
| `_edge.py` `Edge`              | the markers that frame the callback list           |
| `_model_facts.py`              | what the model says about its run (jit, eager)     |
| `_timed.py` `TimedCallback`    | the base class of our callbacks                    |

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
ours do in `on_train_batch_end` counts in the step. The stream turns every
hook into one `analysis.StepRecord` with its three phases, reading what fed
it (`_inputs.py`: the input probe of a dataset that went through
`kg.data.instrument` or fit's source, real frames, shapes, compile
seconds) in batches (`_records.py`: about every quarter second, before
validation, at epoch end and at the end of training; each hook once), and
hands the records to every member (`_on_records`), in order. So the
recommended trio costs what one monitor costs.

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

Where the input facts come from on each backend (instrumented datasets
with their real frames, fit's XLA step's shapes, a `BatchClock` on fit's
`PyDataset`, generator or arrays, JAX's compile seconds): `_inputs.py`.
Where callbacks turned Keras's asynchronous dispatch off, the stream tells
the detector which (`RunFacts.async_blockers`) and prices it
(`_dispatch.py`).

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
| `input_wait` | `on_epoch_end`       | the run's share of the cycle spent        |
|              |                      | waiting for input so far: the figure      |
|              |                      | `report()["input_wait"]` gives (warm-up   |
|              |                      | and epoch starts left out; absent: not    |
|              |                      | measured)                                 |

The verdict is a name, not a number a progress bar can show: it is in
every callback's `report()["verdict"]`, not in `logs`.
"""

import weakref

from keras_gpufix.backends import current
from keras_gpufix.callbacks._clock import StepClock
from keras_gpufix.callbacks._dispatch import SyncCallbacks
from keras_gpufix.callbacks._edge import Edge
from keras_gpufix.callbacks._epoch import EpochLog
from keras_gpufix.callbacks._feed import DetectorFeed
from keras_gpufix.callbacks._inputs import CycleInputs
from keras_gpufix.callbacks._members import Members
from keras_gpufix.callbacks._model_facts import model_facts
from keras_gpufix.callbacks._records import RecordMaker
from keras_gpufix.keras_internals import callback_model, surround_callbacks

__all__ = ["StepStream", "stream_of"]

# id(model) -> the StepStream of the running fit on that model. Weak: its
# members hold it while they run; a fit that ended by an exception (no
# on_train_end) must not keep its callbacks alive (a dropped ProfilerTrigger
# stops its trace when it is collected).
_OPEN = weakref.WeakValueDictionary()


def _view(part, name, doc):
    """A read-only attribute of the stream: `name` of its part `part`."""
    return property(lambda stream: getattr(getattr(stream, part), name), doc=doc)


class StepStream:
    """The step records of one running `fit` or loop, measured once.

    Its parts are its own; members read them through read-only views
    (`hooks`, `last`, `detector`, `facts`, `input_probe`, `step_shapes`,
    `step_shapes_note`, `shapes_seen`) and hand facts over through its
    methods; its own attributes are set by itself alone.

    Attributes:
        clock: the run's `StepClock`.
        members: the run's `Members` (our callbacks, in join order).
        leader: the member that joined first (its hooks drive the stream
            where no markers frame the callback list).
        framed: whether markers at the front and back of the running
            CallbackList time the step (else the members' own hooks do).
        closed: whether the run ended (`train_end`).
    """

    # Seconds the loop waits, before validation, for end hooks still in
    # Keras's pool (so the probe reads training's batches first).
    SETTLE_SECONDS = 2.0

    def __init__(self, key):
        self.key = key
        self.clock = StepClock()
        self.members = Members()
        self._inputs = CycleInputs(self.clock.offset)
        self._records = RecordMaker(self.clock.offset)
        self._feed = DetectorFeed()
        self._epoch = EpochLog()
        self._dispatch = SyncCallbacks()
        self.leader = None
        self.framed = False
        self._unframe = None
        self.closed = False

    # -- membership ------------------------------------------------------

    @classmethod
    def join(cls, callback):
        """The stream of `callback`'s running fit (opened by the first joiner)."""
        key = id(callback_model(callback))
        stream = _OPEN.get(key)
        # Members join at on_train_begin, before any step: a stream that has
        # timed a step belongs to an earlier run (one that ended by an
        # exception, so on_train_end never closed it).
        if (stream is None or stream.closed or callback in stream.members
                or stream.hooks or stream.clock.pending):
            stream = _OPEN[key] = cls(key)
        if stream.members.add(callback):
            stream._open(callback)
        stream._feed.adopt(getattr(callback, "detector", None))
        stream._inputs.offer_batch_size(getattr(callback, "batch_size", None))
        return stream

    def _open(self, leader):
        """When the leader joins: the run's facts, its input, the markers."""
        self.leader = leader
        backend = current()
        model = callback_model(leader)
        self.tell(**self._dispatch.open(backend, leader, model))
        self._unframe = surround_callbacks(leader, Edge(self, end=True), Edge(self, end=False))
        self.framed = self._unframe is not None
        self.tell(**model_facts(model))
        self.tell(**self._inputs.open(backend, model, self.facts))

    # Read-only views of the parts, for the members.
    hooks = _view("_records", "hooks", "End hooks recorded so far.")
    last = _view("_records", "last", "`(index, steps, span_s, gap_s)` of the latest end "
                 "hook, read right at that hook (for callbacks that act on the next step).")
    detector = _view("_feed", "detector", "The run's one `OscillationDetector`.")
    facts = _view("_feed", "facts", "What is known about the run (`analysis.RunFacts`).")
    input_probe = _view("_inputs", "probe", "The `InputProbe` being read, or None.")
    step_shapes = _view("_inputs", "step_shapes", "The `StepShapes` probe of fit's XLA "
                        "train step, or None (`step_shapes_note`: why).")
    step_shapes_note = _view("_inputs", "step_shapes_note",
                             "Why fit's step shapes cannot be watched, or None.")
    shapes_seen = _view("_inputs", "shapes_seen", "Distinct input shapes seen.")

    # -- what other parts of the package hand over -------------------------

    def supply(self, input_wait, samples=None, shape=None, split=False, collective=False):
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
            collective: `next()` also waits at a collective (a
                `tf.distribute` dataset's iterator agrees with the other
                workers that each has a batch): where the dataset's input
                probe measured this worker's own wait, that is the input
                wait and the rest of `next()` counts in the step, as the
                all-reduce's wait does in `fit`. Defaults to False.
        """
        if self.facts.input_in is not None:  # the wrapper times the input itself
            self.tell(input_in=None)
        self._inputs.supply(input_wait, samples=samples, shape=shape, split=split,
                            collective=collective)

    def tell(self, **facts):
        """Updates what is known about the run (`analysis.RunFacts` fields by
        name; `thresholds` are added to the run's) and hands it to the detector."""
        self._feed.tell(**facts)

    def sample_utilisation(self, sampler):
        """Reads each record's GPU utilisation from `sampler` (an `NvmlSampler`, or None)."""
        self._records.sample_utilisation(sampler)

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
        self._inputs.drop_probe()

    # -- hooks: called by the one member whose hook acts (`TimedCallback`) --

    def epoch_begin(self):
        """At the leader's epoch begin hook."""
        self._epoch.begin()
        self._inputs.epoch_begin()

    def cycle_begin(self):
        """At the first begin hook of a step (the loop's thread).

        Hands out the hooks whose end ran in Keras's pool meanwhile, and
        reports what failed there.
        """
        self.members.report_kept()
        self.drain()

    def batch_begin(self, batch):
        """At the last begin hook of a step: stamps its begin."""
        self.clock.begin(batch, (*self._epoch.tag(), self._inputs.take_supplied()))

    def end_hook(self, batch, logs):
        """At the first end hook of the list: ends the step, writes `step_ms` into `logs`.

        Keras runs it in its thread pool where the callbacks are
        `async_safe` (JAX, torch, NumPy backends), else on the loop's
        thread; the records are made on the loop's thread (here when it
        runs there, else at the next step's begin).
        """
        if logs:
            self._feed.saw_logs()  # Keras made the logs numbers: it waited for the step
        per_step = self.clock.end(batch)
        if isinstance(logs, dict) and per_step is not None:
            logs["step_ms"] = per_step * 1e3
        if self.clock.on_loop_thread():
            self.drain()

    def drain(self):
        """Takes the finished hooks, in order, on the loop's thread; syncs when due."""
        self._feed.note_synced()
        for done in self.clock.take():
            due = self._records.add(*done)
            self.members.deliver("_after_hook")
            if due:
                self.sync()

    def stall_limit(self):
        """The run's detector's `stall_limit()` over its log and the hooks not yet handed to it."""
        return self.detector.stall_limit(self._records.waiting(),
                                         self._records.waiting_cycles)

    def upcoming_index(self) -> int:
        """The global index of the step about to begin (the loop's thread).

        Steps whose end is still in Keras's pool count as many steps as the
        latest finished hook.
        """
        return self._records.upcoming_index(self.clock.pending)

    def settle(self):
        """Waits (bounded) for end hooks still in Keras's pool, then drains them."""
        self.clock.settle(self.SETTLE_SECONDS)
        self.drain()

    def fail_off_loop(self, where, exc):
        """Keeps a failure of an end hook in Keras's pool for the loop's thread."""
        self.members.keep_failure(where, exc)

    def train_end(self):
        """At the leader's train end hook: the last records and the final judgement."""
        if self._unframe is not None:
            self._unframe()
            self._unframe = None
        self.members.report_kept()
        self.drain()
        self.clock.drop_open()
        self.sync()
        self._inputs.close()
        self._dispatch.close()
        self._feed.finish(self.members.deliver)
        self.closed = True
        if _OPEN.get(self.key) is self:
            del _OPEN[self.key]

    def sync(self):
        """Reads the input for the hooks not made records yet and hands out their records."""
        records = self._records.make(self._inputs, self._dispatch)
        if not records:
            return
        self.members.hand(records)
        for record in records:
            self._epoch.add(record)
        self._feed.judge(records, self.members.deliver)

    def epoch_logs(self, logs):
        """Writes the epoch's `step_ms` and the run's `input_wait` so far into Keras `logs`."""
        self._epoch.write(logs, self.detector.log.summary()["input_wait"])


def stream_of(callbacks):
    """The `StepStream` our callbacks in `callbacks` joined, or None.

    Args:
        callbacks: a list of callbacks or a `keras.callbacks.CallbackList`,
            after `on_train_begin` was fired.
    """
    for callback in getattr(callbacks, "callbacks", callbacks) or ():
        stream = getattr(callback, "stream", None)
        if isinstance(stream, StepStream) and not stream.closed:
            return stream
    return None
