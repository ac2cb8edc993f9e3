"""`setup_strategy`: one call that picks the `tf.distribute` strategy.

| found                                  | "auto" gives                          |
|----------------------------------------|---------------------------------------|
| `TF_CONFIG` naming a cluster           | `MultiWorkerMirroredStrategy`         |
| >= 2 GPUs (or `devices` lists >= 2)    | `MirroredStrategy`                    |
| 1 GPU (or `devices` lists 1)           | `OneDeviceStrategy`                   |
| no GPU                                 | the default strategy                  |

The all-reduce is TensorFlow's own choice (NCCL on GPUs where TF has it,
else hierarchical copy; ring or NCCL collectives across workers).
`STRATEGY_MODES` and `resolve_strategy_mode` are the mode names and the
"auto" rule; `kg.validate` uses the same ones.

`cluster_seed` is the shuffle seed every worker of a cluster derives alike
(Keras splits each global batch between the workers, so they must draw the
same epoch: `kg.data`'s builder uses it when `seed=None`).

Memory growth is set on every GPU before TensorFlow initialises them (an
error says so when it is too late). The choice and its reason are logged on
the `keras_gpufix.distribute` logger.

Both GPUs train under `MirroredStrategy`; the input pipeline (`tf.data`,
`kg.data`) runs on the CPU for all replicas. There is no "data GPU feeding a
model GPU" mode in `tf.distribute` (see `docs/distributed.md`).
"""

import hashlib
import json
import logging
import os
from typing import TYPE_CHECKING, Optional, Sequence, Tuple

from keras_gpufix.backends import name as backend_name
from keras_gpufix.keras_internals import cross_device_ops_name

if TYPE_CHECKING:
    import tensorflow as tf

__all__ = [
    "STRATEGY_MODES", "cluster_seed", "global_batch_size", "resolve_strategy_mode",
    "setup_strategy", "tf_config_cluster",
]

logger = logging.getLogger(__name__)

STRATEGY_MODES = ("auto", "default", "one_device", "mirrored", "multi_worker")


def resolve_strategy_mode(
    mode: str = "auto",
    *,
    device_count: int = 0,
    devices_given: bool = False,
    cluster: Optional[dict] = None,
) -> Tuple[str, str]:
    """The strategy mode `mode` means on these devices: `(mode, reason)`.

    `"auto"`: `"multi_worker"` when `cluster` (from `TF_CONFIG`) is set, else
    by device count: >= 2 `"mirrored"`, 1 `"one_device"`, 0 `"default"`.
    Another mode is returned as is (reason `"requested"`). Imports no
    TensorFlow.

    Args:
        mode: one of `STRATEGY_MODES`. Defaults to `"auto"`.
        device_count: the devices to replicate on (the `devices` given, else
            the GPUs). Defaults to 0.
        devices_given: whether `device_count` counts a `devices` list (only
            the reason says so). Defaults to False.
        cluster: `tf_config_cluster()`'s dict, or None. Defaults to None.

    Raises:
        ValueError: for a mode not in `STRATEGY_MODES`, and for a `devices`
            list the mode would not use (`"default"` with any, `"one_device"`
            with more than one).
    """
    _check_mode(mode)
    if devices_given and (mode == "default" or (mode == "one_device" and device_count != 1)):
        raise ValueError(
            f"`mode={mode!r}` " + ("uses no device list" if mode == "default" else
                                   "takes exactly one device")
            + f": pass one device, or mode 'mirrored'/'auto' to replicate. Received: "
            f"{device_count} devices")
    if mode != "auto":
        return mode, "requested"
    if cluster:
        return "multi_worker", f"TF_CONFIG names a cluster {cluster}"
    what = "devices given" if devices_given else "GPUs"
    if device_count >= 2:
        return "mirrored", f"{device_count} {what}"
    if device_count == 1:
        return "one_device", f"1 {what}"
    return "default", "no GPU"


def setup_strategy(
    mode: str = "auto",
    devices: Optional[Sequence[str]] = None,
    memory_growth: bool = True,
) -> "tf.distribute.Strategy":
    """Creates the distribution strategy for this machine (or cluster).

    Call it first, before any model, tensor or dataset is created: memory
    growth and logical devices can only be configured before TensorFlow
    initialises its devices. Build and compile the model under
    `strategy.scope()`.

    Args:
        mode: `"auto"`, `"default"`, `"one_device"`, `"mirrored"` or
            `"multi_worker"`. `"auto"`: `MultiWorkerMirroredStrategy` when
            `TF_CONFIG` names a cluster, else by device count (`devices` if
            given, else the GPUs): >= 2 `MirroredStrategy`, 1
            `OneDeviceStrategy`, none the default strategy. Defaults to
            `"auto"`.
        devices: device names such as `["/gpu:0", "/gpu:1"]` or, with
            logical CPU devices, `["/cpu:0", "/cpu:1"]`. Defaults to None
            (every GPU).
        memory_growth: set `tf.config.experimental.set_memory_growth` on every
            GPU so TensorFlow does not reserve all GPU memory up front.
            Defaults to True.

    Returns:
        A `tf.distribute.Strategy`.

    Raises:
        ValueError: for an unknown `mode`, an empty `devices`, or an invalid
            `TF_CONFIG`.
        RuntimeError: when `memory_growth=True` comes after TensorFlow
            initialised the GPUs, or on a Keras backend other than
            TensorFlow (Keras uses a `tf.distribute` strategy there only).

    Example:
    ```python
    strategy = kg.setup_strategy()
    with strategy.scope():
        model = build_model()
        kg.compile_model(model, "adam", "mse")
    train = builder.build(batch_size=kg.global_batch_size(32, strategy))
    ```
    """
    backend = backend_name()
    if backend != "tensorflow":
        raise RuntimeError(
            "kg.setup_strategy makes a tf.distribute strategy, which Keras uses on the "
            f"TensorFlow backend only (this process: the {backend} backend). There, "
            "before the model is built: keras.distribution.set_distribution("
            "keras.distribution.DataParallel()); kg.global_batch_size(per_replica) then "
            "counts its devices")
    import tensorflow as tf

    _check_mode(mode)
    if devices is not None:
        if isinstance(devices, str) or not devices:
            raise ValueError(
                "`devices` must be a non-empty list of device names such as "
                f"['/gpu:0', '/gpu:1']. Received: devices={devices!r}"
            )
        devices = list(devices)
    gpus = tf.config.list_physical_devices("GPU")
    if memory_growth:
        _set_memory_growth(gpus)

    mode, why = resolve_strategy_mode(
        mode,
        device_count=len(devices) if devices is not None else len(gpus),
        devices_given=devices is not None,
        cluster=tf_config_cluster(),
    )

    if mode == "default":
        strategy = tf.distribute.get_strategy()
        detail = "one device, no replication"
    elif mode == "one_device":
        device = devices[0] if devices else ("/gpu:0" if gpus else "/cpu:0")
        strategy = tf.distribute.OneDeviceStrategy(device)
        detail = device
    elif mode == "mirrored":
        strategy, detail = _mirrored(devices, gpus)
    else:
        strategy, detail = _multi_worker()
    logger.info(
        "setup_strategy: %s with %d replica(s): %s (%s)",
        type(strategy).__name__, strategy.num_replicas_in_sync, detail, why,
    )
    return strategy


def global_batch_size(per_replica: int, strategy: Optional["tf.distribute.Strategy"] = None) -> int:
    """The batch size to give the dataset: `per_replica` times the replicas.

    Keras splits each global batch across the replicas of the strategy, so a
    dataset built with this batch size gives every replica `per_replica`
    examples per step.

    Args:
        per_replica: examples per replica and step, an int >= 1.
        strategy: the strategy. Defaults to None (the current strategy; on
            other backends than TensorFlow, the devices along the batch
            dimension of `keras.distribution.distribution()`, 1 without one).

    Returns:
        `per_replica * strategy.num_replicas_in_sync`.

    Raises:
        ValueError: for `per_replica` < 1 or not an int.
    """
    if isinstance(per_replica, bool) or not isinstance(per_replica, int) or per_replica < 1:
        raise ValueError(
            f"`per_replica` must be an int >= 1. Received: per_replica={per_replica!r}"
        )
    if strategy is None and backend_name() != "tensorflow":
        import keras

        distribution = keras.distribution.distribution()
        if distribution is None:
            return per_replica
        mesh = distribution.device_mesh
        return per_replica * int(mesh.shape[mesh.axis_names.index(distribution.batch_dim_name)])
    import tensorflow as tf

    strategy = strategy or tf.distribute.get_strategy()
    return per_replica * int(strategy.num_replicas_in_sync)


def _check_mode(mode):
    if mode not in STRATEGY_MODES:
        raise ValueError(
            f"`mode` must be one of {', '.join(repr(m) for m in STRATEGY_MODES)}. "
            f"Received: mode={mode!r}"
        )


def _set_memory_growth(gpus):
    import tensorflow as tf

    for gpu in gpus:
        if tf.config.get_logical_device_configuration(gpu):
            logger.info("setup_strategy: %s has logical devices; memory growth left as is", gpu.name)
            continue
        if tf.config.experimental.get_memory_growth(gpu):
            continue
        try:
            tf.config.experimental.set_memory_growth(gpu, True)
        except RuntimeError as exc:
            raise RuntimeError(
                "setup_strategy(memory_growth=True) came after TensorFlow "
                "initialised the GPUs (something already created a tensor, "
                "model, dataset or listed logical devices). Call "
                "kg.setup_strategy() first in the script, or pass "
                f"memory_growth=False. TensorFlow said: {exc}"
            ) from exc


def tf_config_cluster() -> Optional[dict]:
    """The cluster `TF_CONFIG` names, as `{job: task count}`, or None.

    Raises:
        ValueError: when `TF_CONFIG` is not valid JSON.
    """
    cluster = _tf_config().get("cluster")
    if not cluster:
        return None
    return {job: len(tasks) for job, tasks in cluster.items()}


def _tf_config() -> dict:
    """`TF_CONFIG` as a dict ({} when unset)."""
    raw = os.environ.get("TF_CONFIG")
    if not raw:
        return {}
    try:
        config = json.loads(raw)
    except ValueError as exc:
        raise ValueError(f"`TF_CONFIG` is not valid JSON ({exc}). Received: TF_CONFIG={raw!r}") from exc
    return config if isinstance(config, dict) else {}


def cluster_seed() -> Optional[int]:
    """A shuffle seed every worker of the cluster derives alike, or None.

    Under `MultiWorkerMirroredStrategy` Keras gives each worker its share of
    every global batch (`tf.distribute` shards the dataset by data), so each
    worker must draw the same epoch: with its own random seed, workers
    read some utterances twice and others never. The seed is a hash of the
    cluster (from `TF_CONFIG`, else the cluster resolver of the strategy in
    scope), which is the same on every worker and needs no communication;
    the same cluster gives the same seed in every run (pass `seed=` to the
    builder to change it).

    Returns:
        A non-negative int, or None outside a cluster of two or more tasks.

    Raises:
        ValueError: when `TF_CONFIG` is not valid JSON.
    """
    cluster = _tf_config().get("cluster") or _strategy_cluster()
    if not cluster or sum(len(tasks) for tasks in cluster.values()) < 2:
        return None
    text = json.dumps(cluster, sort_keys=True)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "big")


def _strategy_cluster():
    import tensorflow as tf

    resolver = getattr(tf.distribute.get_strategy(), "cluster_resolver", None)
    return resolver.cluster_spec().as_dict() if resolver is not None else None


def _mirrored(devices, gpus):
    import tensorflow as tf

    if devices is None:
        devices = [f"/gpu:{i}" for i in range(len(gpus))] or ["/cpu:0"]
    strategy = tf.distribute.MirroredStrategy(devices)
    return strategy, f"{devices}, {cross_device_ops_name(strategy)}"


def _multi_worker():
    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    resolver = strategy.cluster_resolver
    where = f"task {resolver.task_type}:{resolver.task_id}" if resolver else "local"
    return strategy, f"{where}, TensorFlow's collective choice"
