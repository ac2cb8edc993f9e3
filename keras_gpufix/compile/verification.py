"""Whether XLA took: what blocks it before a step runs, what the traced step
really compiles, and the words for both.

`static_jit_blocker` says why XLA cannot be used before anything runs;
`xla_calls` reads the `_XlaMustCompile` calls of the traced train function
(None when it cannot be read: "not verified", never "XLA off");
`describe_xla_error` names the op and layer XLA could not compile.
"""

import re
from typing import List, Optional, Tuple

from keras_gpufix.exceptions import warn
from keras_gpufix.keras_internals import (
    concrete_functions,
    flatten_layers,
    overrides_train_step,
    traced_functions,
)

__all__ = [
    "describe_xla_error",
    "first_line",
    "jit_reason",
    "static_jit_blocker",
    "warn_fallback",
    "xla_calls",
]

def static_jit_blocker(model, scope: str, strategy, compile_kwargs: dict) -> Optional[str]:
    """Why XLA cannot be used before anything runs, or None."""
    if compile_kwargs.get("run_eagerly"):
        return "run_eagerly=True (eager steps are never XLA-compiled)"
    no_jit = [
        layer.name
        for layer in flatten_layers(model)
        if not getattr(layer, "supports_jit", True)
    ]
    if no_jit:
        return f"layers declare supports_jit=False: {no_jit}"
    if scope == "per_replica":
        if overrides_train_step(model):
            return (
                f"{type(model).__name__} overrides train_step; under "
                f"{type(strategy).__name__} only Keras's own train_step can be "
                "XLA-compiled per replica"
            )
    return None


def xla_calls(model) -> Optional[List[Tuple[str, str]]]:
    """(device, callee) of every `_XlaMustCompile` call in the traced train function.

    None when the traced functions cannot be read (not verified).
    """
    calls = set()
    functions = traced_functions(model.train_function)
    if not functions:
        return None
    for fn in functions.values():
        concretes = concrete_functions(fn)
        if concretes is None:
            return None
        for concrete in concretes:
            graph_def = concrete.graph.as_graph_def()
            nodes = list(graph_def.node)
            for func in graph_def.library.function:
                nodes.extend(func.node_def)
            for node in nodes:
                attr = node.attr.get("_XlaMustCompile")
                if attr is not None and attr.b:
                    device = _short_device(node.device) or "default"
                    calls.add((device, node.attr["f"].func.name))
    return sorted(calls)


def _short_device(device):
    match = re.search(r"device:([A-Z]+:\d+)", device or "")
    if match is None:
        return device or ""
    task = re.search(r"/job:(\w+)/replica:\d+/task:(\d+)", device)
    if task and task.group(1) != "localhost":
        return f"{task.group(1)}:{task.group(2)}/{match.group(1)}"
    return match.group(1)


def describe_xla_error(model, exc: BaseException) -> str:
    """One line naming the op (and layer) XLA could not compile."""
    text = str(exc)
    ops = re.search(
        r"Detected unsupported operations when trying to compile graph \S+ on "
        r"(\S+): (.+?)(?:\n|$)",
        text,
    )
    node = re.search(r"\{\{node ([^}]+)\}\}", text)
    layer = None
    if node:
        parts = node.group(1).split("/")
        for candidate in flatten_layers(model):
            pattern = re.escape(candidate.name) + r"(_\d+)?"
            if any(re.fullmatch(pattern, part) for part in parts):
                layer = candidate.name
    if ops:
        op_names = sorted(set(re.findall(r"(\w+) \(No registered", ops.group(2))))
        where = f" in layer '{layer}'" if layer else ""
        at = f" (node {node.group(1)})" if node else ""
        return (
            f"XLA ({ops.group(1)}) cannot compile op {', '.join(op_names) or ops.group(2)[:80]}"
            f"{where}{at}"
        )
    where = f" (layer '{layer}')" if layer else ""
    return f"the XLA-compiled step failed: {first_line(exc)}{where}"


def warn_fallback(reason: str) -> None:
    """The one warning that XLA is off, and why."""
    warn(f"compile_model: XLA is off, training runs in graph mode: {reason}.")


def jit_reason(report, requested: bool, strategy, sampled: bool) -> str:
    """The report's line on XLA: where it compiles and whether that was seen."""
    name = type(strategy).__name__
    if report.jit_compile:
        where = (
            f"each of {report.num_replicas} replicas ({name}); all-reduce and "
            "optimizer update outside XLA"
            if report.xla_scope == "per_replica"
            else "the whole train step"
        )
        seen = (
            f"verified on the sample batch: XLA calls on {list(report.xla_devices)}"
            if report.verified
            else "not verified (" + ("the traced step could not be read on this Keras"
                                     if sampled else "no sample_batch") + ")"
        )
        return f"jit_compile=True: XLA compiles {where}; {seen}"
    if not requested:
        return "jit_compile=False: requested"
    return f"jit_compile=False: {report.fallback_reason}"


def first_line(exc: BaseException) -> str:
    """The line of a TensorFlow error that says what went wrong."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    for i, line in enumerate(lines):
        if line.startswith("[[") and i > 0 and not lines[i - 1].startswith("[["):
            message = lines[i - 1]
            break
    else:
        message = lines[0] if lines else ""
    message = re.sub(r"^\(\d+\) ", "", message)
    return f"{type(exc).__name__}: {message[:200]}"
