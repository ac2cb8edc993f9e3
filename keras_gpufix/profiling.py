"""Profiler traces with step markers, and their headless XProf analysis.

Plain functions, usable from a callback (`kg.ProfilerTrigger`), the CLI
(`keras-gpufix diagnose`) or a notebook:

| function                    | what it does                                          |
|-----------------------------|-------------------------------------------------------|
| `start_trace(log_dir)`      | starts the backend's profiler (`tf.profiler`,         |
|                             | `jax.profiler`); `ProfilerBusyError` if another       |
|                             | profiler is running (TensorBoard's `profile_batch`)   |
| `step_marker(step)`         | context manager: one training step as XProf sees it   |
| `stop_trace()`              | stops the trace *we* started; returns its run folder  |
| `active_trace()`            | our running trace (dict) or None                      |
| `xplane_files(path)`        | the `*.xplane.pb` files of a run folder or log dir    |
| `analyze_trace(path)`       | XProf `input_pipeline_analyzer` -> step time, input % |
| `classify_input_percent(p)` | XProf's classification (`analysis.xprof`, its         |
|                             | thresholds in `analysis.THRESHOLDS`)                  |
| `format_analysis(a)`        | the one line we log for a trace                       |
| `tensorboard_command(dir)`  | the command that opens the traces                     |

Step markers: XProf computes step times only from events marked as steps
(`tf.profiler.experimental.Trace(name, step_num=n, _r=1)`). Keras's own
`TensorBoard(profile_batch=...)` marks its batches without `_r=1`, so its
traces report "No step marker observed" (openxla/xprof#571,
tensorflow/tensorflow#66410); traces taken with `step_marker` do not.

Traces land in `log_dir/plugins/profile/<run>/<host>.xplane.pb`, where
`tensorboard --logdir log_dir` (Profile tab) or `xprof --logdir log_dir`
finds them. The profiler names the run after the second the trace stopped;
`stop_trace` renames it `<that time>_<tag>` so two traces stopped within one
second never overwrite each other.
"""

import glob
import json
import os
import re
import shlex
import threading
import time
from typing import Any

from keras_gpufix.analysis import classify_input_percent
from keras_gpufix.backends import NotSupported, current

__all__ = [
    "ProfilerBusyError",
    "start_trace",
    "stop_trace",
    "step_marker",
    "active_trace",
    "xplane_files",
    "analyze_trace",
    "classify_input_percent",
    "format_analysis",
    "tensorboard_command",
]

_LOCK = threading.RLock()  # re-entrant: a finaliser may stop a trace mid-call
_ACTIVE = None  # the trace this module started and has not stopped


class ProfilerBusyError(RuntimeError):
    """Another profiler (not started by `start_trace`) is running."""


def _profile_dir(log_dir):
    return os.path.join(os.fspath(log_dir), "plugins", "profile")


def _runs(log_dir):
    root = _profile_dir(log_dir)
    try:
        return {d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d))}
    except FileNotFoundError:
        return set()


def active_trace() -> "dict | None":
    """Our running trace: a dict (`log_dir`, `owner`, `started`, `tag`) or None."""
    return None if _ACTIVE is None else dict(_ACTIVE)


def start_trace(log_dir: "str | os.PathLike", owner: Any = None, tag: "str | None" = None,
                host_tracer_level: int = 2, python_tracer_level: int = 0,
                device_tracer_level: int = 1) -> None:
    """Starts a trace that `stop_trace` will save under `log_dir`.

    The profiler is the Keras backend's (`backends.current()`):
    `tf.profiler` on TensorFlow, `jax.profiler` on JAX.

    Args:
        log_dir: the TensorBoard log directory; the trace is saved in
            `log_dir/plugins/profile/<run>/`.
        owner: any object, kept in `active_trace()["owner"]` so a caller
            can tell its own trace from another's. Defaults to None.
        tag: suffix of the run folder name (letters, digits, `-`, `_`).
            Defaults to None (`trace`).
        host_tracer_level: host tracing, 1 to 3. Defaults to 2.
        python_tracer_level: 1 traces Python calls (slow). Defaults to 0.
        device_tracer_level: 1 traces the GPU (CUPTI; TensorFlow only, JAX
            always does). Defaults to 1.

    Raises:
        ProfilerBusyError: another profiler is running (a trace of
            `keras.callbacks.TensorBoard(profile_batch=...)`, a profiler
            server session, or a trace of ours not stopped yet).
        backends.NotSupported: the backend has no profiler (torch, numpy).
        Exception: whatever else the profiler raises when it starts.
    """
    global _ACTIVE
    backend = current()
    tag = re.sub(r"[^A-Za-z0-9_-]+", "-", tag or "trace").strip("-") or "trace"
    with _LOCK:
        if _ACTIVE is not None:
            raise ProfilerBusyError(
                f"A keras_gpufix trace into {_ACTIVE['log_dir']} is running.")
        try:
            backend.start_trace(os.fspath(log_dir), host_tracer_level=host_tracer_level,
                                python_tracer_level=python_tracer_level,
                                device_tracer_level=device_tracer_level)
        except NotSupported:
            raise
        except RuntimeError as exc:
            if "another profiler" in str(exc):
                raise ProfilerBusyError(str(exc)) from None
            raise
        _ACTIVE = {"log_dir": os.fspath(log_dir), "owner": owner,
                   "started": time.time(), "tag": tag}


def stop_trace(save: bool = True) -> "str | None":
    """Stops the trace `start_trace` started; never another profiler.

    Args:
        save: write the trace. Defaults to True (`jax.profiler` always
            writes it; with False its folder is left unnamed).

    Returns:
        The run folder holding the trace's `.xplane.pb`, or None (nothing of
        ours was running, or `save=False`).
    """
    global _ACTIVE
    with _LOCK:
        if _ACTIVE is None:
            return None
        trace, _ACTIVE = _ACTIVE, None
        before = _runs(trace["log_dir"])
        if not current().stop_trace(save=save) or not save:
            return None
        return _claim_run(trace["log_dir"], before, trace["tag"])


def _claim_run(log_dir, before, tag):
    """Renames the run folder TensorFlow just wrote to a unique name."""
    root = _profile_dir(log_dir)
    new = sorted(_runs(log_dir) - before)
    if new:
        run = new[-1]
    else:  # TensorFlow wrote into an existing folder of the same second
        candidates = sorted(
            _runs(log_dir),
            key=lambda d: max((os.path.getmtime(p) for p in xplane_files(os.path.join(root, d))),
                              default=0.0),
        )
        if not candidates:
            return None
        run = candidates[-1]
    src = os.path.join(root, run)
    if not new:
        return src
    dst = os.path.join(root, f"{run}_{tag}")
    n = 1
    while os.path.exists(dst):
        n += 1
        dst = os.path.join(root, f"{run}_{tag}_{n}")
    try:
        os.rename(src, dst)
    except OSError:
        return src
    return dst


def step_marker(step: int, name: str = "train"):
    """Marks one training step for XProf: a context manager.

    TensorFlow: `Trace(name, step_num=step, _r=1)`; JAX:
    `jax.profiler.StepTraceAnnotation(name, step_num=step)`. Costs nothing
    measurable when no profiler runs.
    """
    return current().step_marker(step, name)


def xplane_files(path: "str | os.PathLike") -> "list[str]":
    """The `.xplane.pb` files of one trace.

    Args:
        path: an `.xplane.pb` file, a run folder, or a log directory (then
            the most recent run under `plugins/profile/`, searched
            recursively so `log_dir/train/...` of Keras's TensorBoard is
            found too).

    Returns:
        A sorted list of paths (one per host), empty if none.
    """
    path = os.fspath(path)
    if os.path.isfile(path):
        return [path] if path.endswith(".xplane.pb") else []
    direct = sorted(glob.glob(os.path.join(glob.escape(path), "*.xplane.pb")))
    if direct:
        return direct
    found = glob.glob(os.path.join(glob.escape(path), "**", "*.xplane.pb"), recursive=True)
    if not found:
        return []
    latest = max(found, key=os.path.getmtime)
    return sorted(glob.glob(os.path.join(glob.escape(os.path.dirname(latest)), "*.xplane.pb")))


def _float(value):
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _input_pipeline_json(files):
    try:
        from xprof.convert import raw_to_tool_data
    except ImportError:
        try:
            from tensorboard_plugin_profile.convert import raw_to_tool_data
        except ImportError:
            raise ImportError(
                "Trace analysis needs XProf: `pip install xprof` "
                "(or `pip install tensorboard-plugin-profile`)."
            ) from None
    data, _ = raw_to_tool_data.xspace_to_tool_data(files, "input_pipeline_analyzer", {})
    if data is None:
        raise RuntimeError(f"XProf could not convert {files}")
    if isinstance(data, bytes):
        data = data.decode("utf-8")
    return json.loads(data)


def analyze_trace(path: "str | os.PathLike") -> "dict[str, Any]":
    """Runs XProf's `input_pipeline_analyzer` headless on one trace.

    Args:
        path: an `.xplane.pb` file, a run folder or a log directory (see
            `xplane_files`).

    Returns:
        A dict:

        - `step_time_ms`: mean step time over the marked steps (None when
          the trace has no step marker);
        - `input_percent`: mean share of step time waiting for input, in %
          (XProf's figure: input = host wait for input + host-to-device);
        - `classification`: `highly_input_bound`, `moderately_input_bound`,
          `not_input_bound` (None without steps);
        - `conclusion`: XProf's own sentence;
        - `steps`: number of marked steps; `step_time_ms_max`,
          `step_time_ms_min`, `input_ms`: per-step figures;
        - `breakdown_ms`: mean ms per step of each category XProf reports
          (`device_compute`, `host_compute`, `input`, `kernel_launch`,
          `compile`, `output`, `device_to_device`, `device_collectives`,
          `other`);
        - `hardware_type`, `files`, `diagnostics` (XProf's warnings, such
          as "No step marker observed").

    Raises:
        ValueError: no `.xplane.pb` under `path`.
        ImportError: XProf is not installed.
    """
    files = xplane_files(path)
    if not files:
        raise ValueError(f"No .xplane.pb trace found. Received: path={os.fspath(path)!r}")
    tables = _input_pipeline_json(files)
    steps_table = next((t for t in tables if any(c.get("id") == "stepTimeMs"
                                                 for c in t.get("cols", []))), {})
    props = steps_table.get("p", {})
    ids = [c.get("id") for c in steps_table.get("cols", [])]
    rows = [[cell.get("v") if isinstance(cell, dict) else None for cell in r.get("c", [])]
            for r in steps_table.get("rows", [])]

    def column(name):
        if name not in ids:
            return []
        i = ids.index(name)
        return [_float(r[i]) or 0.0 for r in rows if i < len(r)]

    step_ms = column("stepTimeMs")
    input_ms = column("infeedTimeMs")
    input_percent = None
    if step_ms and any(step_ms):
        shares = [100.0 * i / s for i, s in zip(input_ms, step_ms) if s > 0]
        input_percent = sum(shares) / len(shares) if shares else None
    breakdown = {}
    for key, col in (("device_compute", "deviceComputeTimeMs"),
                     ("device_to_device", "deviceToDeviceTimeMs"),
                     ("device_collectives", "deviceCollectivesTimeMs"),
                     ("host_compute", "hostComputeTimeMs"),
                     ("kernel_launch", "kernelLaunchTimeMs"),
                     ("input", "infeedTimeMs"), ("output", "outfeedTimeMs"),
                     ("compile", "compileTimeMs"), ("other", "otherTimeMs")):
        values = column(col)
        if values:
            breakdown[key] = sum(values) / len(values)
    diagnostics = []
    for table in tables:
        if [c.get("id") for c in table.get("cols", [])] == ["severity", "message"]:
            for r in table.get("rows", []):
                cells = [c.get("v") for c in r.get("c", [])]
                if len(cells) == 2:
                    diagnostics.append(f"{cells[0]}: {cells[1]}")
    conclusion = props.get("input_conclusion") or ""
    stated = re.search(r"([0-9.]+)% of the total step time sampled is waiting for input",
                       conclusion)
    if stated and input_percent is not None:
        input_percent = float(stated.group(1))  # XProf's own figure, as worded
    if not step_ms and diagnostics:
        conclusion = f"{conclusion} {diagnostics[0]}".strip()
    return {
        "step_time_ms": sum(step_ms) / len(step_ms) if step_ms else None,
        "input_percent": input_percent,
        "classification": classify_input_percent(input_percent),
        "conclusion": conclusion,
        "steps": len(step_ms),
        "step_time_ms_max": max(step_ms) if step_ms else None,
        "step_time_ms_min": min(step_ms) if step_ms else None,
        "input_ms": sum(input_ms) / len(input_ms) if input_ms else None,
        "breakdown_ms": breakdown,
        "hardware_type": props.get("hardware_type"),
        "files": files,
        "diagnostics": diagnostics,
    }


def tensorboard_command(log_dir: "str | os.PathLike") -> str:
    """The shell command that opens `log_dir`'s traces in TensorBoard."""
    return f"tensorboard --logdir {shlex.quote(os.fspath(log_dir))}"


def format_analysis(analysis: "dict[str, Any]",
                    log_dir: "str | os.PathLike | None" = None) -> str:
    """One line for people: step time, input %, classification, conclusion."""
    if analysis.get("step_time_ms") is None:
        line = f"no step time measured; {analysis.get('conclusion', '')}".strip()
    else:
        line = (f"step time {analysis['step_time_ms']:.1f} ms over {analysis['steps']} steps, "
                f"input {analysis['input_percent']:.1f}% -> {analysis['classification']}; "
                f"{analysis.get('conclusion', '')}")
    if log_dir is not None:
        line += f" Open: {tensorboard_command(log_dir)} (Profile tab)"
    return line

