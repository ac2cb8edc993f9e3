"""RetracingMonitor: tf.function traces and new input shapes, and what they cost.

Two ways a variable-length input makes training slow:

- the train step's `tf.function` is traced again (Python values or new
  structures in the batch, or `reduce_retracing=False`): counted with
  `experimental_get_tracing_count()` of the functions inside
  `model.train_function`, or of the user's own `functions` in a custom loop
  (the shapes each one was traced for are listed too);
- under `jit_compile=True` XLA compiles once per distinct input shape,
  while the trace count stays at 2 (Keras traces with `reduce_retracing=
  True`, so the second trace has `None` dimensions). Only the shapes show
  it: in `fit` under XLA a probe inside the train step reads each batch's
  shapes from any dataset (`keras_gpufix/_step_shapes.py`, installed by the
  step stream for every keras_gpufix callback), a dataset that went
  through `kg.data.instrument` hands them over, and so does `kg.watch` in
  a custom loop.

The monitor reports facts and judges nothing itself: it counts the traces
of each step into the run's step records (`StepRecord.traces`), tells the
run's one judgement (`analysis.OscillationDetector`, shared by every
keras_gpufix callback of the run through the step stream) whether the step
is XLA-compiled or eager, and reads its verdict: `recompiling` is decided
there, by `analysis.is_recompiling`, like every other verdict. When the
judgement reports `recompiling`, one warning names the shapes (or the
traces) and the fix.

A step that compiled (a new trace, or a new shape under XLA) costs its
time minus the run's median cycle (`analysis.recompile_cost` against the
one step log): the estimated compile cost. The first compile of functions
never compiled before is unavoidable (`compile_ms`); every later one is a
recompile (`recompile_ms`). A step that is not compiled (a plain Python
function, `run_eagerly=True`, or a new shape without XLA) costs no compile.

Per hook the stream reads the trace counter once; shapes come with the
stream's records. Keras `logs`: see `callbacks/_stream.py`.
"""

import sys
import time

from keras_gpufix.analysis import (FIXES, RETRACE_FIX, recompile_cost, recompiling_fix,
                                   step_compiled)
from keras_gpufix.backends import current
from keras_gpufix.callbacks import _arguments
from keras_gpufix.callbacks._timed import TimedCallback
from keras_gpufix.exceptions import warn
from keras_gpufix.keras_internals import (
    concrete_functions,
    function_jit_compile,
    step_jit_compile,
    traced_functions,
)
from keras_gpufix.output import emit

__all__ = ["RetracingMonitor"]

_TOLD = set()  # notes printed: each once a process (diagnose runs one monitor per fit)

_NO_PROBE = ("RetracingMonitor: input shapes are not visible (the dataset did not go "
             "through kg.data.instrument); counting tf.function traces "
             "only. Pass the dataset through kg.data.instrument(ds) (kg.data builders "
             "do) to see which new shapes cost an XLA recompile.")


def _as_lists(key):
    return [list(dims) for dims in key]


def _name(function):
    return getattr(function, "__name__", None) or type(function).__name__


def _signature_shapes(concrete):
    """The shapes of the tensors a concrete function was traced for."""
    import tensorflow as tf

    specs = tf.nest.flatten(concrete.structured_input_signature)
    return [s.shape.as_list() if s.shape.rank is not None else None
            for s in specs if isinstance(s, tf.TensorSpec)]


class RetracingMonitor(TimedCallback):
    """Counts train-step traces and new input shapes; prices their compiles.

    In `model.fit` it finds the train step's `tf.function`s itself. In a
    custom loop (`kg.watch`, or a `keras.callbacks.CallbackList` whose hooks
    the loop calls) pass the loop's own step functions as `functions`: their
    traces are counted, the input shapes each was traced for are listed, and
    a function that is not a `tf.function` (it runs eagerly) is said to
    compile nothing: the run's judgement is then `eager_step`.

    Args:
        functions: the custom loop's step functions (`tf.function`s, or
            plain Python functions, which are reported as not compiled).
            Defaults to None: the functions inside `model.train_function`.
        max_new_shapes: the run's `THRESHOLDS["max_new_shapes"]`: distinct
            input shapes that may compile once each without the run being
            `recompiling`. Defaults to None: the judgement's own (16, or a
            `GPUOscillationMonitor`'s `thresholds`).
        warn: warn once when the run's verdict becomes `recompiling`.
            Defaults to True.
        verbose: 0 silent, 1 prints a one-line summary at the end of `fit`
            and, once, that shapes are not visible. Defaults to 1.

    Example:

    >>> monitor = kg.RetracingMonitor()
    >>> model.fit(kg.data.instrument(ds), callbacks=[monitor])
    >>> monitor.report()["recompile_ms"]

    In a custom loop:

    >>> train_step = tf.function(step, jit_compile=True)
    >>> monitor = kg.RetracingMonitor(functions=[train_step])
    >>> with kg.watch(ds, callbacks=[monitor]) as watched:
    ...     for x, y in watched:
    ...         train_step(x, y)
    """

    # Distinct input shapes listed and priced (bounded memory, as the stream's).
    MAX_SHAPES = 4096

    def __init__(self, functions=None, max_new_shapes=None, warn=True, verbose=1):
        super().__init__()
        self.functions = _arguments.retracing_monitor(functions, max_new_shapes)
        self.max_new_shapes = None if max_new_shapes is None else int(max_new_shapes)
        self.warn = warn
        self.verbose = verbose
        # Shapes the watched functions were compiled for in earlier fits: a
        # function keeps its XLA cache, so they cost nothing again.
        self._watched = ()
        self._compiled_shapes = set()
        self._reset()

    def _reset(self):
        self._functions = {}
        self._compiled = None  # False: nothing is compiled; None: not verified
        self._jit = None
        self._fresh = False
        self._baseline = 0
        self._final = None  # the trace total at the end of the fit
        self._fit_t0 = time.time()
        self._fit_t1 = None
        self._global = 0
        self._seen = {}
        self._events = []  # steps at a new shape or with new traces
        self._epoch = 0
        self._warned = False
        self.notes = []

    def _begin(self):
        self._reset()
        if self.functions is not None:
            self._watch_functions()
        else:
            self._watch_train_function()
        watched = tuple(self._functions.values())
        if len(watched) != len(self._watched) or any(
                a is not b for a, b in zip(watched, self._watched)):
            self._watched, self._compiled_shapes = watched, set()
        # The functions' first compile is the compile, not a recompile.
        self._fresh = self._baseline == 0 and not self._compiled_shapes
        # What the run's one judgement needs to know about the step.
        if self._functions:
            self.stream.count_traces(self._trace_total)
        if self.functions is not None:
            self.stream.tell(jit=self._jit)
        if self._compiled is False:
            self.stream.tell(eager=True)
        if self.max_new_shapes is not None:
            self.stream.tell(thresholds={"max_new_shapes": self.max_new_shapes})

    def _watch_functions(self):
        """The custom loop's own step functions."""
        backend = current()
        if not backend.tensorflow_step:
            self._watch_jitted(backend)
            return
        traced = [f for f in self.functions
                  if callable(getattr(f, "experimental_get_tracing_count", None))]
        for f in self.functions:
            if f not in traced:
                self.notes.append(f"{_name(f)} is not a tf.function: it runs eagerly, so "
                                  "nothing is traced or compiled (wrap it in "
                                  "tf.function(jit_compile=True))")
        tf = sys.modules.get("tensorflow")
        if traced and tf is not None and tf.config.functions_run_eagerly():
            self.notes.append("tf.config.run_functions_eagerly(True) is on: the tf.functions "
                              "run eagerly, so nothing is traced or compiled")
            traced = []
        for f in traced:
            name = _name(f)
            while name in self._functions:
                name += "_"
            self._functions[name] = f
        self._compiled = bool(self._functions)
        if self._functions:
            self._baseline = self._trace_total()
            jit = [function_jit_compile(f) for f in self._functions.values()]
            self._jit = True if any(jit) else (None if None in jit else False)

    def _watch_jitted(self, backend):
        """The loop's step functions on a backend without tf.function (JAX: `jax.jit`).

        A jitted function (it has `lower`) compiles once per input shape:
        its compiles come from the backend (each record's `compile_s`); a
        plain Python function runs op by op, compiling nothing.
        """
        jitted = [f for f in self.functions if callable(getattr(f, "lower", None))]
        for f in self.functions:
            if f not in jitted:
                self.notes.append(f"{_name(f)} is not jitted: it runs op by op, so nothing is "
                                  "compiled (wrap it in jax.jit)")
        self._compiled = bool(jitted)
        self._jit = bool(jitted)
        if jitted and backend.compile_log() is None:
            self.notes.append(backend.unsupported("counting XLA compiles"))

    def _watch_train_function(self):
        """The `tf.function`s of `model.fit`'s train step."""
        model = self.model
        train_function = getattr(model, "train_function", None)
        backend = current()
        if not backend.tensorflow_step:
            # No tf.function: XLA compiles come from the backend (JAX's
            # jax.monitoring events, in each record's compile_s).
            self._compiled = not getattr(model, "run_eagerly", False)
            self._jit = step_jit_compile(model) if self._compiled else False
            how = ("XLA compiles are counted from jax.monitoring" if backend.compile_log()
                   else "compiles are not counted")
            self.notes.append(f"Keras {backend.name} backend: no tf.function traces; {how}, "
                              "input shapes come from fit's data source")
            return
        self._functions = traced_functions(train_function)
        if self._functions:
            self._baseline = self._trace_total()
            self._compiled = True
            self._jit = step_jit_compile(model)
        elif getattr(model, "run_eagerly", False):
            self._compiled = False
            self.notes.append("cannot count traces: the model runs eagerly "
                              "(run_eagerly=True), so nothing is traced")
        elif train_function is None:
            self.notes.append("cannot count traces: no model.train_function (a custom loop?); "
                              "pass the loop's step functions: "
                              "RetracingMonitor(functions=[train_step])")
        else:
            self._jit = step_jit_compile(model)
            self.notes.append(
                "cannot count traces: model.train_function "
                f"({type(train_function).__name__}) holds no "
                "tf.function this Keras version exposes; shapes are still checked")

    def _trace_total(self):
        total = 0  # a loop, not sum() over a generator: this runs at every hook
        for function in self._functions.values():
            total += int(function.experimental_get_tracing_count())
        return total

    def _end(self):
        self._fit_t1 = time.time()
        if self._functions:
            self._final = self._trace_total()
        if self.verbose:
            r = self.report()
            traces = "?" if r["trace_count"] is None else r["trace_count"]
            emit(f"RetracingMonitor: {r['new_shapes']} input shapes, {traces} new traces, "
                 f"estimated recompile cost {r['recompile_ms']:.0f} ms "
                 f"({r['recompile_share']:.0%} of fit time) -> {r['verdict']}", self.verbose)

    # -- internals -------------------------------------------------------

    def _no_shapes_note(self):
        """Why no shapes are seen: no instrument, and (under XLA) why the
        train step's own probe could not watch them."""
        stream = self.stream
        why = stream.step_shapes_note or getattr(stream.step_shapes, "error", None)
        return _NO_PROBE if why is None else f"{_NO_PROBE} Under XLA: {why}."

    def _on_records(self, records):
        """Notes the new shapes and traces of the stream's records."""
        # kg.watch supplies each batch's shapes itself, and fit's XLA step has
        # its own probe: no instrument, yet shapes seen.
        if (self.stream.input_probe is None and not self._seen
                and all(r.shape is None for r in records)):
            note = self._no_shapes_note()
            if note not in self.notes:
                self.notes.append(note)
                if self.verbose and note not in _TOLD:
                    _TOLD.add(note)
                    emit(note, self.verbose)
        for record in records:
            count, key = record.steps, record.shape
            if record.epoch_first and self._global:
                self._epoch += 1
            self._global += count
            new_shape = key is not None and key not in self._seen
            if new_shape and len(self._seen) >= self.MAX_SHAPES:
                new_shape = False
                self._note_too_many_shapes()
            if new_shape:
                self._seen[key] = self._global - count
            if new_shape or record.traces or record.compile_s:
                # Time spent waiting for the batch is the input's, not a compile.
                event = {"step": self._global - count, "steps": count, "shape": key,
                         "traces": record.traces, "step_ms": record.step * 1e3,
                         "epoch": self._epoch, "compiled_before": key in self._compiled_shapes,
                         "compile_s": record.compile_s}
                event["compiles"] = step_compiled(**self._how(event))
                self._events.append(event)
                if (new_shape and self._functions
                        and len(self._compiled_shapes) < self.MAX_SHAPES):
                    self._compiled_shapes.add(key)

    def _on_event(self, event):
        if event["verdict"] == "recompiling" and self.warn and not self._warned:
            self._warned = True
            warn(self._message(self._priced()))

    def _note_too_many_shapes(self):
        note = (f"more than {self.MAX_SHAPES} distinct input shapes: later ones are neither "
                "listed nor priced; bucket the lengths (kg.data builders: num_buckets) or pad "
                "to a few fixed lengths")
        if note not in self.notes:
            self.notes.append(note)

    def _median_ms(self):
        """The run's median cycle per step (the one step log), or None before any step."""
        return None if self.stream is None else self.stream.detector.log.summary()["p50_ms"]

    def _priced(self):
        """Events with `first_compile` and `cost_ms` (`analysis.recompile_cost`).

        Priced against the run's median cycle (with no step logged yet, each
        whole step counts: an upper bound). A step that did not compile
        costs 0. The first compile of functions never compiled before is
        `first_compile`: a cost, not a recompile.
        """
        median_ms = self._median_ms() or 0.0
        out = []
        first = self._fresh
        for e in self._events:
            e = dict(e)
            e["cost_ms"] = recompile_cost(e["step_ms"] / 1e3, median_ms / 1e3, e["steps"],
                                          **self._how(e)) * 1e3
            e["first_compile"] = first and e["compiles"]
            first = first and not e["compiles"]
            out.append(e)
        return out

    def _how(self, event):
        """How an event's step ran: the arguments of `analysis.step_compiled`
        and `analysis.recompile_cost` (nothing compiles in an eager step)."""
        eager = self._compiled is False
        return {"traces": 0 if eager else event["traces"],
                "new_shape": event["shape"] is not None,
                "jit": False if eager else self._jit,
                "compiled_before": event["compiled_before"],
                "compile_s": None if eager else event.get("compile_s")}

    def _trace_count(self):
        """Traces during the fit (so far, while it runs)."""
        if not self._functions:
            return None
        return (self._trace_total() if self._final is None else self._final) - self._baseline

    def _retraces(self, priced):
        """Traces in this fit after the functions' first compile."""
        if not self._functions:
            return 0
        first = sum(e["traces"] for e in priced if e["first_compile"])
        return self._trace_count() - first

    def _traced_shapes(self):
        """Function name -> the input shapes of each of its traces (custom loops)."""
        if self.functions is None:
            return {}
        out = {}
        for name, function in self._functions.items():
            concretes = concrete_functions(function)
            if concretes is not None:
                out[name] = [_signature_shapes(c) for c in concretes]
        return out

    def _message(self, priced):
        recompiles = [e for e in priced if e["compiles"] and not e["first_compile"]]
        cost = sum(e["cost_ms"] for e in recompiles)
        head = (f"RetracingMonitor: recompiles cost an estimated {cost:.0f} ms, "
                f"{self._share(cost):.0%} of fit time so far, and keep coming.")
        parts = [head]
        at_shapes = [e for e in recompiles if e["shape"] is not None and not e["traces"]]
        if at_shapes:
            shapes = sorted(self._seen, key=self._seen.get)
            listed = ", ".join(str(s) for s in shapes[:12])
            more = f" and {len(shapes) - 12} more" if len(shapes) > 12 else ""
            late = sum(1 for e in at_shapes if e["epoch"] > 0)
            latest = at_shapes[-1]
            parts.append(f"{len(at_shapes)} steps compiled at new input shapes "
                         f"(jit_compile={self._jit}), {late} after the first epoch; latest: "
                         f"new shape {latest['shape']} at step {latest['step']}, "
                         f"{len(shapes)} distinct shapes. Shapes seen: {listed}{more}.")
        retraces = self._retraces(priced)
        if retraces:
            if self.functions is None:
                what = "The train step was"
            else:
                what = ", ".join(self._functions) + (" was" if len(self._functions) == 1
                                                      else " were")
            shapes = "".join(f" {name} was traced for {traces[-12:]}."
                             for name, traces in self._traced_shapes().items())
            parts.append(f"{what} traced {self._trace_count()} times in this fit, "
                         f"{retraces} after the first compile.{shapes} "
                         f"{RETRACE_FIX[0].upper()}{RETRACE_FIX[1:]}.")
        parts.append(f"Fix: {FIXES['recompiling']}.")
        return " ".join(parts)

    def _share(self, cost_ms):
        elapsed = (self._fit_t1 or time.time()) - self._fit_t0
        return cost_ms / 1e3 / elapsed if elapsed > 0 else 0.0

    def report(self):
        """What the monitor counted in the last (or current) `fit`.

        Returns:
            A dict: the run's verdict, as every keras_gpufix callback's
            `report()` starts (`verdict`, `fix`, `phase`, `cost_share`,
            `because`, `changed`, `errors`: the run's one judgement, which
            judges `recompiling` from what this monitor counted); then
            `trace_count` (traces during the fit, None when they cannot be
            counted), `trace_counts` (function -> total traces), `shapes`
            (distinct input shape keys, as lists, in order seen; at most
            `MAX_SHAPES`, a note says when more were seen), `new_shapes`
            (their number), `traced_shapes` (with `functions`: name -> the
            input shapes of each trace), `shape_events` (step, steps,
            shape, traces, step_ms, epoch (of the fit, 0-based),
            compiled_before (the shape was compiled in an earlier fit of the
            same functions), compiles, first_compile, cost_ms of each step
            at a new shape or with a new trace), `median_step_ms` (the
            run's median cycle per step, the compiles' reference), `steps`,
            `compile_ms` (the first compile of functions never compiled
            before: unavoidable, not a recompile), `recompile_ms`
            (estimated cost of the other steps that compiled),
            `recompile_share` (of fit wall time), `compiled` (False when
            the step runs eagerly, None when not verified), `jit_compile`,
            `retraces` (traces after the first compile), `notes`.
        """
        priced = self._priced()
        recompile_ms = sum(e["cost_ms"] for e in priced if not e["first_compile"])
        head = self._verdict_report()
        head["fix"] = recompiling_fix(head["verdict"], head["fix"], self._retraces(priced))
        return {
            **head,
            "trace_count": self._trace_count(),
            "trace_counts": {n: int(f.experimental_get_tracing_count())
                             for n, f in self._functions.items()},
            "shapes": [_as_lists(k) for k in sorted(self._seen, key=self._seen.get)],
            "new_shapes": len(self._seen),
            "traced_shapes": self._traced_shapes(),
            "shape_events": [{k: (_as_lists(v) if k == "shape" and v is not None else v)
                              for k, v in e.items()} for e in priced],
            "median_step_ms": self._median_ms(),
            "steps": self._global,
            "compile_ms": sum(e["cost_ms"] for e in priced if e["first_compile"]),
            "recompile_ms": recompile_ms,
            "recompile_share": self._share(recompile_ms),
            "compiled": self._compiled,
            "jit_compile": self._jit,
            "retraces": self._retraces(priced),
            "notes": list(self.notes),
        }
