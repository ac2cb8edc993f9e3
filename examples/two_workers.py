"""One training worker of a multi-worker job (walk-through: docs/distributed.md).

Run one per worker, each with its own TF_CONFIG; every worker reads the same
corpus and writes its monitor summary to the same LOG_DIR, where the chief
gathers the job's report. With --service the input pipeline runs on the
tf.data service (`keras-gpufix data-service`). With --custom-loop it trains
in its own loop (`strategy.run` over the distributed dataset, watched by
`kg.watch`) instead of `fit`; the job's report is the same.

    TF_CONFIG='{"cluster": {"worker": ["localhost:12345", "localhost:12346"]},
                "task": {"type": "worker", "index": 0}}' \\
        python examples/two_workers.py CORPUS LOG_DIR [--service grpc://localhost:5050]
"""

import argparse
import faulthandler
import os
import signal

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_gpufix as kg  # noqa: E402


def model_for(vocab_size, n_mels):
    """Predicts the next mel frame from the previous ones and the text."""
    text = keras.Input((None,), dtype="int32", name="text")
    mel = keras.Input((None, n_mels), name="mel")
    summary = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(vocab_size, 16)(text))
    x = keras.layers.Conv1D(32, 5, padding="causal", activation="relu")(mel)
    x = x + keras.layers.Dense(32)(summary)[:, None, :]
    return keras.Model({"text": text, "mel": mel}, keras.layers.Dense(n_mels)(x))


def train_step(strategy, model, optimizer, loss):
    """One step of a custom loop: `strategy.run` of `loss`'s gradient step on each
    replica (the optimizer all-reduces the gradients), as a `tf.function`."""
    @tf.function
    def step(x, y):
        def replica(x, y):
            with tf.GradientTape() as tape:
                value = tf.reduce_mean(loss(y, model(x, training=True)))
            grads = tape.gradient(value, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return value
        return strategy.run(replica, args=(x, y))
    return step


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("corpus")
    parser.add_argument("log_dir")
    parser.add_argument("--service", help="tf.data service dispatcher, grpc://host:port")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--custom-loop", action="store_true",
                        help="train in a custom loop under kg.watch instead of fit")
    args = parser.parse_args()
    if hasattr(signal, "SIGUSR1"):  # `kill -USR1 PID`: every thread's stack, if it hangs
        faulthandler.register(signal.SIGUSR1, all_threads=True)

    strategy = kg.setup_strategy()
    task = strategy.cluster_resolver.task_id
    builder = kg.data.SpeechDatasetBuilder(args.corpus, verbose=0)
    train = builder.build(batch_size=kg.global_batch_size(8, strategy), num_buckets=4,
                          service=args.service)
    report = builder.report
    print(f"worker {task}: {report['utterances']} utterances, {report['batches_per_epoch']} "
          f"global batches per epoch, remainder {report['remainder']}, "
          f"shuffle seed {report['shuffle_seed']}", flush=True)

    def to_xy(text, mel):
        return {"text": text[0], "mel": mel[0][:, :-1]}, mel[0][:, 1:]

    train = train.map(to_xy)
    with strategy.scope():
        model = model_for(builder.text.num_ids, builder.audio.num_features)
        kg.compile_model(model, "adam", "mse", jit_compile=False, mixed_precision=None,
                         steps_per_execution=1,  # keras-team/keras#19246 under this strategy
                         sample_batch=train)
    monitor = kg.GPUOscillationMonitor(log_dir=args.log_dir, nvml=False)
    if not args.custom_loop:
        model.fit(train, epochs=args.epochs, verbose=0, callbacks=[monitor])
        return
    step = train_step(strategy, model, model.optimizer, keras.losses.MeanSquaredError())
    with kg.watch(strategy.experimental_distribute_dataset(train), callbacks=[monitor],
                  model=model) as watched:
        for _ in range(args.epochs):
            for x, y in watched:
                step(x, y)


if __name__ == "__main__":
    main()
