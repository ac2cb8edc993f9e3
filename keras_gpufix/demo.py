"""`keras-gpufix demo`: the whole fast path on a generated corpus, no data or GPU needed.

1. `kg.data.make_synthetic_corpus` writes a small LJSpeech-style corpus (speech-like
   audio, one deliberately truncated file) and a YAML config beside it;
2. `kg.from_config` makes the strategy, dtype policy, dataset builder
   (feature cache, length buckets) and the monitors;
3. a tiny mel-prediction model is compiled with `kg.compile_model` (XLA)
   and trained for a few epochs with the monitors attached;
4. the report: what the builder skipped and padded, what the compile
   helper set, the monitor's one verdict and its evidence (step times,
   input shapes and traces, the XProf trace's numbers).

TensorFlow's own C++ and absl log lines are hidden for the run
(`TF_CPP_MIN_LOG_LEVEL=2` unless already set, before TensorFlow is
imported; TF 2.21 writes its import-time `I0000`/`W0000`/`E0000` lines before
reading it, so those are filtered from stderr while TensorFlow loads);
`TF_CPP_MIN_LOG_LEVEL=0 keras-gpufix demo` shows them all.
"""

import os
import re
import sys
import tempfile
import time
import warnings

__all__ = ["run_demo", "format_demo", "DEMO_CONFIG"]

DEMO_CONFIG = """\
# Written by `keras-gpufix demo`; check it with `keras-gpufix validate {name}`.
data:
  corpus: corpus
  audio: {{n_mels: 40, max_seconds: 4.0}}
  batch_size: 8
  num_buckets: 4
  cache_dir: cache
  on_bad_input: skip
  prefetch: auto
training:
  jit_compile: true
  mixed_precision: auto
  steps_per_execution: 1
  epochs: {epochs}
distribute:
  mode: auto
monitor:
  window: 16
  warmup: 3
  log_dir: logs
  profiling: {{trigger: [oscillation, 12], steps: 6, max_traces: 1}}
"""


def _model(vocab_size, n_mels):
    """Predicts the next mel frame from the previous ones and the text."""
    import keras

    text = keras.Input((None,), dtype="int32", name="text")
    mel = keras.Input((None, n_mels), name="mel")
    summary = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(vocab_size, 32)(text))
    x = keras.layers.Conv1D(64, 5, padding="causal", activation="relu")(mel)
    x = keras.layers.Conv1D(64, 5, padding="causal", activation="relu")(x)
    x = x + keras.layers.Dense(64)(summary)[:, None, :]
    out = keras.layers.Dense(n_mels, dtype="float32")(x)
    return keras.Model({"text": text, "mel": mel}, out, name="tiny_mel_predictor")


_TF_LOG_LINE = re.compile(r"^([IWE]\d{4} |WARNING: All log messages before absl)")


def _import_tensorflow_quietly():
    """Imports TensorFlow (and probes its devices) with its log lines hidden."""
    if "tensorflow" in sys.modules or os.environ.get("TF_CPP_MIN_LOG_LEVEL") not in (None, "2"):
        import tensorflow as tf
    else:
        os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
        sys.stderr.flush()
        saved = os.dup(2)
        with tempfile.TemporaryFile("w+") as captured:
            os.dup2(captured.fileno(), 2)
            try:
                import tensorflow as tf

                tf.config.list_physical_devices()
            finally:
                os.dup2(saved, 2)
                os.close(saved)
            captured.seek(0)
            for line in captured:
                if not _TF_LOG_LINE.match(line):
                    sys.stderr.write(line)
    from absl import logging as absl_logging

    absl_logging.set_verbosity(absl_logging.ERROR)
    return tf


def run_demo(workdir=None, utterances=96, epochs=3, verbose=1):
    """Generates a corpus, trains briefly with the monitors, returns the report.

    Args:
        workdir: folder for the corpus, cache, config and logs. Defaults to
            a new temp folder.
        utterances: generated utterances (1 to 4 s each). Defaults to 96.
        epochs: training epochs. Defaults to 3.
        verbose: progress output. Defaults to 1.

    Returns:
        A dict: `workdir`, `config`, `corpus_seconds`, `builder` (its
        report), `compile` (the `CompileReport` as a dict), `fit_seconds`,
        `monitor`, `retracing`, `traces`, `loss` (first and last epoch).
    """
    import dataclasses

    tf = _import_tensorflow_quietly()

    import keras_gpufix as kg

    workdir = workdir or tempfile.mkdtemp(prefix="keras_gpufix_demo_")
    os.makedirs(workdir, exist_ok=True)
    config_path = os.path.join(workdir, "demo.yaml")
    with open(config_path, "w") as f:
        f.write(DEMO_CONFIG.format(name=config_path, epochs=epochs))
    t0 = time.perf_counter()
    corpus = os.path.join(workdir, "corpus")
    if not os.path.exists(os.path.join(corpus, "metadata.csv")):
        if verbose:
            print(f"Generating {utterances} utterances in {corpus} ...", flush=True)
        kg.data.make_synthetic_corpus(corpus, utterances, min_seconds=1.0, max_seconds=4.0,
                            bad_files=("truncated",))
    corpus_seconds = time.perf_counter() - t0

    setup = kg.from_config(config_path)
    for cb in setup.callbacks:
        cb.verbose = verbose
    setup.builder.verbose = verbose
    n_mels = setup.builder.audio.n_mels

    def to_xy(text, mel):
        (ids, _), (frames, _) = text, mel
        return {"text": ids, "mel": frames[:, :-1]}, frames[:, 1:]

    train = setup.dataset(seed=0).map(to_xy)
    with setup.strategy.scope():
        model = _model(setup.builder.text.num_ids, n_mels)
        report = kg.compile_model(model, "adam", "mse", **setup.compile_kwargs)
    t1 = time.perf_counter()
    with warnings.catch_warnings():  # the builder shuffles itself; fit's shuffle does not apply
        warnings.filterwarnings("ignore", message=".*shuffle=True.*")
        history = model.fit(train, epochs=setup.config.training.epochs,
                            callbacks=setup.callbacks, verbose=2 if verbose else 0)
    fit_seconds = time.perf_counter() - t1
    reports = {type(cb).__name__: cb.report() for cb in setup.callbacks}
    losses = history.history.get("loss", [])
    return {
        "workdir": workdir,
        "config": config_path,
        "corpus_seconds": corpus_seconds,
        "builder": dict(setup.builder.report),
        "compile": dataclasses.asdict(report),
        "fit_seconds": fit_seconds,
        "monitor": reports["GPUOscillationMonitor"],
        "retracing": reports["RetracingMonitor"],
        "traces": reports["ProfilerTrigger"]["traces"],
        "log_dir": setup.config.path(setup.config.monitor.log_dir),
        "loss": [losses[0], losses[-1]] if losses else [],
        "devices": [d.name for d in tf.config.list_logical_devices()],
    }


def format_demo(result):
    b, m, r = result["builder"], result["monitor"], result["retracing"]
    st = m.get("step_time") or {}
    lines = [
        f"keras-gpufix demo in {result['workdir']} (config {result['config']})",
        f"data:     {b['utterances']} utterances kept, {len(b['skipped'])} skipped"
        + "".join(f"\n          skipped line {s['line']} ({s['id']}): {s['reason']}"
                  for s in b["skipped"])
        + f"\n          cache {b['cache']}, {b['distinct_shapes']} batch shapes, padding "
        f"efficiency {b['padding_efficiency']:.1%}, bucket boundaries {b['bucket_boundaries']}",
    ]
    c = result["compile"]
    lines.append(f"compile:  jit_compile={c.get('jit_compile')}, policy {c.get('policy')}, "
                 f"steps_per_execution={c.get('steps_per_execution')}"
                 + (f", fallback: {c['fallback_reason']}" if c.get("fallback_reason") else ""))
    loss = result["loss"]
    lines.append(f"fit:      {result['fit_seconds']:.1f} s"
                 + (f", loss {loss[0]:.3f} -> {loss[1]:.3f}" if loss else ""))
    if st.get("count"):
        wait = m.get("input_wait")
        lines.append(f"steps:    {st['count']} timed, median {st['p50_ms']:.1f} ms, p95 "
                     f"{st['p95_ms']:.1f} ms, cv {st['cv']:.2f}"
                     + ("" if wait is None else f", input wait {wait:.1%}")
                     + (f", {st['samples_per_s']:.0f} utterances/s" if st.get("samples_per_s") else ""))
    lines.append(f"verdict:  {m.get('verdict')} (GPUOscillationMonitor.report())")
    lines.append(f"evidence: retracing: {r.get('new_shapes')} input shapes, "
                 f"{r.get('trace_count')} traces")
    for t in result["traces"]:
        a = t.get("analysis") or {}
        if "classification" in a:
            lines.append(f"evidence: XProf trace of steps {t['start_step']}-{t['end_step']}: step "
                         f"{a.get('step_time_ms') or 0:.1f} ms, input {a.get('input_percent') or 0:.1f}%")
    lines.append(f"next:     tensorboard --logdir {result['log_dir']}   |   keras-gpufix "
                 f"validate {result['config']}")
    lines.append("TensorFlow's own log lines were hidden: TF_CPP_MIN_LOG_LEVEL=0 keras-gpufix demo "
                 "shows them")
    return "\n".join(lines)
