"""One output channel for every user-facing line keras_gpufix prints.

Monitors, the dataset builder, the cache and the CLI report through `emit`,
which follows Keras's own rule (`keras.src.utils.io_utils.print_msg`): with
interactive logging on (the default) a line goes to standard output; after
`keras.config.disable_interactive_logging()` it goes to the `keras_gpufix`
logger instead, as Keras's progress lines go to absl logging. `verbose=0`
silences it. Problems the user should act on are warnings
(`GpufixWarning`), not lines from here.
"""

import logging
import sys

__all__ = ["emit"]

logger = logging.getLogger("keras_gpufix")


def _interactive():
    keras = sys.modules.get("keras")
    if keras is None:  # never import Keras just to print a line
        return True
    try:
        return bool(keras.config.is_interactive_logging_enabled())
    except AttributeError:  # a Keras without the switch
        return True


def emit(message: str, verbose: int = 1) -> None:
    """Prints one user-facing line (or block) unless `verbose` is 0.

    Args:
        message: the text, without a trailing newline.
        verbose: 0 prints nothing; anything else prints. Defaults to 1.
    """
    if not verbose:
        return
    if _interactive():
        sys.stdout.write(f"{message}\n")
        sys.stdout.flush()
    else:
        logger.info(message)
