"""What fed each cycle: its input wait, samples, shapes, real frames and compile seconds.

One `CycleInputs` per step stream, with the sources it reads:

- the input probe of a dataset that went through `kg.data.instrument`
  (`data/input_probe.py`'s `InputCursor`; TensorFlow datasets only), or, where
  it can (every source on JAX, a Python source on TensorFlow), a
  `BatchClock` (`backends/batch_clock.py`) that follows the source fit
  actually reads: each batch's ready time (the input wait), shapes and,
  for an instrumented dataset, its real (unpadded) frames;
- on TensorFlow, when each step that takes its batch inside its graph
  (Keras's `fit`) started that graph (`keras_internals.
  time_iterator_launches`): its input wait is counted from then, not from
  the cycle's start. The step's launch is no wait: Keras's and the
  `tf.function`'s Python dispatch take 0.4-0.5 ms of each step on a 2-core
  AMD EPYC host (XProf's trace), more on a slower or busier CPU, and were
  counted as input wait before (here 6-8 points more input share than
  XProf's on the planted input-bound run; issue 51);
- what a custom-loop wrapper (`kg.watch`) measured itself and hands over
  with `supply()` before the begin hook (it replaces the probe's wait,
  batch size and shape);
- on TensorFlow, when the model's step is XLA-compiled, the input shapes
  read inside `model.train_function` (`_step_shapes.py`);
- on JAX, the seconds JAX spent compiling (`jax.monitoring`), per cycle.

`read` turns the spans of finished hooks into one `CycleInput` each; new
input shapes are remembered (at most `MAX_SHAPES`) to mark `new_shape`.

Speech throughput: a dataset instrumented with its feature lengths
(`kg.data.instrument(..., frames=, frames_per_second=)`, as the `kg.data`
builder does) gives each cycle its real (unpadded) frames and seconds of
audio, read with the rest of the probe (no extra read per step), in `fit`
and under `kg.watch` alike (when watch iterates the dataset itself; over
an iterator or a generator it calls `drop_probe()`); other datasets leave
them None. Fit's XLA step's shapes serve any dataset; an instrumented
one's shapes come first.
"""

import sys
import time
import weakref
from collections import deque
from typing import NamedTuple, Optional

import numpy as np

from keras_gpufix._step_shapes import StepShapes
from keras_gpufix.analysis.phases import seconds_within
from keras_gpufix.backends.batch_clock import BatchClock
from keras_gpufix.keras_internals import (
    fit_epoch_iterator, instrument_fit_dataset, time_iterator_launches)

__all__ = ["CycleInputs", "CycleInput"]


class CycleInput(NamedTuple):
    """What fed one hook (a step, or N steps).

    `wait` is the input wait in seconds (None: not measured, or a supplied
    wait that is not input alone), `supplied` whether a custom-loop wrapper
    measured it, `split` whether begin -> end holds only the step,
    `collective` the seconds of a supplied wait spent at a collective (a
    distributed dataset's iterator agreeing with the other workers), which
    belong to the step.
    """

    wait: Optional[float]
    supplied: bool
    split: bool
    samples: Optional[int]
    shape: object
    new_shape: bool
    frames: Optional[int]
    audio: Optional[float]
    compile_s: Optional[float]
    collective: float = 0.0


class CycleInputs:
    """The input side of one step stream.

    Args:
        offset: wall time of a step-clock reading minus the reading
            (`StepClock.offset`): the probe stamps wall times.

    Attributes:
        step_shapes: the `StepShapes` probe of fit's XLA train step (the
            input shapes of a plain `tf.data` dataset), or None;
            `step_shapes_note` says why it could not be attached.
    """

    # Distinct input shapes remembered for `new_shape` (bounded memory).
    MAX_SHAPES = 4096
    # Graph launches kept between two reads (the stream reads at least every
    # 1024 hooks; evaluation's launch too).
    MAX_LAUNCHES = 4096

    def __init__(self, offset):
        self._offset = offset
        self._cursor = self._batch_clock = self._compiles = None  # sources, see `open`
        self._launches = deque(maxlen=self.MAX_LAUNCHES)  # step-clock seconds
        self._unlaunch = self._uninstrument = None
        self._supplied = self._batch_size = None
        self._compiles_read = 0.0
        self._shapes = set()
        self.step_shapes = self.step_shapes_note = None

    def open(self, backend, model, facts) -> dict:
        """Starts reading the run's input (when the leader joins).

        Args:
            backend: the run's `backends.current()`.
            model: the model being trained, or None.
            facts: the run's `analysis.RunFacts` so far (jit, eager).

        Returns:
            `RunFacts` fields the input side knows (`input_source`,
            `input_workers` where a `BatchClock` follows fit's source).
        """
        self._compiles = backend.compile_log()  # compiles before the first hook are
        # never a hook's (`read` counts only those inside a hook's span)
        if "tensorflow" in sys.modules:  # only TF datasets can be instrumented
            from keras_gpufix.data.input_probe import InputCursor

            self._cursor = InputCursor()
            self._cursor.start()
        # Under XLA a new shape compiles the step, and a plain `tf.data`
        # dataset (not through `kg.data.instrument`) shows no shape otherwise.
        # TensorFlow's train function only: the probe is a TensorFlow op.
        if backend.tensorflow_step and facts.jit and not facts.eager and model is not None:
            self.step_shapes, self.step_shapes_note = StepShapes.attach(model)
        if backend.tensorflow_step:
            self._unlaunch = time_iterator_launches(
                lambda: self._launches.append(time.perf_counter()))
        iterator = fit_epoch_iterator()
        # where the input's time lies when its wait is not measured
        facts = {"input_in": "between" if iterator is None else "step"}
        self._batch_clock = BatchClock.attach(backend, iterator)
        if self._batch_clock is None:
            if backend.tensorflow_step and iterator is not None:
                self._uninstrument = _instrument_fit_dataset(iterator)
            return facts
        self._cursor = self._batch_clock
        return dict(facts, input_source=self._batch_clock.source,
                    input_workers=self._batch_clock.workers)

    def offer_batch_size(self, size):
        """A member's batch size: the default samples per step (the first one offered)."""
        if self._batch_size is None and size is not None:
            self._batch_size = size

    @property
    def probe(self):
        """The `InputProbe` being read, or None."""
        return None if self._cursor is None else self._cursor.probe

    @property
    def shapes_seen(self) -> int:
        """Distinct input shapes seen (at most `MAX_SHAPES`)."""
        return len(self._shapes)

    def supply(self, input_wait, samples=None, shape=None, split=False, collective=False):
        """Keeps a custom-loop wrapper's facts for the next step (`StepStream.supply`)."""
        wait = None if input_wait is None else float(input_wait)
        self._supplied = (wait, samples, shape, bool(split), bool(collective))

    def take_supplied(self):
        """The supplied facts for the step that begins now (None: none supplied)."""
        supplied, self._supplied = self._supplied, None
        return supplied

    def drop_probe(self):
        """Stops reading the input probe (`StepStream.drop_probe`)."""
        self._cursor = None

    def epoch_begin(self):
        if self._cursor is not None:
            self._cursor.epoch_begin()

    def close(self):
        """At the end of training: lets go of fit's source and of the graph launches."""
        if self._batch_clock is not None:
            self._batch_clock.detach()
        for undo in (self._unlaunch, self._uninstrument):
            if undo is not None:
                undo()
        self._unlaunch = self._uninstrument = None

    def read(self, hooks) -> list:
        """One `CycleInput` per finished hook, in order (the loop's thread).

        Args:
            hooks: `(start, span, gap, steps, supplied)` of each hook in
                step-clock seconds; `supplied` is what `take_supplied`
                gave at its begin.
        """
        n = len(hooks)
        waits = rows = reals = [None] * n
        launched = self._launched(hooks)
        if self._cursor is not None:
            off = self._offset
            # A wait is counted from the cycle's start (a loop may take its
            # batch before the begin hook), or from the launch of the graph
            # that takes the batch: before it the loop launched the step.
            waits, rows, reals = self._cursor.take(
                [start - gap + off if at is None else at + off
                 for (start, _, gap, _, _), at in zip(hooks, launched)],
                [start + span + off for start, span, _, _, _ in hooks],
                [steps for *_, steps, _ in hooks])
            # `split_cycle` takes a probe's wait from the cycle's start: one
            # from the launch lies in the step, after the gap.
            waits = [w if at is None or not w else gap + w
                     for w, at, (_, _, gap, _, _) in zip(waits, launched, hooks)]
        in_step = ([None] * n if self.step_shapes is None
                   else self.step_shapes.take([steps for *_, steps, _ in hooks]))
        compiled = [None] * n
        if self._compiles is not None:
            spans = [(start, start + span) for start, span, *_ in hooks]
            compiled = seconds_within(self._compiles.since(self._compiles_read), spans)
            self._compiles_read = spans[-1][1]
        probe = self.probe
        per_second = None if probe is None else probe.frames_per_second
        out = []
        for (*_, steps, supplied), wait, row, frames, seen, compile_s in zip(
                hooks, waits, rows, reals, in_step, compiled):
            split = True
            samples = None if self._batch_size is None else self._batch_size * steps
            shape = None
            collective = 0.0
            if supplied is not None and supplied[4] and wait is not None \
                    and supplied[0] is not None:
                # next() of a distributed dataset: the probe's wait is this worker's
                # own; the rest of next() waited for the other workers
                local, total = min(wait, supplied[0]), supplied[0]
                collective, wait, split = total - local, local, supplied[3]
                supplied = None
            if supplied is not None:
                wait, sampled, shape, split, _ = supplied
                samples = sampled if sampled is not None else samples
            elif row is not None:
                shape = probe.shape_key(row)
                size = probe.batch_size(shape)
                samples = size * steps if size else samples
            if shape is None:
                shape = seen
            out.append(CycleInput(
                wait=wait, supplied=supplied is not None, split=split, samples=samples,
                shape=shape, new_shape=self._remember(shape), frames=frames,
                audio=None if frames is None or per_second is None else frames / per_second,
                compile_s=compile_s, collective=collective))
        return out

    def _launched(self, hooks) -> list:
        """Per hook, when the first graph launch inside its span came, or None.

        Launches up to the last hook's end are used up (later ones belong
        to hooks not read yet).
        """
        if not hooks or not self._launches:
            return [None] * len(hooks)
        starts = np.array([start for start, *_ in hooks])
        ends = np.array([start + span for start, span, *_ in hooks])
        times = np.array(self._launches)
        used = int(np.searchsorted(times, ends[-1], side="right"))
        for _ in range(used):
            self._launches.popleft()
        first = np.searchsorted(times[:used], starts)  # first launch at or after each start
        at = times[np.minimum(first, max(used - 1, 0))] if used else starts
        inside = (first < used) & (at <= ends)
        return [float(t) if ok else None for t, ok in zip(at.tolist(), inside.tolist())]

    def _remember(self, shape) -> bool:
        """Whether `shape` is new to the run (remembered up to `MAX_SHAPES`)."""
        if shape is None or shape in self._shapes:
            return False
        if len(self._shapes) < self.MAX_SHAPES:
            self._shapes.add(shape)
        return True


def _instrument_fit_dataset(iterator):
    """Puts TensorFlow fit's `tf.data` input through `kg.data.instrument`.

    The user's pipeline is left as it is: one sequential `map` is appended
    (`data/input_probe.py`), so every plain `tf.data` dataset, and arrays,
    get their input wait measured without a `kg.data` call. A dataset that
    went through `instrument` already keeps its own probe (its frames).

    Args:
        iterator: `fit`'s epoch iterator.

    Returns:
        A function that puts the dataset back, or None (nothing changed).
    """
    from keras_gpufix.data.input_probe import instrument, instrumented

    def probed(dataset):
        last = _PROBED[0]
        if last is not None and last[0]() is dataset:
            return last[1]
        out = None if instrumented(dataset) else instrument(dataset)
        _PROBED[0] = (weakref.ref(dataset), out)
        return out

    return instrument_fit_dataset(iterator, probed)


# The last user dataset probed (weakly) and its instrumented copy (None: it had a
# probe), so a script that calls `fit` once an epoch on one dataset makes one probe,
# not one a call (its tables and the traced `map`: ~0.1-0.2 s on a loaded 2-core
# host). One slot: the copy holds the user's dataset (its input), so a map keyed by
# dataset would keep every dataset ever fitted (arrays make a new one each fit).
_PROBED = [None]
