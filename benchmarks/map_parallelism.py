"""Feature passes over a corpus: an autotuned `tf.data` map against the builder's every-core map.

The dataset builder computes features from audio in one-off passes (the
cache build, the trimmed-length pass, `build()` without a cache) with
`_map_on_every_core` (`keras_gpufix/data/builder.py`): tf.data autotuning
off, `2 * usable_cpus()` calls in flight, single-threaded ops inside them.
This benchmark runs the builder's per-utterance feature computation over a
generated corpus three ways, in `--rounds` interleaved rounds: `autotuned`
(`map(num_parallel_calls=AUTOTUNE)` then `prefetch(AUTOTUNE)`, tf.data's
defaults, what the builder did before), `fixed_calls` (the same calls in
flight as `every_core`, autotuning left on) and `every_core`. Each round prints
utterances/s and CPU time / wall time (about the number of cores kept
busy); a round under 1.3 counts as "on one core". Prints the median and
best of each way, and their ratios.

Usage:

    python benchmarks/map_parallelism.py --utterances 300 --rounds 8
"""

import argparse
import os
import shutil
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from _results import add_out_argument, write_results  # noqa: E402

import keras_gpufix as kg  # noqa: E402
from keras_gpufix.compile.hardware import usable_cpus  # noqa: E402
from keras_gpufix.data.builder import _map_on_every_core  # noqa: E402

__all__ = ["main"]

ONE_CORE = 1.3  # CPU time / wall time under this: the pass ran on about one core


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--utterances", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--features", choices=("mel", "linear"), default="mel")
    add_out_argument(parser, "map_parallelism")
    args = parser.parse_args(argv)
    workdir = tempfile.mkdtemp(prefix="kg_map_")
    try:
        corpus = os.path.join(workdir, "corpus")
        kg.data.make_synthetic_corpus(corpus, args.utterances, seed=0)
        builder = kg.data.SpeechDatasetBuilder(
            corpus, audio=kg.data.AudioConfig(features=args.features), verbose=0)
        compute = builder._compute_features()
        count = len(builder.utterances)
        source = tf.data.Dataset.range(count)

        def frames(index):
            return tf.shape(compute(index))[0]

        ways = {
            "autotuned": lambda: source.map(frames, num_parallel_calls=tf.data.AUTOTUNE,
                                            deterministic=False).prefetch(tf.data.AUTOTUNE),
            "fixed_calls": lambda: source.map(frames, num_parallel_calls=2 * usable_cpus(),
                                              deterministic=False).prefetch(2 * usable_cpus()),
            "every_core": lambda: _map_on_every_core(source, frames, deterministic=False),
        }
        rates = {name: [] for name in ways}
        busy = {name: [] for name in ways}
        print(f"{count} utterances, {args.features} features, {usable_cpus()} usable cores")
        for round_ in range(args.rounds):
            for name, make in ways.items():
                dataset = make()
                start, cpu = time.perf_counter(), time.process_time()
                total = sum(int(f) for f in dataset)
                wall = time.perf_counter() - start
                assert total > 0
                rates[name].append(count / wall)
                busy[name].append((time.process_time() - cpu) / wall)
                print(f"round {round_}: {name:11s} {rates[name][-1]:7.1f} utterances/s, "
                      f"CPU/wall {busy[name][-1]:.2f}", flush=True)
        figures = {}
        for name in ways:
            one_core = sum(b < ONE_CORE for b in busy[name])
            print(f"{name:11s} median {np.median(rates[name]):7.1f}, best {max(rates[name]):7.1f} "
                  f"utterances/s; rounds on about one core (CPU/wall < {ONE_CORE}): "
                  f"{one_core} of {args.rounds}")
            figures.update({
                f"{name}_median_utterances_per_s": round(float(np.median(rates[name])), 1),
                f"{name}_best_utterances_per_s": round(max(rates[name]), 1),
                f"{name}_rounds_on_one_core": one_core,
                f"{name}_median_cpu_over_wall": round(float(np.median(busy[name])), 2),
            })
        median_ratio = figures["every_core_median_utterances_per_s"] / figures[
            "autotuned_median_utterances_per_s"]
        print(f"every_core / autotuned: median {median_ratio:.2f}x, best "
              f"{max(rates['every_core']) / max(rates['autotuned']):.2f}x")
        figures["ratio_median_every_core_over_autotuned"] = round(median_ratio, 2)
        write_results(args.out, "map_parallelism", figures,
                      {"rates": rates, "cpu_over_wall": busy, "rounds": args.rounds,
                       "features": args.features})
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
