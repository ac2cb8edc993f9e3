"""Scan memory and time per utterance of `SpeechDatasetBuilder` at 10k-1M utterances.

    python benchmarks/corpus_scale.py            # 10k and 100k utterances
    python benchmarks/corpus_scale.py --full     # and 1M

Writes a JSON Lines manifest of N utterances (`id`, `text` of 40-160
characters, `duration`, `speaker` out of 1000) whose `audio_filepath`s point
to 64 shared tiny WAVs (0.1-0.5 s, 16 kHz), then, in a fresh process for
each N (so one size's memory never counts in another's), builds
`SpeechDatasetBuilder(manifest)` (the scan: the manifest, every WAV
header, the transcripts' ids) and `build(batch_size=32)` (the bucket
layout and the pipeline, not iterated). Reports the resident memory
(RSS) the builder holds after the scan and after `build`, the peak RSS, over
the process's RSS before (TensorFlow and the package imported), per
utterance, and the seconds per utterance of each stage. Goal: <= 1 KB per
utterance held, time linear in N.
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

from _results import add_out_argument, write_results

__all__ = ["main"]

GOAL_BYTES_PER_UTTERANCE = 1024
WORDS = ("the", "speech", "corpus", "holds", "a", "million", "short", "clips", "of", "read",
         "text", "and", "every", "one", "has", "its", "transcript", "with", "some", "words")


def _rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _write_manifest(folder, count, seed=0):
    import numpy as np

    from keras_gpufix.data.synthetic import _speech, write_wav

    rng = np.random.default_rng(seed)
    os.makedirs(os.path.join(folder, "wavs"), exist_ok=True)
    durations = []
    for i in range(64):
        seconds = 0.1 + 0.4 * i / 63
        write_wav(os.path.join(folder, "wavs", f"w{i:02d}.wav"), _speech(rng, seconds, 16000),
                  16000)
        durations.append(seconds)
    words = np.array(WORDS)
    path = os.path.join(folder, f"manifest-{count}.jsonl")
    with open(path, "w") as f:
        for i in range(count):
            text = " ".join(words[rng.integers(0, len(words), int(rng.integers(8, 30)))])
            f.write(json.dumps({"audio_filepath": f"wavs/w{i % 64:02d}.wav", "id": f"u{i:07d}",
                                "text": text, "duration": round(durations[i % 64], 4),
                                "speaker": f"s{i % 1000}"}) + "\n")
    return path


def _measure(manifest):
    """Runs in the child process: prints one JSON line of figures."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras_gpufix as kg

    kg.data.SpeechDatasetBuilder  # noqa: B018 (imports TensorFlow and the data package)
    import tensorflow as tf

    tf.constant(0)
    before = _rss_bytes()
    start = time.perf_counter()
    builder = kg.data.SpeechDatasetBuilder(manifest, verbose=0)
    scanned = time.perf_counter()
    after_scan = _rss_bytes()
    builder.build(batch_size=32, num_buckets=8)
    built = time.perf_counter()
    count = builder.report["utterances"]
    print(json.dumps({
        "utterances": count,
        "scan_s": scanned - start,
        "build_s": built - scanned,
        "scan_bytes": after_scan - before,
        "build_bytes": _rss_bytes() - before,
        "peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before,
    }))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=None,
                        help="utterance counts (default: 10000 100000, with --full also 1000000)")
    parser.add_argument("--full", action="store_true")
    parser.add_argument("--measure", help=argparse.SUPPRESS)
    add_out_argument(parser, "corpus_scale")
    args = parser.parse_args(argv)
    if args.measure:
        _measure(args.measure)
        return 0
    sizes = args.sizes or ([10_000, 100_000] + ([1_000_000] if args.full else []))
    figures, rows = {}, []
    print(f"{'utterances':>10} {'scan s':>8} {'us/utt':>7} {'build s':>8} {'held B/utt':>11} "
          f"{'+build B/utt':>13} {'peak B/utt':>11}")
    with tempfile.TemporaryDirectory() as folder:
        for count in sizes:
            manifest = _write_manifest(folder, count)
            out = subprocess.run([sys.executable, os.path.abspath(__file__), "--measure", manifest],
                                 check=True, capture_output=True, text=True).stdout
            row = json.loads(out.strip().splitlines()[-1])
            rows.append(row)
            n = row["utterances"]
            print(f"{n:>10} {row['scan_s']:>8.1f} {1e6 * row['scan_s'] / n:>7.1f} "
                  f"{row['build_s']:>8.1f} {row['scan_bytes'] / n:>11.0f} "
                  f"{row['build_bytes'] / n:>13.0f} {row['peak_bytes'] / n:>11.0f}")
            label = f"{n // 1000}k"
            figures.update({
                f"scan_us_per_utterance_{label}": round(1e6 * row["scan_s"] / n, 1),
                f"build_us_per_utterance_{label}": round(1e6 * row["build_s"] / n, 1),
                f"held_bytes_per_utterance_after_scan_{label}": round(row["scan_bytes"] / n),
                f"held_bytes_per_utterance_after_build_{label}": round(row["build_bytes"] / n),
                f"peak_bytes_per_utterance_{label}": round(row["peak_bytes"] / n),
            })
            os.remove(manifest)
    worst = max(r["build_bytes"] / r["utterances"] for r in rows)
    times = ", ".join(f"{1e6 * r['scan_s'] / r['utterances']:.1f}" for r in rows)
    print(f"held after build: at most {worst:.0f} B per utterance "
          f"(goal <= {GOAL_BYTES_PER_UTTERANCE}); scan time per utterance {times} us")
    write_results(args.out, "corpus_scale", figures, {"sizes": sizes, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
