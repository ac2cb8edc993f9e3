"""Warning category shared by every keras_gpufix module, and how to raise it.

Tests turn `GpufixWarning` into errors (see `setup.cfg`), so a warning we did
not expect fails the suite; users can silence all of ours with
`warnings.filterwarnings("ignore", category=kg.GpufixWarning)`.

`warn` points the warning at the user's line: the first frame outside
keras_gpufix, Keras and TensorFlow (for a callback, the `model.fit(...)` call
or the custom loop's hook call), never into our base classes.
"""

import os
import sys
import warnings

__all__ = ["GpufixWarning", "warn"]

_OURS = os.path.dirname(os.path.abspath(__file__)) + os.sep
_LIBRARIES = ("keras", "tensorflow", "tf_keras")


class GpufixWarning(UserWarning):
    """A problem keras_gpufix found and worked around (training goes on)."""


def _library_dirs():
    dirs = [_OURS]
    for name in _LIBRARIES:
        module = sys.modules.get(name)
        path = getattr(module, "__file__", None)
        if path:
            dirs.append(os.path.dirname(os.path.abspath(path)) + os.sep)
    return tuple(dirs)


def warn(message: str) -> None:
    """Warns with `GpufixWarning` at the user's line.

    The stack level is the first caller frame whose file lies outside
    keras_gpufix, Keras and TensorFlow; when there is none (a background
    thread), it is the caller of the function that called `warn`.

    Args:
        message: the whole warning text.
    """
    dirs = _library_dirs()
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(dirs):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, GpufixWarning, stacklevel=level + 1 if frame is not None else 3)
