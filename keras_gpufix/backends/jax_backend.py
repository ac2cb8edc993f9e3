"""`JaxBackend`: XLA compiles from `jax.monitoring`, `jax.profiler` traces.

Compiles: JAX reports every compile of a jitted function through its public
`jax.monitoring` listeners: `/jax/core/compile/jaxpr_trace_duration`
(tracing), `/jax/core/compile/jaxpr_to_mlir_module_duration` (lowering) and
`/jax/core/compile/backend_compile_duration` (the XLA compile), each with
its duration in seconds. One listener per process (`CompileLog`) stamps
each event with the clock (`time.perf_counter`) when it is reported; the
step stream gives each step the compiles that ended inside it, with their
seconds. At the first use a throwaway function is compiled once (a few
milliseconds) to check that the backend-compile event exists in the
installed jax; where it does not, one warning says compiles are not counted.

Traces: `jax.profiler.start_trace` / `stop_trace` write
`log_dir/plugins/profile/<run>/*.xplane.pb` (TensorBoard's Profile tab),
each step marked with `jax.profiler.StepTraceAnnotation`, as Keras's own
TensorBoard callback does on JAX.
"""

import threading
import time
from collections import deque

from keras_gpufix.backends.base import Backend
from keras_gpufix.exceptions import warn

__all__ = ["CompileLog", "JaxBackend"]

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
COMPILE_EVENTS = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    BACKEND_COMPILE,
)


class CompileLog:
    """The process's XLA compiles: `(time, seconds, backend_compile)` per event.

    `time` is `time.perf_counter()` when JAX reported the event (its end);
    `backend_compile` is True for the XLA compile itself (one per compiled
    executable), False for its tracing and lowering. At most `CAPACITY`
    events are kept; `since(t)` hands out those after `t`.

    Attributes:
        working: whether a test compile reported the backend-compile event.
        note: why compiles are not counted (None when they are).
    """

    CAPACITY = 65536

    def __init__(self):
        import jax
        import jax.monitoring

        self._events = deque(maxlen=self.CAPACITY)
        self._lock = threading.Lock()
        jax.monitoring.register_event_duration_secs_listener(self._listen)
        before = len(self._events)
        jax.jit(lambda x: x + 1)(0.0)  # a new function: one compile, a few ms
        with self._lock:
            seen = [e for e in list(self._events)[before:] if e[2]]
        self.working = bool(seen)
        self.note = None if seen else (
            f"keras_gpufix: jax {jax.__version__} reported no '{BACKEND_COMPILE}' event "
            "(jax.monitoring) for a test compile: XLA compiles of the train step are not "
            "counted, and `recompiling` is judged from the batches' shapes alone")

    def _listen(self, event, duration, **kwargs):
        if event in COMPILE_EVENTS:
            with self._lock:
                self._events.append((time.perf_counter(), float(duration),
                                     event == BACKEND_COMPILE))

    def since(self, after):
        """Events reported after `after` (a `time.perf_counter()` value), oldest first."""
        with self._lock:
            return [e for e in self._events if e[0] > after]


class JaxBackend(Backend):
    """The Keras JAX backend."""

    def __init__(self):
        super().__init__("jax")
        self._compiles = None
        self._compiles_lock = threading.Lock()

    def compile_log(self):
        with self._compiles_lock:
            if self._compiles is None:
                self._compiles = CompileLog()
                if self._compiles.note:
                    warn(self._compiles.note)
        return self._compiles if self._compiles.working else None

    def start_trace(self, log_dir, host_tracer_level=2, python_tracer_level=0,
                    device_tracer_level=1):
        import jax.profiler

        options = jax.profiler.ProfileOptions()
        options.host_tracer_level = host_tracer_level
        options.python_tracer_level = python_tracer_level
        try:
            jax.profiler.start_trace(str(log_dir), profiler_options=options)
        except RuntimeError as exc:
            raise RuntimeError(f"another profiler is running (jax.profiler: {exc})") from None

    def stop_trace(self, save=True):
        import jax.profiler

        try:
            jax.profiler.stop_trace()
        except RuntimeError:
            return False  # someone stopped it under us: nothing to save
        return True

    def step_marker(self, step, name="train"):
        import jax.profiler

        return jax.profiler.StepTraceAnnotation(name, step_num=int(step))
