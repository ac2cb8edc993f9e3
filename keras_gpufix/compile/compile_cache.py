"""`CompileCache`: XLA compiles kept across runs, on TensorFlow and on JAX.

A restarted run (new hyper-parameters, a crash, a resumed checkpoint)
compiles every input shape of its XLA step again. Both backends can keep
the compiled executables in a folder and load them in the next run:

- TensorFlow: `TF_XLA_FLAGS=--tf_xla_persistent_cache_directory=DIR`. TF
  reads `TF_XLA_FLAGS` once, when it first lists or creates its devices,
  not at `import tensorflow` (measured on TF 2.21: setting it after the
  import works; after the first `tf.constant`, dataset, Keras layer or
  `tf.config.list_physical_devices()` it is ignored). So the cache is
  turned on before that: by `kg.from_config` (before it makes the
  strategy) and `keras-gpufix demo`; `kg.compile_model` turns it on when
  TensorFlow has not started yet, and otherwise says once how to. One
  entry is one file `xla_compile_cache__<signature>__<cluster>__<device>.pb`
  (TensorFlow's `DeviceExecutablePersistor`): the signature hashes the
  traced function's name and its argument shapes and dtypes, the cluster
  fingerprint the HLO module, and a loaded entry must hold the same HLO.
  The name, `__inference_one_step_on_data_<id>`, takes its id from a
  process-wide counter that every trace advances (the HLO module bears it
  too), so a run that traced more before its step (one that built a
  feature cache the next run only opens) looked up other entries.
  `kg.compile_model` makes each trace of the step start at an aligned id
  (`keras_internals.trace_from_aligned_ids`) when the cache is on: the
  entries a run looks up no longer depend on what it traced before. A
  `tf.function(jit_compile=True)` of your own keeps TensorFlow's naming.
- JAX: `jax_compilation_cache_dir`, with
  `jax_persistent_cache_min_compile_time_secs=0` (its default, 1 s, keeps
  no small step), read at the first compile after it is set. JAX keys an
  entry on the program itself (`jax._src.cache_key.get`: the StableHLO
  module without its debug info, the jaxlib version, the platform, the
  XLA flags and compile options, the devices), named `jit_<function>`:
  nothing in it counts what the process did before.

Entries never change results: an entry is the executable the same
computation compiles to (`tests/test_compile_cache.py` trains from a fresh
compile and from the cache, in two processes, and compares the weights).
"""

import contextlib
import logging
import os
import shlex
import sys
import time
from stat import S_ISREG
from typing import Optional

from keras_gpufix.backends import name as backend_name

__all__ = ["CompileCache", "user_cache_dir"]

logger = logging.getLogger("keras_gpufix.compile")

_TF_FLAG = "--tf_xla_persistent_cache_directory"
_SUBFOLDER = "xla"  # beside a feature cache: <cache_dir>/xla
_JAX_HIT = "/jax/compilation_cache/cache_hits"
_JAX_COMPILE = "/jax/core/compile/backend_compile_duration"


def user_cache_dir(name: str) -> str:
    """`$XDG_CACHE_HOME/keras_gpufix/<name>` (or `~/.cache/keras_gpufix/<name>`):
    what keras_gpufix keeps per user across runs."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "keras_gpufix", name)


def _tf_flag_directory() -> Optional[str]:
    """The directory `TF_XLA_FLAGS` names for TensorFlow's cache, or None."""
    for flag in shlex.split(os.environ.get("TF_XLA_FLAGS", "")):
        name, _, value = flag.partition("=")
        if name == _TF_FLAG and value:
            return value
    return None


class CompileCache:
    """The persistent XLA compile cache of this process, and its entries.

    `CompileCache.enable()` turns it on for the Keras backend in use (once
    per process: TensorFlow cannot move or drop it later); `CompileCache(dir)`
    reads or clears the entries of a folder (`keras-gpufix cache info /
    clear`). `watch()` tells what a block of code compiled afresh and, on
    JAX, what it loaded from the cache and the seconds compiling took.

    Attributes:
        directory: the folder of the entries (absolute), None when off.
        active: whether this process's XLA compiles are kept there.
        note: why the cache is off or elsewhere than asked, with the fix;
            None when it is on as asked.

    Example:
    ```python
    from keras_gpufix.compile import CompileCache

    cache = CompileCache.enable()   # before TensorFlow starts
    print(cache.directory, cache.active, cache.note)
    ```
    """

    _current = None  # the process's cache, once enabled
    _told = False  # the "TensorFlow started without it" note was logged

    def __init__(self, directory: Optional[str], active: bool = False,
                 note: Optional[str] = None):
        self.directory = os.path.abspath(directory) if directory else None
        self.active = active
        self.note = note

    @staticmethod
    def default_directory(beside: Optional[str] = None) -> str:
        """Where `"auto"` keeps entries: `<beside>/xla` next to a feature
        cache folder, else `$XDG_CACHE_HOME/keras_gpufix/xla` (or
        `~/.cache/keras_gpufix/xla`)."""
        return os.path.join(beside, _SUBFOLDER) if beside else user_cache_dir(_SUBFOLDER)

    @classmethod
    def current(cls) -> Optional["CompileCache"]:
        """The process's active compile cache, or None: the one `enable()` turned on, else
        the folder the user named (`TF_XLA_FLAGS` on TensorFlow, `jax_compilation_cache_dir`
        on JAX, where JAX is imported). Changes nothing."""
        if cls._current is not None and cls._current.active:
            return cls._current
        backend = backend_name()
        named = _tf_flag_directory() if backend == "tensorflow" else None
        if backend == "jax" and "jax" in sys.modules:
            named = sys.modules["jax"].config.jax_compilation_cache_dir
        return cls(named, True) if named else None

    @classmethod
    def enable(cls, directory="auto", beside: Optional[str] = None) -> "CompileCache":
        """Turns on the persistent compile cache for this process.

        Where the process already has one (an earlier call, or
        `TF_XLA_FLAGS` / `jax_compilation_cache_dir` set by the user), that
        one is kept and returned (its `note` says so when another folder
        was asked). On TensorFlow, after TensorFlow started without it the
        cache stays off: the returned cache's `note` says how to set it,
        and it is logged once (`keras_gpufix.compile` logger).

        Args:
            directory: `"auto"` (`default_directory(beside)`), a folder, or
                None (off: nothing is set). Defaults to `"auto"`.
            beside: a feature cache folder; `"auto"` then keeps the entries
                in its `xla` subfolder. Defaults to None.

        Returns:
            A `CompileCache`.

        Raises:
            ValueError: `directory` is not `"auto"`, None or a path.
        """
        if not (directory is None or isinstance(directory, (str, os.PathLike))):
            raise ValueError("`compile_cache` must be 'auto', a folder or None (off). "
                             f"Received: compile_cache={directory!r}")
        if directory is None:
            current = cls._current
            if current is not None and current.active:
                return cls(current.directory, True, "the compile cache was already on in this "
                           "process; it stays on until the process ends")
            return cls(None, False, "off (compile_cache=None)")
        wanted = os.path.abspath(cls.default_directory(beside) if directory == "auto"
                                 else os.fspath(directory))
        backend = backend_name()
        if backend == "tensorflow":
            cache = cls._enable_tensorflow(wanted)
        elif backend == "jax":
            cache = cls._enable_jax(wanted)
        else:
            return cls(None, False, f"the {backend} backend has no XLA compile cache")
        if cache.active:
            os.makedirs(cache.directory, exist_ok=True)
            if cache.directory != wanted and directory != "auto" and cache.note is None:
                cache.note = f"kept in {cache.directory}, set before {wanted} was asked"
            cls._current = cache
        return cache

    @classmethod
    def _enable_tensorflow(cls, wanted):
        from keras_gpufix.keras_internals import tensorflow_started

        named = _tf_flag_directory()
        if named:  # ours from an earlier call, or the user's
            return cls(named, True)
        if tensorflow_started() is False:
            flags = os.environ.get("TF_XLA_FLAGS", "")
            os.environ["TF_XLA_FLAGS"] = f"{flags} {_TF_FLAG}={shlex.quote(wanted)}".strip()
            return cls(wanted, True)
        note = ("TensorFlow started before the compile cache was turned on (it reads "
                "TF_XLA_FLAGS once, when it creates its devices), so XLA compiles are not "
                "kept across runs. To keep them, start Python with "
                f"TF_XLA_FLAGS={_TF_FLAG}={shlex.quote(wanted)}, or call "
                "keras_gpufix.compile.CompileCache.enable() (or kg.from_config) before "
                "building a model or dataset")
        if not cls._told:
            cls._told = True
            logger.warning("keras_gpufix: %s.", note)
        return cls(None, False, note)

    @classmethod
    def _enable_jax(cls, wanted):
        import jax

        named = jax.config.jax_compilation_cache_dir
        if not named:
            jax.config.update("jax_compilation_cache_dir", wanted)
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        return cls(named or wanted, True)

    def entries(self) -> list:
        """The entries in `directory`: dicts `name`, `size_bytes`, `age_s`
        (seconds since it was written), sorted by name."""
        if not self.directory or not os.path.isdir(self.directory):
            return []
        found, now = [], time.time()
        for name in sorted(os.listdir(self.directory)):
            try:
                stat = os.stat(os.path.join(self.directory, name))
            except FileNotFoundError:  # removed meanwhile
                continue
            if S_ISREG(stat.st_mode) and not name.startswith("."):
                found.append({"name": name, "size_bytes": stat.st_size,
                              "age_s": max(0.0, now - stat.st_mtime)})
        return found

    def clear(self) -> dict:
        """Removes every entry in `directory`.

        Returns:
            A dict: `removed` (entry names), `freed_bytes`.
        """
        removed, freed = [], 0
        for entry in self.entries():
            try:
                os.unlink(os.path.join(self.directory, entry["name"]))
            except FileNotFoundError:
                continue
            removed.append(entry["name"])
            freed += entry["size_bytes"]
        return {"removed": removed, "freed_bytes": freed}

    @contextlib.contextmanager
    def watch(self):
        """What the block compiled: yields a dict filled in when it ends.

        Keys: `written` (entries the block added to the cache: its fresh
        compiles, when the cache is active), and on JAX `compiles` (XLA
        compiles, fresh or from the cache), `from_cache` and `compile_s`
        (seconds they took); those three are None on TensorFlow, which
        reports neither.
        """
        seen = {"written": 0, "compiles": None, "from_cache": None, "compile_s": None}
        before = {e["name"] for e in self.entries()}
        listeners = self._jax_listeners(seen) if "jax" in sys.modules and backend_name() == "jax" \
            else None
        try:
            yield seen
        finally:
            if listeners is not None:
                import jax

                jax.monitoring.unregister_event_listener(listeners[0])
                jax.monitoring.unregister_event_duration_listener(listeners[1])
            seen["written"] = len({e["name"] for e in self.entries()} - before)

    @staticmethod
    def _jax_listeners(seen):
        import jax

        seen.update(compiles=0, from_cache=0, compile_s=0.0)

        def on_event(event, **kwargs):
            if event == _JAX_HIT:
                seen["from_cache"] += 1

        def on_duration(event, duration, **kwargs):
            if event == _JAX_COMPILE:
                seen["compiles"] += 1
                seen["compile_s"] += duration

        jax.monitoring.register_event_listener(on_event)
        jax.monitoring.register_event_duration_secs_listener(on_duration)
        return on_event, on_duration
