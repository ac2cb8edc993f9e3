"""A persistent, fingerprinted, crash-safe feature cache.

TensorFlow's own tools are unsafe for this (checked on TF 2.21):
`Dataset.load` silently returns a partial dataset after an interrupted
`Dataset.save`; `cache(filename)` leaves a lockfile after a kill that blocks
the next run and never notices changed files; `Dataset.snapshot` is keyed on
the graph, so an audio file edited in place gives stale features.
`FeatureCache` therefore keeps its own files and rules:

- **Fingerprint.** The entry's name is a hash of everything that determines
  the features (the file list with sizes and mtimes, the transcripts, the
  audio and text configs, the package version and the cache format); any
  change builds a new entry next to the old one.
- **Atomic publish.** A build writes into a hidden temporary folder, then
  `manifest.json` (frames, size and SHA-256 of every feature file), then the
  completion marker `COMPLETE` last (with the manifest's SHA-256, the
  entry's content fingerprint), and renames the folder into place. A killed
  build leaves only a temporary folder that no reader uses and the next
  builder deletes.
- **Lock.** Builders of the same entry take an exclusive `flock` on
  `<entry>.lock`; the second one waits, then finds the entry published and
  uses it (a hit). The kernel releases the lock when a process dies, so a
  killed build never blocks the next run.
- **Checked on open.** The marker, the manifest hash and every file's size
  are checked each time the entry is opened (a damaged entry is rebuilt
  with a warning); `verify(full=True)` also re-hashes the contents.

Layout: `cache_dir/features-<fingerprint>/{manifest.json, COMPLETE,
features/<index // 1000>/<index>.f32}` (shards of 1000 files, so no folder
holds a million); a feature file holds the raw float32 values of the
`(frames, num_features)` array (`AudioConfig.num_features`), row by row,
in this machine's byte order (little-endian on x86-64 and ARM), no header:
the manifest has the frames. Features are computed and fingerprinted in
the `tf.data` pipeline, in parallel, and written from their buffers
without a copy.
"""

import errno
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np
import tensorflow as tf

from keras_gpufix.data.checks import nearest_existing, writable_problem
from keras_gpufix.exceptions import warn
from keras_gpufix.output import emit

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None

__all__ = ["FeatureCache", "fingerprint", "writable_problem"]

# 1: tf.io.serialize_tensor files (.tensor); 2: raw float32 (.f32); 3: the same in
# shards of SHARD files. An entry of another format is a miss (never read).
CACHE_FORMAT = 3
SHARD = 1000
ENTRY_PREFIX = "features-"
LITTLE_ENDIAN = sys.byteorder == "little"


def fingerprint(description) -> str:
    """SHA-256 of a JSON-serialisable description (sorted keys)."""
    payload = json.dumps(description, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(payload).hexdigest()


class _Lock:
    """An exclusive advisory lock on a file, released on close or death."""

    def __init__(self, path, verbose):
        self.path = path
        self.verbose = verbose

    def __enter__(self):
        self.file = open(self.path, "a+")
        if fcntl is None:
            return self
        try:
            fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            emit(f"Waiting for another process building the cache ({self.path})", self.verbose)
            fcntl.flock(self.file, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        if fcntl is not None:
            fcntl.flock(self.file, fcntl.LOCK_UN)
        self.file.close()


class _Paths:
    """`paths[index]`: the feature file of `index` in a temporary entry folder."""

    def __init__(self, cache, root):
        self.cache = cache
        self.root = root

    def __len__(self):
        return self.cache.count

    def __getitem__(self, index):
        return self.cache.feature_path(index, self.root)


def _mib(size) -> str:
    return f"{size / 2**20:.1f} MiB"


class FeatureCache:
    """One cache entry: feature files for a fixed list of utterances.

    Args:
        cache_dir: the folder that holds entries (created if needed).
        key: the entry's fingerprint (from `fingerprint(...)`).
        count: number of utterances (feature files).
        verbose: print a line when waiting for another builder. Defaults
            to 1.

    Example:

    >>> cache = FeatureCache("cache/", fingerprint({"files": [...]}), count=100)
    >>> manifest, status = cache.open_or_build(write_features)
    """

    def __init__(self, cache_dir, key, count, verbose=1):
        self.cache_dir = str(cache_dir)
        self.key = key
        self.count = count
        self.verbose = verbose
        self.name = f"{ENTRY_PREFIX}{key[:24]}"
        self.path = os.path.join(self.cache_dir, self.name)

    def feature_path(self, index, root=None) -> str:
        """Where utterance `index`'s features are (under `root`, default the entry)."""
        return os.path.join(root or self.path, "features", f"{index // SHARD:04d}",
                            f"{index:07d}.f32")

    def feature_path_tensor(self, index) -> tf.Tensor:
        """`feature_path(index)` in TF ops, for an int64 tensor of indices
        (no Python string per utterance)."""
        return tf.strings.join([
            os.path.join(self.path, "features", ""),
            tf.strings.as_string(index // SHARD, width=4, fill="0"), os.sep,
            tf.strings.as_string(index, width=7, fill="0"), ".f32",
        ])

    @staticmethod
    def file_bytes(features) -> tf.Tensor:
        """A feature file's contents: the float32 `(frames, num_features)`
        features as a uint8 vector (a view in the machine's byte order)."""
        return tf.reshape(tf.bitcast(tf.cast(features, tf.float32), tf.uint8), [-1])

    @staticmethod
    def decode(contents, num_features) -> tf.Tensor:
        """A feature file's contents (scalar string) -> float32 `(frames, num_features)`."""
        values = tf.io.decode_raw(contents, tf.float32, little_endian=LITTLE_ENDIAN)
        return tf.reshape(values, [-1, num_features])

    @staticmethod
    def digest(data) -> tf.Tensor:
        """64-bit FarmHash fingerprint (uint8 `(8,)`) of a uint8 vector (`file_bytes`)."""
        return tf.fingerprint(data[None])[0]

    def read(self, index):
        """The cached float32 `(frames, num_features)` features of one utterance
        (its frame count from the manifest; the entry is not checked here:
        `open` and `verify` do that)."""
        with open(os.path.join(self.path, "manifest.json"), "rb") as f:
            frames = json.load(f)["frames"][index]
        values = np.fromfile(self.feature_path(index), "<f4" if LITTLE_ENDIAN else ">f4")
        return values.reshape(frames, -1)

    def open(self):
        """The manifest of a complete, intact entry, or None."""
        manifest, problem = self._check()
        if problem is not None and os.path.exists(self.path):
            warn(f"The feature cache at {self.path} is damaged ({problem}); it will be rebuilt.")
        return manifest

    def _check(self):
        try:
            with open(os.path.join(self.path, "COMPLETE")) as f:
                marker = json.load(f)
            with open(os.path.join(self.path, "manifest.json"), "rb") as f:
                payload = f.read()
        except FileNotFoundError:
            return None, "no completion marker or manifest"
        except (OSError, ValueError) as exc:
            return None, f"unreadable marker: {exc}"
        if marker.get("key") != self.key or marker.get("format") != CACHE_FORMAT:
            return None, "the marker names another fingerprint"
        if hashlib.sha256(payload).hexdigest() != marker.get("manifest_sha256"):
            return None, "manifest.json does not match its fingerprint"
        manifest = json.loads(payload)
        if len(manifest["sizes"]) != self.count:
            return None, f"{len(manifest['sizes'])} feature files, expected {self.count}"
        for index, size in enumerate(manifest["sizes"]):
            try:
                actual = os.path.getsize(self.feature_path(index))
            except OSError:
                return None, f"feature file {index} is missing"
            if actual != size:
                return None, f"feature file {index} has {actual} bytes, expected {size}"
        return manifest, None

    def verify(self, full=True) -> bool:
        """True when the entry is complete and intact (`full`: re-hash every file)."""
        manifest, problem = self._check()
        if problem is not None:
            return False
        if full:
            for index, expected in enumerate(manifest["fingerprints"]):
                data = tf.io.decode_raw(tf.io.read_file(self.feature_path(index)), tf.uint8)
                if bytes(self.digest(data).numpy()).hex() != expected:
                    return False
        return True

    @staticmethod
    def estimate_bytes(frames, num_features) -> int:
        """Disk space of an entry whose utterances have `frames` frames each."""
        frames = [int(f) for f in frames]
        return sum(frames) * num_features * 4

    def check_writable(self) -> None:
        """Raises `OSError` (one line: the folder, why, the fix) if it cannot be written."""
        why = writable_problem(self.cache_dir)
        if why is not None:
            raise OSError(f"The cache folder {self.cache_dir} cannot be written ({why}). "
                          "Pass a writable `cache_dir` (or `data.cache_dir` in the config).")

    def check_space(self, needed_bytes) -> None:
        """Raises `OSError` (one line) if the cache folder's disk has less free space than needed."""
        free = shutil.disk_usage(nearest_existing(self.cache_dir)).free
        if free < needed_bytes:
            raise OSError(f"Not enough disk space for the feature cache in {self.cache_dir}: "
                          f"needs about {_mib(needed_bytes)}, {_mib(free)} free. "
                          "Free some space or pass another `cache_dir`.")

    @staticmethod
    def entries(cache_dir) -> list:
        """Names of the published entries in `cache_dir` (sorted)."""
        return [n for n in FeatureCache._names(cache_dir) if n.startswith(ENTRY_PREFIX)
                and not n.endswith(".lock") and os.path.isdir(os.path.join(cache_dir, n))]

    @staticmethod
    def leftovers(cache_dir) -> list:
        """Names of temporary folders that interrupted or failed builds left (sorted)."""
        return [n for n in FeatureCache._names(cache_dir)
                if n.startswith(f".{ENTRY_PREFIX}") and ".tmp-" in n]

    @staticmethod
    def _names(cache_dir):
        try:
            return sorted(os.listdir(cache_dir))
        except (FileNotFoundError, NotADirectoryError):
            return []

    @staticmethod
    def remove(cache_dir, name, drop_lock=True) -> None:
        """Removes entry or leftover `name`; an entry is renamed aside first
        (no reader ever sees half of one) and, with `drop_lock`, its lock
        file goes too."""
        path = os.path.join(cache_dir, name)
        if name.startswith(ENTRY_PREFIX):
            trash = tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=cache_dir)
            os.rename(path, os.path.join(trash, name))
            path = trash
            lock = os.path.join(cache_dir, name + ".lock")
            if drop_lock and os.path.exists(lock):
                os.unlink(lock)
        shutil.rmtree(path, ignore_errors=True)

    def open_or_build(self, write_features, needed_bytes=None):
        """Opens the entry, building it first if needed (under the lock).

        Args:
            write_features: `write_features(paths) -> iterable of (index,
                frames, size, digest)`, called once, only on a miss: it
                writes each utterance's features (`file_bytes`) to
                `paths[index]` (in a temporary folder) and yields, in any
                order, the frames, the file size and `digest(data)`. It
                writes in the calling thread only: once it raised (disk
                full, Ctrl-C), nothing writes into the folder being removed.

            needed_bytes: the entry's estimated size (`estimate_bytes`);
                checked against the free disk space before building.
                Defaults to None (not checked).

        Returns:
            `(manifest, status)`: the manifest dict (`frames` per index) and
            `"hit"` or `"miss"`.

        Raises:
            OSError: the folder cannot be written, or the disk is (or gets)
                too full; one line naming the folder, nothing left behind.
        """
        manifest = self.open()
        if manifest is not None:
            return manifest, "hit"
        self.check_writable()
        if needed_bytes is not None:
            self.check_space(needed_bytes)
        os.makedirs(self.cache_dir, exist_ok=True)
        with _Lock(self.path + ".lock", self.verbose):
            manifest, _ = self._check()
            if manifest is not None:
                return manifest, "hit"
            self._remove_leftovers()
            manifest = self._build(write_features, needed_bytes)
        return manifest, "miss"

    def _remove_leftovers(self):
        """Deletes temporary folders of killed builds and a damaged entry."""
        for entry in self.leftovers(self.cache_dir):
            if entry.startswith(f".{self.name}.tmp-"):
                self.remove(self.cache_dir, entry)
        if os.path.exists(self.path):
            self.remove(self.cache_dir, self.name, drop_lock=False)  # we hold that lock

    def _build(self, write_features, needed_bytes):
        tmp = tempfile.mkdtemp(prefix=f".{self.name}.tmp-", dir=self.cache_dir)
        try:
            return self._build_in(tmp, write_features)
        except BaseException as exc:  # Ctrl-C included: nothing half-written stays
            shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
                free = shutil.disk_usage(self.cache_dir).free
                needs = "" if needed_bytes is None else f"; the entry needs about {_mib(needed_bytes)}"
                raise OSError(f"The disk holding the feature cache {self.cache_dir} is full "
                              f"({_mib(free)} free{needs}); the partial entry was removed. "
                              "Free some space or pass another `cache_dir`.") from None
            raise

    def _build_in(self, tmp, write_features):
        count = self.count
        for shard in range(0, max(count, 1), SHARD):
            os.makedirs(os.path.dirname(self.feature_path(shard, tmp)))
        records = {}
        for index, frames, size, digest in write_features(_Paths(self, tmp)):
            records[int(index)] = (int(frames), int(size), bytes(digest).hex())
        if sorted(records) != list(range(count)):
            raise RuntimeError("the feature writer must yield each index 0..n-1 exactly once")
        manifest = {
            "key": self.key,
            "frames": [records[i][0] for i in range(count)],
            "sizes": [records[i][1] for i in range(count)],
            "fingerprints": [records[i][2] for i in range(count)],
            "created": time.time(),
        }
        payload = json.dumps(manifest).encode()
        self._write_synced(os.path.join(tmp, "manifest.json"), payload)
        marker = {"key": self.key, "format": CACHE_FORMAT,
                  "manifest_sha256": hashlib.sha256(payload).hexdigest()}
        self._write_synced(os.path.join(tmp, "COMPLETE"), json.dumps(marker).encode())
        os.rename(tmp, self.path)
        return manifest

    @staticmethod
    def _write_synced(path, payload):
        with open(path, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
