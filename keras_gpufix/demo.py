"""`keras-gpufix demo`: the whole fast path on a generated corpus, no data or GPU needed.

1. `kg.data.make_synthetic_corpus` writes a small LJSpeech-style corpus (speech-like
   audio, one deliberately truncated file) and a YAML config beside it;
2. `kg.from_config` makes the strategy, dtype policy, dataset builder
   (feature cache, length buckets) and the monitors;
3. a tiny mel-prediction model is compiled with `kg.compile_model` (XLA)
   and trained for a few epochs with the monitors attached;
4. the report: what the builder skipped and padded, what the compile
   helper set, the monitors' verdict, shapes and the XProf trace conclusion.
"""

import os
import tempfile
import time

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

    import tensorflow as tf

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
    history = model.fit(train, epochs=setup.config.training.epochs, callbacks=setup.callbacks,
                        verbose=2 if verbose else 0)
    fit_seconds = time.perf_counter() - t1
    reports = {type(cb).__name__: cb.report() for cb in setup.callbacks}
    losses = history.history.get("loss", [])
    return {
        "workdir": workdir,
        "config": config_path,
        "corpus_seconds": corpus_seconds,
        "builder": dict(setup.builder.report),
        "compile": dataclasses.asdict(report) if dataclasses.is_dataclass(report) else str(report),
        "fit_seconds": fit_seconds,
        "monitor": reports.get("GPUOscillationMonitor"),
        "retracing": reports.get("RetracingMonitor"),
        "traces": (reports.get("ProfilerTrigger") or {}).get("traces", []),
        "log_dir": setup.config.path(setup.config.monitor.log_dir),
        "loss": [losses[0], losses[-1]] if losses else [],
        "devices": [d.name for d in tf.config.list_logical_devices()],
    }


def format_demo(result):
    b, m, r = result["builder"], result["monitor"] or {}, result["retracing"] or {}
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
    if isinstance(c, dict):
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
    lines.append(f"verdict:  {m.get('verdict')} (GPUOscillationMonitor); retracing: "
                 f"{r.get('new_shapes')} input shapes, {r.get('trace_count')} traces -> "
                 f"{r.get('verdict')}")
    for t in result["traces"]:
        a = t.get("analysis") or {}
        if "classification" in a:
            lines.append(f"XProf:    steps {t['start_step']}-{t['end_step']}: step "
                         f"{a.get('step_time_ms') or 0:.1f} ms, input {a.get('input_percent') or 0:.1f}% "
                         f"-> {a['classification']}")
    lines.append(f"next:     tensorboard --logdir {result['log_dir']}   |   keras-gpufix "
                 f"validate {result['config']}")
    return "\n".join(lines)
