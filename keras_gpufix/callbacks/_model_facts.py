"""What a model says about its run: whether its step is XLA-compiled or eager, and where.

The step stream asks once, when a run starts (`model_facts`), and tells the
run's detector (`analysis.RunFacts`).
"""

import os

import keras

from keras_gpufix.keras_internals import step_jit_compile

__all__ = ["model_facts"]


def model_facts(model) -> dict:
    """`jit`, `eager` and `eager_where` of `model`'s train step (`analysis.RunFacts` fields).

    Args:
        model: the model being trained, or None (a custom loop without one).
    """
    eager = bool(getattr(model, "run_eagerly", False))
    return {"jit": step_jit_compile(model), "eager": eager,
            "eager_where": _compile_site(model) if eager else None}


def _compile_site(model):
    """`file:line` of the call in the user's `compile` override that hands
    `run_eagerly` on (`super().compile(..., run_eagerly=...)`), or None
    (no override, or its source is not readable)."""
    import ast
    import inspect
    import textwrap

    method = getattr(type(model), "compile", None)
    code = getattr(method, "__code__", None)
    if code is None or code.co_filename.startswith(_KERAS_DIR):
        return None
    try:
        lines, first = inspect.getsourcelines(method)
        tree = ast.parse(textwrap.dedent("".join(lines)))
    except (OSError, TypeError, SyntaxError):
        return None
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)
             and any(k.arg == "run_eagerly" for k in n.keywords)]
    return (f"{code.co_filename}:{first + min(c.lineno for c in calls) - 1}" if calls
            else None)


_KERAS_DIR = os.path.dirname(keras.__file__) + os.sep
