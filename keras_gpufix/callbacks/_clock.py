"""The step clock: begin and ready times of each hook, safe across threads.

Since Keras 3.6, on the JAX, torch and NumPy backends, `CallbackList` runs
batch-end hooks in a thread pool once the step's logs are numbers, while the
loop's thread dispatches the next steps, unless a callback overrides a
batch-end hook without `async_safe = True` (then the loop waits for the
device at every step). Our callbacks are `async_safe`, so the clock is
written from two sides:

- `begin(batch)`, on the loop's thread (Keras always runs begin hooks
  there): stamps the hook's begin time, keyed by its place in the run;
- `end(batch)`, wherever Keras runs the end hook (its pool, or the loop's
  thread on TensorFlow and whenever a callback is not `async_safe`): waits
  for what `kg.watch` handed over (the step's outputs), then stamps the
  ready time.

A lock guards what both sides touch. The pool has several threads, so end
hooks may come out of order: `take()` hands out the finished hooks in the
order they began, never one before all earlier ones are finished. Phases
come from `analysis.phases`; the clock reads `time.perf_counter` twice per
hook and once when it opens (the offset to wall time).

`timed(call, ...)` is the one other reading of time on the step path: the
calls a custom-loop wrapper times itself (`kg.watch`: each `next()`, the
input wait, and an epoch's iterator made and released; diagnose's loop
patch: each call of the user's train function). Nothing else on the step
path reads a clock.
"""

import threading
import time

from keras_gpufix.analysis.phases import hook_span

__all__ = ["StepClock", "Hook", "timed"]


def timed(call, *args, **kwargs):
    """`(call(*args, **kwargs), seconds it took)`; an exception propagates untimed."""
    start = time.perf_counter()
    result = call(*args, **kwargs)
    return result, time.perf_counter() - start


class Hook:
    """One begun hook: what the loop's thread knew at its begin, and its ready time."""

    __slots__ = ("first", "begin", "facts", "ready", "steps", "traces", "waiter")

    def __init__(self, first, begin, facts):
        self.first = first
        self.begin = begin
        self.facts = facts
        self.ready = None
        self.steps = 1
        self.traces = None
        self.waiter = None


class StepClock:
    """Begin and ready times of a run's hooks, in step order.

    Attributes:
        offset: `time.time() - time.perf_counter()` when the clock opened
            (wall time of a clock reading).
        loop_thread: the thread that runs the begin hooks (the loop's).
    """

    # Hooks begun and not yet taken that are kept (the loop may run this far
    # ahead of the device); older ones are dropped, and their end matches
    # nothing.
    MAX_OPEN = 4096

    def __init__(self):
        self.offset = time.time() - time.perf_counter()
        self.loop_thread = threading.get_ident()
        self._lock = threading.Lock()
        self._settled = threading.Condition(self._lock)
        self._open = []
        self.pooled = False  # an end hook ran off the loop's thread
        self._last_ready = None
        self._tracer = None
        self._traces = 0

    def count_traces(self, counter):
        """Reads `counter()` (total traces so far) at every end hook."""
        with self._lock:
            self._tracer = counter
            self._traces = counter()

    def on_loop_thread(self) -> bool:
        """Whether the caller runs on the loop's thread."""
        return threading.get_ident() == self.loop_thread

    def begin(self, batch, facts):
        """At the begin hook (the loop's thread): stamps the hook's begin."""
        now = time.perf_counter()
        with self._lock:
            self.loop_thread = threading.get_ident()
            self._open.append(Hook(batch, now, facts))
            if len(self._open) > self.MAX_OPEN:
                del self._open[0]

    def attach(self, waiter):
        """Hands the latest begun hook a function that waits for its step's work.

        Called on the loop's thread before its end hook; the end hook calls
        it (off that thread where Keras dispatches end hooks to its pool).
        """
        with self._lock:
            if self._open:
                self._open[-1].waiter = waiter

    def end(self, batch):
        """At the end hook (any thread): stamps the hook's ready time.

        Returns:
            The cycle per step of this hook in seconds where the previous
            hook is finished (else None), or None when no begun hook
            matches (its begin hook was missed).
        """
        looped = self.on_loop_thread()
        self.pooled = self.pooled or not looped
        with self._lock:
            hook = self._match(batch, looped)
            waiter = None if hook is None else hook.waiter
        if hook is None:
            return None
        if waiter is not None:
            waiter()
        now = time.perf_counter()
        with self._lock:
            hook.ready = now
            hook.steps = max(1, batch - hook.first + 1)
            if self._tracer is not None:
                hook.traces = self._tracer()
            self._settled.notify_all()
            at = next((i for i, h in enumerate(self._open) if h is hook), None)
            if at is None:
                return None
            last = self._open[at - 1].ready if at else self._last_ready
            if at and last is None:
                return None
            start, span, gap = hook_span(hook.begin, now, last)
            return (span + gap) / hook.steps

    def _match(self, batch, looped):
        """The begun hook an end hook of `batch` closes (under the lock)."""
        waiting = [h for h in self._open if h.ready is None]
        if not waiting:
            return None
        if looped:
            # On the loop's thread ends come in order: the latest begin is
            # this step's; earlier ones without an end lost it.
            for hook in waiting[:-1]:
                self._open.remove(hook)
            return waiting[-1]
        before = [h for h in waiting if h.first <= batch]
        return before[-1] if before else None

    def take(self):
        """The finished hooks not taken yet, in the order they began.

        Returns:
            A list of `(hook, start, span, gap, traces)`: `analysis.phases.
            hook_span` of each, and the traces counted during it.
        """
        out = []
        with self._lock:
            while self._open and self._open[0].ready is not None:
                hook = self._open.pop(0)
                start, span, gap = hook_span(hook.begin, hook.ready, self._last_ready)
                self._last_ready = start + span
                traces = 0
                if hook.traces is not None:
                    traces, self._traces = max(0, hook.traces - self._traces), max(
                        self._traces, hook.traces)
                out.append((hook, start, span, gap, traces))
        return out

    def settle(self, timeout):
        """Waits at most `timeout` seconds for every begun hook's end.

        Only where end hooks run in Keras's pool: on the loop's thread they
        all ran already.
        """
        if not self.pooled:
            return
        deadline = time.monotonic() + timeout
        with self._settled:
            while any(h.ready is None for h in self._open):
                left = deadline - time.monotonic()
                if left <= 0 or not self._settled.wait(left):
                    return

    def drop_open(self):
        """Forgets begun hooks that got no end (after Keras flushed its pool)."""
        with self._lock:
            self._open = [h for h in self._open if h.ready is not None]

    @property
    def pending(self) -> int:
        """Begun hooks not yet taken."""
        with self._lock:
            return len(self._open)
