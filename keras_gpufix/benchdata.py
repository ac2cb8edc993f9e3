"""`keras-gpufix bench-data` and `keras-gpufix cache`: the input path alone.

`bench_data` times `SpeechDatasetBuilder.build` pipelines with no model,
over a grid of batch sizes and tf.data thread-pool sizes
(`tf.data.Options().threading.private_threadpool_size`), and recommends the
fastest setting: its batches/s is how many steps/s of a model it can feed.

`cache_build`, `cache_info` and `cache_clear` manage the builder's feature
cache (`kg.data.FeatureCache`) ahead of training. The cache entry depends
on the corpus and on the audio/text configs, so they take the same
`--config` as training (or the defaults).
"""

import os
import time

__all__ = ["bench_data", "cache_build", "cache_info", "cache_clear", "format_bench",
           "format_cache"]


def _builder(corpus, cache_dir=None, config=None, verbose=1):
    """(builder, cache_dir) from a corpus and an optional YAML config."""
    from keras_gpufix import data
    from keras_gpufix.config import load_config

    if not os.path.isdir(corpus):
        raise FileNotFoundError(f"CORPUS must be a corpus folder. Received: {corpus!r}")
    kwargs = {}
    if config is not None:
        cfg = load_config(config)
        if cfg.data.audio:
            kwargs["audio"] = data.AudioConfig(**cfg.data.audio)
        if cfg.data.text:
            kwargs["text"] = data.TextConfig(**cfg.data.text)
        if cfg.data.on_bad_input is not None:
            kwargs["on_bad_input"] = cfg.data.on_bad_input
        cache_dir = cache_dir or cfg.path(cfg.data.cache_dir)
    return data.SpeechDatasetBuilder(corpus, cache_dir=cache_dir, verbose=verbose,
                                     **kwargs), cache_dir


def _dir_size(path):
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:
                pass
    return total


def _need_cache_dir(cache_dir):
    if not cache_dir:
        raise ValueError("no cache folder: pass --cache-dir DIR or --config with data.cache_dir")


def cache_info(corpus, cache_dir=None, config=None, verbose=0):
    """The cache entry for `corpus` (with `config`'s audio/text settings).

    Returns:
        A dict: `cache_dir`, `fingerprint`, `path`, `status` (`"fresh"`:
        complete and intact for the corpus as it is now; `"missing"`),
        `utterances` (in the corpus scan; in the entry when fresh),
        `size_bytes`, `skipped` (bad utterances: dicts `id`, `path`, `line`,
        `reason`) and `other_entries` (other
        fingerprints in the folder: stale versions of this corpus or other
        corpora, with their sizes) and `leftovers` (temporary folders of
        interrupted or failed builds, which `cache_clear` removes).
    """
    from keras_gpufix.data.cache import FeatureCache

    builder, cache_dir = _builder(corpus, cache_dir, config, verbose=0)
    _need_cache_dir(cache_dir)
    cache = builder.cache_entry()
    fresh = cache.verify(full=False)
    mine = cache.name
    return {
        "action": "info",
        "corpus": corpus,
        "cache_dir": cache_dir,
        "fingerprint": cache.key,
        "path": cache.path,
        "status": "fresh" if fresh else "missing",
        "utterances": len(builder.utterances),
        "skipped": builder.report["skipped"],
        "size_bytes": _dir_size(cache.path) if fresh else 0,
        "other_entries": [{"name": n, "size_bytes": _dir_size(os.path.join(cache_dir, n))}
                          for n in FeatureCache.entries(cache_dir) if n != mine],
        "leftovers": [{"name": n, "size_bytes": _dir_size(os.path.join(cache_dir, n))}
                      for n in FeatureCache.leftovers(cache_dir)],
    }


def cache_build(corpus, cache_dir=None, config=None, verbose=1):
    """Builds the feature cache of `corpus` now (progress bar with `verbose`).

    Returns:
        `cache_info` plus `build` (`"hit"` if it was already there, else
        `"miss"`) and `seconds` (time to open or build it).
    """
    from keras_gpufix.data.audio import resampled_length
    from keras_gpufix.data.cache import FeatureCache

    builder, cache_dir = _builder(corpus, cache_dir, config, verbose=verbose)
    _need_cache_dir(cache_dir)
    cache = builder.cache_entry()
    if not cache.verify(full=False):
        cache.check_writable()
        audio = builder.audio
        frames = [audio.num_frames(resampled_length(u.info.frames, u.info.sample_rate,
                                                    audio.sample_rate))
                  for u in builder.utterances]
        cache.check_space(FeatureCache.estimate_bytes(frames, audio.n_mels))
    t0 = time.perf_counter()
    builder.prepare()
    seconds = time.perf_counter() - t0
    info = cache_info(corpus, cache_dir=cache_dir, config=config)
    return {**info, "action": "build", "build": builder.report["cache"], "seconds": seconds}


def cache_clear(corpus, cache_dir=None, config=None, all_entries=False, verbose=0):
    """Removes the cache entry of `corpus` (every entry with `all_entries`),
    and the temporary folders that interrupted or failed builds left.

    An entry is renamed aside first, so no reader ever sees half of one.

    Returns:
        A dict: `cache_dir`, `removed` (entry and leftover names),
        `freed_bytes`.
    """
    from keras_gpufix.data.cache import FeatureCache

    builder, cache_dir = _builder(corpus, cache_dir, config, verbose=0)
    _need_cache_dir(cache_dir)
    mine = builder.cache_entry().name
    entries = FeatureCache.entries(cache_dir)
    names = (entries if all_entries else [n for n in entries if n == mine]) \
        + FeatureCache.leftovers(cache_dir)
    removed, freed = [], 0
    for name in names:
        size = _dir_size(os.path.join(cache_dir, name))
        FeatureCache.remove(cache_dir, name)
        removed.append(name)
        freed += size
    return {"action": "clear", "corpus": corpus, "cache_dir": cache_dir, "removed": removed,
            "freed_bytes": freed}


def _measure(dataset, seconds):
    """(batches, utterances, seconds, first-batch seconds) reading `dataset`."""
    t0 = time.perf_counter()
    iterator = iter(dataset.repeat())
    next(iterator)
    first = time.perf_counter() - t0
    batches = utterances = 0
    t1 = time.perf_counter()
    while time.perf_counter() - t1 < seconds:
        (_, text_len), _ = next(iterator)
        batches += 1
        utterances += int(text_len.shape[0])
    return batches, utterances, time.perf_counter() - t1, first


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
        verbose: print one line per setting. Defaults to 1.

    Returns:
        A dict: `corpus`, `utterances`, `cache` (`hit`/`miss`/`off`),
        `cache_seconds`, `runs` (one per setting: `batch_size`,
        `parallel`, `batches_per_s`, `utterances_per_s`, `first_batch_s`,
        `batches`, `seconds`), `best` (the fastest run in utterances/s)
        and `recommendation` (one sentence).
    """
    import tensorflow as tf

    builder, cache_dir = _builder(corpus, cache_dir, config, verbose=verbose)
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
        batches, utterances, elapsed, first = _measure(dataset, seconds)
        run = {"batch_size": batch_size, "parallel": threads,
               "batches_per_s": batches / elapsed, "utterances_per_s": utterances / elapsed,
               "first_batch_s": first, "batches": batches, "seconds": elapsed}
        runs.append(run)
        if verbose:
            print(f"[{i}/{len(grid)}] batch {batch_size:4d}, parallel {str(threads):>4}: "
                  f"{run['batches_per_s']:8.1f} batches/s, {run['utterances_per_s']:8.1f} "
                  f"utterances/s (first batch {first:.2f} s)", flush=True)
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


def _mb(n):
    return f"{n / 2**20:.1f} MiB"


def format_cache(result):
    if result["action"] == "clear":
        if not result["removed"]:
            return f"nothing to clear in {result['cache_dir']}"
        return (f"removed {len(result['removed'])} entr{'y' if len(result['removed']) == 1 else 'ies'} "
                f"from {result['cache_dir']} ({_mb(result['freed_bytes'])}): "
                + ", ".join(result["removed"]))
    lines = []
    if result["action"] == "build":
        lines.append(f"cache {result['build']} in {result['seconds']:.2f} s")
    lines += [
        f"corpus:       {result['corpus']} ({result['utterances']} utterances, "
        f"{len(result['skipped'])} skipped)",
        f"cache entry:  {result['path']}",
        f"fingerprint:  {result['fingerprint']}",
        f"status:       {result['status']}"
        + ("" if result["status"] == "fresh" else " (run `keras-gpufix cache build`)"),
        f"size:         {_mb(result['size_bytes'])}",
    ]
    others = result["other_entries"]
    if others:
        lines.append(f"other entries ({len(others)}, stale or other corpora; "
                     "`cache clear --all` removes them): "
                     + ", ".join(f"{o['name']} ({_mb(o['size_bytes'])})" for o in others))
    leftovers = result["leftovers"]
    if leftovers:
        lines.append(f"leftovers ({len(leftovers)}, from interrupted or failed builds; "
                     "`cache clear` removes them): "
                     + ", ".join(f"{o['name']} ({_mb(o['size_bytes'])})" for o in leftovers))
    lines += [f"skipped {s['path']}" + (f" (line {s['line']})" if s["line"] is not None else "")
              + f": {s['reason']}" for s in result["skipped"]]
    return "\n".join(lines)
