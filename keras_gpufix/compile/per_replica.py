"""The per-replica XLA train step, and the fixes Keras needs under multi-worker.

Keras 3's own `jit_compile=True` under `MirroredStrategy` wraps the whole
replicated step, all devices together, in one XLA cluster and fails at the
first step. `install_per_replica_xla` compiles each replica's forward and
backward pass instead; the gradient all-reduce and the optimizer update stay
outside XLA, where `tf.distribute` needs them.
"""

import inspect

import keras
import tensorflow as tf

from keras_gpufix.keras_internals import (
    in_multi_worker_mode,
    set_symbolic_build,
    symbolic_build,
)

__all__ = [
    "batch_size",
    "install_multi_worker_fixes",
    "install_per_replica_xla",
    "is_mirrored",
    "is_multi_worker",
    "remove_per_replica_xla",
]

def is_mirrored(strategy) -> bool:
    """Whether `strategy` is a (multi-worker) mirrored strategy."""
    return isinstance(
        strategy,
        (tf.distribute.MirroredStrategy, tf.distribute.MultiWorkerMirroredStrategy),
    )


def is_multi_worker(strategy) -> bool:
    """Whether `strategy` runs multi-worker (a cluster, not one local worker)."""
    return isinstance(
        strategy, tf.distribute.MultiWorkerMirroredStrategy
    ) and in_multi_worker_mode(strategy)


def install_per_replica_xla(model) -> None:
    """Replaces `model.train_step` by one whose forward/backward is XLA-compiled.

    Runs inside `strategy.run`, so each replica compiles its own cluster on its
    own device; the all-reduce (a cross-replica `merge_call`) and the
    optimizer update stay outside XLA, where `tf.distribute` needs them.
    Keras has no public way to compile only part of its step, so this is a
    copy of Keras 3.15.1's `TensorFlowTrainer.train_step` through public
    names (`model.compute_loss`, `model.metrics`, `optimizer.scale_loss`);
    `tests/test_compile.py` checks it against Keras's own step.
    """
    takes_training = "training" in inspect.signature(model.compute_loss).parameters

    @tf.function(jit_compile=True, reduce_retracing=True)
    def forward_backward(x, y, sample_weight):
        with tf.GradientTape() as tape:
            y_pred = model(x, training=True)
            extra = {"training": True} if takes_training else {}
            loss = model.compute_loss(x, y, y_pred, sample_weight, **extra)
            scaled = model.optimizer.scale_loss(loss)
        grads = tape.gradient(scaled, model.trainable_weights)
        return loss, y_pred, grads

    def train_step(data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        loss, y_pred, grads = forward_backward(x, y, sample_weight)
        replicas = tf.distribute.get_strategy().num_replicas_in_sync
        _loss_metric(model).update_state(
            loss * tf.cast(replicas, loss.dtype),  # the replica's share, unscaled
            sample_weight=batch_size(x),
        )
        model.optimizer.apply_gradients(zip(grads, model.trainable_weights))
        logs = model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        return _with_replica_axis(logs) if multi_worker else logs

    multi_worker = is_multi_worker(model.distribute_strategy)
    model.train_step = train_step


def _loss_metric(model):
    """The compiled model's loss tracker: the metric `fit` logs as "loss"."""
    return next(m for m in model.metrics if m.name == "loss")


def batch_size(x) -> tf.Tensor:
    """Rows in the batch, from its first input that is not None (keras-team/keras#21630)."""
    return tf.shape(next(t for t in tf.nest.flatten(x) if t is not None))[0]


def _with_replica_axis(logs):
    return tf.nest.map_structure(
        lambda t: tf.reshape(t, [1]) if t.shape.rank == 0 else t, logs
    )


def install_multi_worker_fixes(model) -> None:
    """Makes Keras 3 `fit`/`evaluate` run under a multi-worker
    MultiWorkerMirroredStrategy (tensorflow/tensorflow#72388).

    Keras reduces each scalar log with `strategy.reduce("MEAN", v, axis=0)`
    there, which fails on 0-d values, so the steps give scalars a length-1
    axis; and `fit` starts by reducing a distributed input batch in eager
    mode, which fails too, so the symbolic build reads the local batch.
    """
    strategy = model.distribute_strategy
    cls = type(model)
    if "train_step" not in model.__dict__:
        model.train_step = lambda data: _with_replica_axis(cls.train_step(model, data))
    model.test_step = lambda data: _with_replica_axis(cls.test_step(model, data))

    def local(value):
        if isinstance(value, tf.distribute.DistributedValues):
            return strategy.experimental_local_results(value)[0]
        return value

    def maybe_symbolic_build(iterator=None, data_batch=None):
        if iterator is not None and data_batch is None:
            for _, _, it in iterator:
                data_batch = tf.nest.map_structure(local, next(it))
                break
        with strategy.scope():
            symbolic_build(model, data_batch)

    set_symbolic_build(model, maybe_symbolic_build)


def remove_per_replica_xla(model) -> None:
    """Gives the model Keras's own train step back (the XLA fallback)."""
    model.__dict__.pop("train_step", None)
    if is_multi_worker(model.distribute_strategy):
        install_multi_worker_fixes(model)
