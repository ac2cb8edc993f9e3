"""Phase arithmetic: one hook's begin and ready times -> its three phases.

Pure functions, the one place where a cycle is split. The step clock
(`callbacks/_clock.py`) stamps, per hook (a step, or N steps with
`steps_per_execution=N`), when its begin hook ran (`begin`, always on the
loop's thread) and when its results were ready (`ready`: Keras made its logs
numbers, or `kg.watch` waited for its outputs; on the JAX, torch and NumPy
backends that is in Keras's thread pool, while the loop already dispatches
the next steps).

A device runs its steps one after the other, so step N starts when it was
dispatched and the previous one was done: `start = max(begin(N),
ready(N-1))`. Then

- `span = ready(N) - start`: the step (its input wait, when it waits inside
  the hook, is taken from it below);
- `gap = start - ready(N-1)`: host time in which the device had nothing to
  do (other callbacks, logging, the loop's own work); 0 whenever the loop
  dispatched step N before step N-1 was done, as it does with asynchronous
  dispatch.

Where every hook runs on the loop's thread (TensorFlow, or a callback that
is not `async_safe`), `begin(N)` comes after `ready(N-1)` and these are the
plain `begin -> end` span and `end -> begin` gap.

Events timed inside a hook (JAX's compiles) are summed per hook by
`seconds_within`.
"""

__all__ = ["hook_span", "split_cycle", "seconds_within"]


def hook_span(begin: float, ready: float, last_ready: "float | None") -> tuple:
    """`(start, span, gap)` of one hook, in seconds.

    Args:
        begin: when the hook's begin hook ran.
        ready: when its results were ready (not before `last_ready`).
        last_ready: when the previous hook's results were ready, or None
            for the run's first hook (its gap is then 0).
    """
    if last_ready is None:
        return begin, max(0.0, ready - begin), 0.0
    ready = max(ready, last_ready)
    start = max(begin, last_ready)
    return start, ready - start, start - last_ready


def split_cycle(span: float, gap: float, wait: "float | None", supplied: bool = False,
                unsynced: bool = False) -> tuple:
    """`(input_wait, step, between)` of one hook; they add up to `span + gap`.

    Args:
        span, gap: from `hook_span`.
        wait: the input wait in seconds, or None when not measured. An
            input probe's wait is measured from the cycle's start (the
            previous hook's ready time): the part of it that ends before
            the step starts lies in the gap and is taken from `between`,
            the rest from the step. A supplied wait (`kg.watch` timed
            `next()`) lies in the gap; only the part of it the device
            spent idle (at most the gap) counts.
        supplied: `wait` was supplied by a custom-loop wrapper.
        unsynced: the wrapper's steps are timed at dispatch: only the
            cycle is real, and it is all `step`.
    """
    if unsynced:
        return None, span + gap, 0.0
    if wait is None:
        return None, span, gap
    if supplied or wait <= gap:
        wait = min(wait, gap) if supplied else wait
        return wait, span, max(0.0, gap - wait)
    return wait - gap, span - (wait - gap), gap


def seconds_within(events, spans) -> list:
    """Per span, the seconds of the events inside it.

    Args:
        events: tuples that start with `(time, seconds)` (an event's end
            and length).
        spans: `(begin, end)` pairs on the same clock; an event counts in
            a span where `begin < time <= end`.
    """
    return [sum(e[1] for e in events if begin < e[0] <= end)
            for begin, end in spans]
