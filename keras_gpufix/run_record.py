"""RunRecord: a judged run kept as one versioned, bounded JSON file.

Every run that judges steps leaves one `run_record.json` in its log folder:

| written by                                 | where                                   |
|--------------------------------------------|-----------------------------------------|
| `GPUOscillationMonitor(log_dir=...)` in     | `log_dir/keras_gpufix/` (beside its     |
| `fit`, or in `kg.watch(..., callbacks=...)` | TensorBoard scalars), at the end of the |
|                                            | run, and when SIGTERM or SIGINT stops it |
| `keras-gpufix diagnose`                    | `--log-dir` (the report of the whole    |
|                                            | diagnosis), with `report.html`          |
| `keras-gpufix demo`                        | `logs/naive/`, `logs/keras_gpufix/`,    |
|                                            | each with `report.html`                 |

The record is read from what the run already judged (the monitor's
`report()`, diagnose's result); nothing is judged again. Its schema is in
docs/run_record.md and checked by `RunRecord.load`. Its size does not grow
with the run: the per-step series is at most `analysis.StepSeries`'s 1024
points, texts and lists are capped (`MAX_TEXT`, `MAX_ITEMS`); a
100,000-step run's record is under `MAX_BYTES` (tests/test_run_record.py).
Written atomically: a temporary file in the same folder, then `os.replace`.
`keras-gpufix report RUN` renders it as HTML, `keras-gpufix compare BEFORE
AFTER` compares two.
"""

import datetime
import json
import os
import platform
import signal
import sys
import threading

from keras_gpufix import __version__
from keras_gpufix.analysis import cost_share_prediction, fix_for, format_what_if, speedup_of
from keras_gpufix.output import write_text_atomically

__all__ = ["RunRecord"]

# Keys of `StepLog.summary()` kept, and the record's other parts with their types.
_STEP_TIME = ("count", "total_s", "mean_ms", "p50_ms", "p95_ms", "p99_ms", "max_ms", "std_ms",
              "cv", "steps_per_s", "samples_per_s")
_SERIES = ("first_step", "steps", "input_wait_ms", "step_ms", "between_ms", "max_ms",
           "compiles", "gpu_util", "epoch", "epoch_first", "judged", "stall")
_REQUIRED = {"schema": str, "version": int, "source": str, "written_at": str,
             "command": list, "verdict": dict, "causes": list, "fixes": list,
             "step_time": dict, "phases": dict, "series": dict, "environment": dict}


class RunRecord:
    """One judged run, as kept on disk (`data`: the JSON object).

    Made from a run's own report (`from_monitor`, `from_diagnosis`) or read
    back (`load`, which checks the schema); `write(folder)` keeps it.

    Args:
        data: the record's JSON object (checked: `ValueError` naming what is
            wrong).

    Example:

    >>> record = RunRecord.from_monitor(monitor.report())
    >>> path = record.write("logs/keras_gpufix")
    >>> RunRecord.load(path).data["verdict"]["verdict"]
    'input_bound'
    """

    SCHEMA = "keras_gpufix.run_record"
    VERSION = 1
    FILE = "run_record.json"
    MAX_TEXT = 2000
    MAX_ITEMS = 20
    MAX_BYTES = 256 * 1024

    def __init__(self, data: dict):
        problem = _problem(data)
        if problem:
            raise ValueError(f"not a keras_gpufix run record: {problem}")
        self.data = data
        self.path = None  # the file it was read from or written to

    # -- made from a run's report ---------------------------------------------

    @classmethod
    def from_monitor(cls, report: dict, command=None, ended_by=None) -> "RunRecord":
        """The record of a `GPUOscillationMonitor.report()` (a `fit` or a `kg.watch` loop);
        an `input_bound` cause's share is the run's input wait (`report()["input_wait"]`).

        Args:
            report: the monitor's `report()`.
            command: the command line. Defaults to None: `sys.argv`.
            ended_by: what stopped the run early (`"SIGTERM"`), or None.
        """
        # an input-bound run's cost is its input wait: the run's share (the figure its
        # end line, Keras's logs and report.html give), not its last window's
        wait = report.get("input_wait")
        causes = [_cause(dict(c, share=wait) if c.get("verdict") == "input_bound"
                         and wait is not None else c) for c in report.get("causes") or ()]
        fixes = []
        for cause, where in zip(causes, (c.get("where") for c in report.get("causes") or ())):
            if not cause["share"]:
                continue
            fix = report.get("fix") if cause["verdict"] == report.get("verdict") else fix_for(
                cause["verdict"], phase=cause["phase"], period=cause["period"],
                share=cause["share"], where=where)
            fixes.append({"rank": len(fixes) + 1, "verdict": cause["verdict"], "fix": fix,
                          "where": [where] if where else [], "share": cause["share"],
                          "expected_speedup": cause["expected_speedup"], "speedup_range": None,
                          "source": "cost_share",
                          "text": cost_share_prediction(cause["share"])})
        return cls._made("GPUOscillationMonitor", report, causes, fixes, None,
                         command if command is not None else sys.argv, ended_by, {})

    @classmethod
    def from_diagnosis(cls, result: dict) -> "RunRecord":
        """The record of `keras-gpufix diagnose`'s result (`run_diagnosis`): its
        verdict, ranked causes and fixes with their file:line, its what-if, and the
        series and step times of its main run (the judged run that timed the most steps)."""
        monitor = dict((main_fit(result) or {}).get("monitor") or {})
        fixes = [{"rank": f["rank"], "verdict": f["verdict"], "fix": f["fix"],
                  "where": list(f.get("where") or ()),
                  "share": f["predicted"].get("share"),
                  "expected_speedup": f["predicted"].get("speedup"),
                  "steady_speedup": f["predicted"].get("steady_speedup"),
                  "run_speedup": f["predicted"].get("run_speedup"),
                  "whole_run": f["predicted"].get("whole_run"),
                  "stage_op": (f.get("stage") or {}).get("op"),
                  "stage_kind": (f.get("stage") or {}).get("kind"),
                  "later_speedup": f["predicted"].get("speedup_later_runs"),
                  "speedup_range": f["predicted"].get("speedup_range"),
                  "known": f["predicted"].get("known"),
                  "settle_steps": f["predicted"].get("settle_steps"),
                  "source": f["predicted"].get("source"), "text": f["predicted"].get("text"),
                  "patch": f.get("patch"), "refused": f.get("refused")}
                 for f in result.get("fixes") or ()]
        predicted = {f["verdict"]: f for f in fixes}
        causes = [dict(_cause({**(c.get("evidence") or [{}])[0], "verdict": c["verdict"],
                               "share": c.get("score")}),
                       expected_speedup=(predicted.get(c["verdict"]) or {}).get(
                           "expected_speedup", speedup_of(c.get("score") or 0.0)))
                  for c in result.get("ranking") or ()]
        head = {"verdict": result.get("verdict"),
                "fix": fixes[0]["fix"] if fixes else monitor.get("fix"),
                "phase": monitor.get("phase"), "cost_share": monitor.get("cost_share"),
                "because": [e.get("text") for e in result.get("evidence") or ()],
                "changed": monitor.get("changed")}
        what_if = result.get("what_if")
        env = dict(result.get("environment") or {})
        env["gpus"] = [g.get("name") if isinstance(g, dict) else g for g in env.get("gpus") or ()]
        together = result.get("together")
        return cls._made("diagnose", {**monitor, **head}, causes, fixes, what_if,
                         result.get("command") or [], (result.get("ended_by") or {}).get("text"),
                         env, together=together and {k: together.get(k) for k in (
                             "fixes", "speedup", "speedup_range", "known")})

    @classmethod
    def _made(cls, source, report, causes, fixes, what_if, command, ended_by, environment,
              together=None):
        step_time = {k: (report.get("step_time") or {}).get(k) for k in _STEP_TIME}
        per_s, steps_per_s = step_time["samples_per_s"], step_time["steps_per_s"]
        step_time["batch_size"] = per_s / steps_per_s if per_s and steps_per_s else None
        series = report.get("series") or {}
        data = {
            "schema": cls.SCHEMA,
            "version": cls.VERSION,
            "source": source,
            "written_at": datetime.datetime.now(datetime.timezone.utc).isoformat(
                timespec="seconds"),
            "ended_by": ended_by,
            "command": [str(c) for c in command][:64],
            "verdict": {k: report.get(k) for k in ("verdict", "fix", "phase", "cost_share",
                                                   "because", "changed", "input_unmeasured")},
            "causes": causes,
            "fixes": fixes,
            "together": together,
            "step_time": step_time,
            "phases": dict(report.get("phases") or {}),
            "gpu_util": report.get("gpu_util"),
            "contention": report.get("contention"),
            "job": report.get("job"),
            "what_if": None if not what_if else {
                "speedup_if_input_free": what_if.get("speedup_if_input_free"),
                "speedup_range": what_if.get("speedup_range"),
                "known": what_if.get("known", True),
                "text": format_what_if(what_if, gain=not any(  # one gain for the input
                    f.get("source") == "stage" for f in fixes))},
            "series": {"stride": series.get("stride", 1), "records": series.get("records", 0),
                       **{k: list(series.get(k) or ()) for k in _SERIES}},
            "environment": {**_environment(), **environment},
        }
        return cls(_bounded(_jsonable(data), cls.MAX_TEXT, cls.MAX_ITEMS))

    # -- kept and read back ---------------------------------------------------

    def write(self, folder) -> str:
        """Writes `folder/run_record.json` atomically; returns its path (also `path`)."""
        self.path = write_text_atomically(
            os.path.join(os.fspath(folder), self.FILE),
            json.dumps(self.data, separators=(",", ":"), allow_nan=False))
        return self.path

    def write_html(self, path=None) -> str:
        """Writes the record as one self-contained HTML page (`html_report`) atomically.

        Args:
            path: the HTML file. Defaults to None: `report.html` beside the
                record's file (`path`).

        Returns:
            The HTML file's path.
        """
        from keras_gpufix.html_report import html_report

        if path is None and self.path is None:
            raise ValueError("`path` is needed for a record that was neither read nor written")
        path = path or os.path.join(os.path.dirname(self.path), "report.html")
        return write_text_atomically(os.fspath(path), html_report(self))

    @classmethod
    def find(cls, run) -> str:
        """The record file of `run`: the file itself, or the one `run_record.json`
        in a folder (directly in it, else the only one below it).

        Raises:
            ValueError: none, or several below the folder (named).
        """
        run = os.fspath(run)
        if not os.path.isdir(run):
            if not os.path.exists(run):
                raise ValueError(f"{run}: no such file or folder")
            return run
        if os.path.isfile(os.path.join(run, cls.FILE)):
            return os.path.join(run, cls.FILE)
        found = sorted(os.path.join(d, cls.FILE) for d, _, files in os.walk(run)
                       if cls.FILE in files)
        if len(found) != 1:
            raise ValueError(f"{run}: " + ("no run record (run_record.json) in this folder"
                                           if not found else
                                           f"{len(found)} run records below it; name one: "
                                           + ", ".join(found)))
        return found[0]

    @classmethod
    def load(cls, run) -> "RunRecord":
        """Reads and checks a record (a file, or a folder: `find`).

        Raises:
            ValueError: naming the file: it is missing, truncated, not JSON,
                not a run record, or of a newer version.
        """
        path = cls.find(run)
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path}: not a keras_gpufix run record: cannot be read as JSON "
                             f"(truncated or another file: {exc})") from None
        problem = _problem(data)
        if problem:
            raise ValueError(f"{path}: not a keras_gpufix run record: {problem}")
        record = cls(data)
        record.path = path
        return record

    # -- a run stopped by a signal ---------------------------------------------

    @staticmethod
    def on_signal(write):
        """Calls `write(signal_name)` when SIGTERM or SIGINT arrives, then lets the
        signal do what it did before (the default: the process ends by it; Python's:
        KeyboardInterrupt; another handler: that handler). Only in the main thread,
        and not for a signal that is ignored.

        Returns:
            A function that puts the previous handlers back (if still ours).
        """
        if threading.current_thread() is not threading.main_thread():
            return lambda: None
        previous = {}

        def handler(signum, frame):
            before = previous.get(signum, signal.SIG_DFL)
            try:
                write(signal.Signals(signum).name)
            except Exception:  # keeping the record never changes how the signal ends
                pass
            signal.signal(signum, before)
            if callable(before):
                before(signum, frame)
            else:
                os.kill(os.getpid(), signum)

        for signum in (signal.SIGTERM, signal.SIGINT):
            current = signal.getsignal(signum)
            if current is not signal.SIG_IGN and current is not None:
                previous[signum] = signal.signal(signum, handler)

        def undo():
            for signum, before in previous.items():
                if signal.getsignal(signum) is handler:
                    signal.signal(signum, before)

        return undo




def main_fit(result: dict) -> "dict | None":
    """The run a diagnose result's record is about: of its fits (and loops) the one
    whose monitor timed the most steps; None where none timed a step."""
    fits = [f for f in result.get("fits") or ()
            if ((f.get("monitor") or {}).get("step_time") or {}).get("count")]
    return max(fits, key=lambda f: f["monitor"]["step_time"]["count"], default=None)


def _cause(c):
    share = c.get("share")
    return {"verdict": c.get("verdict"), "share": share, "phase": c.get("phase"),
            "period": c.get("period"),
            "expected_speedup": speedup_of(share) if share is not None else None}


def _environment():
    """This process's machine and software, without starting TensorFlow or a device."""
    import keras

    env = {"python": platform.python_version(), "platform": platform.platform(),
           "host": platform.node(), "machine": platform.machine(),
           "cpu_count": os.cpu_count(), "keras": keras.__version__,
           "keras_backend": keras.backend.backend(), "keras_gpufix": __version__,
           "tensorflow": getattr(sys.modules.get("tensorflow"), "__version__", None)}
    try:
        from keras_gpufix.compile import device_info

        env["gpus"] = [g["name"] for g in device_info()["gpus"]]
    except Exception:  # no way to list them here: say nothing rather than fail the record
        env["gpus"] = []
    return env


def _jsonable(value):
    """`value` with NumPy scalars as numbers, tuples as lists, NaN and inf as None."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else None
    if value is None or isinstance(value, (str, int, bool)):
        return value
    if hasattr(value, "item"):
        return _jsonable(value.item())
    return str(value)


def _bounded(value, max_text, max_items, series=False):
    """Texts cut at `max_text` characters, lists at `max_items` (the series' columns,
    bounded by `StepSeries`, and the command, kept whole)."""
    if isinstance(value, dict):
        return {k: _bounded(v, max_text, max_items, series or k in ("series", "command"))
                for k, v in value.items()}
    if isinstance(value, list):
        kept = value if series else value[:max_items]
        return [_bounded(v, max_text, max_items, series) for v in kept]
    if isinstance(value, str) and len(value) > max_text:
        return value[:max_text - 3] + "..."
    return value


def _problem(data) -> "str | None":
    """What makes `data` no run record this version reads, or None."""
    if not isinstance(data, dict):
        return f"a JSON {type(data).__name__}, not an object"
    if data.get("schema") != RunRecord.SCHEMA:
        return f"its schema is {data.get('schema')!r}, not {RunRecord.SCHEMA!r}"
    version = data.get("version")
    if not isinstance(version, int) or version < 1:
        return f"its version is {version!r}"
    if version > RunRecord.VERSION:
        return (f"version {version} was written by a newer keras_gpufix (this one reads "
                f"version {RunRecord.VERSION}): pip install -U keras-gpufix")
    for key, kind in _REQUIRED.items():
        if not isinstance(data.get(key), kind):
            return f"`{key}` is missing or not a {kind.__name__}"
    series = data["series"]
    lengths = {k: len(series.get(k)) for k in _SERIES if isinstance(series.get(k), list)}
    if len(lengths) != len(_SERIES):
        return "its series lacks " + ", ".join(k for k in _SERIES if k not in lengths)
    if len(set(lengths.values())) > 1:
        return f"its series' columns differ in length ({lengths})"
    return None
