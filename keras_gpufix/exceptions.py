"""Warning category shared by every keras_gpufix module.

Tests turn `GpufixWarning` into errors (see `setup.cfg`), so a warning we did
not expect fails the suite; users can silence all of ours with
`warnings.filterwarnings("ignore", category=kg.GpufixWarning)`.
"""

__all__ = ["GpufixWarning"]


class GpufixWarning(UserWarning):
    """A problem keras_gpufix found and worked around (training goes on)."""
