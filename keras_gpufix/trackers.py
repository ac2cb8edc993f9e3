"""Trackers: a run's judgement logged where the team keeps its runs (MLflow, W&B).

Where an MLflow run is active (`mlflow.active_run()`) or a Weights & Biases
run is (`wandb.run`, online or offline), `GPUOscillationMonitor` (in `fit`
and in `kg.watch`) and `keras-gpufix diagnose` log to it, with no line of
the user's code:

| what                         | MLflow                          | W&B                             |
|------------------------------|---------------------------------|---------------------------------|
| the headline: verdict, its   | tags `keras_gpufix.verdict`,    | summary `keras_gpufix/verdict`, |
| share, the fix, its gain,    | `.share`, `.fix`, `.gain`,      | `/share`, `/fix`, `/gain`,      |
| the three lines              | `.headline`                     | `/headline`                     |
| the step phases, per step    | metrics `keras_gpufix/cycle_ms`,| the same keys, against          |
| (ms), at `update_freq`       | `input_wait_ms`, `step_ms`,     | `keras_gpufix/train_step`       |
|                              | `between_ms` (step: steps done; |                                 |
|                              | a second fit's follow the first)|                                 |
| the run record and its page  | artifacts `keras_gpufix/`       | files `keras_gpufix/`           |
|                              | `run_record.json`, `report.html`| `run_record.json`, `report.html`|

`share` is the verdict's share of the run (0 to 1), `gain` the top fix's
expected speedup (None where it was not measured); `fix` is the headline's
fix sentence with its gain in words. The page's `compare` line names the
tracker's copy (`keras-gpufix compare runs:/<id> AFTER`).

`KERAS_GPUFIX_TRACKERS=off` in the environment turns `"auto"` off (a script run
unchanged, diagnose's patched reruns). Only where the package is already imported
is a run looked for (nothing is
imported for it), and only the trackers' public API is used. A failure of a
tracker (no server, a full disk, a network error) is one warning naming the
tracker and the reason; nothing more goes to it in that run, training goes
on and the local record is complete. Under `keras-gpufix diagnose` the
monitors log the step phases and diagnose alone logs the headline and the
files, once, to each run its monitors saw (an MLflow run by its id, ended or
not; a W&B run that ended before diagnose's report is resumed for it).

`load_record(RUN)` reads a record back from a tracker: an MLflow `runs:/<id>`
URI (its `keras_gpufix/run_record.json` artifact) or, like any folder, a W&B
run folder (`wandb/offline-run-*`, `wandb/latest-run`).
"""

import importlib
import os
import sys
import tempfile
import threading
import time

from keras_gpufix.analysis.headline import headline, verdict_share
from keras_gpufix.exceptions import warn
from keras_gpufix.output import emit
from keras_gpufix.run_record import RunRecord

__all__ = ["Trackers", "load_record"]

#: The trackers, by name: the title warnings and lines use.
NAMES = {"mlflow": "MLflow", "wandb": "W&B"}
#: The environment variable that turns `"auto"` off (`off`, `0`, `none`, `false`): for a
#: script run unchanged, under `keras-gpufix diagnose` too.
ENV = "KERAS_GPUFIX_TRACKERS"
_OFF = ("off", "0", "none", "false")
_FOLDER = "keras_gpufix"  # the artifacts' folder in a tracker's run
_PHASES = ("cycle_ms", "input_wait_ms", "step_ms", "between_ms")
_MAX_TAG = 5000  # MLflow's tag values are bounded (8000 characters on its stores)
# (tracker, run id) -> the steps this process logged to it: a second fit's points follow
# the first's on the run's step axis
_STEPS_LOGGED = {}


def _needed(name):
    """The tracker's module, imported; ImportError quoting the pip command."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise ImportError(f"logging to {NAMES[name]} needs the `{name}` package ({exc}): "
                          f"pip install keras-gpufix[{name}]") from None


class Trackers:
    """The experiment-tracker runs one monitored run logs to.

    Made by `GPUOscillationMonitor(trackers=...)`; pass one to it for a
    rate other than once an epoch.

    Args:
        trackers: `"auto"`: the active MLflow run and the W&B run, where
            there is one (none where the environment variable
            `KERAS_GPUFIX_TRACKERS` is `off`); a name (`"mlflow"`, `"wandb"`) or a list of them:
            those, a run started where none is active (and ended with the
            run); None or `[]`: none. Defaults to `"auto"`.
        update_freq: `"epoch"`: the step phases logged at each epoch's end;
            an integer N: every N steps (and at each epoch's end). Defaults
            to `"epoch"`.

    Raises:
        ValueError: `trackers` or `update_freq` is not one of those.
        ImportError: a named tracker's package is not installed (quoting
            the pip command).

    Example:

    >>> kg.GPUOscillationMonitor(trackers=Trackers("mlflow", update_freq=200))
    """

    #: The most seconds the end of a run waits for the trackers (a server that does not
    #: answer: MLflow retries for minutes); the rest is sent in the background.
    END_WAIT_S = 60.0

    def __init__(self, trackers="auto", update_freq="epoch"):
        names = ("auto" if trackers == "auto" else [] if trackers is None
                 else [trackers] if isinstance(trackers, str)
                 else list(trackers) if isinstance(trackers, (list, tuple)) else None)
        if names is None or names != "auto" and any(n not in NAMES for n in names):
            raise ValueError("`trackers` must be 'auto', None, 'mlflow', 'wandb' or a list of "
                             f"them. Received: trackers={trackers!r}")
        if update_freq != "epoch" and not (isinstance(update_freq, int)
                                           and not isinstance(update_freq, bool)
                                           and update_freq >= 1):
            raise ValueError("`update_freq` must be 'epoch' or an integer >= 1. "
                             f"Received: update_freq={update_freq!r}")
        for name in () if names == "auto" else names:
            _needed(name)  # named: missing is an error now, quoting the pip command
        self.trackers = trackers
        self._names = names
        self.update_freq = update_freq
        self.owner = "GPUOscillationMonitor"
        self._runs = []
        self._sums = [0, 0.0, 0.0, 0.0, 0, False]  # steps, input, step, between, last, measured

    @classmethod
    def of(cls, trackers) -> "Trackers":
        """`trackers` if it is a `Trackers`, else one made of it."""
        return trackers if isinstance(trackers, cls) else cls(trackers)

    @property
    def runs(self) -> list:
        """The runs logged to: one JSON-ready dict each (`tracker`, `run_id`, ...)."""
        return [run.describe() for run in self._runs]

    # -- a monitored run -------------------------------------------------------

    def begin(self):
        """At the run's start: finds the active runs (starts the named ones where none is)."""
        self._runs, self._sums = [], [0, 0.0, 0.0, 0.0, 0, False]
        auto = self._names == "auto"
        if auto and os.environ.get(ENV, "").strip().lower() in _OFF:
            return
        for name in NAMES if auto else dict.fromkeys(self._names):
            run = _RUNS[name](self.owner)
            module = sys.modules.get(name) if auto else _guarded(run, "import", _needed, name)
            if module is not None:
                _guarded(run, "start", run.attach, module, not auto)
            if run.live and module is not None:
                run.base = _STEPS_LOGGED.get(run.key(), 0)
                self._runs.append(run)

    def add(self, records):
        """Adds `analysis.StepRecord`s; logs a point every `update_freq` steps."""
        if not self._runs:
            return
        sums = self._sums
        for record in records:
            sums[0] += record.steps
            sums[1] += record.input_wait or 0.0
            sums[2] += record.step
            sums[3] += record.between
            sums[5] = sums[5] or record.input_wait is not None
            sums[4] = record.index + record.steps
        if isinstance(self.update_freq, int) and sums[0] >= self.update_freq:
            self._point()

    def epoch_end(self):
        """At an epoch's end: logs the steps since the last point."""
        if self._runs:
            self._point()

    def end(self, record=None, verbose=0):
        """At the run's end: the last point; then, where `record` is given (a function
        that returns the run's `RunRecord`), its headline and files; then ends the runs
        started here.

        Args:
            record: a function returning the `RunRecord`, or None (diagnose logs it).
            verbose: 1 prints one line naming the runs logged to. Defaults to 0.
        """
        if not self._runs:
            return
        self._point()
        kept = None
        if record is not None:
            try:
                kept = record()
            except Exception as exc:  # no record, no headline: the metrics stay
                for run in self._runs:
                    run.failed("record", exc)
        sending = threading.Thread(target=self._send, args=(kept,), daemon=True,
                                   name="keras_gpufix-trackers")
        sending.start()
        sending.join(self.END_WAIT_S)
        if sending.is_alive():
            warn(f"{self.owner}: " + " and ".join(NAMES[run.name] for run in self._runs)
                 + f" did not answer within {self.END_WAIT_S:.0f} s; training goes on, the "
                 "local run record is complete, and the rest is sent in the background")
            return
        for run in self._runs:
            _guarded(run, "end", run.finish)
        said = [run.words() for run in self._runs if run.live]
        if said and kept is not None:
            emit(f"{self.owner}: logged to " + " and ".join(said), verbose)

    def _send(self, kept):
        """What is left to send, then the headline and the files (another thread)."""
        for run in self._runs:
            _guarded(run, "metrics", run.flush)
            if kept is not None:
                _guarded(run, "headline", run.headline, kept.data)
                _guarded(run, "files", _log_files, run, kept)

    def _point(self):
        sums = self._sums
        if not sums[0]:
            return
        per = 1e3 / sums[0]
        values = {"cycle_ms": (sums[1] + sums[2] + sums[3]) * per, "step_ms": sums[2] * per,
                  "between_ms": sums[3] * per}
        if sums[5]:
            values["input_wait_ms"] = sums[1] * per
        for run in self._runs:
            _guarded(run, "metrics", run.metrics, values, run.base + sums[4])
            _STEPS_LOGGED[run.key()] = run.base + sums[4]
        self._sums = [0, 0.0, 0.0, 0.0, sums[4], False]

    # -- diagnose ---------------------------------------------------------------

    @classmethod
    def of_diagnosis(cls, result: dict) -> "Trackers":
        """The runs the monitors of a diagnose `result` logged to, once each."""
        trackers = cls(None)
        trackers.owner = "keras-gpufix diagnose"
        seen = set()
        for fit in result.get("fits") or ():
            for described in (fit.get("monitor") or {}).get("trackers") or ():
                key = (described.get("tracker"), described.get("run_id"))
                if key in seen or described.get("tracker") not in NAMES:
                    continue
                seen.add(key)
                run = _RUNS[described["tracker"]](trackers.owner)
                if _guarded(run, "find", run.reopen, described) is not None:
                    trackers._runs.append(run)
        return trackers


def _guarded(run, what, function, *args):
    """`function(*args)` for `run`; a failure disables the run (one warning). None then."""
    if not run.live:
        return None
    try:
        return function(*args)
    except Exception as exc:  # a tracker never stops training
        run.failed(what, exc)
        return None


def _log_files(run, record):
    """The record and its page into `run` (the page's `compare` line names the run)."""
    with tempfile.TemporaryDirectory(prefix="keras_gpufix_tracker_") as tmp:
        folder = run.folder(tmp)
        copy = RunRecord(record.data)
        copy.write(folder)
        copy.path = run.uri()  # what `compare` is given to read this run back
        copy.write_html(os.path.join(folder, "report.html"))
        run.files(folder)


def _headline(data, path):
    """The headline's parts: verdict, share, fix (with its gain in words), gain (the top
    fix's expected speedup), the three lines (`path`: the run as `compare` reads it)."""
    verdict, share = verdict_share(data)
    lines = headline(data, path)
    fixes = data.get("fixes") or ()
    return {"verdict": verdict, "share": share, "fix": lines[1][len("fix:"):].strip(),
            "gain": fixes[0].get("expected_speedup") if fixes else None,
            "headline": "\n".join(lines)}


class _Run:
    """One tracker's run: subclasses say how each part is logged."""

    name = None

    def __init__(self, owner):
        self.owner = owner
        self.live = True
        self.started = False
        self.base = 0  # the steps logged to the run before this one

    def key(self):
        return self.name, self.describe()["run_id"]

    def failed(self, what, exc):
        if self.live:
            self.live = False
            warn(f"{self.owner}: logging to {NAMES[self.name]} failed ({what}: "
                 f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); "
                 f"training goes on, the local run record is complete, and nothing more "
                 f"is sent to {NAMES[self.name]} in this run")


class _MlflowRun(_Run):
    """An MLflow run, logged to by its id through `MlflowClient` (ended or not)."""

    name = "mlflow"

    def attach(self, mlflow, start):
        active = mlflow.active_run()
        if active is None and start:
            active = mlflow.start_run()
            self.started = True
        self.live = active is not None
        if self.live:
            self._open(mlflow, active.info.run_id, mlflow.get_tracking_uri())

    def _open(self, mlflow, run_id, tracking_uri):
        self.mlflow, self.run_id, self.tracking_uri = mlflow, run_id, tracking_uri
        self.client = mlflow.tracking.MlflowClient(tracking_uri)
        self.pending = []

    def reopen(self, described):
        self._open(_needed("mlflow"), described["run_id"], described["tracking_uri"])
        return self

    def describe(self):
        return {"tracker": self.name, "run_id": self.run_id, "tracking_uri": self.tracking_uri,
                "uri": self.uri(), "started": self.started}

    def uri(self):
        return f"runs:/{self.run_id}"

    def words(self):
        return f"MLflow run {self.run_id} ({self.tracking_uri})"

    def metrics(self, values, step):
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        done = self.client.log_batch(self.run_id, metrics=[
            Metric(f"{_FOLDER}/{k}", float(v), now, step) for k, v in values.items()],
            synchronous=False)  # a thread of MLflow's sends it: the loop goes on
        if done is not None:
            self.pending.append(done)

    def headline(self, data):
        from mlflow.entities import RunTag

        head = _headline(data, self.uri())
        tags = {"verdict": head["verdict"], "fix": head["fix"], "headline": head["headline"],
                "share": "" if head["share"] is None else f"{head['share']:.4g}",
                "gain": "" if head["gain"] is None else f"{head['gain']:.4g}"}
        self.client.log_batch(self.run_id, tags=[
            RunTag(f"{_FOLDER}.{k}", v[:_MAX_TAG]) for k, v in tags.items()])

    def folder(self, tmp):
        return os.path.join(tmp, _FOLDER)

    def files(self, folder):
        self.client.log_artifacts(self.run_id, folder, artifact_path=_FOLDER)

    def flush(self):
        pending, self.pending = self.pending, []
        for done in pending:
            done.wait()

    def finish(self):
        if not self.started:
            return
        active = self.mlflow.active_run()
        if active is not None and active.info.run_id == self.run_id:
            self.mlflow.end_run()
        else:
            self.client.set_terminated(self.run_id)


class _WandbRun(_Run):
    """A W&B run (online or offline): its summary, `run.log` and its files folder."""

    name = "wandb"
    STEP = f"{_FOLDER}/train_step"

    def attach(self, wandb, start):
        run = wandb.run
        if run is None and start:
            run = wandb.init()
            self.started = True
        self.live = run is not None
        if self.live:
            self._open(wandb, run)

    def _open(self, wandb, run):
        self.wandb, self.run, self.defined = wandb, run, False
        self.described = {"tracker": self.name, "run_id": run.id, "project": run.project,
                          "entity": run.entity or None, "mode": "offline" if run.offline
                          else "online", "root_dir": run.settings.root_dir,
                          "folder": os.path.dirname(run.dir), "started": self.started}

    def reopen(self, described):
        wandb = _needed("wandb")
        run = wandb.run
        if run is None or run.id != described["run_id"]:  # it ended: resumed for the record
            run = wandb.init(id=described["run_id"], project=described["project"],
                             entity=described["entity"], dir=described["root_dir"],
                             mode=described["mode"], resume="allow")
            self.started = True
        self._open(wandb, run)
        return self

    def describe(self):
        return dict(self.described, folder=os.path.dirname(self.run.dir))

    def uri(self):
        return os.path.dirname(self.run.dir)

    def words(self):
        return f"W&B run {self.run.id} ({os.path.dirname(self.run.dir)})"

    def metrics(self, values, step):
        if not self.defined:
            self.run.define_metric(self.STEP)
            self.run.define_metric(f"{_FOLDER}/*", step_metric=self.STEP)
            self.defined = True
        self.run.log({self.STEP: step, **{f"{_FOLDER}/{k}": v for k, v in values.items()}})

    def headline(self, data):
        head = _headline(data, self.uri())
        self.run.summary.update({f"{_FOLDER}/{k}": head[k] for k in (
            "verdict", "share", "fix", "gain", "headline")})

    def folder(self, tmp):
        return os.path.join(self.run.dir, _FOLDER)  # files in the run's folder are its own

    def files(self, folder):
        for file in (RunRecord.FILE, "report.html"):
            self.run.save(os.path.join(folder, file), base_path=self.run.dir, policy="now")

    def flush(self):
        pass  # `run.log` hands its rows to W&B's own process

    def finish(self):
        if self.started:
            self.run.finish()


_RUNS = {"mlflow": _MlflowRun, "wandb": _WandbRun}


def load_record(run) -> RunRecord:
    """A run record from a file or folder (`RunRecord.load`; a W&B run folder is one)
    or from an MLflow run (`runs:/<id>`, its `keras_gpufix/run_record.json`, through
    the tracking URI MLflow is set to: `MLFLOW_TRACKING_URI`). Its `path` is `run`.

    Raises:
        ValueError: naming `run`: no such run, no record in it, not a record.
        ImportError: a `runs:/` URI without MLflow installed (quoting the pip command).
    """
    text = os.fspath(run)
    if not text.startswith("runs:/"):
        return RunRecord.load(run)
    mlflow = _needed("mlflow")
    uri = text if text.endswith(".json") else f"{text.rstrip('/')}/{_FOLDER}/{RunRecord.FILE}"
    with tempfile.TemporaryDirectory(prefix="keras_gpufix_runs_") as tmp:
        try:
            local = mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=tmp)
        except Exception as exc:  # no such run, no such artifact, no store
            raise ValueError(f"{text}: no keras_gpufix run record in this MLflow run ({uri}, "
                             f"tracking URI {mlflow.get_tracking_uri()}: "
                             f"{type(exc).__name__}: {str(exc).splitlines()[0]})") from None
        record = RunRecord.load(local)
    record.path = text
    return record
