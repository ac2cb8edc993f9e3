"""`keras-gpufix cache build|info|clear`: the feature cache ahead of training.

`cache_build`, `cache_info` and `cache_clear` manage the builder's feature
cache (`kg.data.FeatureCache`, which owns the layout: listing, leftovers,
removing) ahead of training, and the XLA compile entries kept beside it
(`<cache_dir>/xla`, where `kg.from_config` keeps them: `CompileCache`).
The cache entry depends on the corpus and on the audio/text configs, so they take the same `--config` as training (or
the defaults); `corpus_builder` turns those arguments into a
`SpeechDatasetBuilder` (`bench-data` uses it too).
"""

import os
import time

__all__ = ["corpus_builder", "cache_build", "cache_info", "cache_clear", "format_cache"]


def corpus_builder(corpus, cache_dir=None, config=None, verbose=1):
    """A `SpeechDatasetBuilder` for `corpus` with a config's data settings.

    Args:
        corpus: LJSpeech-style corpus folder or JSON Lines manifest.
        cache_dir: feature cache folder; overrides the config's
            `data.cache_dir`. Defaults to None.
        config: YAML config path (its `data` section, through
            `config.builder_kwargs`). Defaults to None.
        verbose: the builder's `verbose`. Defaults to 1.

    Returns:
        `(builder, cache_dir)`.

    Raises:
        FileNotFoundError: `corpus` is neither a folder nor a manifest file.
    """
    from keras_gpufix import data
    from keras_gpufix.config import builder_kwargs, load_config

    if not os.path.exists(corpus):
        raise FileNotFoundError(f"CORPUS {corpus} does not exist: check the path (a corpus "
                                "folder or a JSON Lines manifest)")
    if not (os.path.isdir(corpus) or corpus.endswith((".jsonl", ".json")) and os.path.isfile(corpus)):
        raise FileNotFoundError(
            f"CORPUS must be a corpus folder or a JSON Lines manifest (.jsonl). Received: {corpus!r}")
    kwargs = {} if config is None else builder_kwargs(load_config(config))
    if cache_dir is not None:
        kwargs["cache_dir"] = cache_dir
    return data.SpeechDatasetBuilder(corpus, verbose=verbose, **kwargs), kwargs.get("cache_dir")


def _dir_size(path):
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:
                pass
    return total


def _need_cache_dir(cache_dir, exists=False):
    """Raises unless a cache folder was given (and, with `exists`, is there)."""
    if not cache_dir:
        raise ValueError("no cache folder: pass --cache-dir DIR or --config with data.cache_dir")
    if exists and not os.path.isdir(cache_dir):
        raise FileNotFoundError(f"cache folder {cache_dir} does not exist: check the path, or "
                                "create it with `keras-gpufix cache build`")


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
        interrupted or failed builds, which `cache_clear` removes),
        `compile_dir` and `compile_entries` (the XLA compile entries
        beside the feature cache: dicts `name`, `size_bytes`, `age_s`).
    """
    from keras_gpufix.compile.compile_cache import CompileCache
    from keras_gpufix.data.cache import FeatureCache

    builder, cache_dir = corpus_builder(corpus, cache_dir, config, verbose=0)
    _need_cache_dir(cache_dir, exists=True)
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
        "compile_dir": CompileCache.default_directory(beside=cache_dir),
        "compile_entries": _compile_cache(cache_dir).entries(),
    }


def _compile_cache(cache_dir):
    """The XLA compile entries kept beside the feature cache in `cache_dir`."""
    from keras_gpufix.compile.compile_cache import CompileCache

    return CompileCache(CompileCache.default_directory(beside=cache_dir))


def cache_build(corpus, cache_dir=None, config=None, verbose=1):
    """Builds the feature cache of `corpus` now (progress bar with `verbose`).

    `SpeechDatasetBuilder.prepare` checks, before computing anything, that
    the folder is writable and its disk has room for the estimated entry
    (one-line `OSError` otherwise).

    Returns:
        `cache_info` plus `build` (`"hit"` if it was already there, else
        `"miss"`) and `seconds` (time to open or build it).
    """
    builder, cache_dir = corpus_builder(corpus, cache_dir, config, verbose=verbose)
    _need_cache_dir(cache_dir)
    t0 = time.perf_counter()
    builder.prepare()
    seconds = time.perf_counter() - t0
    info = cache_info(corpus, cache_dir=cache_dir, config=config)
    return {**info, "action": "build", "build": builder.report["cache"], "seconds": seconds}


def cache_clear(corpus, cache_dir=None, config=None, all_entries=False, verbose=0):
    """Removes the cache entry of `corpus` (every entry with `all_entries`),
    the temporary folders that interrupted or failed builds left, and the
    XLA compile entries beside them.

    An entry is renamed aside first, so no reader ever sees half of one.

    Returns:
        A dict: `cache_dir`, `removed` (entry and leftover names),
        `compile_removed` (compile entry names), `freed_bytes` (both).
    """
    from keras_gpufix.data.cache import FeatureCache

    builder, cache_dir = corpus_builder(corpus, cache_dir, config, verbose=0)
    _need_cache_dir(cache_dir, exists=True)
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
    compiled = _compile_cache(cache_dir).clear()
    return {"action": "clear", "corpus": corpus, "cache_dir": cache_dir, "removed": removed,
            "compile_removed": compiled["removed"],
            "freed_bytes": freed + compiled["freed_bytes"]}


def _mb(n):
    return f"{n / 2**20:.1f} MiB"


def _age(seconds):
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f} {unit}"
    return f"{seconds:.0f} s"


def format_cache(result):
    if result["action"] == "clear":
        compiled = len(result["compile_removed"])
        if not result["removed"] and not compiled:
            return f"nothing to clear in {result['cache_dir']}"
        n = len(result["removed"])
        return (f"removed {n} entr{'y' if n == 1 else 'ies'} "
                + (f"and {compiled} XLA compile entr{'y' if compiled == 1 else 'ies'} "
                   if compiled else "")
                + f"from {result['cache_dir']} ({_mb(result['freed_bytes'])})"
                + (": " + ", ".join(result["removed"]) if n else ""))
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
        f"compiles:     {len(result['compile_entries'])} XLA compile entries in "
        f"{result['compile_dir']} "
        f"({_mb(sum(e['size_bytes'] for e in result['compile_entries']))}; kept across runs, "
        "`cache clear` removes them)",
        *(f"  {e['name']}  {_mb(e['size_bytes'])}, written {_age(e['age_s'])} ago"
          for e in result["compile_entries"]),
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
