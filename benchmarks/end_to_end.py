"""End to end: the same TTS model trained the naive way and the keras_gpufix way.

    python benchmarks/end_to_end.py [--utterances 256] [--rounds 3] [--quick] [--out PATH]

Both ways train `examples/train_tts.py`'s model (a light configuration, as
on a GPU where the input path decides) on the same generated LJSpeech-style
corpus, interleaved in one process: after a first epoch each, the ways
alternate blocks of `--block-epochs` epochs for `--rounds` rounds, so both
see the same machine load.

| way          | input                                         | compile                  |
|--------------|-----------------------------------------------|--------------------------|
| naive        | `tf.numpy_function` reading the WAV (`wave`)  | `model.compile` defaults |
|              | and computing its NumPy mel spectrogram per   | (on CPU: no XLA,         |
|              | clip, every epoch (AUTOTUNE map parallelism), | steps_per_execution=1)   |
|              | `padded_batch` (each batch padded to its      |                          |
|              | longest clip, no bucketing), prefetch         |                          |
| keras_gpufix | `kg.data.SpeechDatasetBuilder` with the       | `kg.compile_model` (XLA, |
|              | feature cache, `num_buckets` length buckets   | measured                 |
|              |                                               | steps_per_execution)     |

Reported: steady-state samples/s per way (every epoch after each way's
first), their ratio, each way's first epoch (the feature cache build and
the XLA compiles for keras_gpufix) separately, and the verdicts of the
monitors (`GPUOscillationMonitor`, `RetracingMonitor`, `ProfilerTrigger`'s
XProf analysis) attached to both ways. The naive dataset goes through
`kg.data.instrument`, as `keras-gpufix diagnose` does, so the monitor
measures its input wait; the builder's dataset is instrumented already.
The naive loader is `keras_gpufix.data.naive` (the one `keras-gpufix demo`
shows). Figures go to `--out` (default `benchmarks/results/end_to_end.json`).
"""

import argparse
import importlib.util
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402

import keras_gpufix as kg  # noqa: E402
from keras_gpufix.data.naive import naive_dataset  # noqa: E402
from keras_gpufix.output import faster  # noqa: E402

from _results import add_out_argument, write_results  # noqa: E402 (beside this file)

_HERE = os.path.dirname(os.path.abspath(__file__))


def _load_example():
    path = os.path.join(_HERE, "..", "examples", "train_tts.py")
    spec = importlib.util.spec_from_file_location("train_tts", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tts = _load_example()


class EpochClock(keras.callbacks.Callback):
    """Wall time of every epoch."""

    def __init__(self):
        super().__init__()
        self.seconds = []

    def on_epoch_begin(self, epoch, logs=None):
        self._start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.seconds.append(time.perf_counter() - self._start)


class Way:
    """One way of training: a model, its dataset and its monitors' findings."""

    def __init__(self, name, model, dataset, steps, batch_size, log_dir, compile_info):
        self.name, self.model, self.dataset = name, model, dataset
        self.steps, self.batch_size, self.log_dir = steps, batch_size, log_dir
        self.compile_info = compile_info
        self.first_epoch_s = None
        self.epoch_s = []
        self.losses = []
        self.reports = []
        self.epoch = 0

    def run(self, epochs, monitor_window):
        clock = EpochClock()
        monitor = kg.GPUOscillationMonitor(window=monitor_window, warmup=3, verbose=0)
        retracing = kg.RetracingMonitor(warn=False, verbose=0)
        profiler = kg.ProfilerTrigger(self.log_dir, trigger="oscillation", steps=5,
                                      max_traces=1, cooldown=10, verbose=0)
        history = self.model.fit(self.dataset, initial_epoch=self.epoch,
                                 epochs=self.epoch + epochs, steps_per_epoch=self.steps,
                                 shuffle=False,  # both datasets shuffle themselves
                                 verbose=0, callbacks=[clock, monitor, retracing, profiler])
        self.epoch += epochs
        self.losses += history.history["loss"]
        if self.first_epoch_s is None:
            self.first_epoch_s = clock.seconds.pop(0)
        self.epoch_s += clock.seconds
        self.reports.append({"monitor": monitor.report(), "retracing": retracing.report(),
                             "traces": profiler.report().get("traces", [])})

    def summary(self):
        samples = self.steps * self.batch_size
        rates = [samples / s for s in self.epoch_s]
        last = self.reports[-1]
        mon, ret = last["monitor"], last["retracing"]
        traces = [t for r in self.reports for t in r["traces"]]
        analysis = traces[0].get("analysis") if traces else None
        return {
            "first_epoch_s": round(self.first_epoch_s, 2),
            "steady_epochs": len(self.epoch_s),
            "steady_epoch_s_median": round(statistics.median(self.epoch_s), 3),
            "steady_samples_per_s": round(samples * len(self.epoch_s) / sum(self.epoch_s), 1),
            "steady_samples_per_s_per_epoch": [round(r, 1) for r in rates],
            "loss_first_last": [round(self.losses[0], 4), round(self.losses[-1], 4)],
            "verdicts": [r["monitor"]["verdict"] for r in self.reports],
            "verdict": mon["verdict"],
            "input_wait": None if mon["input_wait"] is None else round(mon["input_wait"], 3),
            "step_ms_p50": round(mon["step_time"].get("p50_ms") or 0, 2),
            "step_cv": round(mon["step_time"].get("cv") or 0, 3),
            "fix": mon["fix"] if mon["verdict"] != "healthy" else None,
            "retracing": {k: ret.get(k) for k in ("verdict", "trace_count", "recompile_ms")},
            "new_shapes": len(ret.get("shapes") or []),
            "xprof": None if not analysis else {
                k: analysis.get(k) for k in ("step_time_ms", "input_percent", "classification")},
            "compile": self.compile_info,
        }


def build_model(vocab_size, args):
    return tts.build_model(vocab_size, n_mels=80, d_model=args.d_model, heads=2,
                           encoder_layers=1, decoder_layers=1, ff=2 * args.d_model,
                           reduction=args.reduction, dropout=0.0, postnet_channels=0)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--utterances", type=int, default=256)
    parser.add_argument("--min-seconds", type=float, default=1.0)
    parser.add_argument("--max-seconds", type=float, default=5.0)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--num-buckets", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3, help="alternating blocks per way")
    parser.add_argument("--block-epochs", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=32)
    parser.add_argument("--reduction", type=int, default=8)
    parser.add_argument("--mixed-precision", default="float32",
                        help='policy for the keras_gpufix way: "float32" (default: '
                             'on the 2-core test VM bfloat16 under XLA was slower), "auto", ...')
    parser.add_argument("--dir", help="work folder (default: a new temp folder)")
    parser.add_argument("--quick", action="store_true",
                        help="96 utterances, 1 round (about a minute on 2 cores)")
    add_out_argument(parser, "end_to_end")
    args = parser.parse_args(argv)
    if args.quick:
        args.utterances, args.rounds = min(args.utterances, 96), 1

    work = args.dir or tempfile.mkdtemp(prefix="kg_e2e_")
    corpus = os.path.join(work, "corpus")
    if not os.path.exists(os.path.join(corpus, "metadata.csv")):
        print(f"Generating {args.utterances} utterances ({args.min_seconds}-"
              f"{args.max_seconds} s) into {corpus} ...", flush=True)
        kg.data.make_synthetic_corpus(corpus, args.utterances, seed=0, min_seconds=args.min_seconds,
                            max_seconds=args.max_seconds)
    audio, text = kg.data.AudioConfig(), kg.data.TextConfig()
    vocab = len(text.vocabulary) + 2
    keras.utils.set_random_seed(0)

    # naive: model.compile defaults, float32
    keras.mixed_precision.set_global_policy("float32")
    naive_ds, naive_steps = naive_dataset(corpus, args.batch_size, audio, text, seed=0)
    naive_model = build_model(vocab, args)
    naive_model.compile(keras.optimizers.Adam(1e-3), "mae")
    naive = Way("naive", naive_model,
                tts.to_training_batches(naive_ds).repeat(), naive_steps, args.batch_size,
                os.path.join(work, "logs_naive"),
                {"jit_compile": naive_model.jit_compile, "policy": "float32",
                 "steps_per_execution": 1})

    # keras_gpufix: builder + cache + bucketing + compile_model
    start = time.perf_counter()
    strategy = kg.setup_strategy()
    policy = kg.enable_mixed_precision(args.mixed_precision)
    builder = kg.data.SpeechDatasetBuilder(corpus, audio=audio, text=text,
                                           cache_dir=os.path.join(work, "cache"), verbose=0)
    kg_ds = builder.build(batch_size=kg.global_batch_size(args.batch_size, strategy),
                          num_buckets=args.num_buckets, drop_remainder=True, seed=0)
    cache_s = time.perf_counter() - start
    kg_steps = builder.report["batches_per_epoch"]
    kg_train = tts.to_training_batches(kg_ds).repeat()
    with strategy.scope():
        kg_model = build_model(vocab, args)
        report = kg.compile_model(kg_model, keras.optimizers.Adam(1e-3), "mae",
                                  mixed_precision=policy, sample_batch=kg_train)
    cap = max(1, kg_steps // 8)  # callbacks fire once per execution: >= 8 per epoch
    calibrated = kg_model.steps_per_execution
    kg_model.steps_per_execution = min(calibrated, cap)
    setup_s = time.perf_counter() - start
    keras.mixed_precision.set_global_policy("float32")
    fast = Way("keras_gpufix", kg_model, kg_train, kg_steps, args.batch_size,
               os.path.join(work, "logs_kg"),
               {"jit_compile": report.jit_compile, "policy": report.policy,
                "steps_per_execution": kg_model.steps_per_execution,
                "steps_per_execution_calibrated": calibrated,
                "setup_s": round(setup_s, 2), "cache_build_s": round(cache_s, 2),
                "compile_model_s": round(setup_s - cache_s, 2), "cache": builder.report["cache"],
                "distinct_shapes": builder.report["distinct_shapes"],
                "padding_efficiency": builder.report["padding_efficiency"]})

    window = max(8, min(naive_steps, kg_steps) // 2)
    for way in (naive, fast):
        print(f"{way.name}: first epoch ...", flush=True)
        way.run(1, window)
    for r in range(args.rounds):
        for way in (naive, fast) if r % 2 == 0 else (fast, naive):
            print(f"round {r + 1}/{args.rounds}: {way.name}, {args.block_epochs} epochs ...",
                  flush=True)
            way.run(args.block_epochs, window)

    naive_s, fast_s = naive.summary(), fast.summary()
    figures = {
        "steady_samples_per_s_naive": naive_s["steady_samples_per_s"],
        "steady_samples_per_s_keras_gpufix": fast_s["steady_samples_per_s"],
        "ratio_steady_keras_gpufix_over_naive": round(
            fast_s["steady_samples_per_s"] / naive_s["steady_samples_per_s"], 2),
        "first_epoch_s_naive": naive_s["first_epoch_s"],
        "first_epoch_s_keras_gpufix": fast_s["first_epoch_s"],
        "setup_s_keras_gpufix": round(setup_s, 2),
        "verdict_naive": naive_s["verdict"],
        "verdict_keras_gpufix": fast_s["verdict"],
        "input_wait_naive": naive_s["input_wait"],
        "input_wait_keras_gpufix": fast_s["input_wait"],
        "steps_per_execution_keras_gpufix": fast_s["compile"]["steps_per_execution"],
    }
    details = {
        "corpus": {"utterances": args.utterances, "seconds": round(builder.report["seconds"], 1),
                   "range_s": [args.min_seconds, args.max_seconds]},
        "batch_size": args.batch_size,
        "naive": naive_s,
        "keras_gpufix": fast_s,
    }
    result = write_results(args.out, "end_to_end", figures, details)
    print(format_result(result))
    return 0


def format_result(result):
    d, f = result["details"], result["figures"]
    n, k = d["naive"], d["keras_gpufix"]
    lines = [
        f"machine: {result['machine']}",
        f"corpus: {d['corpus']['utterances']} generated utterances, "
        f"{d['corpus']['seconds']} s of audio ({d['corpus']['range_s'][0]}-"
        f"{d['corpus']['range_s'][1]} s clips); batch {d['batch_size']}",
        "",
        f"{'':28}{'naive':>20}{'keras_gpufix':>20}",
        f"{'steady samples/s':28}{n['steady_samples_per_s']:>20}{k['steady_samples_per_s']:>20}",
        f"{'steady epochs measured':28}{n['steady_epochs']:>20}{k['steady_epochs']:>20}",
        f"{'median step (ms)':28}{n['step_ms_p50']:>20}{k['step_ms_p50']:>20}",
        f"{'first epoch (s)':28}{n['first_epoch_s']:>20}{k['first_epoch_s']:>20}",
        f"{'  + before fit: cache (s)':28}{'-':>20}{k['compile']['cache_build_s']:>20}",
        f"{'  + before fit: compile (s)':28}{'-':>20}{k['compile']['compile_model_s']:>20}",
        f"{'monitor verdict':28}{n['verdict']:>20}{k['verdict']:>20}",
        f"{'input wait':28}{str(n['input_wait']):>20}{str(k['input_wait']):>20}",
        f"{'retracing verdict':28}{str(n['retracing']['verdict']):>20}"
        f"{str(k['retracing']['verdict']):>20}",
        f"{'XProf classification':28}"
        f"{(n['xprof'] or {}).get('classification', '-'):>20}"
        f"{(k['xprof'] or {}).get('classification', '-'):>20}",
        f"{'loss first -> last':28}{str(n['loss_first_last']):>20}"
        f"{str(k['loss_first_last']):>20}",
        "",
        "steady state: " + faster("keras_gpufix", k["steady_samples_per_s"], "naive",
                                  n["steady_samples_per_s"], " samples/s"),
        "first epoch, keras_gpufix's with its cache build and compile_model: "
        + faster("keras_gpufix", k["first_epoch_s"] + f["setup_s_keras_gpufix"], "naive",
                 n["first_epoch_s"], " s", durations=True),
        f"keras_gpufix compile: {k['compile']}",
    ]
    if n["fix"]:
        lines.append(f"naive fix suggested by the monitor: {n['fix']}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
