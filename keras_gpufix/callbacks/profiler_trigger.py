"""ProfilerTrigger: profiler traces of `model.fit` when something is wrong.

A trace is armed by a trigger and starts at the next step:

| trigger          | fires when                                                  |
|------------------|-------------------------------------------------------------|
| `"oscillation"`  | `GPUOscillationMonitor` reports a verdict other than        |
|                  | `healthy` (wired by `on_detect=`, or found in the same list)|
| `"slow_step"`    | a cycle (a step and the host time before it: input, other   |
|                  | callbacks) is a stall by the run's judgement: slower than   |
|                  | `stall_factor` x the median of the recent cycles, by        |
|                  | `min_slow_ms` (`analysis.slow_limit`, with the thresholds   |
|                  | of the run's detector: `THRESHOLDS`, or a                   |
|                  | `GPUOscillationMonitor`'s `thresholds`)                     |
| `int` / `[int]`  | the training reaches that global step (0-based, across      |
|                  | epochs)                                                     |

Every traced step is wrapped in a step marker (`keras_gpufix.profiling
.step_marker`), so XProf measures step times (stock `profile_batch` traces
show "No step marker observed"). After each trace, with `analyze=True`,
XProf's `input_pipeline_analyzer` runs headless in a background thread (it
releases the GIL, so steps go on) and one line is printed: step time,
input %, classification and XProf's conclusion, plus the TensorBoard
command; where XProf's reading disagrees with the run's verdict, the line
says which the verdict believes and why (`analysis.weigh`). At the end of `fit` it waits at most `analysis_timeout` seconds
for analyses still running (a trace of long steps can take minutes), so
`fit` returns on time; a late analysis lands in `traces` and `report()`
when it finishes. Traces land in `log_dir/plugins/profile/<run>/`.

Steps are timed by the shared step stream (`callbacks/_stream.py`, one
clock read per hook for all our callbacks): the trigger reads the latest
step's span from it (`stream.last`) and times nothing itself; the run's
events (`"oscillation"`) come from the stream's one judgement, with or
without a `GPUOscillationMonitor` in the list, and with or without a model
(`kg.watch` without `model=`). Keras `logs`: see `callbacks/_stream.py`;
the traces are in `traces` and `report()`.
"""

import threading
import time
import types
import weakref

from keras_gpufix import profiling
from keras_gpufix.analysis import is_cause, trace_cost_text, weigh
from keras_gpufix.callbacks import _arguments
from keras_gpufix.callbacks._base import guarded
from keras_gpufix.callbacks._timed import TimedCallback
from keras_gpufix.exceptions import warn
from keras_gpufix.output import emit

__all__ = ["ProfilerTrigger"]


class ProfilerTrigger(TimedCallback):
    """Captures TensorBoard profiler traces of `model.fit` when useful.

    Bounded: at most `max_traces` traces per `fit`, `cooldown` steps between
    them, never two profilers at once (if `keras.callbacks.TensorBoard(
    profile_batch=...)` or anything else is profiling, the trace waits and
    one warning says so). It stops only the trace it started, also after a
    `fit` that ended by an exception: the next `on_train_begin` of a
    `ProfilerTrigger` on the same model, or this object's deletion, stops
    and saves it. Profiler errors are never fatal.

    Args:
        log_dir: TensorBoard log directory; traces go to
            `log_dir/plugins/profile/<run>/`.
        trigger: `"oscillation"`, `"slow_step"`, a global step number, or a
            list of these. Defaults to `"oscillation"`.
        steps: steps per trace. Defaults to 10.
        max_traces: traces per `fit`. Defaults to 3.
        analyze: analyse each trace with XProf and print its conclusion.
            Defaults to True.
        cooldown: steps after a trace before the next may start. Defaults
            to 100.
        warmup: steps at the start of each `fit` that never fire
            `"slow_step"` (compilation); neither do the first step of an
            epoch and the step after a trace (saving it). Defaults to 10.
        analysis_timeout: seconds the end of `fit` waits, in all, for
            XProf analyses still running; later ones land in `traces` and
            `report()` when they finish. Defaults to 5.0.
        verbose: 0 silent, 1 prints one line per trace. Defaults to 1.

    Attributes:
        traces: one dict per trace this object took (across fits): `path`
            (run folder), `start_step`, `end_step`, `reason`, `analysis`
            (`step_time_ms`, `input_percent`, `classification`,
            `conclusion`, ... from `profiling.analyze_trace`; None while
            running or with `analyze=False`; `{"error": ...}` on failure;
            `"pending"` says whether XProf is still analysing it), `save_s`
            (stopping and saving it: the pause after its last step) and
            `analysis_cpu_s` (the analysis thread's CPU seconds).
        seconds: this fit's own seconds on the loop's thread: `capture`
            (starting and saving its traces) and `waited` (the end of `fit`
            waiting for their analyses).
        skipped: why armed traces did not start when due (another profiler
            running, profiler errors), at most 100 entries.

    Example:

    >>> trigger = kg.ProfilerTrigger("logs")
    >>> model.fit(ds, callbacks=[kg.GPUOscillationMonitor(), trigger])
    >>> trigger.traces[0]["analysis"]["classification"]
    'highly_input_bound'
    """

    MAX_SKIPPED = 100

    def __init__(self, log_dir, trigger="oscillation", steps=10, max_traces=3, analyze=True,
                 cooldown=100, warmup=10, analysis_timeout=5.0, verbose=1):
        super().__init__()
        self._kinds, self._at_steps = _arguments.profiler_trigger(
            log_dir, trigger, steps, max_traces, cooldown, warmup, analysis_timeout)
        self.log_dir = log_dir
        self.trigger = trigger
        self.steps = int(steps)
        self.max_traces = int(max_traces)
        self.analyze = analyze
        self.cooldown = int(cooldown)
        self.warmup = int(warmup)
        self.analysis_timeout = float(analysis_timeout)
        self.verbose = verbose
        self.traces = []
        self.skipped = []
        self._owner = None
        self._current = None
        self._pending = []
        self._warned = set()
        self.seconds = {"capture": 0.0, "waited": 0.0}
        self._reset()

    def _reset(self):
        self._global = 0
        self._hooks = 0
        self._armed = None
        self._retry_at = 0
        self._taken = 0
        self._last_end = None
        self._marker = None
        self._skip = True  # the next cycle holds an epoch start or our own work
        self._next_at = list(self._at_steps)

    def _warn_once(self, key, message):
        if key not in self._warned:
            self._warned.add(key)
            warn(message)

    # -- triggers --------------------------------------------------------

    @guarded
    def on_oscillation(self, event):
        """Arms a trace for an event of the run's judgement (not `healthy`)."""
        if "oscillation" in self._kinds and is_cause(event.get("verdict")):
            self._arm(f"oscillation: {event.get('verdict')} at steps "
                      f"{event.get('start_step')}-{event.get('end_step')}")

    def _on_event(self, event):
        self.on_oscillation(event)

    def _arm(self, reason):
        if self._armed is None and self._taken < self.max_traces:
            self._armed = reason

    # -- Keras hooks -----------------------------------------------------

    def _begin(self):
        self._stop_stale()
        self._reset()
        self.seconds = {"capture": 0.0, "waited": 0.0}
        self._warned.discard("busy")

    @guarded
    def on_epoch_begin(self, epoch, logs=None):
        self._skip = True
        super().on_epoch_begin(epoch, logs)

    @guarded
    def on_train_batch_begin(self, batch, logs=None):
        if self.stream is None:
            return
        try:
            # Steps whose end is still in Keras's pool (asynchronous
            # dispatch) count: the step now beginning is the stream's next.
            step = self.stream.upcoming_index()
            self._exit_marker()
            while self._next_at and self._next_at[0] <= step:
                self._arm(f"step {self._next_at.pop(0)}")
            if self._current is None and self._armed is not None:
                self._maybe_start(step)
            if self._current is not None:
                marker = profiling.step_marker(step)
                marker.__enter__()
                self._marker = (step, marker)
        finally:  # the stream's clock starts after our own work
            super().on_train_batch_begin(batch, logs)

    def _exit_marker(self, before=None):
        """Closes the open step marker (only one of a step before `before`)."""
        if self._marker is not None and (before is None or self._marker[0] < before):
            (_, marker), self._marker = self._marker, None
            marker.__exit__(None, None, None)

    def _after_hook(self):
        """After each end hook, on the loop's thread: the step just timed by the stream."""
        if self.stream.hooks == self._hooks:
            return  # the stream timed no step (its begin hook was missed)
        self._hooks = self.stream.hooks
        index, count, span, gap = self.stream.last
        self._global = index + count
        skip, self._skip = self._skip, False
        self._exit_marker(before=self._global)
        if self._current is not None:
            if self._global - self._current["start_step"] >= self.steps:
                self._stop(self._global - 1)
                self._skip = True  # saving the trace lies in the next cycle
        elif "slow_step" in self._kinds and not skip:
            self._watch((span + gap) / count)
        if self._pending:
            self._collect(wait=False)

    def _epoch_done(self):
        self._collect(wait=False)

    def _end(self):
        if self._current is not None:
            self._stop(self._global - 1)
        self._collect(wait=True)

    def __del__(self):
        try:
            trace = profiling.active_trace()
            if trace is not None and self._owner is not None and trace["owner"] is self._owner:
                profiling.stop_trace()
        except Exception:  # never raise from a finaliser
            pass

    # -- internals -------------------------------------------------------

    def _watch(self, step_time):
        """Slow-step trigger: a stall by the run's judgement (its detector's
        `stall_limit()`: `analysis.slow_limit` with `stall_factor` and
        `min_slow_ms` over the recent cycles the stream measured) on the
        cycle (the step and the host time before it)."""
        if self._global > self.warmup:
            limit = self.stream.stall_limit()
            if limit is not None and step_time > limit[0]:
                self._arm(f"slow step {self._global - 1}: {step_time * 1e3:.1f} ms against "
                          f"a median of {limit[1] * 1e3:.1f} ms")

    def _maybe_start(self, step):
        if self._taken >= self.max_traces:
            self._armed = None
            return
        if self._last_end is not None and step <= self._last_end + self.cooldown:
            return
        if step < self._retry_at:
            return
        model = self.model  # None under kg.watch without model=
        self._owner = types.SimpleNamespace(
            callback=weakref.ref(self),
            model=(lambda: None) if model is None else weakref.ref(model))
        recent = self.stream.stall_limit() if self.stream is not None else None
        emit(f"\nProfilerTrigger: tracing steps {step}-{step + self.steps - 1} ({self._armed}): "
             f"{trace_cost_text(self.steps, recent and recent[1])}", self.verbose)
        t0 = time.perf_counter()
        try:
            profiling.start_trace(self.log_dir, owner=self._owner, tag=f"steps_{step}")
        except profiling.ProfilerBusyError as exc:
            self._busy(step, str(exc))
            return
        except Exception as exc:  # profiler errors are never fatal
            self._armed = None
            if len(self.skipped) < self.MAX_SKIPPED:
                self.skipped.append(f"step {step}: profiler failed to start ({exc})")
            self._warn_once("start", f"ProfilerTrigger: the profiler failed to start "
                                     f"({type(exc).__name__}: {exc}); no trace taken.")
            return
        finally:
            self.seconds["capture"] += time.perf_counter() - t0
        self._current = {"path": None, "start_step": step, "end_step": None,
                         "reason": self._armed, "analysis": None}
        self._armed = None
        self._taken += 1

    def _busy(self, step, why):
        self._retry_at = step + self.steps
        if len(self.skipped) < self.MAX_SKIPPED:
            self.skipped.append(f"step {step}: {why}")
        hint = "" if "keras_gpufix" in why else " (keras.callbacks.TensorBoard profile_batch?)"
        self._warn_once("busy", f"ProfilerTrigger: {why}{hint}; not starting a second one. "
                                f"The trace armed for '{self._armed}' waits until it stops.")

    def _stop(self, end_step, note=""):
        trace, self._current = self._current, None
        self._exit_marker()  # a step cut short by an exception
        trace["end_step"] = end_step
        trace["reason"] += note
        self._last_end = end_step
        t0 = time.perf_counter()
        try:
            trace["path"] = profiling.stop_trace()
        except Exception as exc:  # profiler errors are never fatal
            trace["analysis"] = {"error": f"{type(exc).__name__}: {exc}"}
            self._warn_once("stop", f"ProfilerTrigger: the profiler failed to stop or "
                                    f"save ({type(exc).__name__}: {exc}).")
        finally:  # saving the trace: the pause after its last step
            trace["save_s"] = time.perf_counter() - t0
            self.seconds["capture"] += trace["save_s"]
        self.traces.append(trace)
        if trace["path"] is None:
            return
        if self.analyze:
            thread = threading.Thread(target=self._analyze, args=(trace,), daemon=True,
                                      name="kg-xprof-analysis")
            thread.start()
            self._pending.append((trace, thread))
        else:
            emit(f"\nProfilerTrigger: steps {trace['start_step']}-{end_step} "
                 f"({trace['reason']}) traced to {trace['path']}. Open: "
                 f"{profiling.tensorboard_command(self.log_dir)} (Profile tab)", self.verbose)

    @staticmethod
    def _analyze(trace):
        t0 = time.thread_time()
        try:
            trace["analysis"] = profiling.analyze_trace(trace["path"])
        except Exception as exc:
            trace["analysis"] = {"error": f"{type(exc).__name__}: {exc}"}
        finally:  # the analysis thread's CPU, taken beside the steps
            trace["analysis_cpu_s"] = time.thread_time() - t0

    def _collect(self, wait):
        """Reports finished analyses; with `wait`, waits `analysis_timeout` s in all."""
        t0 = time.perf_counter()
        deadline = time.monotonic() + self.analysis_timeout
        still = []
        for trace, thread in self._pending:
            if wait:
                thread.join(timeout=max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                still.append((trace, thread))
                continue
            analysis = trace["analysis"] or {}
            if "error" in analysis:
                self._warn_once("analysis", f"ProfilerTrigger: XProf could not analyse "
                                            f"{trace['path']} ({analysis['error']}).")
            else:
                emit(f"\nProfilerTrigger: steps {trace['start_step']}-{trace['end_step']} "
                     f"({trace['reason']}): "
                     f"{profiling.format_analysis(analysis, self.log_dir)}"
                     + "".join(f" {b}." for b in self._weighed(trace)), self.verbose)
        self._pending = still
        if wait:
            self.seconds["waited"] += time.perf_counter() - t0
        if wait and still:
            emit(f"ProfilerTrigger: {len(still)} XProf analysis(es) still running after "
                 f"{self.analysis_timeout:g} s; fit returns now and each lands in "
                 "report() when it finishes.", self.verbose)

    def _weighed(self, trace):
        """What the run's verdict makes of this trace, where XProf disagrees with it."""
        if self.stream is None:
            return []
        run = dict(self.stream.detector.verdict(),
                   input_wait=self.stream.detector.log.summary()["input_wait"])
        xprof = dict(trace["analysis"], start_step=trace["start_step"],
                     end_step=trace["end_step"])
        return [f"The run's verdict, {run['verdict']}: {b}"
                for b in weigh(run, xprof=[xprof])["because"][len(run["because"]):]]

    def _stop_stale(self):
        """Stops a trace of ours left running by a `fit` that raised."""
        trace = profiling.active_trace()
        owner = trace and trace["owner"]
        if not isinstance(owner, types.SimpleNamespace):
            return
        callback, model = owner.callback(), owner.model()
        if callback is not None and callback is not self and model is not self.model:
            return  # a fit of another model is running: its trace
        if callback is not None and callback._current is not None:
            callback._stop(callback._global - 1, note=" (fit ended by an exception)")
            path = callback.traces[-1]["path"]
            callback._collect(wait=True)
        else:
            path = profiling.stop_trace()
        self._warn_once("stale", "ProfilerTrigger: a trace left running by a fit that "
                                 f"ended by an exception was stopped and saved to {path}.")

    def report(self):
        """The run's verdict, the traces of this object and the triggers it skipped.

        Returns:
            A dict: the run's verdict, as every keras_gpufix callback's
            `report()` starts (`verdict`, `fix`, `phase`, `cost_share`,
            `because`, `changed`, `errors`), then `traces` (as in `traces`,
            each with `pending`: XProf is still analysing it; its `analysis`
            arrives when it finishes), `skipped`, `seconds` (as the
            attribute), `log_dir`, `tensorboard` (the command to open them).
        """
        pending = {id(trace) for trace, thread in self._pending if thread.is_alive()}
        return {
            **self._verdict_report(),
            "traces": [dict(t, pending=id(t) in pending) for t in self.traces],
            "skipped": list(self.skipped),
            "seconds": dict(self.seconds),
            "log_dir": str(self.log_dir),
            "tensorboard": profiling.tensorboard_command(self.log_dir),
        }
