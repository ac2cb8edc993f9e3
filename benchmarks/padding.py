"""Padded frames of length bucketing on real speech lengths (no audio needed).

    python benchmarks/padding.py [--utterances 600] [--batch-size 16] [--num-buckets 8]

Draws clip lengths of 1-10 s from three skewed distributions seen in speech
corpora (log-normal around 4 s like LibriTTS / VCTK read speech, LJSpeech's
long-heavy shape, a gamma with a long tail), converts them to frames
(22050 Hz, hop 256) and lays out one epoch with `kg.data.BucketPlan` twice:
with its buckets (`padding_buckets`: dynamic programming over the sorted
lengths, whole batches per bucket) and with the equal-count quantile
boundaries it used before (same layout code, boundaries from
`np.quantile`). Prints and writes the share of real frames among padded
frames and the distinct batch shapes of an epoch.
"""

import argparse
import contextlib
import sys

import numpy as np
from _results import add_out_argument, write_results

from keras_gpufix.data import bucketing

__all__ = ["DISTRIBUTIONS", "main"]

DISTRIBUTIONS = {
    "lognormal": lambda rng, n: rng.lognormal(np.log(4.0), 0.5, n),
    "ljspeech": lambda rng, n: 1 + 9 * rng.beta(3.5, 1.8, n),
    "gamma": lambda rng, n: 1 + rng.gamma(2.0, 1.3, n),
}


@contextlib.contextmanager
def _quantile_buckets():
    """`BucketPlan` with the equal-count quantile boundaries of before."""
    def quantile(lengths, num_buckets, step=1):
        quantiles = np.arange(1, num_buckets + 1) / num_buckets
        boundaries = np.unique(np.quantile(lengths, quantiles, method="inverted_cdf")).astype(np.int64)
        return boundaries, np.searchsorted(boundaries, lengths).astype(np.int64)

    original = bucketing.padding_buckets
    bucketing.padding_buckets = quantile
    try:
        yield
    finally:
        bucketing.padding_buckets = original


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--utterances", type=int, default=600)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--num-buckets", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    add_out_argument(parser, "padding")
    args = parser.parse_args(argv)
    figures, details = {}, {}
    print(f"{args.utterances} clips of 1-10 s, batch {args.batch_size}, {args.num_buckets} buckets")
    print(f"{'lengths':<10} {'buckets':<9} {'real frames':>11} {'shapes':>7}  boundaries")
    for name, draw in DISTRIBUTIONS.items():
        seconds = np.clip(draw(np.random.default_rng(args.seed), args.utterances), 1.0, 10.0)
        frames = (seconds * 22050 / 256).astype(np.int64) + 1
        text = (seconds * 14).astype(np.int64) + 1
        for kind, context in (("quantile", _quantile_buckets()), ("padding", contextlib.nullcontext())):
            with context:
                plan = bucketing.BucketPlan(frames, text, args.batch_size, args.num_buckets)
            figures[f"real_frames_share_{name}_{kind}"] = round(plan.padding_efficiency, 4)
            figures[f"batch_shapes_{name}_{kind}"] = len(plan.shapes)
            details[f"boundaries_{name}_{kind}"] = plan.boundaries.tolist()
            print(f"{name:<10} {kind:<9} {plan.padding_efficiency:>11.3f} {len(plan.shapes):>7}  "
                  f"{plan.boundaries.tolist()}")
    details.update(utterances=args.utterances, batch_size=args.batch_size,
                   num_buckets=args.num_buckets, seed=args.seed)
    write_results(args.out, "padding", figures, details)
    return 0


if __name__ == "__main__":
    sys.exit(main())
