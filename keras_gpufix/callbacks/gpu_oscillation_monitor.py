"""GPUOscillationMonitor: names the cause of a slow or oscillating `fit`.

One line is enough: `model.fit(..., callbacks=[kg.GPUOscillationMonitor()])`.
It is a member of the shared step stream (one clock read and one input-probe
read per hook for all our callbacks in the `fit`), which gives it one
`analysis.StepRecord` per hook with the cycle's three phases (`input_wait`,
`step`, `between`); it samples GPU utilisation with NVML in a background
thread where `nvidia-ml-py` and a GPU exist, and feeds the records to
`keras_gpufix.analysis.OscillationDetector`, which judges by cost (the share
of the cycle lost, by phase). Each event is printed once.

Records left out of the judgement: the first `warmup` of a `fit`
(compilation) and the first of every epoch (iterator creation and
shuffle-buffer filling happen there; their mean is reported as
`epoch_start_ms`). A record that covers N steps (`steps_per_execution=N`)
counts as one observation of its per-step time. A run too short for the
window is judged once at its end.

Logged TensorBoard scalars (run `keras_gpufix` under `log_dir`):

| tag                          | when          | value                            |
|------------------------------|---------------|----------------------------------|
| `oscillation/cycle_ms`       | each hook     | cycle time per step (ms)         |
| `oscillation/input_wait_ms`  | each hook     | input wait per step (measured)   |
| `oscillation/between_ms`     | each hook     | time between steps, per step     |
| `oscillation/cv`             | each judgement| coefficient of variation         |
| `oscillation/median_ms`      | each judgement| median cycle time                |
| `oscillation/slow_time_share`| each judgement| share of the window lost to slow |
|                              |               | steps                            |
| `oscillation/input_wait`     | each judgement| input-wait share (when measured) |
| `oscillation/gpu_util`       | each judgement| mean GPU utilisation (NVML)      |

Logged TensorBoard text (Text tab): `oscillation/verdict`, at each event
(`<verdict>: <message>. Fix: <fix>`) and at the end of `fit` (`final:
<verdict>. Fix: <fix>`, the verdict of `report()`).

The run's record (`keras_gpufix.run_record.RunRecord`, docs/run_record.md):
with `log_dir`, `log_dir/keras_gpufix/run_record.json` at the end of `fit`
(and when SIGTERM or SIGINT stops it; in a multi-worker job the chief's);
`keras-gpufix report` renders it.

Experiment trackers (`keras_gpufix.trackers`): where an MLflow run or a
W&B run is active (or those named in `trackers`), the step phases go to it
once an epoch, and the headline (verdict, share, fix, gain) and the run's
record and report.html at the end of the run; `trackers=None` turns it off.

Keras `logs`: `step_ms` (each step), `step_ms` and `input_wait` (each
epoch; `input_wait` the run's so far, the figure `report()` gives), written
by the first of our callbacks in the list (see `callbacks/_stream.py`).

The monitor is the run's one judgement: its detector judges the records of
every keras_gpufix callback in the `fit`, and their reports name its
verdict. `on_detect` is the user's function: an exception it raises
propagates out of `fit`, as from any Keras callback.

Several workers (`MultiWorkerMirroredStrategy`) with a shared `log_dir`:
at the end of `fit` each worker's monitor writes its summary there and
judges the whole job (`analysis.judge_job`: samples/s counted once, each
worker's phases, its wait at the all-reduce and its CPU; the straggler, its
cause and what the others lose waiting for it). The chief prints the job's
line; the other workers print nothing unless they are the straggler.
`report()["job"]` holds the job's report; the chief's run record keeps it,
and its headline and report.html open with the straggler
(docs/distributed.md). The same holds in a `kg.watch` loop over a
`tf.distribute` dataset.
"""

import os
import sys
import time

from keras_gpufix import cpu_load
from keras_gpufix.analysis.contention import cpu_contention
from keras_gpufix.analysis.headline import headline
from keras_gpufix.analysis.step_series import StepSeries
from keras_gpufix.callbacks import _arguments
from keras_gpufix.callbacks._base import ScalarWriter, UserError
from keras_gpufix.callbacks._job import cluster_task, gather_job
from keras_gpufix.callbacks._timed import TimedCallback
from keras_gpufix.compile.hardware import device_info
from keras_gpufix.exceptions import warn
from keras_gpufix.keras_internals import callback_model
from keras_gpufix.nvml import NvmlSampler
from keras_gpufix.output import emit
from keras_gpufix.run_record import RunRecord
from keras_gpufix.trackers import Trackers

__all__ = ["GPUOscillationMonitor"]

_TOLD = []  # why GPU utilisation was not sampled, once said (once a process)


class GPUOscillationMonitor(TimedCallback):
    """Detects input-bound, stalling, recompiling or dispatch-bound training.

    Args:
        window: steps per judged window. Defaults to 96.
        warmup: steps ignored at the start of each `fit`. Defaults to 5.
        min_windows: consecutive judgements a verdict must hold before it
            is reported. Defaults to 2.
        thresholds: other `OscillationDetector` arguments by name
            (names of `keras_gpufix.analysis.THRESHOLDS`: `slow_factor`,
            `cost_share`, `input_wait_share`, ...). Defaults to None.
        log_dir: directory for TensorBoard scalars. Defaults to None.
        on_detect: called with each event dict; an object with an
            `on_oscillation(event)` method (such as `kg.ProfilerTrigger`)
            gets that method called. Our callbacks in the same `fit` get
            every event without wiring. An exception it raises propagates
            out of `fit` (it is the user's code, not the monitor's).
            Defaults to None.
        nvml: sample GPU utilisation through NVML when possible. Where a
            GPU exists and it is not sampled (no `nvidia-ml-py`, or
            `nvml=False`), one line says why, once a process; on a machine
            without a GPU nothing is said. Defaults to True.
        verbose: 0 silent, 1 prints each event and a summary at the end of
            `fit`. Defaults to 1.
        trackers: the experiment trackers the run is logged to
            (`keras_gpufix.trackers.Trackers`): `"auto"`, the MLflow run
            and the W&B run active at the start of `fit`; `"mlflow"`,
            `"wandb"` or a list of them, those (a run started where none
            is active); None, none; or a `Trackers` (another rate).
            Defaults to `"auto"`.

    Example:

    >>> monitor = kg.GPUOscillationMonitor()
    >>> model.fit(ds, epochs=3, callbacks=[monitor])
    >>> monitor.report()["verdict"]
    'input_bound'
    """

    def __init__(self, window=96, warmup=5, min_windows=2, thresholds=None,
                 log_dir=None, on_detect=None, nvml=True, verbose=1, trackers="auto"):
        super().__init__()
        self.detector = _arguments.gpu_oscillation_monitor(window, warmup, min_windows,
                                                           thresholds, on_detect)
        self.window = window
        self.warmup = warmup
        self.min_windows = min_windows
        self.thresholds = dict(thresholds or {})
        self.log_dir = log_dir
        self.on_detect = on_detect
        self.nvml = nvml
        self.verbose = verbose
        self.trackers = trackers
        self._trackers = Trackers.of(trackers)
        self._sampler = None
        self._writer = None
        self._firsts = [0, 0.0]  # epoch-first records: count, seconds
        self._task = None  # (index, chief, tasks) under a multi-worker strategy
        self._began = 0.0
        self.job = None
        self._series = StepSeries(warmup=warmup)
        self._keep_on_signal = None
        # cpu_load samples at the run's start, its end and its first steady step
        self._cpu = [None, None, None]
        # under `keras-gpufix diagnose`, whose headline says the share and the fix with
        # the gain it measured (a rerun of the script): the end line says the verdict only
        self._fix_said_by_diagnose = False

    @property
    def events(self):
        """The events of the last (or current) `fit` (held by the detector)."""
        return self.detector.events

    def _begin(self):
        self._cpu = [cpu_load.sample(), None, None]
        self._firsts = [0, 0.0]
        self._task = cluster_task(callback_model(self))
        self._began = time.time()
        self.job = None
        if self.log_dir is not None and self._writer is None:
            self._writer = ScalarWriter(self.log_dir)
        self._series.reset()
        if self.log_dir is not None and (self._task is None or self._task[1]):
            # a run stopped by a signal leaves its record too
            self._keep_on_signal = RunRecord.on_signal(self._keep)
        self._start_sampler()
        self.stream.sample_utilisation(self._sampler)
        if self._task is None or self._task[1]:  # in a job, the chief's
            self._trackers.begin()

    def _start_sampler(self):
        self._sampler = None  # a stopped sampler keeps its samples for report()
        reason = "disabled (nvml=False)"
        if self.nvml:
            sampler = NvmlSampler()
            try:
                sampler.start()
            except Exception as exc:  # no pynvml, no driver, no GPU
                reason = str(exc).splitlines()[0]
            else:
                self._sampler = sampler
                return
        # said once a process (diagnose runs one monitor per fit), where a GPU exists
        if self.verbose and not _TOLD and device_info()["gpus"]:
            _TOLD.append(reason)
            emit(f"GPUOscillationMonitor: GPU utilisation not sampled ({reason}); "
                 "judging from step times" + (
                     " and input wait." if self.stream.input_probe is not None
                     or "tensorflow" in sys.modules else "."), self._voice)

    def _epoch_done(self):
        if self._writer is not None:
            self._writer.flush()
        self._trackers.epoch_end()

    @property
    def _voice(self):
        """`verbose`, or 0 on a worker of a job that is not the chief."""
        return self.verbose if self._task is None or self._task[1] else 0

    def _end(self):
        # The stream's last records and final judgement came before this hook.
        self._cpu[1] = cpu_load.sample()
        if self._task is not None and self.log_dir is not None:
            try:
                self._gather_job()
            except Exception as exc:  # a shared folder that fails: one warning
                self._report_failure("gather_job", exc)
        if self._sampler is not None:
            self._sampler.stop()
            if self._sampler.error is not None:
                warn(f"NVML sampling stopped: {self._sampler.error}")
        if self._keep_on_signal is not None:
            self._keep_on_signal()
            self._keep_on_signal = None
        kept = None
        if self.log_dir is not None and (self._task is None or self._task[1]):
            try:
                kept = self._keep()
            except Exception as exc:  # a full disk: one warning
                self._report_failure("keep", exc)
        r = self.report()
        if self._writer is not None:
            self._writer.text("oscillation/verdict", f"final: {r['verdict']}. Fix: {r['fix']}",
                              max(0, self.detector.log.steps - 1))
            self._writer.close()
            self._writer = None
        st = r["step_time"]
        if self._voice and self.job is None and st["count"]:  # in a job, the job's line says it
            try:
                self._summary(r)
            except Exception as exc:  # a monitor never stops training
                self._report_failure("summary", exc)
        # under diagnose, its report's record goes to the trackers, once
        self._trackers.end(None if self._fix_said_by_diagnose else lambda: RunRecord.load(
            kept) if kept else RunRecord.from_monitor(r), self._voice)

    def _summary(self, r):
        """Prints the run's end line: the headline of its record (what report.html
        opens with), then the steady steps' figures."""
        st = r["step_time"]
        lines = headline(RunRecord.from_monitor(r).data, None if self.log_dir
                         is None else os.path.join(self.log_dir, "keras_gpufix"))
        first, load, (fix, check) = lines[0], lines[1:-2], lines[-2:]
        wait = r["input_wait"]
        said = self._fix_said_by_diagnose  # its report's headline, after the run
        verdict = (f"{r['verdict']}; its share and fix: diagnose's report, below" if said
                   else first[len("verdict: "):])
        emit(f"GPUOscillationMonitor: verdict {verdict}\n"
             + "".join(f"  {line}\n" for line in load)
             + ("" if said else f"  {fix}\n")
             + (f"  {check}\n" if self.log_dir is not None and not said else "")
             + f"  {st['count']} steady steps in {st['total_s']:.1f} s, mean "
             f"{st['mean_ms']:.1f} ms, median {st['p50_ms']:.1f} ms, "
             f"p95 {st['p95_ms']:.1f} ms, cv {st['cv']:.2f}"
             + ("" if wait is None else f", input wait {wait:.0%}")
             + f", between steps {r['phases']['between']:.0%}"
             + ("" if r["changed"] is None else f"; {r['changed']}"),
             self._voice)

    def _gather_job(self):
        self.job = gather_job(self._task, self.report(), self.log_dir, self._began)
        straggler = None if self.job is None else self.job["straggler"]
        if self.job is not None and (self._task[1] or (
                straggler is not None and straggler["task"] == self._task[0])):
            emit(f"GPUOscillationMonitor (task {self._task[0]}): {self.job['message']}",
                 self.verbose)

    def _after_hook(self):
        """On the loop's thread, once a run: the CPU at the end of its warmup steps."""
        last = self.stream.last
        if self._cpu[2] is None and last is not None and last[0] + last[1] >= self.warmup:
            self._cpu[2] = cpu_load.sample()

    def _on_records(self, records):
        """Counts epoch starts and writes the per-step scalars (the stream judges)."""
        self._trackers.add(records)
        for record in records:
            self._series.add(record, jit=self.detector.jit)
            if record.epoch_first:
                self._firsts[0] += 1
                self._firsts[1] += record.cycle
            if self._writer is not None:
                step, per = record.index + record.steps - 1, 1e3 / record.steps
                self._writer.add("oscillation/cycle_ms", record.cycle * per, step)
                if record.input_wait is not None:
                    self._writer.add("oscillation/input_wait_ms", record.input_wait * per, step)
                self._writer.add("oscillation/between_ms", record.between * per, step)

    def _on_judgement(self, judgement, step):
        evidence = judgement["evidence"]
        if self._writer is None or "median_ms" not in evidence:  # too few records to judge
            return
        self._writer.add("oscillation/cv", evidence["cv"], step)
        self._writer.add("oscillation/median_ms", evidence["median_ms"], step)
        self._writer.add("oscillation/slow_time_share", evidence["slow_time_share"], step)
        self._writer.add("oscillation/input_wait", evidence.get("input_wait"), step)
        self._writer.add("oscillation/gpu_util", evidence.get("gpu_util"), step)

    def _on_event(self, event):
        emit(f"\nGPUOscillationMonitor: {event['message']}. Fix: {event['fix']}", self._voice)
        if self._writer is not None:
            self._writer.text("oscillation/verdict", f"{event['verdict']}: {event['message']}. "
                                                     f"Fix: {event['fix']}", event["end_step"])
        target = self.on_detect
        if target is None or any(target is m for m in self.stream.members):
            return  # our callbacks in the run get the event from the stream
        try:
            getattr(target, "on_oscillation", target)(event)
        except Exception as exc:
            raise UserError() from exc

    def report(self):
        """The run's diagnosis as a dict, readable at any time (no side effects).

        Returns:
            `verdict` (the run's one verdict, `OscillationDetector.verdict()`:
            dominant over the run; before any event, the judgement of the
            current window; `healthy` when nothing was found, `unknown` when
            too few steps were seen), `fix`, `phase` (where the time goes),
            `cost_share`, `because` (what the verdict rests on), `changed`
            (the live events that said otherwise, or None), `errors` (internal failures
            that were skipped): the head every keras_gpufix callback's
            `report()` starts with. Then `events` (dicts with `verdict`,
            `phase`, `start_step`, `end_step`, `cv`, `period`,
            `cost_share`, `evidence`, `fix`, `message`), `step_time`
            (`StepLog.summary()` of the records after warmup: per-step
            cycle figures, `samples_per_s`, `phases`,
            `audio_seconds_per_s`, `real_frames_per_s`), `phases` (share of
            the cycle per phase), `input_wait` (share, None when not
            measured), `gpu_util` (mean, None without NVML),
            `epoch_start_ms` (mean first step of an epoch), `new_shapes`,
            `job` (the multi-worker job's report, `analysis.judge_job`; None
            outside a job or without `log_dir`), `series` (every record
            of the run in at most 1024 points, `analysis.StepSeries`) and
            `contention` (what other processes took of the CPU from the
            run's start to its end, or to now: `analysis.cpu_contention`;
            None before a run), `steady_contention` (the same from the first
            step after warmup: None before it), `trackers` (the tracker runs logged to:
            `Trackers.runs`).
        """
        summary = self.detector.log.summary()
        gpu_util = None
        if self._sampler is not None:
            gpu_util = self._sampler.mean_between(0.0, float("inf"))
        count, seconds = self._firsts
        return {
            **self._verdict_report(),
            "events": [dict(e) for e in self.events],
            "step_time": summary,
            "phases": summary["phases"] or dict.fromkeys(("input_wait", "step", "between"), 0.0),
            "input_wait": summary["input_wait"],
            "gpu_util": gpu_util,
            "epoch_start_ms": seconds / count * 1e3 if count else None,
            "new_shapes": 0 if self.stream is None else self.stream.shapes_seen,
            "job": self.job,
            "series": self._series.as_dict(),
            "contention": None if self._cpu[0] is None else cpu_contention(
                self._cpu[0], self._cpu[1] or cpu_load.sample()),
            "steady_contention": None if self._cpu[2] is None else cpu_contention(
                self._cpu[2], self._cpu[1] or cpu_load.sample()),
            "trackers": self._trackers.runs,
        }

    def _keep(self, ended_by=None):
        """Writes the run's record (`RunRecord`) into `log_dir/keras_gpufix/`.

        Called at the end of each run, and when SIGTERM or SIGINT stops it
        (`ended_by`: the signal's name), where `log_dir` was given.

        Returns:
            The record's path.
        """
        return RunRecord.from_monitor(self.report(), ended_by=ended_by).write(
            os.path.join(os.fspath(self.log_dir), "keras_gpufix"))
