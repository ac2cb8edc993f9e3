"""`keras-gpufix bench-data`: the input path alone.

`bench_data` times `SpeechDatasetBuilder.build` pipelines with no model,
over a grid of batch sizes and tf.data thread-pool sizes
(`tf.data.Options().threading.private_threadpool_size`), and recommends the
fastest setting: its batches/s is how many steps/s of a model it can feed.
"""

import time

from keras_gpufix.cache_cli import corpus_builder
from keras_gpufix.output import emit, progress

__all__ = ["bench_data", "format_bench"]


def _measure(dataset, seconds, verbose):
    """(batches, utterances, seconds, first-batch seconds) reading `dataset`
    (a live batch count on a terminal)."""
    t0 = time.perf_counter()
    iterator = iter(dataset.repeat())
    next(iterator)
    first = time.perf_counter() - t0
    batches = utterances = 0
    update = progress(None, "batch", verbose)
    t1 = time.perf_counter()
    while time.perf_counter() - t1 < seconds:
        (_, text_len), _ = next(iterator)
        batches += 1
        utterances += int(text_len.shape[0])
        update(batches)
    elapsed = time.perf_counter() - t1
    update(batches, finalize=True)
    return batches, utterances, elapsed, first


def bench_data(corpus, batch_sizes=(16, 32, 64), parallel=("auto",), seconds=3.0,
               num_buckets=8, cache_dir=None, config=None, verbose=1):
    """Input-pipeline throughput over a grid, and the setting to use.

    Args:
        corpus: LJSpeech-style corpus folder.
        batch_sizes: batch sizes to try. Defaults to (16, 32, 64).
        parallel: tf.data thread-pool sizes (`"auto"`: TensorFlow's
            default). Defaults to ("auto",).
        seconds: measuring time per setting (after the first batch).
            Defaults to 3.0.
        num_buckets: as for `build`. Defaults to 8.
        cache_dir: feature cache; opened or built (timed) before the runs.
            Defaults to None (features computed in the pipeline).
        config: YAML config for audio/text/cache_dir. Defaults to None.
        verbose: one line per setting (and a live batch count on a
            terminal). Defaults to 1.

    Returns:
        A dict: `corpus`, `utterances`, `cache` (`hit`/`miss`/`off`),
        `cache_seconds`, `runs` (one per setting: `batch_size`,
        `parallel`, `batches_per_s`, `utterances_per_s`, `first_batch_s`,
        `batches`, `seconds`), `best` (the fastest run in utterances/s)
        and `recommendation` (one sentence).
    """
    import tensorflow as tf

    builder, cache_dir = corpus_builder(corpus, cache_dir, config, verbose=verbose)
    t0 = time.perf_counter()
    builder.prepare()
    cache_seconds = time.perf_counter() - t0
    runs = []
    grid = [(b, p) for b in batch_sizes for p in parallel]
    for i, (batch_size, threads) in enumerate(grid, start=1):
        dataset = builder.build(batch_size=batch_size, num_buckets=num_buckets, seed=0)
        if threads != "auto":
            options = tf.data.Options()
            options.threading.private_threadpool_size = int(threads)
            dataset = dataset.with_options(options)
        batches, utterances, elapsed, first = _measure(dataset, seconds, verbose)
        run = {"batch_size": batch_size, "parallel": threads,
               "batches_per_s": batches / elapsed, "utterances_per_s": utterances / elapsed,
               "first_batch_s": first, "batches": batches, "seconds": elapsed}
        runs.append(run)
        emit(f"[{i}/{len(grid)}] batch {batch_size:4d}, parallel {str(threads):>4}: "
             f"{run['batches_per_s']:8.1f} batches/s, {run['utterances_per_s']:8.1f} "
             f"utterances/s (first batch {first:.2f} s)", verbose)
    best = max(runs, key=lambda r: (r["utterances_per_s"], -r["batch_size"]))
    recommendation = (
        f"batch_size={best['batch_size']}, parallel={best['parallel']}: "
        f"{best['utterances_per_s']:.0f} utterances/s, so this pipeline can feed a model at "
        f"up to {best['batches_per_s']:.1f} steps/s (a step slower than "
        f"{1e3 / best['batches_per_s']:.1f} ms will not wait for input)")
    return {"corpus": corpus, "utterances": len(builder.utterances),
            "cache": builder.report["cache"], "cache_seconds": cache_seconds,
            "runs": runs, "best": best, "recommendation": recommendation}


def format_bench(result):
    lines = [f"bench-data {result['corpus']}: {result['utterances']} utterances, "
             f"cache {result['cache']} ({result['cache_seconds']:.2f} s to open or build)",
             f"{'batch':>6} {'parallel':>8} {'batches/s':>10} {'utt/s':>9} {'first batch':>12}"]
    for r in result["runs"]:
        lines.append(f"{r['batch_size']:>6} {str(r['parallel']):>8} {r['batches_per_s']:>10.1f} "
                     f"{r['utterances_per_s']:>9.1f} {r['first_batch_s']:>11.2f}s")
    lines.append(f"recommended: {result['recommendation']}")
    return "\n".join(lines)
