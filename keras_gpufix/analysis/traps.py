"""The one trap table: the traps a script's code can hold, and their verdicts.

A trap is a known way to lose speed that can be seen before (or without)
measuring: a line of the user's script (`keras-gpufix diagnose`'s static
scan, `diagnose/scan.py`) or a value of a YAML config on this machine
(`keras-gpufix validate`, `config.py`). The scan and the config reader only
find them; what each one means, and the rule that finds a config trap, is
here. A config trap produces no verdict: `validate` reports it (and `--fix`
rewrites it) before any step runs.

| name                    | what it answers                                       |
|-------------------------|-------------------------------------------------------|
| `TRAPS`                 | code trap -> (the measured verdict it would produce,  |
|                         | why, and what to change on that line)                 |
| `traps_of`              | the code traps that produce a verdict                 |
| `divisible_batch`       | `batch_not_divisible`: the batch size the replicas    |
|                         | share equally                                         |
| `missing_gpus`          | `device_missing`: the GPUs named that this machine    |
|                         | lacks                                                 |
"""

import re

__all__ = ["TRAPS", "traps_of", "divisible_batch", "missing_gpus"]

# Static traps: id -> (the measured verdict it would produce, why, and what to
# change on that line). The fix of the verdict is the one verdict table's
# (`analysis.FIXES`); `jit_compile_false` produces no verdict of its own (XLA
# off is slower, not oscillating), so it is listed but never ranked as a fix.
TRAPS = {
    "py_function_in_map": (
        "input_bound",
        "`tf.py_function`/`tf.numpy_function` inside `Dataset.map` runs Python per "
        "element under the GIL: the map cannot run in parallel; compute the features with "
        "TF ops (kg.data.log_mel) or once into a feature cache",
    ),
    "python_generator": (
        "input_bound",
        "a Python generator feeds the model: every batch is produced by Python, one at a "
        "time, with no parallelism or prefetch; build a tf.data pipeline "
        "(kg.data.SpeechDatasetBuilder)",
    ),
    "no_prefetch": (
        "input_bound",
        "the tf.data pipeline has no `prefetch`: the next batch is prepared only after "
        "the step that needs it asked for it; end the pipeline with "
        "`.prefetch(tf.data.AUTOTUNE)`",
    ),
    "run_eagerly": (
        "eager_step",
        "`run_eagerly=True` runs every op from Python: no graph, no XLA",
    ),
    "jit_compile_false": (
        None,
        "`jit_compile=False` turns XLA off: no op fusion; kg.compile_model(model, ..., "
        "jit_compile=True) with bucketed shapes",
    ),
    "numpy_in_loop": (
        "dispatch_bound",
        "`.numpy()` inside a loop copies to the host and waits for the device at every "
        "iteration; keep values as tensors inside the loop and convert once after it",
    ),
}

def traps_of(verdict: str) -> "set[str]":
    """The code traps (`TRAPS`) that would produce `verdict`."""
    return {trap for trap, (produces, _) in TRAPS.items() if produces == verdict}


def divisible_batch(batch: int, replicas: int) -> "int | None":
    """`batch_not_divisible`: the next batch size the `replicas` share equally, or None
    when `batch` already divides (replicas with unequal batches, the last one a
    different shape, otherwise)."""
    return -(-batch // replicas) * replicas if batch % replicas else None


def missing_gpus(names, gpu_count: int) -> list:
    """`device_missing`: the device names in `names` (`/gpu:N`, any case) whose
    index this machine's `gpu_count` GPUs do not reach."""
    found = [re.search(r"gpu:(\d+)$", str(n), re.IGNORECASE) for n in names]
    return [n for n, m in zip(names, found) if m and int(m.group(1)) >= gpu_count]
