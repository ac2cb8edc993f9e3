"""Mixed precision: the global policy, and the check of a built model's layers.

`enable_mixed_precision` sets the global Keras dtype policy (`"auto"` asks
`hardware.auto_policy`); `check_precision` is `compile_model`'s check of the
layers' compute dtype against the policy wanted, and its choice of loss
scaling. A dtype policy only applies to layers created after it is set, so
the check never changes a built layer: where a policy was asked for (by name,
or set globally) and the layers compute in another, it warns with the fix.

`"auto"` with no global policy set is the default of `compile_model`, so it
is what a user who built the model first gets; what it would pick depends on
the machine (AMX-BF16 or not, the GPU's generation). There it never warns:
the layers keep the dtype they were built in, the report says what `auto`
would choose here and how to get it, and the same note is printed once per
process. Warnings then do not depend on the machine a script runs on.
"""

import logging
from typing import Optional, Tuple

import keras

from keras_gpufix.compile.hardware import POLICIES, auto_policy
from keras_gpufix.exceptions import warn
from keras_gpufix.keras_internals import flatten_layers
from keras_gpufix.output import emit

__all__ = ["POLICIES", "check_precision", "enable_mixed_precision"]

logger = logging.getLogger("keras_gpufix.compile")

_noted = set()  # (built policy, auto's policy) pairs already printed in this process


def enable_mixed_precision(policy: str = "auto") -> str:
    """Sets the global Keras dtype policy; call it before building the model.

    `"auto"` picks `"mixed_bfloat16"` where the device computes bfloat16 fast
    (NVIDIA compute capability >= 8.0, CPUs with AMX-BF16),
    `"mixed_float16"` on older GPUs with tensor cores (compute capability
    7.x; Keras adds dynamic loss scaling) and `"float32"` where neither helps.
    Layers built before the call keep their policy (`compile_model` warns,
    or, with its default `mixed_precision="auto"` and no global policy set,
    notes what `"auto"` would pick).

    Args:
        policy: `"auto"`, `"float32"`, `"mixed_float16"` or
            `"mixed_bfloat16"`. Defaults to `"auto"`.

    Returns:
        The policy name set.

    Raises:
        ValueError: for another `policy`.

    Example:
    ```python
    kg.enable_mixed_precision()          # before the model is built
    model = build_model()
    ```
    """
    if policy == "auto":
        policy, why = auto_policy()
    elif policy in POLICIES:
        why = "requested"
    else:
        raise ValueError(
            "`policy` must be one of 'auto', "
            f"{', '.join(repr(p) for p in POLICIES)}. Received: policy={policy!r}"
        )
    keras.mixed_precision.set_global_policy(policy)
    logger.info("enable_mixed_precision: %s (%s)", policy, why)
    return policy


def _weighted_leaf_layers(model):
    layers = []
    for layer in flatten_layers(model):
        leaf = not flatten_layers(layer, recursive=False)
        if leaf and layer.weights:
            layers.append(layer)
    return layers


def _majority(values):
    values = list(values)
    return max(dict.fromkeys(values), key=values.count)


def check_precision(model, optimizer, mixed_precision: Optional[str], compile_kwargs: dict,
                    reasons: list) -> Tuple[str, bool, object]:
    """Checks the layers' compute dtype; returns (policy, loss_scaling, optimizer).

    Appends its choices to `reasons`; wraps `optimizer` in one
    `LossScaleOptimizer` where layers compute in float16.
    """
    layers = _weighted_leaf_layers(model)
    if layers:
        policy = _majority(layer.dtype_policy.name for layer in layers)
        compute = _majority(layer.compute_dtype for layer in layers)
    else:
        policy, compute = model.dtype_policy.name, model.compute_dtype

    if mixed_precision is not None:
        global_policy = keras.mixed_precision.global_policy().name
        if mixed_precision != "auto":
            target, why = mixed_precision, "requested"
        elif global_policy != "float32":
            target, why = global_policy, "the global policy"
        else:
            target, why = auto_policy()
        wanted = keras.DTypePolicy(target).compute_dtype
        off = [layer.name for layer in layers if layer.compute_dtype != wanted]
        if compute != wanted and mixed_precision == "auto" and global_policy == "float32":
            note = (f"mixed_precision='auto' would choose {target} here ({why}); "
                    f"the layers were built in {policy} and keep it. To train in "
                    f"{target}, call kg.enable_mixed_precision() before building the "
                    "model")
            reasons.append(f"policy={policy}: model layers; {note}")
            if (policy, target) not in _noted:
                _noted.add((policy, target))
                emit(f"compile_model: {note} (this note is printed once).")
        else:
            if compute != wanted:
                warn(
                    f"compile_model: mixed_precision={mixed_precision!r} wants "
                    f"{target} ({why}), but {len(off)} of {len(layers)} layers with "
                    f"weights compute in another dtype (e.g. {off[:3]}): a dtype "
                    "policy only applies to layers built after it is set. Call "
                    f"kg.enable_mixed_precision({target!r}) before building the "
                    "model, or pass mixed_precision=None to keep it as it is."
                )
            reasons.append(f"policy={policy}: model layers; wanted {target} ({why})")
    else:
        reasons.append(f"policy={policy}: model layers (not checked)")

    with model.distribute_strategy.scope():
        optimizer = keras.optimizers.get(optimizer)
    is_lso = isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
    float16 = any(layer.compute_dtype == "float16" for layer in layers)
    if is_lso:
        reasons.append("loss scaling: the LossScaleOptimizer passed in")
    elif float16 and optimizer.loss_scale_factor is not None:
        reasons.append(
            f"loss scaling: static, loss_scale_factor={optimizer.loss_scale_factor}"
        )
    elif float16 and compile_kwargs.get("auto_scale_loss", True):
        with model.distribute_strategy.scope():
            optimizer = keras.optimizers.LossScaleOptimizer(
                optimizer, name="loss_scale_optimizer"
            )
        is_lso = True
        reasons.append("loss scaling: dynamic (LossScaleOptimizer), float16 layers")
    elif float16:
        reasons.append("loss scaling: none (auto_scale_loss=False) with float16 layers")
    return policy, is_lso, optimizer
