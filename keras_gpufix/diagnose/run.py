"""The run: execute the script as `__main__` with every `fit` patched, gather the diagnosis."""

import contextlib
import functools
import gc
import math
import os
import platform
import runpy
import signal
import sys
import sysconfig
import tempfile
import threading
import time
import traceback
import warnings

from keras_gpufix import __version__, script_env
from keras_gpufix.analysis import (MONITOR_WARMUP, OWN_ITEMS, is_cause, main_what_if, own_cost,
                                   stages_needed, trace_plan, trace_question, traced_extra_s)
from keras_gpufix.analysis.what_if import what_if_budget
from keras_gpufix.backends import name as backend_name
from keras_gpufix.diagnose.jax_steps import STAGES_ELSEWHERE, WHAT_IF_ELSEWHERE, Drained
from keras_gpufix.diagnose.lines_run import LinesRun
from keras_gpufix.diagnose.loop_patch import LoopPatch, StepsEnded, StepsReached
from keras_gpufix.diagnose.report import (healthy_evidence, not_offered, rank_causes,
                                          seen_in_code, trace_evidence)
from keras_gpufix.diagnose.scan import scan_script
from keras_gpufix.diagnose.step_patch import attach_patches
from keras_gpufix.diagnose.stages import StageSites, measure_stages
from keras_gpufix.diagnose.what_if import (Budget, Cycles, fit_replay, input_rate,
                                           replay_rates, what_if_until_known)
from keras_gpufix.exceptions import GpufixWarning, warn
from keras_gpufix.output import emit, import_tensorflow_quietly

__all__ = ["environment", "run_diagnosis"]


def environment():
    """Python, Keras and the backend's versions, devices, XLA, NVML (`reason` "no GPU"
    where there is none) and CPUs, as a dict (`tf_keras`: its version where
    TF_USE_LEGACY_KERAS made `tf.keras` tf_keras and the script imported it).
    TensorFlow is read only where it is imported (the TensorFlow backend, or a
    script that imported it): on JAX `tensorflow` is None, `jax` its version,
    `devices` `jax.devices()`; XLA is always built in."""
    import keras

    from keras_gpufix.compile import device_info
    from keras_gpufix.compile.hardware import usable_cpus
    from keras_gpufix.nvml import nvml_status

    tf = sys.modules.get("tensorflow")
    jax = sys.modules.get("jax")
    build = dict(tf.sysconfig.get_build_info()) if tf is not None else {}
    gpus = device_info()["gpus"]
    legacy = sys.modules.get("tf_keras") if os.environ.get(
        "TF_USE_LEGACY_KERAS", "").lower() in ("1", "true", "yes") else None
    backend = keras.backend.backend()
    if backend == "tensorflow" or jax is None:
        devices = [d.name for d in tf.config.list_physical_devices()] if tf is not None else []
    else:
        devices = [str(d) for d in jax.devices()]
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "tensorflow": getattr(tf, "__version__", None),
        "jax": getattr(jax, "__version__", None),
        "keras": keras.__version__,
        "keras_backend": backend,
        # TF_USE_LEGACY_KERAS=1: tf.keras is tf_keras (Keras 2), what the script ran on
        "tf_keras": getattr(legacy, "__version__", None),
        "keras_gpufix": __version__,
        "cpu_count": os.cpu_count(),
        "cpus_usable": usable_cpus(),
        "devices": devices,
        "gpus": gpus,
        "cuda_build": bool(build.get("is_cuda_build")) if tf is not None else None,
        "cuda_version": build.get("cuda_version"),
        "cudnn_version": build.get("cudnn_version"),
        "xla": {"built_with_xla": bool(tf.test.is_built_with_xla()) if backend == "tensorflow"
                else backend == "jax",
                "TF_XLA_FLAGS": os.environ.get("TF_XLA_FLAGS")},
        # NVML (and its install hint) only where there is a GPU to sample
        "nvml": nvml_status() if gpus else {"available": False, "reason": "no GPU",
                                            "gpus": []},
        "dtype_policy": keras.mixed_precision.global_policy().name,
    }


def _time_own_hooks(callbacks, batch_hooks=False):
    """A two-item list that adds up the seconds `callbacks` (diagnose's own) spend in
    their train and epoch begin and end hooks (the fit's wall holds them, the
    script's run does not: `report._script_run`) and, with `batch_hooks`, in
    their batch begin and end hooks (on TensorFlow, where Keras runs them on
    the loop's thread: elsewhere the end hooks run in Keras's pool, beside it)."""
    seconds = [0.0, 0.0]

    def timed(hook, slot):
        def run(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return hook(*args, **kwargs)
            finally:
                seconds[slot] += time.perf_counter() - t0
        return run

    names = {"on_train_begin": 0, "on_train_end": 0, "on_epoch_begin": 0, "on_epoch_end": 0}
    if batch_hooks:
        names.update(on_train_batch_begin=1, on_train_batch_end=1)
    for callback in callbacks:
        for name, slot in names.items():
            setattr(callback, name, timed(getattr(callback, name), slot))
    return seconds


def _step_counter(steps=None, pending=lambda: None):
    """A callback that counts `fit`'s steps (counting steps_per_execution) and,
    with `steps`, stops `fit` after that many.

    It is `async_safe`, so a diagnosed fit keeps Keras's asynchronous
    dispatch (JAX, torch, NumPy backends). The stop is decided on the
    loop's thread, in the begin hook of the execution that reaches `steps`
    (Keras checks `stop_training` right after that execution's end hook,
    as it did when the end hook set it): the steps of the epochs that
    ended, the execution's first batch and its length (`steps_per_execution`,
    cut at the epoch's end). The steps run are counted in the end hooks,
    under a lock (Keras's pool has several threads): an epoch's batches
    are run up to the last one an end hook names. Each begin hook first
    calls `pending` (raises a signal the script lost, `FitPatch.raise_pending`).
    Last of the fit's callbacks, it also times the release of the fit's epoch
    iterators (`released_s` at each later epoch's start, beyond the first epoch's
    gap from its begin hook to its first batch; `ended`: its train end hook).
    """
    import keras

    class StepCounter(keras.callbacks.Callback):
        async_safe = True

        def __init__(self):
            super().__init__()
            self.seen, self.stopped, self.ended, self.released_s = 0, False, None, 0.0
            self._began = self._first_gap = None
            self._done = 0  # steps of the epochs that ended
            self._reached = 0  # batches of this epoch up to the last an end hook named
            self._lock = threading.Lock()

        def on_train_begin(self, logs=None):
            self.seen, self.stopped, self._done, self._reached = 0, False, 0, 0
            self.ended, self.released_s, self._first_gap = None, 0.0, None

        def on_epoch_begin(self, epoch, logs=None):  # the last hook: the epoch's iterator
            self._began = time.perf_counter()  # is made next, the last one's released

        def on_train_end(self, logs=None):  # the last hook: the iterator released after it
            self.ended = time.perf_counter()

        def on_train_batch_begin(self, batch, logs=None):
            if batch == 0 and self._began is not None:  # beyond the first epoch's gap (an
                gap = time.perf_counter() - self._began  # iterator made): one released
                if self._first_gap is None:
                    self._first_gap = gap
                else:
                    self.released_s += max(0.0, gap - self._first_gap)
                self._began = None
            pending()
            try:  # Keras's epoch iterator ends this execution at batch + per_call - 1
                per_call = max(1, int(getattr(self.model, "steps_per_execution", 1) or 1))
            except (TypeError, ValueError):
                per_call = 1
            epoch_steps = (self.params or {}).get("steps")
            if epoch_steps:
                per_call = max(1, min(per_call, epoch_steps - batch))
            if steps and self._done + batch + per_call >= steps:
                self.model.stop_training = True
                self.stopped = True

        def on_train_batch_end(self, batch, logs=None):
            with self._lock:
                self._reached = max(self._reached, batch + 1)
                self.seen = self._done + self._reached

        def on_epoch_end(self, epoch, logs=None):  # Keras waited for the end hooks
            self._done, self._reached = self._done + self._reached, 0

    return StepCounter()


class FitPatch:
    """Context manager: every `keras.Model.fit` gets the diagnostic callbacks.

    While it is open, `sites` (a `StageSites`) records where the script
    builds each `tf.data` stage. Each run's what-if (its input drain,
    replay and stages) keeps one `Budget` (`what_if_budget`). `steps`
    counts the script's training steps in all, fits' and custom loops'
    (`steps_done`): a fit runs the steps left, and once none is left a
    `fit` (or a loop's next step) ends the script (`StepsEnded`).
    """

    def __init__(self, steps=None, log_dir=None, trace="auto", what_if=True, verbose=1,
                 what_if_budget=None):
        self.steps = steps
        self.log_dir = log_dir
        self.trace = trace
        self.what_if = what_if
        self.verbose = verbose
        self.budget_s = what_if_budget  # None: `analysis.what_if_budget` of each run
        self.fits = []
        self.notes = []
        self.steps_done = 0  # training steps of the runs so far: fits', and loops' cycles
        self.own = dict.fromkeys(OWN_ITEMS, 0.0)  # diagnose's own seconds, by item
        self._gpus = None
        self.what_if_stopped = None  # what a signal during a what-if stopped
        self._depth = 0
        self._signal = None  # the SIGTERM or SIGINT that ends the script, once one came
        self._budgets = {}  # id(entry) -> the run's Budget
        self._measuring = None  # (entry, Budget) of the what-if running now

    def interrupt(self, exc):
        """A signal ends the script (`exc`: `Terminated` or KeyboardInterrupt):
        the what-ifs still to come are skipped, and `raise_pending` raises it
        again should the script lose it. A signal during a run's what-if (its
        training ended) is recorded as stopping that what-if (`what_if_stopped`,
        the run's `what_if` `reason`)."""
        self._signal = exc
        self.what_if = False
        if self._measuring is not None:
            entry, budget = self._measuring
            name = str(exc) if isinstance(exc, Terminated) else "SIGINT"
            run = f"{entry.get('kind', 'fit')} {entry.get('index')}"
            self.what_if_stopped = {"signal": name, "run": run, "after_s": budget.spent(),
                                    "budget_s": budget.seconds}
            entry.setdefault("what_if", {
                "reason": f"{name} stopped the what-if after {budget.spent():.0f} s",
                "budget_s": budget.seconds, "spent_s": budget.spent(), "cut_short": None})

    def what_if_budget(self, entry):
        """The `Budget` of the what-if of the run `entry` (made, its clock started and
        one line saying so printed, at the first call): `--what-if-budget`, else
        `analysis.what_if_budget` of the run's `wall_s`."""
        key = id(entry)
        if key not in self._budgets:
            budget = Budget(what_if_budget(entry.get("wall_s"), self.budget_s))
            self._budgets[key], self._measuring = budget, (entry, budget)
            emit(f"keras-gpufix diagnose: {entry.get('kind', 'fit')} {entry.get('index')} "
                 f"ended; its what-if (the input alone, the step alone) takes at most "
                 f"{budget.seconds:.0f} s", self.verbose)
        return self._budgets[key]

    @contextlib.contextmanager
    def timing(self, item):
        """Adds the seconds the block takes to diagnose's own `item` (`OWN_ITEMS`)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.own[item] += time.perf_counter() - t0

    def bill_traces(self, entry, timer):
        """Adds a run's traces to diagnose's own seconds: starting and saving them and
        the traced steps' slowdown (capture), the wait for their analysis."""
        profiler = entry.get("profiler") or {}
        seconds = profiler.get("seconds") or {}
        spans = [(t["start_step"], t["end_step"]) for t in profiler.get("traces") or ()]
        extra = 0.0
        if spans and timer is not None:
            extra = traced_extra_s({r.index: r.cycle for r in timer.records()}, spans)
        self.own["trace capture"] += (seconds.get("capture") or 0.0) + extra
        self.own["trace analysis"] += seconds.get("waited") or 0.0

    def _trace_question(self):
        """`analysis.trace_question` for this run's host (its GPUs read once)."""
        if self.trace is False:
            return None
        if self._gpus is None:
            from keras_gpufix.compile import device_info

            try:
                self._gpus = device_info()["gpus"]
            except Exception:  # never break the user's run
                self._gpus = []
        return trace_question(self.trace, self._gpus)

    def steps_reached(self):
        """Whether `--steps N` is reached: N training steps ran, fits' and loops'."""
        return self.steps is not None and self.steps_done >= self.steps

    def end_if_reached(self, asked):
        """Ends the script (`StepsEnded`) where, `--steps` reached, it asks for `asked`
        (a fit, a train step, a batch of a dataset it trained on)."""
        if self.steps_reached():
            raise StepsEnded(self.steps, asked)

    def raise_pending(self):
        """Raises the signal's exception again when the script lost it and went on:
        a KeyboardInterrupt that lands in a finalizer or weakref callback (TensorFlow
        runs many) is printed as `Exception ignored in ...` and dropped by Python,
        as it is by a script's own `except KeyboardInterrupt: pass`. Called on the
        loop's thread before each step (fit's begin hook, a custom loop's next batch)."""
        if self._signal is not None:
            raise self._signal

    def __enter__(self):
        import keras

        self._cls = keras.Model
        self._had_own = "fit" in self._cls.__dict__
        original = self._cls.fit
        patch = self

        @functools.wraps(original)
        def fit(model, *args, **kwargs):
            if patch._depth:  # a subclass's fit calling super().fit
                return original(model, *args, **kwargs)
            patch._depth += 1
            try:
                return patch._fit(original, model, args, kwargs)
            finally:
                patch._depth -= 1

        self._original = original
        self._cls.fit = fit
        # tf.data, tf.function and the stages' sites exist on the TensorFlow backend only
        self.backend = keras.backend.backend()
        self.tensorflow = self.backend == "tensorflow"
        self.sites = StageSites().__enter__() if self.tensorflow else None
        return self

    def __exit__(self, *exc):
        if self.sites is not None:
            self.sites.__exit__(*exc)
        if self._had_own:
            self._cls.fit = self._original
        else:
            del self._cls.fit
        return False

    def _note(self, message):
        if message not in self.notes:
            self.notes.append(message)
            warn(f"keras-gpufix diagnose: {message}")  # at the script's fit line

    def monitors(self, total, kind, user=(), retracing=True, functions=None):
        """Our callbacks for one run (`kind` "fit" or "loop") of `total` steps, by report key.

        `total` is None when unknown. `functions`: a custom loop's step functions
        (`RetracingMonitor(functions=...)`; None: the model's train function).
        A monitor the user already passed is used instead of a new one.
        The run's TensorBoard folder is `log_dir/<kind>_<n>`: the step timer's
        per-step and per-epoch `step_timer/*` scalars, the monitor's
        `oscillation/*` per judgement, and the traces.
        """
        import keras_gpufix as kg

        mine = {}
        warmup = MONITOR_WARMUP
        verbose = self.verbose
        run_dir = os.path.join(self.log_dir, f"{kind}_{len(self.fits) + 1}")
        classes = {"monitor": "GPUOscillationMonitor", "retracing": "RetracingMonitor",
                   "profiler": "ProfilerTrigger", "timer": "StepTimer"}
        if not retracing:
            del classes["retracing"]
        for key, name in classes.items():
            try:
                cls = getattr(kg, name)
            except (ImportError, AttributeError) as exc:
                self._note(f"{name} is not available ({exc}); its evidence is missing")
                continue
            existing = [cb for cb in user if isinstance(cb, cls)]
            if existing:
                mine[key] = existing[0]
            elif key == "monitor":
                mine[key] = cls(warmup=warmup, log_dir=run_dir, verbose=verbose)
            elif key == "retracing":
                mine[key] = cls(functions=functions, verbose=verbose)
            elif key == "timer":
                mine[key] = cls(log_dir=run_dir, warmup=warmup)
            elif self._trace_question() is not None:
                plan = trace_plan(total)
                mine[key] = cls(run_dir, trigger=["oscillation", plan["at"]], steps=plan["steps"],
                                max_traces=plan["max_traces"], verbose=verbose)
                emit(f"keras-gpufix diagnose: {kind} {len(self.fits) + 1} is traced from step "
                     f"{plan['at']} ({plan['steps']} steps, at most {plan['max_traces']} "
                     f"traces; why: {self._trace_question()}); each trace slows its steps "
                     "and pauses the run to save it after them (its cost is said as it "
                     "starts and listed in the report; --no-trace takes none)", verbose)
        if "monitor" in mine:  # diagnose's headline says the fix, with what it measured
            mine["monitor"]._fix_said_by_diagnose = True
        return mine

    @staticmethod
    def collect(entry, mine):
        """Puts each monitor's report and the timed step count into `entry`."""
        for key, cb in mine.items():
            if not hasattr(cb, "report"):  # the step timer only writes scalars
                continue
            try:
                entry[key] = cb.report()
            except Exception as exc:
                entry[key] = {"error": f"{type(exc).__name__}: {exc}"}
        entry["steps"] = (entry.get("monitor") or {}).get("step_time", {}).get("count")

    def _prepare(self, original, model, args, kwargs):
        """(bound arguments, our callbacks) for one fit."""
        import inspect

        import keras

        bound = inspect.signature(original).bind(model, *args, **kwargs)
        arguments = bound.arguments
        x = arguments.get("x")
        tf = sys.modules.get("tensorflow")  # a tf.data dataset exists only where it is imported
        dataset = tf is not None and isinstance(x, tf.data.Dataset)
        epochs = arguments.get("epochs", 1)
        per_epoch = arguments.get("steps_per_epoch")
        if per_epoch is None and dataset:
            card = int(x.cardinality())
            per_epoch = card if card > 0 else None
        left = None if self.steps is None else self.steps - self.steps_done
        total = left or (per_epoch * epochs if per_epoch else None)
        if left and per_epoch:
            total = min(left, per_epoch * epochs)
        user = list(arguments.get("callbacks") or [])
        mine = self.monitors(total, "fit", user=user, retracing=True)
        ours = [cb for cb in mine.values() if not any(cb is u for u in user)]
        counter = _step_counter(left, self.raise_pending)
        arguments["callbacks"] = user + ours + [counter]
        info = {"kind": "fit", "x": type(x).__name__, "instrumented": dataset, "epochs": epochs,
                "steps_per_epoch": per_epoch, "tf_data": dataset,
                # the profiler's seconds are its own items (`bill_traces`), not the monitors'
                "own_hooks": _time_own_hooks([cb for cb in ours if cb is not mine.get("profiler")],
                                             batch_hooks=self.tensorflow),
                "profiler_hooks": _time_own_hooks([cb for cb in ours
                                                   if cb is mine.get("profiler")])}
        if not self.tensorflow and isinstance(x, keras.utils.PyDataset):
            return bound, mine, counter, info, x  # its what-if drains it alone (`Drained`)
        return bound, mine, counter, info, x if dataset else None

    def fit_what_if(self, model, dataset, timer, budget):
        """The what-if of one fit (`what_if.py`) over its `StepTimer`'s records, within
        its `budget`, or a dict with the reason it was not measured."""
        if not self.tensorflow and dataset is not None and timer is not None:
            try:  # the step as measured in the run, the PyDataset drained alone
                result = what_if_until_known(Cycles.of(timer.records()),
                                             input_rate(Drained(dataset), budget=budget), None,
                                             budget=budget)
            except Exception as exc:  # never break the user's run
                return {"reason": f"{type(exc).__name__}: {exc}"}
            return result or {"reason": "no steady cycles were timed"}
        if not self.tensorflow:
            return {"reason": WHAT_IF_ELSEWHERE.format(self.backend)}
        if dataset is None:
            return {"reason": "the input is not a tf.data.Dataset"}
        if timer is None:
            return {"reason": "no StepTimer timed the fit's steps"}
        cycles = Cycles.of(timer.records())
        try:
            input_per_s = input_rate(dataset, budget=budget)
            cached, real, variables, per_call = fit_replay(model, dataset)
            result = what_if_until_known(
                cycles, input_per_s,
                lambda: replay_rates(cached, variables, real, batches_per_call=per_call,
                                     budget=budget),
                batches_per_cycle=per_call, budget=budget)
        except Exception as exc:  # never break the user's run
            return {"reason": f"{type(exc).__name__}: {exc}"}
        return result or {"reason": "no steady cycles were timed"}

    def input_stages(self, entry, dataset):
        """The stages of a run's input (`stages.py`) when the run's verdict or
        what-if makes them worth measuring (`analysis.stages_needed`), a dict
        with the reason they could not be measured, or None."""
        monitor = entry.get("monitor") or {}
        if not stages_needed(monitor.get("verdict"), entry.get("what_if"),
                             monitor.get("input_wait")):
            return None
        if self.sites is None:
            return {"reason": STAGES_ELSEWHERE.format(self.backend)}
        if dataset is None:
            return None
        budget = self.what_if_budget(entry)
        if budget.left() <= 0:
            budget.stop()
            return {"reason": f"not measured: the what-if's {budget.cut}"}
        try:
            return measure_stages(dataset, self.sites, budget=budget)
        except Exception as exc:  # never break the user's run
            return {"reason": f"{type(exc).__name__}: {exc}"}

    def _fit(self, original, model, args, kwargs):
        self.end_if_reached("a fit")
        try:
            bound, mine, counter, info, dataset = self._prepare(original, model, args, kwargs)
        except Exception as exc:  # never break the user's fit
            self._note(f"could not attach the monitors ({type(exc).__name__}: {exc}); "
                       "this fit ran without them")
            return original(model, *args, **kwargs)
        own_hooks, profiler_hooks = info.pop("own_hooks"), info.pop("profiler_hooks")
        entry = {"index": len(self.fits) + 1, **info}
        self.fits.append(entry)
        cache = _compile_cache()
        t0 = time.perf_counter()
        try:
            with cache.watch() if cache else contextlib.nullcontext({}) as compiled:
                history = original(*bound.args, **bound.kwargs)
        except BaseException as exc:
            entry["error"] = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            if cache:
                entry["compile_cache"] = {"directory": cache.directory, **compiled}
            entry["wall_s"] = time.perf_counter() - t0
            # the fit's epoch iterators released (`report._script_run`): at each later
            # epoch's start and after the fit's last hook
            entry["teardown_s"] = counter.released_s + (
                0.0 if counter.ended is None else t0 + entry["wall_s"] - counter.ended)
            entry["own_hooks_s"] = own_hooks[0] + profiler_hooks[0]
            entry["own_batch_hooks_s"] = own_hooks[1]
            entry["stopped_by_diagnose"] = counter.stopped
            entry["steps_run"] = counter.seen
            self.steps_done += counter.seen
            entry["model"] = {
                "name": model.name,
                "jit_compile": getattr(model, "jit_compile", None),
                "run_eagerly": getattr(model, "run_eagerly", None),
                "steps_per_execution": getattr(model, "steps_per_execution", None),
            }
            self.collect(entry, mine)
            self.own["monitors"] += own_hooks[0] + own_hooks[1]
            self.bill_traces(entry, mine.get("timer"))
            # A fit stopped early leaves its epoch iterator in a reference
            # cycle; freed only at interpreter exit, an iterator with a
            # py_function in flight deadlocks there (TF 2.21). Free it now
            # (only then: a collection of TensorFlow's heap takes ~0.5 s).
            if counter.stopped or "error" in entry:
                with self.timing("monitors"):
                    gc.collect()
        if self.what_if:
            with self.timing("what-if"):
                entry["what_if"] = self.fit_what_if(model, dataset, mine.get("timer"),
                                                    self.what_if_budget(entry))
                stages = self.input_stages(entry, dataset)
                if stages is not None:
                    entry["stages"] = stages
                self._measuring = None
                gc.collect()
        return history


def _compile_cache():
    """The script's persistent XLA compile cache (`CompileCache.enable()`, `compile_model`,
    or `TF_XLA_FLAGS` / `jax_compilation_cache_dir` set by the user), or None when off:
    each fit's compiles are then counted fresh (entries it wrote) or from the cache."""
    from keras_gpufix.compile.compile_cache import CompileCache

    try:
        return CompileCache.current()
    except Exception:  # never break the user's run
        return None


_QUIET_NOTE = ("TensorFlow's own log lines were hidden (TF_CPP_MIN_LOG_LEVEL=2); "
               "to see them: TF_CPP_MIN_LOG_LEVEL=0 keras-gpufix diagnose ...")


def _user_frames(exc):
    """The traceback frames of `exc` outside keras_gpufix and runpy (the script's and
    the libraries' it called)."""
    import keras_gpufix

    ours = os.path.dirname(keras_gpufix.__file__) + os.sep
    return [f for f in traceback.extract_tb(exc.__traceback__)
            if not f.filename.startswith(ours) and f.filename != runpy.__file__]


def _stopped(steps, steps_done, exc):
    """The report's `stopped`: how `--steps` ended the run (None when it was not
    reached). `exc`: the `StepsEnded` that ended the script where it asked to
    train again or in its loop's own `next()` call (`own_next`), the
    `StepsReached` a generator made a RuntimeError of, or None: the script ran
    on to its own end."""
    if steps is None or (exc is None and steps_done < steps):
        return None
    steps_done = max(steps_done, steps)  # a kg.watch loop's steps are its own
    user = _user_frames(exc) if exc is not None else []
    where = f"{user[-1].filename}:{user[-1].lineno}" if user else None
    at = f" at {where}" if where else ""
    text = f"stopped by --steps after {steps_done} steps"
    if isinstance(exc, StepsEnded) and exc.own_next:
        how = "own_next"
        text += (f"; its loop calls next() itself{at}: diagnose ended the script there "
                 "(exit 0), past the script's `except Exception` handlers (a `for` loop over "
                 "the dataset would have ended cleanly and the script run on)")
    elif isinstance(exc, StepsEnded):
        how = "asked_again"
        text += (f"; the script then asked for {exc.asked}{at} and ended there, as a "
                 "finished run ends (exit 0)")
    elif exc is not None:
        how = "own_next"
        text += (f"; its loop calls next() itself{at} and ended there (exit 0); a `for` loop "
                 "over the dataset would have ended cleanly and the script run on")
    else:
        how = "ran_on"
        text += "; the script ran on to its own end"
    return {"steps": steps, "steps_run": steps_done, "how": how, "where": where,
            "text": text}


class Terminated(BaseException):
    """SIGTERM (a job scheduler's time limit) while the script ran."""

    def __init__(self, signum):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def _signals_end_the_script(patch):
    """SIGTERM raises `Terminated` in the script, SIGINT KeyboardInterrupt (when
    Python's own handler has it: not where SIGINT is ignored, as in a background
    job), so the run unwinds and its report is printed; the what-ifs still to come
    are skipped, and the next step raises it again if the script lost it
    (`FitPatch.raise_pending`). A second SIGTERM kills at once, a second SIGINT
    raises KeyboardInterrupt at once. Only in the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    again = {signal.SIGTERM: signal.SIG_DFL, signal.SIGINT: signal.default_int_handler}

    def on_signal(signum, frame):
        signal.signal(signum, again[signum])
        exc = KeyboardInterrupt() if signum == signal.SIGINT else Terminated(signum)
        patch.interrupt(exc)
        raise exc

    previous = {signal.SIGTERM: signal.signal(signal.SIGTERM, on_signal)}
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        previous[signal.SIGINT] = signal.signal(signal.SIGINT, on_signal)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _ended_by(exc, steps_seen, what_if_stopped=None):
    """What ended the script early: a dict `kind` (`exception` or `signal`), `type`,
    `message`, `raised_at` (file:line), `script_line` (the script's own line that led
    there, when `raised_at` is in a library), `steps_seen`, `during` (`what_if`:
    a signal came during a run's what-if, after its training ended, as
    `what_if_stopped` (`FitPatch.what_if_stopped`) says; else `script`) and `text`."""
    steps = f"after {steps_seen} training step{'s' * (steps_seen != 1)}"
    if isinstance(exc, (Terminated, KeyboardInterrupt)):
        name = str(exc) if isinstance(exc, Terminated) else "SIGINT"
        text = f"{name} stopped the script {steps}"
        if what_if_stopped is not None:
            text = (f"{name} stopped diagnose's what-if of {what_if_stopped['run']} "
                    f"{what_if_stopped['after_s']:.0f} s into it (its budget "
                    f"{what_if_stopped['budget_s']:.0f} s), not training: training had ended "
                    f"{steps}; the script stopped there")
        return {"kind": "signal", "type": name, "message": "", "raised_at": None,
                "script_line": None, "steps_seen": steps_seen,
                "during": "script" if what_if_stopped is None else "what_if",
                "text": f"{text}; this report covers what was measured until then"}
    frames = _user_frames(exc)
    libraries = tuple({sysconfig.get_paths()[k] + os.sep for k in
                       ("stdlib", "platstdlib", "purelib", "platlib")})
    own = [f for f in frames if not f.filename.startswith(libraries)]
    raised = frames[-1] if frames else None
    line = own[-1] if own and own[-1] is not raised else None
    where = "" if raised is None else f" (raised at {raised.filename}:{raised.lineno}" + (
        f", from {line.filename}:{line.lineno})" if line else ")")
    message = str(exc)
    lines = [m for m in message.splitlines() if m.strip()]
    return {"kind": "exception", "type": type(exc).__name__, "message": message,
            "raised_at": raised and f"{raised.filename}:{raised.lineno}",
            "script_line": line and f"{line.filename}:{line.lineno}",
            "steps_seen": steps_seen, "during": "script",
            "text": f"{type(exc).__name__}" + (f": {lines[0]}" if lines else "")
                    + (" ..." if len(lines) > 1 else "") + f"{where} {steps}"}


def _process_age():
    """Seconds since this process started (Linux: /proc), or None where unknown."""
    try:
        with open("/proc/self/stat") as f:
            started = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - started / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def _framework_import():
    """Imports Keras (and TensorFlow quietly, on its backend): the script's own
    import, made before it runs. Returns whether TensorFlow's log lines were hidden."""
    quiet = backend_name() == "tensorflow" and import_tensorflow_quietly()
    import keras  # noqa: F401

    return quiet


def _exit_code(code):
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _jsonable(value):
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, (str, int, bool)):
        return value
    if hasattr(value, "item"):  # NumPy scalars
        return _jsonable(value.item())
    return str(value)


def run_diagnosis(command, steps=None, log_dir=None, trace="auto", what_if=True, verbose=1,
                  what_if_budget=None, sources=None, rounds=None):
    """Runs a training script with the monitors attached; returns the diagnosis.

    Args:
        command: `["python", "train.py", *args]`, `["train.py", *args]`,
            `["-m", "package.module", *args]` or `["python", "-c", code, *args]`
            (the code is saved as `log_dir/command.py` and run from there).
        steps: the script's training steps, fits' and custom loops' in all:
            a fit runs the steps left, a loop's iterator ends after the
            last, and where the script then asks to train again (a `fit`,
            a train step, the next epoch of a dataset it trained on) it
            ends there with exit code 0. Defaults to None (the script's
            own length).
        log_dir: where the TensorBoard scalars and profiler traces of
            each run go (`fit_1/`, `loop_2/`, ...). Defaults to a new folder
            under the system temp dir.
        trace: take XProf traces (ProfilerTrigger): True (the user asked
            for them: their seconds are listed aside of diagnose's bound),
            False (none) or `"auto"`, where one answers what the step log
            cannot (`analysis.trace_question`: on a GPU). Defaults to
            `"auto"`.
        what_if: after each run, measure the input alone and the step
            alone (`what_if.py`, a few seconds). Defaults to True.
        verbose: the monitors print their events (1) or not (0).
        what_if_budget: seconds each run's what-if may take in all (the
            input drain, the replay and its retries, the stages). Defaults
            to None: `analysis.what_if_budget` (a minute, or a tenth of the
            run where that is longer).
        sources: `{path: text}`: the script's files to run from that text (a patch
            applied in memory: `patched_run`, which runs the eager step's patch
            before it is offered). Defaults to None: the files as they are.
        rounds: the most rounds of the reruns that measure a fix (the script as it
            is and with the fix, alternated: `patched_run.run_pairs`). Defaults to
            None: `analysis.comparison.MAX_ROUNDS`.

    Returns:
        A JSON-ready dict: `command`, `exit_code` (the script's: 1 when it
        raised, 128 + the signal's number when SIGTERM or SIGINT stopped
        it), `ended_by` (None, or what stopped the script early: `kind`
        `exception` or `signal`, `type`, `message`, `raised_at` and
        `script_line` as file:line, `steps_seen`, `during` (`what_if`
        when a signal stopped a run's what-if, not its training), `text`),
        `stopped` (None, or how `--steps` ended the run: `steps`,
        `steps_run`, `how` (`asked_again`: the script asked to train again
        and ended there; `own_next`: its loop's own `next()` call ended it;
        `ran_on`: it ran on to its own end), `where` (file:line) and
        `text`, "stopped by --steps after N steps; ..."), `verdict`,
        `evidence` (of the verdict), `ranking`, `fixes` (ranked, each with
        its `predicted` effect: where diagnose ran the script again with the fix
        applied, `source` `patched-run` or `skipped-run`), `together` (None, or the
        fixes it ran, run together: `speedup`, `speedup_range`, `steps_per_s`,
        `text`), `seen_in_code` (static findings of no
        measured cause: not ranked, one entry per verdict), `not_offered`
        (static findings the run rules out, with the reason: their line never
        ran, or the measurement contradicts them), `scan` (each finding's
        `ran`: whether its line ran, None when not known),
        `environment`, `own_cost` (what diagnose added beyond the script,
        item by item, against its bound: `analysis.own_cost`; the CLI adds
        the writing of the record to its `report` item), `fits` (one per
        `fit` or custom loop: the monitors' reports; a fit's `steps_run`), `what_if` (of the longest run: `input_batches_per_s`,
        `step_batches_per_s`, `speedup_if_input_free`, `speedup_range`, `known`,
        `budget_s`, `spent_s`, `cut_short`, ...), `traces`
        (XProf evidence), `log_dir`, `notes`.

    Raises:
        ValueError: when the command names no script that exists.
    """
    if steps is not None and steps < 1:
        raise ValueError(f"`steps` must be >= 1. Received: steps={steps}")
    if rounds is not None and rounds < 1:
        raise ValueError(f"`rounds` must be >= 1. Received: rounds={rounds}")
    t_in, age = time.perf_counter(), _process_age()
    kind, target, argv = script_env.resolve(command)
    log_dir = log_dir or tempfile.mkdtemp(prefix="keras_gpufix_diagnose_")
    notes = []
    if kind == "code":  # saved as a file: tracebacks and the scan name its lines
        os.makedirs(log_dir, exist_ok=True)
        code, target = target, os.path.join(log_dir, "command.py")
        with open(target, "w", encoding="utf-8") as f:
            f.write(code)
        notes.append(f"the -c code was saved as {target}: the lines below refer to it")
    script = target if kind == "code" else argv[0]
    t0 = time.perf_counter()
    scan = scan_script(script)
    scan_s = time.perf_counter() - t0
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    sys.argv = list(argv)
    if kind != "module":
        sys.path.insert(0, os.getcwd() if kind == "code" else os.path.dirname(target))
    exit_code = 0
    ended = stop = None
    script_env.apply(script)  # the CLI did it before NumPy; an API caller gets it here
    # TensorFlow's log lines would bury the report; no TensorFlow on another backend
    t0 = time.perf_counter()
    quiet = _framework_import()
    framework_s = time.perf_counter() - t0
    with warnings.catch_warnings():
        warnings.simplefilter("default", GpufixWarning)
        with LinesRun(scan, sources) as lines_run, \
                FitPatch(steps=steps, log_dir=log_dir, trace=trace, what_if=what_if,
                         verbose=verbose, what_if_budget=what_if_budget) as patch, \
                _signals_end_the_script(patch):
            try:
                with LoopPatch(patch) as loops:  # its exit measures the loop's what-if
                    try:
                        patch.own["scan"] = scan_s
                        patch.own["start-up"] = ((age or 0.0) + time.perf_counter() - t_in
                                                 - scan_s - framework_s)
                        if kind == "module":
                            runpy.run_module(target, run_name="__main__", alter_sys=True)
                        elif not lines_run.run_main(target):
                            runpy.run_path(target, run_name="__main__")
                    except SystemExit as exc:
                        exit_code = _exit_code(exc.code)
                    except BaseException as exc:
                        if isinstance(exc, (KeyboardInterrupt, Terminated)):
                            patch.what_if = False  # nothing more is measured
                            raise
                        if isinstance(exc, (StepsEnded, StepsReached)) or isinstance(
                                exc.__cause__, StepsReached):
                            stop = exc
                        else:
                            traceback.print_exc()
                            ended = exc
                            exit_code = 1
                    finally:
                        sys.argv, sys.path[:] = saved_argv, saved_path
                        with contextlib.suppress(Exception):
                            sys.stdout.flush()
                            sys.stderr.flush()
            except (KeyboardInterrupt, Terminated) as exc:  # in the script or a what-if
                patch.what_if = False
                ended = exc
                exit_code = 128 + getattr(exc, "signum", 2)
    t_report = time.perf_counter()
    for finding in scan:  # a line the run never executed is no cause of it
        finding["ran"] = lines_run.status(finding)
    if ended is not None:
        seen = sum(f.get("steps_run") or 0 for f in patch.fits) + loops.step_calls
        ended = _ended_by(ended, seen, patch.what_if_stopped)
    verdict, ranking, fixes = rank_causes(patch.fits, scan)
    attach_patches(fixes, patch.fits, scan, log_dir)
    traces = trace_evidence(patch.fits)
    evidence = list(ranking[0]["evidence"]) if ranking else []
    if not is_cause(verdict):  # the evidence that the run is healthy, or what was seen
        evidence = healthy_evidence(patch.fits, loops.seen())
    if ended is not None and verdict == "unknown":  # not "the script ran": it stopped
        evidence = [{"source": "diagnose", "figure": "steps", "value": ended["steps_seen"],
                     "text": f"nothing to judge: the script stopped after {ended['steps_seen']} "
                             "training steps (ended by, above)"}]
    evidence += [t for t in traces if t not in evidence]
    env = environment()
    patch.own["report"] = time.perf_counter() - t_report
    result = _jsonable({
        "command": list(command),
        "exit_code": exit_code,
        "ended_by": ended,
        "stopped": _stopped(steps, patch.steps_done, stop),
        "verdict": verdict,
        "evidence": evidence,
        "ranking": ranking,
        "fixes": fixes,
        "together": None,
        "seen_in_code": seen_in_code(patch.fits, scan, fixes),
        "not_offered": not_offered(patch.fits, scan),
        "scan": scan,
        "environment": env,
        "fits": patch.fits,
        "what_if": main_what_if(patch.fits),
        "traces": traces,
        "log_dir": log_dir,
        "notes": notes + patch.notes + ([_QUIET_NOTE] if quiet else []),
    })
    if what_if:  # the fixes diagnose can apply in memory, run before they are offered
        from keras_gpufix.diagnose.patched_run import check_fixes  # its own __main__

        try:
            patch.own["patched run"] = check_fixes(result, steps, log_dir, rounds=rounds)
        except Exception as exc:  # noqa: BLE001 - the report comes first
            result["notes"].append(f"the patched run could not be judged ({type(exc).__name__}: "
                                   f"{exc}): the predictions are the first run's")
    result["own_cost"] = _jsonable(own_cost(patch.own, (age or 0.0) + time.perf_counter() - t_in,
                                            opted_in_trace=trace is True))
    return result
