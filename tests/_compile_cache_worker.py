"""One training run for `tests/test_compile_cache.py`, in its own process:
opens the feature cache of a small corpus (building it when it is not there
yet, as a first run does), then `kg.compile_model(jit_compile=True)` on the
first batch and one epoch of `fit` over two batch shapes; prints what the
package reported as JSON and saves the weights.

Usage: python tests/_compile_cache_worker.py CACHE_DIR WEIGHTS.npz CORPUS
"""

import json
import sys

import tensorflow as tf

from keras_gpufix.compile import CompileCache
from keras_gpufix.keras_internals import tensorflow_started

started_at_import = tensorflow_started()  # TF reads TF_XLA_FLAGS later: still False
cache = CompileCache.enable(sys.argv[1])

import keras  # noqa: E402
import numpy as np  # noqa: E402
from tensorflow.python.framework import ops  # noqa: E402

import keras_gpufix as kg  # noqa: E402

corpus = sys.argv[3]
builder = kg.data.SpeechDatasetBuilder(corpus, audio=kg.data.AudioConfig(n_mels=8),
                                       cache_dir=corpus + "_cache", verbose=0).prepare()
ids_before = ops.uid()  # how much this process traced before its model (differs by run)


def batches(frames):
    x = np.linspace(-1, 1, 4 * frames * 8, dtype="float32").reshape(4, frames, 8)
    return tf.data.Dataset.from_tensors((x, np.roll(x, 1, axis=1)))


keras.utils.set_random_seed(0)
data = batches(16).concatenate(batches(24)).repeat(4)  # shapes 16 and 24 frames
model = keras.Sequential([keras.Input((None, 8)),
                          keras.layers.Conv1D(16, 5, padding="same", activation="relu"),
                          keras.layers.Conv1D(16, 5, padding="same", activation="relu"),
                          keras.layers.Dense(8)])
report = kg.compile_model(model, "adam", "mse", jit_compile=True, mixed_precision=None,
                          steps_per_execution=1, sample_batch=data, compile_cache=sys.argv[1])
monitor = kg.RetracingMonitor(verbose=0, warn=False)
with cache.watch() as fit_seen:
    history = model.fit(data, epochs=1, verbose=0, callbacks=[monitor])
np.savez(sys.argv[2], *model.get_weights())
print(json.dumps({
    "started_at_import": started_at_import,
    "feature_cache": builder.report["cache"],
    "ids_before": ids_before,
    "compile_cache": report.compile_cache,
    "compiles": report.compiles,
    "fit_written": fit_seen["written"],
    "fit_compile_ms": monitor.report()["compile_ms"] + monitor.report()["recompile_ms"],
    "loss": history.history["loss"],
}))
