"""`keras-gpufix diagnose`: run an unchanged training script and say why it is slow.

Like `python -m cProfile train.py`, the script runs in this process as
`__main__` with its own `sys.argv`. While it runs, `keras.Model.fit` is
patched so that every `fit` gets, beside the user's own callbacks:

| callback                | what it contributes                                  |
|-------------------------|------------------------------------------------------|
| `GPUOscillationMonitor` | step times (its `StepTimer`), input wait, events     |
| `RetracingMonitor`      | train-step traces, new input shapes, recompile cost  |
| `ProfilerTrigger`       | an XProf trace (at a fixed step and on oscillation), |
|                         | analysed headless: input %, classification, conclusion|

A `tf.data.Dataset` passed as `x` goes through `kg.data.instrument` (unless
it already did), so the input wait is measured. `steps=N` stops each `fit`
after N steps. The script is also scanned statically (`scan_script`) for
known traps, and the environment is recorded (`environment`).

`run_diagnosis` returns one dict; `verdict` is the cause that cost the most
measured time (`rank_causes`), `healthy` when none did. Every figure in it
was measured in this run.
"""

import ast
import contextlib
import functools
import gc
import importlib.util
import math
import os
import platform
import runpy
import sys
import tempfile
import time
import traceback
import warnings

from keras_gpufix import __version__
from keras_gpufix.analysis import FIXES
from keras_gpufix.exceptions import GpufixWarning

__all__ = [
    "run_diagnosis",
    "scan_script",
    "environment",
    "rank_causes",
    "format_report",
    "TRAPS",
]

# Static traps: id -> (related verdict, why, fix).
TRAPS = {
    "py_function_in_map": (
        "input_bound",
        "`tf.py_function`/`tf.numpy_function` inside `Dataset.map` runs Python per "
        "element under the GIL: the map cannot run in parallel",
        "compute features with TF ops (kg.data.log_mel) or once into a feature cache "
        "(kg.data.SpeechDatasetBuilder(cache_dir=...))",
    ),
    "python_generator": (
        "input_bound",
        "a Python generator feeds the model: every batch is produced by Python, one at a "
        "time, with no parallelism or prefetch",
        "build a tf.data pipeline (kg.data.SpeechDatasetBuilder, or "
        "Dataset.from_tensor_slices + map(num_parallel_calls=AUTOTUNE) + prefetch)",
    ),
    "no_prefetch": (
        "input_bound",
        "the tf.data pipeline has no `prefetch`: the next batch is prepared only after "
        "the step that needs it asked for it",
        "end the pipeline with `.prefetch(tf.data.AUTOTUNE)`",
    ),
    "run_eagerly": (
        "dispatch_bound",
        "`run_eagerly=True` runs every op from Python: no graph, no XLA",
        "remove run_eagerly=True (use it only to debug)",
    ),
    "jit_compile_false": (
        "healthy",
        "`jit_compile=False` turns XLA off: no op fusion",
        "kg.compile_model(model, ..., jit_compile=True) (with bucketed shapes)",
    ),
    "numpy_in_loop": (
        "dispatch_bound",
        "`.numpy()` inside a loop copies to the host and waits for the device at every "
        "iteration",
        "keep values as tensors inside the loop; convert once after it",
    ),
}

_PY_FUNCS = {"py_function", "numpy_function", "py_func", "eager_py_func"}


# ------------------------------------------------------------ static scan ---

def _attr(node):
    """The called name of a Call (`tf.data.Dataset.map` -> "map")."""
    func = node.func
    if isinstance(func, ast.Attribute):
        return func.attr
    if isinstance(func, ast.Name):
        return func.id
    return None


def _calls(node):
    return [n for n in ast.walk(node) if isinstance(n, ast.Call)]


def _const(node, value):
    return isinstance(node, ast.Constant) and node.value is value


def _own_body_nodes(func):
    """Nodes of a function, without those of nested functions."""
    stack = list(func.body)
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            stack.extend(ast.iter_child_nodes(node))


class _Scanner(ast.NodeVisitor):
    def __init__(self, tree):
        self.findings = []
        self.loops = 0
        funcs = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        self.py_defs = {f.name: next(c.lineno for c in _calls(f) if _attr(c) in _PY_FUNCS)
                        for f in funcs if any(_attr(c) in _PY_FUNCS for c in _calls(f))}
        self.generators = {f.name for f in funcs
                           if any(isinstance(n, (ast.Yield, ast.YieldFrom)) for n in _own_body_nodes(f))}
        self.gen_vars = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and self._is_generator(node.value):
                self.gen_vars.update(t.id for t in node.targets if isinstance(t, ast.Name))
        calls = _calls(tree)
        self.batch_calls = [c for c in calls if _attr(c) in ("batch", "padded_batch")
                            and isinstance(c.func, ast.Attribute)]
        self.has_prefetch = any(_attr(c) in ("prefetch", "prefetch_to_device") for c in calls)
        self.uses_tf_data = any(_attr(c) in ("from_tensor_slices", "from_tensors", "from_generator",
                                             "TFRecordDataset", "TextLineDataset", "list_files",
                                             "range", "zip") and isinstance(c.func, ast.Attribute)
                                for c in calls)

    def _is_generator(self, node):
        return isinstance(node, ast.GeneratorExp) or (
            isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id in self.generators)

    def add(self, trap, node, detail=""):
        self.findings.append({"trap": trap, "line": node.lineno, "detail": detail})

    def _loop(self, node):
        self.loops += 1
        self.generic_visit(node)
        self.loops -= 1

    visit_For = visit_AsyncFor = visit_While = visit_ListComp = _loop
    visit_SetComp = visit_DictComp = visit_GeneratorExp = _loop

    def _map_uses_py(self, fn):
        if isinstance(fn, ast.Lambda):
            lines = [c.lineno for c in _calls(fn) if _attr(c) in _PY_FUNCS]
            if lines:
                return lines[0]
            names = [c.func.id for c in _calls(fn) if isinstance(c.func, ast.Name)]
            return next((self.py_defs[n] for n in names if n in self.py_defs), None)
        if isinstance(fn, ast.Name):
            return self.py_defs.get(fn.id)
        if isinstance(fn, ast.Attribute):
            return self.py_defs.get(fn.attr)
        if isinstance(fn, ast.Call):  # functools.partial(f, ...)
            return next((self._map_uses_py(a) for a in fn.args if self._map_uses_py(a)), None)
        return None

    def visit_Call(self, node):
        name = _attr(node)
        kwargs = {k.arg: k.value for k in node.keywords if k.arg}
        if name == "map" and isinstance(node.func, ast.Attribute):
            fn = node.args[0] if node.args else kwargs.get("map_func")
            line = self._map_uses_py(fn) if fn is not None else None
            if line is not None:
                self.add("py_function_in_map", node, f"the py_function call is at line {line}")
        if name == "from_generator":
            self.add("python_generator", node, "Dataset.from_generator")
        if "run_eagerly" in kwargs and _const(kwargs["run_eagerly"], True):
            self.add("run_eagerly", node)
        if name == "run_functions_eagerly" and node.args and _const(node.args[0], True):
            self.add("run_eagerly", node, "tf.config.run_functions_eagerly(True)")
        if "jit_compile" in kwargs and _const(kwargs["jit_compile"], False):
            self.add("jit_compile_false", node)
        if name == "numpy" and not node.args and self.loops:
            self.add("numpy_in_loop", node)
        if name == "fit" and isinstance(node.func, ast.Attribute):
            x = node.args[0] if node.args else kwargs.get("x")
            if x is not None and (self._is_generator(x) or (
                    isinstance(x, ast.Name) and x.id in self.gen_vars)):
                self.add("python_generator", node, "a Python generator passed to fit")
        self.generic_visit(node)

    def visit_Assign(self, node):
        if _const(node.value, True) and any(
                isinstance(t, ast.Attribute) and t.attr == "run_eagerly" for t in node.targets):
            self.add("run_eagerly", node)
        self.generic_visit(node)


def scan_script(path):
    """Finds known input-pipeline and compile traps in a Python file.

    Args:
        path: the script.

    Returns:
        A list of findings sorted by line, each a dict with `trap` (a key
        of `TRAPS`), `file`, `line`, `code` (the source line), `detail`,
        `why`, `fix` and `verdict` (the measured cause it would produce).
        A file that is not valid Python gives one finding with trap
        `syntax_error`.
    """
    path = os.fspath(path)
    with open(path, encoding="utf-8", errors="replace") as f:
        source = f.read()
    lines = source.splitlines()
    try:
        tree = ast.parse(source, filename=path)
    except SyntaxError as exc:
        return [{"trap": "syntax_error", "file": path, "line": exc.lineno, "code": "",
                 "detail": str(exc.msg), "why": "the script does not parse", "fix": "",
                 "verdict": None}]
    scanner = _Scanner(tree)
    scanner.visit(tree)
    if scanner.uses_tf_data and scanner.batch_calls and not scanner.has_prefetch:
        scanner.add("no_prefetch", scanner.batch_calls[-1], "no .prefetch( in the script")
    out, seen = [], set()
    for f in sorted(scanner.findings, key=lambda f: (f["line"], f["trap"])):
        if (f["trap"], f["line"]) in seen:
            continue
        seen.add((f["trap"], f["line"]))
        verdict, why, fix = TRAPS[f["trap"]]
        code = lines[f["line"] - 1].strip() if 0 < f["line"] <= len(lines) else ""
        out.append({**f, "file": path, "code": code, "why": why, "fix": fix,
                    "verdict": verdict})
    return out


# ------------------------------------------------------------ environment ---

def environment():
    """TensorFlow/Keras versions, devices, XLA, NVML and CPUs, as a dict."""
    import keras
    import tensorflow as tf

    from keras_gpufix.compile import device_info
    from keras_gpufix.nvml import nvml_status

    build = dict(tf.sysconfig.get_build_info())
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = None
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "keras_backend": keras.backend.backend(),
        "keras_gpufix": __version__,
        "cpu_count": os.cpu_count(),
        "cpus_usable": affinity,
        "devices": [d.name for d in tf.config.list_physical_devices()],
        "gpus": device_info()["gpus"],
        "cuda_build": bool(build.get("is_cuda_build")),
        "cuda_version": build.get("cuda_version"),
        "cudnn_version": build.get("cudnn_version"),
        "xla": {"built_with_xla": bool(tf.test.is_built_with_xla()),
                "TF_XLA_FLAGS": os.environ.get("TF_XLA_FLAGS")},
        "nvml": nvml_status(),
        "dtype_policy": keras.mixed_precision.global_policy().name,
    }


# ---------------------------------------------------------------- fit patch ---

def _instrumented(dataset, depth=64):
    """Whether `dataset` or one of its inputs went through kg.data.instrument."""
    for _ in range(depth):
        if dataset is None:
            return False
        if getattr(dataset, "input_probe", None) is not None:
            return True
        dataset = getattr(dataset, "_input_dataset", None)
    return False


def _monitor_window(total_steps, warmup):
    """A detector window that can judge twice within `total_steps`."""
    if not total_steps:
        return 96
    return int(max(8, min(96, (total_steps - warmup - 2) / 1.5)))


def _stop_after(steps):
    """A callback that stops `fit` after `steps` steps (counting steps_per_execution)."""
    import keras

    class StopAfter(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.seen, self.stopped, self._first = 0, False, 0

        def on_train_begin(self, logs=None):
            self.seen, self.stopped = 0, False

        def on_train_batch_begin(self, batch, logs=None):
            self._first = batch

        def on_train_batch_end(self, batch, logs=None):
            self.seen += max(1, batch - self._first + 1)
            if self.seen >= steps:
                self.model.stop_training = True
                self.stopped = True

    return StopAfter()


class FitPatch:
    """Context manager: every `keras.Model.fit` gets the diagnostic callbacks."""

    def __init__(self, steps=None, log_dir=None, trace=True, verbose=1):
        self.steps = steps
        self.log_dir = log_dir
        self.trace = trace
        self.verbose = verbose
        self.fits = []
        self.notes = []
        self._depth = 0

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
        return self

    def __exit__(self, *exc):
        if self._had_own:
            self._cls.fit = self._original
        else:
            del self._cls.fit
        return False

    def _note(self, message):
        if message not in self.notes:
            self.notes.append(message)
            warnings.warn(f"keras-gpufix diagnose: {message}", GpufixWarning, stacklevel=3)

    def _prepare(self, original, model, args, kwargs):
        """(bound arguments, our callbacks) for one fit."""
        import inspect

        import tensorflow as tf

        import keras_gpufix as kg

        bound = inspect.signature(original).bind(model, *args, **kwargs)
        arguments = bound.arguments
        x = arguments.get("x")
        dataset = isinstance(x, tf.data.Dataset)
        if dataset and not _instrumented(x):
            arguments["x"] = kg.data.instrument(x)
        epochs = arguments.get("epochs", 1)
        per_epoch = arguments.get("steps_per_epoch")
        if per_epoch is None and dataset:
            card = int(x.cardinality())
            per_epoch = card if card > 0 else None
        total = self.steps or (per_epoch * epochs if per_epoch else None)
        if self.steps and per_epoch:
            total = min(self.steps, per_epoch * epochs)
        user = list(arguments.get("callbacks") or [])
        mine = {}
        warmup = 5
        verbose = self.verbose
        classes = {"monitor": "GPUOscillationMonitor", "retracing": "RetracingMonitor",
                   "profiler": "ProfilerTrigger"}
        for key, name in classes.items():
            try:
                cls = getattr(kg, name)
            except (ImportError, AttributeError) as exc:
                self._note(f"{name} is not available ({exc}); its evidence is missing")
                continue
            existing = [cb for cb in user if isinstance(cb, cls)]
            if existing:
                mine[key] = existing[0]
                continue
            if key == "monitor":
                mine[key] = cls(window=_monitor_window(total, warmup), warmup=warmup,
                                verbose=verbose)
            elif key == "retracing":
                mine[key] = cls()
            elif self.trace:
                at = min(10, max(warmup, (total or 30) // 3))
                steps = max(2, min(10, ((total or 30) - at) // 2))
                mine[key] = cls(os.path.join(self.log_dir, f"fit_{len(self.fits) + 1}"),
                                trigger=["oscillation", at], steps=steps, max_traces=2,
                                verbose=verbose)
        ours = [cb for cb in mine.values() if not any(cb is u for u in user)]
        stop = _stop_after(self.steps) if self.steps else None
        arguments["callbacks"] = user + ours + ([stop] if stop else [])
        info = {"x": type(x).__name__, "instrumented": dataset, "epochs": epochs,
                "steps_per_epoch": per_epoch}
        return bound, mine, stop, info

    def _fit(self, original, model, args, kwargs):
        try:
            bound, mine, stop, info = self._prepare(original, model, args, kwargs)
        except Exception as exc:  # never break the user's fit
            self._note(f"could not attach the monitors ({type(exc).__name__}: {exc}); "
                       "this fit ran without them")
            return original(model, *args, **kwargs)
        entry = {"index": len(self.fits) + 1, **info}
        self.fits.append(entry)
        t0 = time.perf_counter()
        try:
            return original(*bound.args, **bound.kwargs)
        except BaseException as exc:
            entry["error"] = f"{type(exc).__name__}: {exc}"
            raise
        finally:
            entry["wall_s"] = time.perf_counter() - t0
            entry["stopped_by_diagnose"] = bool(stop and stop.stopped)
            entry["model"] = {
                "name": model.name,
                "jit_compile": getattr(model, "jit_compile", None),
                "run_eagerly": getattr(model, "run_eagerly", None),
                "steps_per_execution": getattr(model, "steps_per_execution", None),
            }
            for key, cb in mine.items():
                try:
                    entry[key] = cb.report()
                except Exception as exc:
                    entry[key] = {"error": f"{type(exc).__name__}: {exc}"}
            entry["steps"] = (entry.get("monitor") or {}).get("step_time", {}).get("count")
            # A fit stopped early leaves its epoch iterator in a reference
            # cycle; freed only at interpreter exit, an iterator with a
            # py_function in flight deadlocks there (TF 2.21). Free it now.
            gc.collect()


# ----------------------------------------------------------------- verdict ---

def _pct(x):
    return f"{x:.0%}"


def _fit_causes(fit):
    """(verdict, score, evidence list) candidates measured in one fit."""
    out = []
    monitor = fit.get("monitor") or {}
    st = monitor.get("step_time") or {}
    label = f"fit {fit['index']}"
    wait = monitor.get("input_wait")
    if wait is not None and wait >= 0.2:
        out.append(("input_bound", wait, [{
            "source": "GPUOscillationMonitor", "figure": "input_wait", "value": wait,
            "text": f"{label}: {_pct(wait)} of step time spent waiting for the next batch "
                    f"({st.get('count')} steps, median {st.get('p50_ms', 0):.1f} ms, "
                    f"p95 {st.get('p95_ms', 0):.1f} ms)"}]))
    retr = fit.get("retracing") or {}
    if retr.get("verdict") == "recompiling":
        share = retr.get("recompile_share") or 0.0
        out.append(("recompiling", share, [{
            "source": "RetracingMonitor", "figure": "recompile_share", "value": share,
            "text": f"{label}: {retr.get('new_shapes')} distinct input shapes, "
                    f"{retr.get('recompile_ms') or 0:.0f} ms spent at new shapes "
                    f"({_pct(share)} of the fit's wall time, median step "
                    f"{retr.get('median_step_ms') or 0:.1f} ms), "
                    f"{retr.get('trace_count')} train-step traces"}]))
    for event in monitor.get("events") or []:
        verdict = event["verdict"]
        if verdict == "healthy" or verdict in ("input_bound", "recompiling") and any(
                c[0] == verdict for c in out):
            continue
        ev = event.get("evidence") or {}
        score = ev.get("slow_time_share") or ev.get("input_wait") or 0.1
        out.append((verdict, score, [{
            "source": "GPUOscillationMonitor", "figure": "event", "value": score,
            "text": f"{label}: {event['message']}"}]))
    for trace in (fit.get("profiler") or {}).get("traces", []):
        a = trace.get("analysis") or {}
        if a.get("classification") == "highly_input_bound":
            out.append(("input_bound", (a.get("input_percent") or 0) / 100,
                        [_trace_item(fit, trace)]))
    return out


def _trace_item(fit, trace):
    a = trace["analysis"]
    return {"source": "XProf", "figure": "input_percent", "value": a.get("input_percent"),
            "text": f"fit {fit['index']}: XProf trace of steps {trace['start_step']}-"
                    f"{trace['end_step']} ({trace.get('reason')}): step "
                    f"{a.get('step_time_ms') or 0:.1f} ms, {a.get('input_percent') or 0:.1f}% "
                    f"input, {a['classification']}. XProf: {a.get('conclusion', '')}",
            "path": trace.get("path")}


def _trace_evidence(fits):
    return [_trace_item(fit, trace) for fit in fits
            for trace in (fit.get("profiler") or {}).get("traces", [])
            if "classification" in (trace.get("analysis") or {})]


def rank_causes(fits, scan=()):
    """Ranks the measured causes; returns (verdict, ranking, fixes).

    A cause is ranked by the share of time it measurably cost (input wait,
    recompile time, time lost to slow steps); static findings never make a
    verdict, they point at the lines to change for it.

    Returns:
        `verdict` (`healthy` when no cause was measured), `ranking` (list
        of dicts `verdict`, `score`, `evidence`, `fix`, best first) and
        `fixes` (ranked list of dicts `rank`, `verdict`, `fix`, `where`:
        `file:line` of the matching scan findings).
    """
    merged = {}
    for fit in fits:
        for verdict, score, evidence in _fit_causes(fit):
            slot = merged.setdefault(verdict, {"verdict": verdict, "score": 0.0, "evidence": []})
            slot["score"] = max(slot["score"], float(score))
            slot["evidence"].extend(evidence)
    ranking = sorted(merged.values(), key=lambda c: -c["score"])
    for cause in ranking:
        period = next((e.get("period") for f in fits
                       for e in (f.get("monitor") or {}).get("events", [])
                       if e["verdict"] == cause["verdict"]), None)
        cause["fix"] = FIXES.get(cause["verdict"], "").format(period=period)
    verdict = ranking[0]["verdict"] if ranking else "healthy"
    fixes, used = [], set()
    for cause in ranking:
        where = [f for f in scan if f.get("verdict") == cause["verdict"]]
        used.update(id(f) for f in where)
        fixes.append({"verdict": cause["verdict"], "fix": cause["fix"],
                      "where": [f"{f['file']}:{f['line']}: {f['why']}; {f['fix']}" for f in where]})
    for f in scan:
        if id(f) not in used and f.get("verdict") is not None:
            fixes.append({"verdict": f["verdict"], "fix": f["fix"],
                          "where": [f"{f['file']}:{f['line']}: {f['why']}"]})
    for rank, fix in enumerate(fixes, start=1):
        fix["rank"] = rank
    return verdict, ranking, fixes


# -------------------------------------------------------------- the runner ---

def _resolve(command):
    """(kind, target, argv) for `python train.py ARGS`, `train.py ARGS` or `-m mod ARGS`."""
    command = list(command)
    if command and os.path.basename(command[0]).startswith("python") and (
            len(command) == 1 or not command[0].endswith(".py")):
        command = command[1:]
    if not command:
        raise ValueError("no script given: use `keras-gpufix diagnose -- python train.py ARGS`")
    if command[0] == "-m":
        if len(command) < 2:
            raise ValueError("`-m` needs a module name")
        spec = importlib.util.find_spec(command[1])
        if spec is None or spec.origin is None:
            raise ValueError(f"no module named {command[1]!r}")
        return "module", command[1], [spec.origin, *command[2:]]
    if not os.path.isfile(command[0]):
        raise ValueError(f"script not found: {command[0]}")
    return "script", os.path.abspath(command[0]), command


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


def run_diagnosis(command, steps=None, log_dir=None, trace=True, verbose=1):
    """Runs a training script with the monitors attached; returns the diagnosis.

    Args:
        command: `["python", "train.py", *args]`, `["train.py", *args]` or
            `["-m", "package.module", *args]`.
        steps: stop every `fit` after this many steps. Defaults to None
            (the script's own length).
        log_dir: where profiler traces go. Defaults to a new folder under
            the system temp dir.
        trace: take XProf traces (ProfilerTrigger). Defaults to True.
        verbose: the monitors print their events (1) or not (0).

    Returns:
        A JSON-ready dict: `command`, `exit_code` (the script's),
        `verdict`, `evidence` (of the verdict), `ranking`, `fixes`
        (ranked), `scan`, `environment`, `fits` (one per `fit`: the
        monitors' reports), `traces` (XProf evidence), `log_dir`, `notes`.

    Raises:
        ValueError: when the command names no script that exists.
    """
    if steps is not None and steps < 1:
        raise ValueError(f"`steps` must be >= 1. Received: steps={steps}")
    kind, target, argv = _resolve(command)
    script = argv[0]
    scan = scan_script(script)
    log_dir = log_dir or tempfile.mkdtemp(prefix="keras_gpufix_diagnose_")
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    sys.argv = list(argv)
    if kind == "script":
        sys.path.insert(0, os.path.dirname(target))
    exit_code = 0
    with warnings.catch_warnings():
        warnings.simplefilter("default", GpufixWarning)
        with FitPatch(steps=steps, log_dir=log_dir, trace=trace, verbose=verbose) as patch:
            try:
                if kind == "module":
                    runpy.run_module(target, run_name="__main__", alter_sys=True)
                else:
                    runpy.run_path(target, run_name="__main__")
            except SystemExit as exc:
                exit_code = _exit_code(exc.code)
            except KeyboardInterrupt:
                traceback.print_exc()
                exit_code = 130
            except BaseException:
                traceback.print_exc()
                exit_code = 1
            finally:
                sys.argv, sys.path[:] = saved_argv, saved_path
                with contextlib.suppress(Exception):
                    sys.stdout.flush()
                    sys.stderr.flush()
    verdict, ranking, fixes = rank_causes(patch.fits, scan)
    traces = _trace_evidence(patch.fits)
    evidence = list(ranking[0]["evidence"]) if ranking else []
    if verdict == "healthy":
        evidence = _healthy_evidence(patch.fits)
    evidence += [t for t in traces if t not in evidence]
    return _jsonable({
        "command": list(command),
        "exit_code": exit_code,
        "verdict": verdict,
        "evidence": evidence,
        "ranking": ranking,
        "fixes": fixes,
        "scan": scan,
        "environment": environment(),
        "fits": patch.fits,
        "traces": traces,
        "log_dir": log_dir,
        "notes": patch.notes,
    })


def _healthy_evidence(fits):
    out = []
    for fit in fits:
        monitor = fit.get("monitor") or {}
        st = monitor.get("step_time") or {}
        if not st.get("count"):
            continue
        wait = monitor.get("input_wait")
        retr = fit.get("retracing") or {}
        out.append({"source": "GPUOscillationMonitor", "figure": "step_time",
                    "value": st.get("p50_ms"),
                    "text": f"fit {fit['index']}: {st['count']} steps, median "
                            f"{st['p50_ms']:.1f} ms, p95 {st['p95_ms']:.1f} ms, cv {st['cv']:.2f}"
                            + ("" if wait is None else f", input wait {_pct(wait)}")
                            + (f", {retr['trace_count']} train-step traces"
                               if retr.get("trace_count") is not None else "")
                            + "; no cause measured: the steps are compute-bound"})
    return out


def format_report(result):
    """The diagnosis as text for people."""
    lines = [f"keras-gpufix diagnose: {' '.join(result['command'])} "
             f"(exit code {result['exit_code']})",
             f"verdict: {result['verdict']}"]
    if result["evidence"]:
        lines.append("evidence:")
        lines += [f"  - {e['text']}" for e in result["evidence"]]
    if result["fixes"]:
        lines.append("fixes (ranked):")
        for fix in result["fixes"]:
            lines.append(f"  {fix['rank']}. [{fix['verdict']}] {fix['fix']}")
            lines += [f"     {w}" for w in fix["where"]]
    lines.append(f"static scan: {len(result['scan'])} finding(s)")
    lines += [f"  {f['file']}:{f['line']}: {f['trap']}: {f['code']}" for f in result["scan"]]
    env = result["environment"]
    gpus = ", ".join(g["name"] for g in env["gpus"]) or "none"
    nvml = "available" if env["nvml"]["available"] else f"unavailable ({env['nvml']['reason']})"
    lines.append(f"environment: TensorFlow {env['tensorflow']}, Keras {env['keras']} "
                 f"({env['keras_backend']}), Python {env['python']}, {env['cpu_count']} CPUs "
                 f"({env['cpus_usable']} usable), GPUs: {gpus}, XLA built: "
                 f"{env['xla']['built_with_xla']}, NVML: {nvml}, policy {env['dtype_policy']}")
    for fit in result["fits"]:
        st = (fit.get("monitor") or {}).get("step_time") or {}
        retr = fit.get("retracing") or {}
        text = f"fit {fit['index']}: {fit.get('steps') or 0} steps timed in {fit.get('wall_s', 0):.1f} s"
        if fit.get("stopped_by_diagnose"):
            text += " (stopped by --steps)"
        if st.get("count"):
            text += f", median {st['p50_ms']:.1f} ms, p95 {st['p95_ms']:.1f} ms"
        if retr.get("trace_count") is not None:
            text += f", {retr['trace_count']} traces, recompile {retr.get('recompile_ms') or 0:.0f} ms"
        if fit.get("error"):
            text += f"; ended by {fit['error']}"
        lines.append(text)
    if result["traces"]:
        lines.append(f"traces under {result['log_dir']}: tensorboard --logdir {result['log_dir']}")
    lines += [f"note: {n}" for n in result["notes"]]
    return "\n".join(lines)
