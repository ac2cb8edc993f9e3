"""`examples/diagnose_slow_loader.py` with its input path fixed.

    keras-gpufix diagnose -- python examples/diagnose_slow_loader_fixed.py

The same corpus, model and `compile`; only `dataset()` changed. The clips
go through `kg.data.SpeechDatasetBuilder`: log-mel in TensorFlow ops,
computed once into a persistent cache (the first run builds it; later runs
and epochs read it), length buckets so each batch is padded to one of a few
lengths, parallel loading and prefetch.
"""

import os

import tensorflow as tf

import keras_gpufix as kg
from diagnose_slow_loader import build_model, corpus_dir, parse_args


def dataset(corpus, batch_size, cache_dir):
    builder = kg.data.SpeechDatasetBuilder(corpus, cache_dir=cache_dir, verbose=0)
    train = builder.build(batch_size=batch_size, num_buckets=4)
    return train.map(lambda text, audio: (audio[0], tf.cast(audio[1], tf.float32) / 100.0))


def main():
    args = parse_args(__doc__.splitlines()[0])
    train = dataset(corpus_dir(args.dir), args.batch_size, os.path.join(args.dir, "cache"))
    build_model().fit(train, epochs=args.epochs, verbose=2)


if __name__ == "__main__":
    main()
