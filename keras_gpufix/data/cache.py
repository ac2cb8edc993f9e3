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
features/<index>.tensor}`; a feature file is a `tf.io.serialize_tensor` of
the float32 `(frames, n_mels)` array. Files are serialised, written and
fingerprinted inside the `tf.data` pipeline that computes them, in parallel.
"""

import hashlib
import json
import os
import shutil
import tempfile
import time
import warnings

import tensorflow as tf

from keras_gpufix.exceptions import GpufixWarning

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None

__all__ = ["FeatureCache", "fingerprint"]

CACHE_FORMAT = 1


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
            if self.verbose:
                print(f"Waiting for another process building the cache ({self.path})")
            fcntl.flock(self.file, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        if fcntl is not None:
            fcntl.flock(self.file, fcntl.LOCK_UN)
        self.file.close()


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
        self.name = f"features-{key[:24]}"
        self.path = os.path.join(self.cache_dir, self.name)

    def feature_path(self, index, root=None) -> str:
        return os.path.join(root or self.path, "features", f"{index:07d}.tensor")

    @staticmethod
    def digest(data) -> tf.Tensor:
        """64-bit FarmHash fingerprint (uint8 `(8,)`) of a scalar string tensor."""
        return tf.fingerprint(tf.reshape(data, [1]))[0]

    def read(self, index):
        """The cached float32 `(frames, n_mels)` features of one utterance."""
        return tf.io.parse_tensor(tf.io.read_file(self.feature_path(index)), tf.float32).numpy()

    def open(self):
        """The manifest of a complete, intact entry, or None."""
        manifest, problem = self._check()
        if problem is not None and os.path.exists(self.path):
            warnings.warn(
                f"The feature cache at {self.path} is damaged ({problem}); it will be rebuilt.",
                GpufixWarning,
                stacklevel=3,
            )
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
                data = tf.io.read_file(self.feature_path(index))
                if bytes(self.digest(data).numpy()).hex() != expected:
                    return False
        return True

    def open_or_build(self, write_features):
        """Opens the entry, building it first if needed (under the lock).

        Args:
            write_features: `write_features(paths) -> iterable of (index,
                frames, size, digest)`, called once, only on a miss: it
                writes each utterance's serialised features to
                `paths[index]` (in a temporary folder) and yields, in any
                order, the frames, the file size and `digest(data)`.

        Returns:
            `(manifest, status)`: the manifest dict (`frames` per index) and
            `"hit"` or `"miss"`.
        """
        manifest = self.open()
        if manifest is not None:
            return manifest, "hit"
        os.makedirs(self.cache_dir, exist_ok=True)
        with _Lock(self.path + ".lock", self.verbose):
            manifest, _ = self._check()
            if manifest is not None:
                return manifest, "hit"
            self._remove_leftovers()
            manifest = self._build(write_features)
        return manifest, "miss"

    def _remove_leftovers(self):
        """Deletes temporary folders of killed builds and a damaged entry."""
        for entry in os.listdir(self.cache_dir):
            if entry.startswith(f".{self.name}.tmp-"):
                shutil.rmtree(os.path.join(self.cache_dir, entry), ignore_errors=True)
        if os.path.exists(self.path):
            trash = tempfile.mkdtemp(prefix=f".{self.name}.tmp-", dir=self.cache_dir)
            os.rename(self.path, os.path.join(trash, "damaged"))
            shutil.rmtree(trash, ignore_errors=True)

    def _build(self, write_features):
        tmp = tempfile.mkdtemp(prefix=f".{self.name}.tmp-", dir=self.cache_dir)
        os.makedirs(os.path.join(tmp, "features"))
        count = self.count
        records = {}
        for index, frames, size, digest in write_features(
            [self.feature_path(i, tmp) for i in range(count)]
        ):
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
