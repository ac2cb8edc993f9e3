"""`keras-gpufix demo`: the problem caught and fixed, side by side, no data or GPU needed.

1. `kg.data.make_synthetic_corpus` writes a small LJSpeech-style corpus (speech-like
   audio, one deliberately truncated file) and a YAML config beside it;
2. `kg.from_config` makes the strategy, dtype policy, dataset builder
   (feature cache, length buckets) and the monitors;
3. the naive way: a tiny mel-prediction model (as light a step on the CPU as a
   GPU makes a real model's, so the naive way's costs are those a GPU run
   meets: its input and its padding) trained from the naive loader
   (`keras_gpufix.data.naive`: a NumPy spectrogram in `tf.numpy_function`,
   padded batches, its utterances' lengths told to the monitors) with
   `model.compile` defaults, the monitors attached;
4. the keras_gpufix way: the same model from the config's cached, bucketed
   dataset, compiled with `kg.compile_model` (XLA), the same monitors;
5. the report: what the builder skipped and padded, each way's one verdict
   (`GPUOscillationMonitor.report()`, judged after the way's first epoch, whose
   XLA compiles, one per length bucket, are expected) with its evidence (the
   input wait, the padding, the shapes), the naive way's other ranked causes,
   and utterances/s after the first epoch, each way's first epoch split into
   compiling (`RetracingMonitor`'s priced compiles: tracing, and XLA
   compiling or loading from the compile cache) and training, each way's
   wall time (its setup, feature cache and compile included, to its last
   epoch), the measured ratio naming the faster way and the pay-back point:
   after how many utterances (and seconds) the keras_gpufix way had caught
   up with the naive way, both counted from their setup, measured in this
   run (projected at the steady rates, and said so, when it had not yet);
   then the promise check: the gain the naive way's verdict predicted for
   the fix of each of its causes, all of them together, beside the gain the
   keras_gpufix way measured, and the phase (input wait, step, time between
   steps) where what no fix covered went;
6. each way's run record (`logs/<way>/run_record.json`, written by its
   monitor) rendered as `logs/<way>/report.html` (`keras-gpufix report`).

The demo keeps its work folder across runs: `~/.cache/keras_gpufix/demo`
(`$XDG_CACHE_HOME/keras_gpufix/demo`) unless `workdir` (`--dir`) names
another, printed at the start; `fresh` (`--fresh`) removes what an earlier
demo left there first. A rerun reuses the corpus (generated again when
`utterances` changed), opens the feature cache (checked against the corpus
and the config as always) and loads the keras_gpufix way's XLA compiles from
`cache/xla` beside it (`CompileCache`, turned on before TensorFlow starts);
the `speed:` line says how many shapes came from the compile cache and how
many were compiled afresh, and why. Each run's logs replace the previous
run's.

Both ways are traced once by a `kg.ProfilerTrigger` in steady state (up to 6
steps of the second epoch, from its second step), so TensorBoard's Profile
tab shows the two side by side: runs `naive` and `keras_gpufix` under
`logs/`, each with its `step_timer/*` and `oscillation/*` scalars and its
trace.

TensorFlow's own C++ and absl log lines are hidden for the run
(`TF_CPP_MIN_LOG_LEVEL=3` unless already set, before TensorFlow is
imported: errors too, as XLA:CPU logs two `E0000` lines for each compile
it loads from the cache on some CPUs (docs/compile.md); TF 2.21 writes its
import-time `I0000`/`W0000`/`E0000` lines before reading it, so those are
filtered from stderr while TensorFlow loads);
`TF_CPP_MIN_LOG_LEVEL=0 keras-gpufix demo` shows them all.
"""

import gc
import glob
import json
import os
import shutil
import tempfile
import time

from keras_gpufix.compile.compile_cache import CompileCache, user_cache_dir
from keras_gpufix.output import emit, faster, import_tensorflow_quietly
from keras_gpufix.run_record import RunRecord

__all__ = ["run_demo", "format_demo", "prepare_workdir", "DEMO_CONFIG"]

# what a demo writes in its work folder: `fresh` removes these, and nothing else
_MADE = ("corpus", "corpus.json", "cache", "demo.yaml")
_RUNS = ("logs/naive", "logs/keras_gpufix")  # each run's logs replace the previous run's

DEMO_CONFIG = """\
# Written by `keras-gpufix demo`; check it with `keras-gpufix validate {name}`.
data:
  corpus: corpus
  audio: {{n_mels: 40, max_seconds: 4.0}}
  cache_dir: cache
  on_bad_input: skip
build: {{batch_size: 8, num_buckets: 3}}
compile: {{jit_compile: true, mixed_precision: auto, steps_per_execution: 1}}
strategy: {{mode: auto}}
callbacks:
  # warmup: the first epoch: its XLA compiles (one per bucket) are not judged (the demo
  # sets each way's monitor to its own first epoch's steps)
  GPUOscillationMonitor: {{window: 16, warmup: {warmup}, log_dir: logs}}
  RetracingMonitor: {{max_new_shapes: 5}}
  StepTimer: {{log_dir: logs}}
  # no ProfilerTrigger: the demo traces each way's second epoch itself (steady state)
fit: {{epochs: {epochs}}}
"""


def prepare_workdir(workdir=None, fresh=False):
    """The demo's work folder, made ready for a run.

    Args:
        workdir: the folder; None: `user_cache_dir("demo")`
            (`~/.cache/keras_gpufix/demo`). Defaults to None.
        fresh: remove what an earlier demo left there (its corpus, feature
            and compile caches, config and logs; nothing else in the
            folder) first. Defaults to False.

    Returns:
        The folder (absolute). The previous run's logs (and any scalars a
        stopped run left half-moved) are removed either way. Nothing is
        removed from a folder whose `demo.yaml` the demo did not write.
    """
    workdir = os.path.abspath(workdir or user_cache_dir("demo"))
    os.makedirs(workdir, exist_ok=True)
    try:
        with open(os.path.join(workdir, "demo.yaml")) as f:
            ours = f.readline().startswith(DEMO_CONFIG.split("{", 1)[0])
    except OSError:
        ours = False
    if not ours:  # a new folder, or not the demo's: nothing to remove
        return workdir
    leftovers = _RUNS + tuple(glob.glob(os.path.join(workdir, ".naive_scalars_*")))
    for name in (_MADE if fresh else ()) + leftovers:
        path = os.path.join(workdir, name)
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.unlink(path)
    return workdir


def _corpus(kg, workdir, utterances, verbose):
    """The generated corpus of `utterances`: made when there is none, made
    again when an earlier demo generated another one (`corpus.json` beside
    it says what it made); a corpus the demo did not make is used as it is."""
    corpus = os.path.join(workdir, "corpus")
    stamp = os.path.join(workdir, "corpus.json")
    made = {"utterances": utterances, "min_seconds": 1.0, "max_seconds": 4.0,
            "bad_files": ["truncated"]}
    there = os.path.exists(os.path.join(corpus, "metadata.csv"))
    try:
        with open(stamp) as f:
            same = json.load(f) == made and there
    except (OSError, ValueError):  # none made by the demo: is there one at all?
        same = there
    if not same:
        if os.path.exists(stamp):
            shutil.rmtree(corpus, ignore_errors=True)
        emit(f"Generating {utterances} utterances in {corpus} ...", verbose)
        kg.data.make_synthetic_corpus(corpus, utterances, min_seconds=made["min_seconds"],
                                      max_seconds=made["max_seconds"],
                                      bad_files=tuple(made["bad_files"]))
        with open(stamp, "w") as f:
            json.dump(made, f)
    return corpus


def _model(vocab_size, n_mels):
    """Predicts the next mel frame from the previous ones and the text: as light
    a step on the CPU as a GPU makes a real model's (a few milliseconds), so the
    naive way's costs are those a GPU run meets: its input and its padding."""
    import keras

    text = keras.Input((None,), dtype="int32", name="text")
    mel = keras.Input((None, n_mels), name="mel")
    summary = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(vocab_size, 16)(text))
    x = keras.layers.Conv1D(32, 5, padding="causal", activation="relu")(mel)
    x = x + keras.layers.Dense(32)(summary)[:, None, :]
    out = keras.layers.Dense(n_mels, dtype="float32")(x)
    return keras.Model({"text": text, "mel": mel}, out, name="tiny_mel_predictor")


def _import_tensorflow_quietly():
    """Imports TensorFlow with its log lines hidden (absl's too; errors too,
    unless the user set `TF_CPP_MIN_LOG_LEVEL`)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import_tensorflow_quietly()
    import tensorflow as tf
    from absl import logging as absl_logging

    absl_logging.set_verbosity(absl_logging.ERROR)
    return tf


def _steady_rate(epoch_seconds, samples_per_epoch):
    """Samples/s over every epoch after the first (None with one epoch)."""
    steady = epoch_seconds[1:]
    return samples_per_epoch * len(steady) / sum(steady) if steady else None


def _steady_trace(kg, log_dir, steps_per_epoch, epochs):
    """A `ProfilerTrigger` that traces up to 6 steps of the second epoch, from its
    second step on (the first epoch's XLA compiles and each epoch's first step,
    iterator start-up, left out); None with one epoch."""
    if epochs < 2:
        return None
    offset = min(max(1, steps_per_epoch // 4), steps_per_epoch - 1)
    return kg.ProfilerTrigger(log_dir, trigger=[steps_per_epoch + offset],
                              steps=max(1, min(6, steps_per_epoch - offset)), max_traces=1,
                              verbose=0)


def _name_run(staging, run_dir):
    """Moves the scalars our callbacks wrote under `staging` (their TensorBoard run
    `keras_gpufix`) into `run_dir`, and removes `staging`."""
    written = os.path.join(staging, "keras_gpufix")
    os.makedirs(run_dir, exist_ok=True)
    for entry in os.listdir(written):
        os.replace(os.path.join(written, entry), os.path.join(run_dir, entry))
    shutil.rmtree(staging)


def _side(monitor, retracing, trace, steps_per_epoch, epoch_seconds, samples_per_epoch,
          history, started, step_ends):
    losses = history.history.get("loss", [])
    per_step = samples_per_epoch / steps_per_epoch
    compiles = [e for e in retracing.report()["shape_events"] if e["epoch"] == 0]
    report = monitor.report()
    return {
        "monitor": report,
        "phase_ms": _phase_ms(report["step_time"]),
        "retracing": retracing.report(),
        "traces": [] if trace is None else trace.report()["traces"],
        "steps_per_epoch": steps_per_epoch,
        "epoch_seconds": epoch_seconds,
        "fit_seconds": sum(epoch_seconds),
        "samples_per_epoch": samples_per_epoch,
        "steady_samples_per_s": _steady_rate(epoch_seconds, samples_per_epoch),
        "loss": [losses[0], losses[-1]] if losses else [],
        "first_epoch_compile_s": sum(e["cost_ms"] for e in compiles) / 1e3,
        "wall_seconds": step_ends[-1] - started if step_ends else None,
        "progress": [((i + 1) * per_step, t - started) for i, t in enumerate(step_ends)],
    }


def _padding(report):
    """The padding share of the features' frames the monitor's latest judgement
    measured (`analysis.judge`'s evidence), or None."""
    return next((e["evidence"]["padding"] for e in reversed(report.get("events") or ())
                 if e["evidence"].get("padding") is not None), None)


def _phase_ms(summary):
    """Milliseconds per utterance in each phase of the cycle (`PHASES`), over the
    steps the monitor judged (`StepLog.summary()`); None without samples."""
    from keras_gpufix.analysis import PHASES

    rate, phases = summary.get("samples_per_s"), summary.get("phases") or {}
    if not rate:
        return None
    return {p: 1e3 * (phases.get(p) or 0.0) / rate for p in PHASES}


def _promise(naive, fast, fast_padding=None):
    """The naive way's predicted gain for each fix of its causes, beside the gain the
    keras_gpufix way measured, and what no fix covered.

    Args:
        naive, fast: `run_demo` sides.
        fast_padding: the keras_gpufix way's padding share (its builder's
            `1 - padding_efficiency`), or None.

    Returns:
        None without both steady rates; else a dict: `causes` (the naive way's
        ranked causes: `verdict`, `share`, `speedup` (predicted, the whole run
        once its time goes), `phase`, `fix`), `predicted` (all of them
        together, `analysis.combined_speedup`; 1.0 with none), `measured` (the
        keras_gpufix way's steady utterances/s over the naive way's),
        `not_covered` (`measured / predicted`) and `phases`: per phase,
        milliseconds per utterance `[naive, predicted once the fixes remove
        their causes' time, keras_gpufix]` (None without the monitors' rates),
        `padding` (`[naive, keras_gpufix]` shares of padded frames, each None
        when not measured).
    """
    from keras_gpufix.analysis import combined_speedup

    slow, quick = naive["steady_samples_per_s"], fast["steady_samples_per_s"]
    if not slow or not quick:
        return None
    causes = [c for c in naive["monitor"].get("causes") or () if c.get("share")]
    predicted = combined_speedup([c["speedup"] for c in causes]) if causes else 1.0
    phases = None
    before, after = naive["phase_ms"], fast["phase_ms"]
    if before and after:
        cycle = sum(before.values())
        left = dict(before)
        for c in causes:
            if c.get("phase") in left:
                left[c["phase"]] = max(0.0, left[c["phase"]] - c["share"] * cycle)
        phases = {p: [before[p], left[p], after[p]] for p in before}
    measured = quick / slow
    return {"causes": causes, "predicted": predicted, "measured": measured,
            "not_covered": None if predicted is None else measured / predicted,
            "phases": phases, "padding": [_padding(naive["monitor"]), fast_padding]}


def _at(progress, utterances, rate):
    """Seconds a way took to reach `utterances` (linear between its steps,
    at its steady `rate` past its last step)."""
    (n0, t0) = (0.0, 0.0)
    for n1, t1 in progress:
        if utterances <= n1:
            return t0 + (t1 - t0) * (utterances - n0) / (n1 - n0) if n1 > n0 else t1
        n0, t0 = n1, t1
    return t0 + (utterances - n0) / rate if rate else float("inf")


def _payback(slow, fast):
    """When `fast` caught up with `slow`: both counted from their setup.

    Args:
        slow, fast: `run_demo` sides (their `progress`: (utterances done,
            seconds since the way's setup began) at each step's end, and
            `steady_samples_per_s`).

    Returns:
        None when `fast` never catches up (not faster in steady state);
        else a dict: `utterances`, `seconds` (fast's time then) and
        `measured` (True: within this run; False: projected at both ways'
        steady rates past the run's end).
    """
    for n, t in fast["progress"]:
        if t <= _at(slow["progress"], n, slow["steady_samples_per_s"]):
            return {"utterances": n, "seconds": t, "measured": True}
    r_slow, r_fast = slow["steady_samples_per_s"], fast["steady_samples_per_s"]
    if not fast["progress"] or not r_slow or not r_fast or r_fast <= r_slow:
        return None
    n, t = fast["progress"][-1]
    extra = (t - _at(slow["progress"], n, r_slow)) / (1 / r_slow - 1 / r_fast)
    return {"utterances": n + extra, "seconds": t + extra / r_fast, "measured": False}


def _fit(model, dataset, epochs, callbacks, steps=None):
    """`model.fit` quietly; returns (history, wall seconds of each epoch, the
    `perf_counter` time of each step's end)."""
    import keras

    seconds, start, ends = [], [], []
    clock = keras.callbacks.LambdaCallback(
        on_epoch_begin=lambda epoch, logs: start.append(time.perf_counter()),
        on_train_batch_end=lambda batch, logs: ends.append(time.perf_counter()),
        on_epoch_end=lambda epoch, logs: seconds.append(time.perf_counter() - start[-1]))
    history = model.fit(dataset, epochs=epochs, steps_per_epoch=steps, shuffle=False,
                        callbacks=[clock, *callbacks], verbose=0)  # both loaders shuffle
    return history, seconds, ends


def run_demo(workdir=None, utterances=96, epochs=3, verbose=1, fresh=False):
    """Generates a corpus, trains it the naive way and the keras_gpufix way.

    Both ways train the same tiny model on the same generated corpus, one
    after the other in this process, with the same monitors: first the
    naive loader (`keras_gpufix.data.naive.naive_dataset`: a NumPy
    spectrogram in `tf.numpy_function`, padded batches) with
    `model.compile` defaults, then the config's path (`kg.from_config`: feature cache, length
    buckets, `kg.compile_model`).

    Args:
        workdir: folder for the corpus, caches, config and logs, kept for
            the next run. Defaults to `~/.cache/keras_gpufix/demo`
            (`prepare_workdir`).
        utterances: generated utterances (1 to 4 s each). Defaults to 96.
        epochs: training epochs of each way (throughput is measured over
            every epoch after the first). Defaults to 3.
        verbose: one progress line per phase. Defaults to 1.
        fresh: start clean: remove what an earlier demo left in `workdir`.
            Defaults to False.

    Returns:
        A dict: `workdir`, `config`, `corpus_seconds`, `cache_seconds`
        (opening or building the feature cache), `builder` (its
        report), `compile` (the `CompileReport` as a dict), `naive` and
        `keras_gpufix` (each: `monitor` and `retracing` reports, `traces`
        (ProfilerTrigger's: one XProf trace of up to 6 steps of the second
        epoch, none with one epoch), `steps_per_epoch`, `epoch_seconds`,
        `fit_seconds`, `samples_per_epoch`, `steady_samples_per_s`, `loss`
        first and last epoch, `first_epoch_compile_s` (the first epoch's
        priced compiles), `wall_seconds` (from the way's setup to its last
        step), `progress` (utterances done and seconds since the setup at
        each step's end), `phase_ms` (`_phase_ms`)), `payback`
        (`_payback(naive, keras_gpufix)`), `promise` (`_promise(naive,
        keras_gpufix)`: the naive way's predicted gain per fix beside the
        measured),
        `compile_cache` (`directory`, `active`, `note`, `entries` (before
        the keras_gpufix way's fit), `written`: entries its fit added, i.e.
        its fresh compiles, `fresh_shapes`: the batch shapes whose first
        step added one), `log_dir` (TensorBoard: runs `naive` and
        `keras_gpufix`, each with its scalars, its trace and its run record),
        `reports` (each way's HTML report), `devices`.
    """
    import dataclasses

    workdir = prepare_workdir(workdir, fresh)
    emit(f"keras-gpufix demo: work folder {workdir} (kept for the next run: corpus, feature "
         "cache, XLA compiles; --dir DIR chooses another, --fresh starts clean)", verbose)
    # before TensorFlow starts (it reads TF_XLA_FLAGS once): beside the feature cache
    compile_cache = CompileCache.enable(beside=os.path.join(workdir, "cache"))
    tf = _import_tensorflow_quietly()

    import keras

    import keras_gpufix as kg
    from keras_gpufix.data.naive import naive_dataset

    config_path = os.path.join(workdir, "demo.yaml")
    with open(config_path, "w") as f:
        f.write(DEMO_CONFIG.format(name=config_path, epochs=epochs, warmup=utterances // 8))
    t0 = time.perf_counter()
    corpus = _corpus(kg, workdir, utterances, verbose)
    corpus_seconds = time.perf_counter() - t0

    setup = kg.from_config(config_path)
    cfg = setup.config
    for cb in setup.callbacks:
        cb.verbose = 0
    setup.builder.verbose = verbose
    audio, text = setup.builder.audio, setup.builder.text

    def to_xy(text_batch, mel_batch):
        (ids, _), (frames, _) = text_batch, mel_batch
        return {"text": ids, "mel": frames[:, :-1]}, frames[:, 1:]

    m = cfg.callbacks["GPUOscillationMonitor"]
    log_dir = m["log_dir"]
    staging = tempfile.mkdtemp(prefix=".naive_scalars_", dir=workdir)  # then run `naive`
    naive_ds, naive_steps = naive_dataset(corpus, cfg.build["batch_size"], audio, text, seed=0)
    monitor = kg.GPUOscillationMonitor(  # as the config's, judged after the first epoch
        **{**m, "log_dir": staging, "warmup": naive_steps, "verbose": 0})
    retracing = kg.RetracingMonitor(**{**cfg.callbacks["RetracingMonitor"], "warn": False,
                                       "verbose": 0})

    emit(f"1/2 naive: NumPy spectrogram in tf.numpy_function, padded batches, model.compile "
         f"defaults; {epochs} epochs ...", verbose)
    started = time.perf_counter()
    policy = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy("float32")  # model.compile's default
    naive_model = _model(text.num_ids, audio.n_mels)
    naive_model.compile("adam", "mse")
    keras.mixed_precision.set_global_policy(policy)
    naive_trace = _steady_trace(kg, os.path.join(log_dir, "naive"), naive_steps, epochs)
    history, seconds, ends = _fit(naive_model, naive_ds.map(to_xy).repeat(), epochs,
                                  [monitor, retracing, kg.StepTimer(log_dir=staging)]
                                  + [naive_trace] * (naive_trace is not None), steps=naive_steps)
    _name_run(staging, os.path.join(log_dir, "naive"))  # beside the keras_gpufix way's run
    naive = _side(monitor, retracing, naive_trace, naive_steps, seconds,
                  naive_steps * cfg.build["batch_size"], history, started, ends)
    del naive_ds, naive_model, history
    gc.collect()  # the naive iterator's threads stop making batches the monitors would see

    emit(f"2/2 keras_gpufix: {os.path.basename(config_path)} through kg.from_config (feature "
         f"cache, length buckets, kg.compile_model); {epochs} epochs ...", verbose)
    started = t1 = time.perf_counter()
    setup.builder.prepare()  # the feature cache, timed apart from fit
    cache_seconds = time.perf_counter() - t1
    train = setup.dataset(seed=0).map(to_xy).repeat()  # as the naive way: one iterator
    with setup.strategy.scope():
        model = _model(text.num_ids, audio.n_mels)
        report = kg.compile_model(model, "adam", "mse", **setup.compile_kwargs)
    steps = setup.builder.report["batches_per_epoch"]
    callbacks = [kg.GPUOscillationMonitor(**{**m, "warmup": steps, "verbose": 0})
                 if isinstance(cb, kg.GPUOscillationMonitor) else cb
                 for cb in setup.callbacks]  # judged after its own first epoch
    trace = _steady_trace(kg, os.path.join(log_dir, "keras_gpufix"), steps,
                          setup.fit_kwargs["epochs"])
    after_step = []  # compile entries after each step: a step that added one compiled afresh
    entries = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: after_step.append(len(compile_cache.entries())))
    with compile_cache.watch() as written:
        history, seconds, ends = _fit(model, train, setup.fit_kwargs["epochs"],
                                      callbacks + [trace] * (trace is not None)
                                      + [entries], steps=steps)
    by_name = {type(cb).__name__: cb for cb in callbacks}
    fast = _side(by_name["GPUOscillationMonitor"], by_name["RetracingMonitor"], trace, steps,
                 seconds, setup.builder.report["utterances"], history, started, ends)
    kept = report.compile_cache or {}
    reports = {way: RunRecord.load(os.path.join(log_dir, way)).write_html() for way in
               ("naive", "keras_gpufix")}  # the records each way's monitor wrote
    return {
        "workdir": workdir,
        "config": config_path,
        "corpus_seconds": corpus_seconds,
        "cache_seconds": cache_seconds,
        "builder": dict(setup.builder.report),
        "compile": dataclasses.asdict(report),
        "naive": naive,
        "keras_gpufix": fast,
        "payback": _payback(naive, fast),
        "promise": _promise(naive, fast, 1.0 - setup.builder.report["padding_efficiency"]),
        "compile_cache": {**kept, "written": written["written"], "fresh_shapes": _fresh_shapes(
            fast["retracing"]["shape_events"], after_step, kept.get("entries") or 0)},
        "log_dir": log_dir,
        "reports": reports,
        "devices": [d.name for d in tf.config.list_logical_devices()],
    }


def _trace_line(t, steps_per_epoch):
    a = t.get("analysis") or {}
    epoch = t["start_step"] // steps_per_epoch + 1
    head = (f"          evidence: XProf trace of steps {t['start_step']}-{t['end_step']} "
            f"(epoch {epoch})")
    if "classification" not in a:
        why = a.get("error") or ("XProf is still analysing it" if t.get("pending")
                                 else "XProf found no step in it")
        return f"{head}: not analysed ({why})"
    return (f"{head}: step {a.get('step_time_ms') or 0:.1f} ms, input "
            f"{a.get('input_percent') or 0:.1f}%")


def _side_lines(side, compiled=""):
    m, r = side["monitor"], side["retracing"]
    wait = m.get("input_wait")
    rate = side["steady_samples_per_s"]
    loss = side["loss"]
    padding = _padding(m)
    lines = [f"          verdict:  {m.get('verdict')} (GPUOscillationMonitor.report(), steps after "
             "the first epoch)",
             f"          evidence: median step {(m.get('step_time') or {}).get('p50_ms') or 0:.1f} ms"
             + ("" if wait is None else f", input wait {wait:.0%}")
             + ("" if padding is None else f", padding {padding:.0%} of the frames")
             + f", {r.get('new_shapes')} input shapes, {r.get('trace_count')} traces"]
    lines += [_trace_line(t, side["steps_per_epoch"]) for t in side["traces"]]
    if m.get("verdict") != "healthy":
        lines.append(f"          fix:      {m.get('fix')}")
    for c in (m.get("causes") or ())[1:]:  # ranked after the verdict's own
        lines.append(f"          also:     {c['verdict']}, {c['share']:.0%} of the run: {c['fix']}")
    first, compiling = side["epoch_seconds"][0], side["first_epoch_compile_s"]
    lines.append(f"          speed:    first epoch {first:.1f} s (compiling {compiling:.1f} s"
                 f"{compiled}; training and start-up {max(0.0, first - compiling):.1f} s), then "
                 + ("-" if rate is None else f"{rate:.0f} utterances/s")
                 + (f"; loss {loss[0]:.3f} -> {loss[1]:.3f}" if loss else ""))
    return lines


def _fresh_shapes(shape_events, after_step, before):
    """The batch shapes compiled afresh: those whose first step added a compile
    entry (`after_step`: the entries after each step of the fit; `before`: at
    its start; `shape_events`: `RetracingMonitor.report()`'s)."""
    fresh = []
    for e in shape_events:
        step = e["step"]
        if e["shape"] is not None and step < len(after_step) \
                and after_step[step] > (after_step[step - 1] if step else before):
            fresh.append(e["shape"])
    return fresh


def _cache_words(cache, shapes):
    """How the keras_gpufix way's compiles went: from the compile cache or
    fresh, and for fresh ones which and why."""
    if not cache.get("active"):
        return ", not kept across runs (compile cache off)"
    fresh = min(cache["written"], shapes)
    which = " ".join(json.dumps(s, separators=(",", ":")) for s in cache.get("fresh_shapes") or [])
    why = ("" if not fresh else " (the compile cache was empty)" if not cache["entries"]
           else f" ({which + ': ' if which else ''}not in the compile cache: no earlier run "
                "compiled it with this model, TensorFlow and XLA flags, or its entry was removed)")
    return f", {shapes - fresh} of {shapes} shapes from the compile cache, {fresh} fresh{why}"


def _payback_words(p, ways=("keras_gpufix", "naive")):
    fast, slow = ways
    if p is None:
        return f"{fast} does not catch up with {slow} (not faster in steady state)"
    when = f"{p['utterances']:.0f} utterances ({p['seconds']:.1f} s from its setup)"
    return (f"{fast} caught up with {slow} after {when}, measured in this run" if p["measured"]
            else f"{fast} had not caught up with {slow} by the end of this run: at the steady "
                 f"rates it would after {when}")


def _promise_lines(p, jit):
    """The promise check for people: each fix's predicted gain, all of them against
    the measured gain, and where the time no fix covered went."""
    if p is None:
        return []
    x = lambda v: "unbounded" if v is None else f"{v:.2f}x"  # noqa: E731
    lines = ["promise:  the naive way's verdict priced each fix; the keras_gpufix way made "
             "them all (utterances/s after the first epoch)"]
    lines += [f"          {c['verdict']} ({c['share']:.0%} of the naive run): its fix predicted "
              f"{x(c['speedup'])}" for c in p["causes"]]
    if not p["causes"]:
        lines.append("          the naive way's verdict named no cause: no fix predicted a gain")
    lines.append(f"          together: predicted {x(p['predicted'])}, measured "
                 f"{x(p['measured'])}")
    covered = p["not_covered"]
    if covered is None:
        return lines
    if abs(covered - 1.0) < 0.10:
        lines.append(f"          covered: the fixes' prediction is within 10% of the measured "
                     "gain")
        return lines
    text = (f"          not covered by any fix: {x(covered)} "
            + ("beyond" if covered > 1 else "short of") + " the prediction")
    if not p["phases"]:  # a way's monitor gave no per-phase rates
        lines.append(text + "; where it went was not measured (no per-phase rates)")
        return lines
    gaps = {ph: v[1] - v[2] for ph, v in p["phases"].items()}
    worst = max(gaps, key=lambda ph: abs(gaps[ph]))
    before, left, after = p["phases"][worst]
    name = {"input_wait": "input wait", "step": "step", "between": "time between steps"}[worst]
    text += (f"; the {name} per utterance: {before:.1f} ms naive, "
             f"{left:.1f} ms predicted with the fixes, {after:.1f} ms measured")
    if worst == "step" and gaps[worst] > 0:
        naive_pad, fast_pad = p["padding"]
        padded = ("" if naive_pad is None or fast_pad is None
                  else f", padded to its bucket ({naive_pad:.0%} -> {fast_pad:.0%} of the frames "
                       "padding)")
        text += (f": the keras_gpufix way's step is compiled with XLA (jit_compile={jit})"
                 f"{padded} and has the cores to itself (no NumPy input beside it); no fix "
                 "priced those")
    lines.append(text)
    return lines


def format_demo(result):
    """The demo's report for people: data, both ways side by side, the ratio."""
    b, c, cache = result["builder"], result["compile"], result["compile_cache"]
    naive, fast = result["naive"], result["keras_gpufix"]
    skipped = "".join(f"\n          skipped line {s['line']} ({s['id']}): {s['reason']}"
                      for s in b["skipped"])
    lines = [
        f"keras-gpufix demo in {result['workdir']} (config {result['config']})",
        f"data:     {b['utterances']} utterances kept, {len(b['skipped'])} skipped{skipped}",
        f"          cache {b['cache']} ({result['cache_seconds']:.1f} s), {b['distinct_shapes']} "
        f"batch shapes, padding efficiency {b['padding_efficiency']:.1%}, bucket boundaries "
        f"{b['bucket_boundaries']}",
        "naive:    NumPy spectrogram in tf.numpy_function, padded_batch, model.compile defaults",
        *_side_lines(naive),
        f"keras_gpufix: feature cache, {len(b['bucket_boundaries'])} length buckets, "
        f"compile_model (jit_compile={c.get('jit_compile')}, policy {c.get('policy')}, "
        f"steps_per_execution={c.get('steps_per_execution')})"
        + (f", fallback: {c['fallback_reason']}" if c.get("fallback_reason") else ""),
        "          compile cache: " + (
            f"{cache['directory']} ({cache['entries']} entries before this run; keras-gpufix "
            f"cache info {os.path.join(result['workdir'], 'corpus')} --config {result['config']}"
            " lists them)" if cache.get("active") else f"off: {cache.get('note')}"),
        # one XLA compile per batch shape: the builder's count (RetracingMonitor's
        # new_shapes read 5 for these 3 once: its input cursor lost the dataset)
        *_side_lines(fast, _cache_words(cache, b["distinct_shapes"])),
        "result:   " + faster("keras_gpufix", fast["steady_samples_per_s"], "naive",
                              naive["steady_samples_per_s"], " utterances/s")
        + " after the first epoch, same corpus and model, this run; "
        + _payback_words(result["payback"]),
        *_promise_lines(result.get("promise"), c.get("jit_compile")),
        f"wall:     naive {naive['wall_seconds']:.1f} s, keras_gpufix {fast['wall_seconds']:.1f} s "
        "(each way from its setup, feature cache and compile included, to its last step)",
        f"report:   {result['reports']['naive']}  {result['reports']['keras_gpufix']}",
        f"next:     tensorboard --logdir {result['log_dir']} (runs naive and keras_gpufix; "
        "Profile tab: one trace of each)   |   keras-gpufix compare "
        f"{os.path.join(result['log_dir'], 'naive')} "
        f"{os.path.join(result['log_dir'], 'keras_gpufix')}   |   keras-gpufix validate "
        + result["config"],
        "TensorFlow's own log lines were hidden: TF_CPP_MIN_LOG_LEVEL=0 keras-gpufix demo "
        "shows them",
    ]
    return "\n".join(lines)
