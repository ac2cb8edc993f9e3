"""YAML configuration: one file for data, training, distribution and monitors.

```yaml
data:
  corpus: data/LJSpeech-1.1     # relative paths are relative to this file
  audio: {sample_rate: 22050, n_mels: 80}   # kg.data.AudioConfig fields
  text: {}                      # kg.data.TextConfig fields
  batch_size: 32                # global batch (all replicas)
  num_buckets: 8                # >= 1 length buckets (bounded shapes)
  cache_dir: cache/
  on_bad_input: skip            # skip | raise
  prefetch: auto                # auto | /gpu:0 (to that device)
  service: null                 # grpc://host:port of a tf.data service
training:
  jit_compile: true
  mixed_precision: auto         # auto | float32 | bfloat16 | float16 (mixed_*)
  steps_per_execution: auto
  epochs: 10
distribute:
  mode: auto                    # auto | default | one_device | mirrored | multi_worker
  devices: null
monitor:
  window: 96
  warmup: 5
  min_windows: 2
  thresholds: {}                # OscillationDetector arguments
  log_dir: logs                 # TensorBoard scalars and profiler traces
  profiling: {trigger: oscillation, steps: 10, max_traces: 3}   # ProfilerTrigger, or false
```

- `load_config(path)` parses and type-checks; every error names the key,
  its line, the expected type and the closest valid key. A value is also
  checked by the object it configures where that has a rule (`AudioConfig`,
  `TextConfig`, `OscillationDetector`, `ProfilerTrigger`, device names).
- Each section's keys are arguments of what it feeds; their defaults are
  read from that signature (`ProfilerTrigger`, `GPUOscillationMonitor`,
  `compile_model`, `setup_strategy`, `SpeechDatasetBuilder`), not repeated.
- `validate_config(path, fix=False)` also checks the performance traps
  (`check_config`) and, with `fix=True`, rewrites the file in place
  (atomically, the original kept as `<file>.bak`) with each change listed.
- `from_config(cfg)` makes everything in the right order: the strategy,
  the mixed-precision policy (before the model is built), the dataset
  builder, the `kg.compile_model` arguments and the callbacks.
"""

import dataclasses
import difflib
import functools
import importlib
import inspect
import json
import os
import re
import shutil
import tempfile
from typing import Any

import yaml

from keras_gpufix.distribute import STRATEGY_MODES, resolve_strategy_mode

__all__ = [
    "Config",
    "DataConfig",
    "TrainingConfig",
    "DistributeConfig",
    "MonitorConfig",
    "ProfilingConfig",
    "ConfigError",
    "Setup",
    "load_config",
    "from_config",
    "builder_kwargs",
    "check_config",
    "validate_config",
]

_POLICIES = ("auto", "float32", "bfloat16", "float16", "mixed_bfloat16", "mixed_float16")
# The YAML's short names are Keras's mixed policies (float32 variables).
_POLICY_NAMES = {False: "float32", "bfloat16": "mixed_bfloat16", "float16": "mixed_float16"}


def _spec(default, expected, valid, coerce=None):
    """A dataclass field with its YAML check: `expected` in words, `valid(v)`,
    and `coerce(v)` -> a corrected value or None (what `--fix` writes).
    A callable `default` is a factory (`_fed`: the fed signature's default)."""
    meta = {"expected": expected, "valid": valid, "coerce": coerce}
    if callable(default):
        return dataclasses.field(default_factory=default, metadata=meta)
    if isinstance(default, (dict, list)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


@functools.lru_cache(maxsize=None)
def _parameters(owner):
    module, _, path = owner.partition(":")
    target = importlib.import_module(module)
    for name in path.split("."):
        target = getattr(target, name)
    return inspect.signature(target).parameters


def _fed(owner):
    """Defaults owned by the signature a section feeds: `_fed(owner)(name)`
    is a default factory returning parameter `name`'s default of `owner`
    (`"module:qualname"`, imported when a section is made, not at import)."""
    def default(name):
        return lambda: _parameters(owner)[name].default
    return default


_BUILDER = _fed("keras_gpufix.data.builder:SpeechDatasetBuilder")
_BUILD = _fed("keras_gpufix.data.builder:SpeechDatasetBuilder.build")
_COMPILE = _fed("keras_gpufix.compile.entry:compile_model")
_STRATEGY = _fed("keras_gpufix.distribute:setup_strategy")
_MONITOR = _fed("keras_gpufix.callbacks.gpu_oscillation_monitor:GPUOscillationMonitor")
_TRIGGER = _fed("keras_gpufix.callbacks.profiler_trigger:ProfilerTrigger")


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _int_from_str(v):
    return int(v) if isinstance(v, str) and re.fullmatch(r"\s*[+-]?\d+\s*", v) else None


def _bool_from_str(v):
    if isinstance(v, str) and v.strip().lower() in ("true", "yes", "on", "false", "no", "off"):
        return v.strip().lower() in ("true", "yes", "on")
    return None


def _opt_str(v):
    return v is None or isinstance(v, str)


@dataclasses.dataclass
class DataConfig:
    """The `data` section: arguments of `kg.data.SpeechDatasetBuilder` and `build`."""

    corpus: str = _spec(None, "a path (string) or null", _opt_str)
    audio: dict = _spec({}, "a mapping of kg.data.AudioConfig fields",
                        lambda v: isinstance(v, dict))
    text: dict = _spec({}, "a mapping of kg.data.TextConfig fields",
                       lambda v: isinstance(v, dict))
    batch_size: int = _spec(32, "an integer >= 1", lambda v: _is_int(v) and v >= 1,
                            _int_from_str)
    num_buckets: int = _spec(
        _BUILD("num_buckets"), "an integer >= 1 (no bucketing is not supported: with unbounded "
        "lengths every new padded length is a new XLA compile)", lambda v: _is_int(v) and v >= 1,
        lambda v: _BUILD("num_buckets")() if v is None or v == 0 else _int_from_str(v))
    cache_dir: str = _spec(_BUILDER("cache_dir"), "a path (string) or null", _opt_str)
    on_bad_input: str = _spec(None, '"skip", "raise" or null',
                              lambda v: v in (None, "skip", "raise"))
    prefetch: str = _spec(
        "auto", '"auto" (tf.data AUTOTUNE) or a device such as "/gpu:0" (prefetch_to_device)',
        lambda v: isinstance(v, str) and (v == "auto" or v.startswith("/")),
        lambda v: "auto" if v is not None else None)
    service: str = _spec(_BUILD("service"),
                         'a tf.data service address "grpc://host:port" or null',
                         lambda v: v is None or (isinstance(v, str) and "://" in v))


@dataclasses.dataclass
class TrainingConfig:
    """The `training` section: arguments of `kg.compile_model` and `fit`."""

    jit_compile: bool = _spec(_COMPILE("jit_compile"), "true or false",
                              lambda v: isinstance(v, bool), _bool_from_str)
    mixed_precision: str = _spec(_COMPILE("mixed_precision"),
                                 " | ".join(_POLICIES) + " or false",
                                 lambda v: v is False or v in _POLICIES)
    steps_per_execution: Any = _spec(
        _COMPILE("steps_per_execution"), '"auto" or an integer >= 1',
        lambda v: v == "auto" or (_is_int(v) and v >= 1), _int_from_str)
    epochs: int = _spec(1, "an integer >= 1", lambda v: _is_int(v) and v >= 1, _int_from_str)


@dataclasses.dataclass
class DistributeConfig:
    """The `distribute` section: arguments of `kg.setup_strategy`."""

    mode: str = _spec(_STRATEGY("mode"), " | ".join(STRATEGY_MODES),
                      lambda v: v in STRATEGY_MODES)
    devices: list = _spec(_STRATEGY("devices"),
                          'a list of device names (["/gpu:0", "/gpu:1"]) or null',
                          lambda v: v is None or (isinstance(v, list) and v
                                                  and all(isinstance(d, str) for d in v)))


@dataclasses.dataclass
class ProfilingConfig:
    """`monitor.profiling`: arguments of `kg.ProfilerTrigger` (`false` disables it)."""

    trigger: Any = _spec(_TRIGGER("trigger"),
                         '"oscillation", "slow_step", a step number or a list of these',
                         lambda v: isinstance(v, str) or _is_int(v)
                         or (isinstance(v, list) and v
                             and all(_is_int(s) or isinstance(s, str) for s in v)))
    steps: int = _spec(_TRIGGER("steps"), "an integer >= 1", lambda v: _is_int(v) and v >= 1,
                       _int_from_str)
    max_traces: int = _spec(_TRIGGER("max_traces"), "an integer >= 1",
                            lambda v: _is_int(v) and v >= 1, _int_from_str)
    analyze: bool = _spec(_TRIGGER("analyze"), "true or false", lambda v: isinstance(v, bool),
                          _bool_from_str)
    cooldown: int = _spec(_TRIGGER("cooldown"), "an integer >= 0",
                          lambda v: _is_int(v) and v >= 0, _int_from_str)
    warmup: int = _spec(_TRIGGER("warmup"), "an integer >= 0", lambda v: _is_int(v) and v >= 0,
                        _int_from_str)
    analysis_timeout: float = _spec(_TRIGGER("analysis_timeout"), "a number of seconds >= 0",
                                    lambda v: _is_number(v) and v >= 0)


@dataclasses.dataclass
class MonitorConfig:
    """The `monitor` section: `kg.GPUOscillationMonitor` arguments (`log_dir`
    for its TensorBoard scalars and `ProfilerTrigger`'s traces) and `profiling`."""

    window: int = _spec(_MONITOR("window"), "an integer >= 8", lambda v: _is_int(v) and v >= 8,
                        _int_from_str)
    warmup: int = _spec(_MONITOR("warmup"), "an integer >= 0", lambda v: _is_int(v) and v >= 0,
                        _int_from_str)
    min_windows: int = _spec(_MONITOR("min_windows"), "an integer >= 1",
                             lambda v: _is_int(v) and v >= 1, _int_from_str)
    thresholds: dict = _spec({}, "a mapping of OscillationDetector arguments to numbers",
                             lambda v: isinstance(v, dict)
                             and all(_is_number(x) for x in v.values()))
    log_dir: str = _spec("logs", "a path (string) or null", _opt_str)
    profiling: Any = _spec(ProfilingConfig, "a mapping of ProfilerTrigger arguments or false",
                           lambda v: v is None or v is False or isinstance(v, dict))


_SECTIONS = {
    "data": DataConfig,
    "training": TrainingConfig,
    "distribute": DistributeConfig,
    "monitor": MonitorConfig,
}


@dataclasses.dataclass
class Config:
    """A loaded configuration.

    Attributes:
        data, training, distribute, monitor: the sections.
        source: the file it came from (None when built in code).
        lines: `"section.key"` -> line number in `source`.
    """

    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    training: TrainingConfig = dataclasses.field(default_factory=TrainingConfig)
    distribute: DistributeConfig = dataclasses.field(default_factory=DistributeConfig)
    monitor: MonitorConfig = dataclasses.field(default_factory=MonitorConfig)
    source: str = None
    lines: dict = dataclasses.field(default_factory=dict)

    def path(self, value):
        """`value` (a path from the file) resolved against the file's folder."""
        if value is None:
            return None
        value = os.path.expanduser(value)
        if self.source is None or os.path.isabs(value):
            return value
        return os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(self.source)), value))


class ConfigError(ValueError):
    """A configuration that cannot be used as written.

    Attributes:
        problems: list of problem dicts (`kind`, `key`, `line`, `message`,
            `expected`, `suggestion`); one per error found.
        unusable: True when the file cannot be read or parsed at all.
    """

    def __init__(self, problems, unusable=False):
        self.problems = problems
        self.unusable = unusable
        super().__init__("\n".join(p["message"] for p in problems))


# ----------------------------------------------------------------- parsing ---

class _Doc:
    """A parsed YAML text with the node of every key (for lines and edits)."""

    def __init__(self, text, source):
        self.text = text
        self.source = source
        try:
            self.root = yaml.compose(text, Loader=yaml.SafeLoader)
            self.data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
            line = mark.line + 1 if mark is not None else None
            what = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            raise ConfigError([_problem("yaml_syntax", None, line, source,
                                        f"YAML syntax error: {what}")], unusable=True)
        if self.data is None:
            raise ConfigError([_problem(
                "empty_file", None, None, source,
                "the file is empty (or only comments): nothing is configured. "
                "Start from examples/tts.yaml")], unusable=True)
        if not isinstance(self.data, dict):
            raise ConfigError([_problem(
                "not_a_mapping", None, 1, source,
                "the top level must be a mapping of sections "
                f"({', '.join(_SECTIONS)}). Received: {_describe(self.data)}")], unusable=True)
        self.nodes = {}  # "a.b" -> (key node, value node, parent mapping node)
        self.duplicates = []  # (path, first line, repeated line)
        self._walk(self.root, "")

    def _walk(self, node, prefix):
        if not isinstance(node, yaml.MappingNode):
            return
        for key, value in node.value:
            path = f"{prefix}{key.value}"
            if path in self.nodes:
                self.duplicates.append((path, self.line(path), key.start_mark.line + 1))
            self.nodes[path] = (key, value, node)
            self._walk(value, path + ".")

    def line(self, path):
        item = self.nodes.get(path)
        return item[0].start_mark.line + 1 if item else None


def _describe(value):
    names = {str: "a string", bool: "a boolean", int: "an integer", float: "a number",
             list: "a list", dict: "a mapping", type(None): "null"}
    return f"{value!r} ({names.get(type(value), type(value).__name__)})"


def _problem(kind, key, line, source, message, expected=None, suggestion=None, fix=None):
    where = os.path.basename(source) if source else "config"
    where = f"{where}, line {line}" if line else where
    return {
        "kind": kind,
        "key": key,
        "line": line,
        "message": f"{where}: {message}",
        "expected": expected,
        "suggestion": suggestion,
        "fix": fix,
    }


def _closest(name, valid):
    match = difflib.get_close_matches(str(name), list(valid), n=1, cutoff=0.6)
    return match[0] if match else None


def _unknown_keys(mapping, valid, prefix, doc, problems):
    """Adds an `unknown_key` problem per key of `mapping` not in `valid`."""
    for key in mapping:
        if key in valid:
            continue
        path = f"{prefix}.{key}" if prefix else str(key)
        guess = _closest(key, valid)
        fix = None
        if guess is not None and guess not in mapping:
            fix = {"action": "rename", "key": path, "to": guess}
        hint = f"; did you mean `{guess}`?" if guess else ""
        problems.append(_problem(
            "unknown_key", path, doc.line(path), doc.source,
            f"unknown key `{path}`{hint} Valid keys{' in `' + prefix + '`' if prefix else ''}: "
            + ", ".join(sorted(valid)),
            expected=", ".join(sorted(valid)), suggestion=guess, fix=fix))


def _sub_keys(owner):
    """Argument names of a class (dataclass fields or `__init__` parameters)."""
    if dataclasses.is_dataclass(owner):
        return [f.name for f in dataclasses.fields(owner)]
    params = inspect.signature(owner).parameters.values()
    return [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def _data_class(name):
    """`kg.data.AudioConfig` / `TextConfig`, or None where not available."""
    try:
        from keras_gpufix import data
        return getattr(data, name)
    except (ImportError, AttributeError):
        return None


def _threshold_keys():
    from keras_gpufix.analysis import THRESHOLDS
    return sorted(THRESHOLDS)


def _detector(monitor, thresholds):
    from keras_gpufix.analysis import OscillationDetector

    return OscillationDetector(window=monitor.window, warmup=monitor.warmup,
                               min_windows=monitor.min_windows, **thresholds)


def _device_specs(names):
    import tensorflow as tf

    return [tf.DeviceSpec.from_string(name) for name in names]


def _profiler_trigger(profiling):
    from keras_gpufix.callbacks import ProfilerTrigger

    return ProfilerTrigger("logs", verbose=0, **dataclasses.asdict(profiling))


def _owner_check(key, what, make, doc, problems):
    """Adds an `invalid_value` problem when `make()`, the object `key`
    configures built from the loaded values, rejects them: the object's own
    rule decides, so `load_config` accepts exactly what it accepts."""
    try:
        make()
    except (TypeError, ValueError) as exc:
        problems.append(_problem(
            "invalid_value", key, doc.line(key), doc.source,
            f"`{key}` is not {what}: {exc}"))


def _section(cls, raw, prefix, doc, problems):
    """Builds a section dataclass from `raw`; bad entries keep their default."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    _unknown_keys(raw, fields, prefix, doc, problems)
    kwargs = {}
    for name, f in fields.items():
        if name not in raw:
            continue
        value, path = raw[name], f"{prefix}.{name}"
        meta = f.metadata
        if meta["valid"](value):
            kwargs[name] = value
            continue
        coerced = meta["coerce"](value) if meta["coerce"] else None
        fix = None
        if coerced is not None and meta["valid"](coerced):
            fix = {"action": "set", "key": path, "value": coerced}
        problems.append(_problem(
            "wrong_type", path, doc.line(path), doc.source,
            f"`{path}` must be {meta['expected']}. Received: {_describe(value)}",
            expected=meta["expected"], fix=fix))
    return cls(**kwargs)


def _nested(raw, prefix, valid, doc, problems):
    if isinstance(raw, dict):
        _unknown_keys(raw, valid, prefix, doc, problems)


def _build(doc):
    """(Config, schema problems) from a parsed document; lenient."""
    problems = []
    for path, first, again in doc.duplicates:
        problems.append(_problem(
            "duplicate_key", path, again, doc.source,
            f"`{path}` is set twice, on line {first} and line {again} (YAML keeps only "
            f"line {again}'s value); delete one of them"))
    _unknown_keys(doc.data, _SECTIONS, "", doc, problems)
    sections = {}
    for name, cls in _SECTIONS.items():
        raw = doc.data.get(name)
        if raw is None:
            raw = {}
        if not isinstance(raw, dict):
            problems.append(_problem(
                "wrong_type", name, doc.line(name), doc.source,
                f"`{name}` must be a mapping. Received: {_describe(raw)}",
                expected="a mapping"))
            raw = {}
        sections[name] = _section(cls, raw, name, doc, problems)
    data, monitor = sections["data"], sections["monitor"]
    for key, cls_name in (("audio", "AudioConfig"), ("text", "TextConfig")):
        owner = _data_class(cls_name)
        if owner is None:
            continue
        values = getattr(data, key)
        _nested(values, f"data.{key}", _sub_keys(owner), doc, problems)
        known = {k: v for k, v in values.items() if k in _sub_keys(owner)}
        _owner_check(f"data.{key}", f"a valid {cls_name}", lambda: owner(**known), doc,
                     problems)
    _nested(monitor.thresholds, "monitor.thresholds", _threshold_keys(), doc, problems)
    if monitor.thresholds:
        known = {k: v for k, v in monitor.thresholds.items() if k in _threshold_keys()}
        _owner_check("monitor.thresholds", "accepted by OscillationDetector",
                     lambda: _detector(monitor, known), doc, problems)
    distribute = sections["distribute"]
    if distribute.devices:
        _owner_check("distribute.devices", "a list of TensorFlow device names",
                     lambda: _device_specs(distribute.devices), doc, problems)
        _owner_check("distribute.devices", f"usable with mode {distribute.mode!r}",
                     lambda: resolve_strategy_mode(distribute.mode,
                                                   device_count=len(distribute.devices),
                                                   devices_given=True), doc, problems)
    if data.prefetch != "auto":
        _owner_check("data.prefetch", "a TensorFlow device name",
                     lambda: _device_specs([data.prefetch]), doc, problems)
    if monitor.profiling is None or isinstance(monitor.profiling, dict):
        given = bool(monitor.profiling)
        monitor.profiling = _section(ProfilingConfig, monitor.profiling or {},
                                     "monitor.profiling", doc, problems)
        if given:
            _owner_check("monitor.profiling", "accepted by ProfilerTrigger",
                         lambda: _profiler_trigger(monitor.profiling), doc, problems)
    lines = {path: doc.line(path) for path in doc.nodes}
    return Config(source=doc.source, lines=lines, **sections), _in_line_order(problems)


def _in_line_order(problems):
    return sorted(problems, key=lambda p: (p["line"] is None, p["line"] or 0))


def _read(path):
    path = os.fspath(path)
    if not os.path.exists(path):
        raise ConfigError([_problem("missing_file", None, None, path,
                                    f"no such file: {path}")], unusable=True)
    try:
        with open(path, encoding="utf-8") as f:
            return _Doc(f.read(), path)
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError([_problem("unreadable", None, None, path,
                                    f"cannot read {path}: {exc}")], unusable=True) from exc


def load_config(path) -> Config:
    """Reads and type-checks a YAML config.

    Args:
        path: the YAML file.

    Returns:
        A `Config`. Performance traps are not errors here: see
        `check_config` / `keras-gpufix validate`.

    Raises:
        ConfigError: (a `ValueError`) listing every unknown key (with the
            closest valid one), wrong type (with the expected one) and YAML
            syntax error, each with its line.

    Example:

    >>> cfg = kg.load_config("examples/tts.yaml")
    >>> cfg.data.batch_size
    32
    """
    doc = _read(path)
    cfg, problems = _build(doc)
    if problems:
        raise ConfigError(problems)
    return cfg


# ------------------------------------------------------------------ checks ---

def _replicas(distribute, info):
    """Replicas the distribute section gives on this machine (distribute's rule)."""
    from keras_gpufix.distribute import tf_config_cluster

    try:
        cluster = tf_config_cluster() if distribute.mode in ("auto", "multi_worker") else None
    except ValueError:  # setup_strategy names the bad TF_CONFIG itself
        cluster = None
    count = len(distribute.devices) if distribute.devices else len(info["gpus"])
    try:
        mode, _ = resolve_strategy_mode(distribute.mode, device_count=count,
                                        devices_given=bool(distribute.devices), cluster=cluster)
    except ValueError:  # devices the mode cannot use: already an invalid_value problem
        return 1
    if mode in ("default", "one_device"):
        return 1
    return max(1, count) * (sum(cluster.values()) if cluster else 1)


def _default_cache_dir():
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "keras_gpufix")


def check_config(cfg: Config, environment=None):
    """Performance traps in a config, as problem dicts (empty when none).

    Checks what really costs GPU time, on this machine: `on_bad_input`
    unset for a corpus that has bad files, a batch size the replicas cannot
    share, a mixed-precision policy the device does not run fast, a GPU
    this machine does not have, a `cache_dir` that cannot be written, a
    corpus that does not exist.

    Args:
        cfg: a `Config`.
        environment: `keras_gpufix.compile.device_info()`-like dict; defaults
            to this machine's.

    Returns:
        A list of dicts with `kind`, `key`, `line`, `message`, `expected`,
        `suggestion` and `fix` (`{"action": "set", "key", "value"}` or None).
    """
    from keras_gpufix.compile.hardware import device_info, precision_support

    info = device_info() if environment is None else environment
    problems = []
    d, t = cfg.data, cfg.training

    def add(kind, key, message, fix_value=dataclasses.MISSING):
        fix = None if fix_value is dataclasses.MISSING else {
            "action": "set", "key": key, "value": fix_value}
        problems.append(_problem(kind, key, cfg.lines.get(key) or cfg.lines.get(key.split(".")[0]),
                                 cfg.source, message, fix=fix))

    corpus = cfg.path(d.corpus)
    if corpus is not None:
        if not os.path.exists(corpus):
            add("corpus_missing", "data.corpus", f"`data.corpus` does not exist: {corpus}")
        elif d.on_bad_input is None:
            skipped = _bad_inputs(corpus, d.audio.get("max_seconds"))
            if skipped:
                first = skipped[0]
                add("bad_input_unset", "data.on_bad_input",
                    f"`data.on_bad_input` is unset and the corpus has {len(skipped)} bad "
                    f"utterance(s) (first: line {first['line']}, {first['path']}: "
                    f"{first['reason']}); choose `skip` (drop and report) or `raise`", "skip")
    replicas = _replicas(cfg.distribute, info)
    if d.batch_size % replicas:
        fixed = -(-d.batch_size // replicas) * replicas
        add("batch_not_divisible", "data.batch_size",
            f"`data.batch_size` {d.batch_size} is not divisible by the {replicas} replicas "
            f"of `distribute` (mode {cfg.distribute.mode!r}): replicas get unequal batches "
            "and the last one a different shape", fixed)
    fast, reason = (True, None) if t.mixed_precision in (False, "auto") else (
        precision_support(t.mixed_precision, info))
    if not fast:
        add("mixed_precision_unsupported", "training.mixed_precision",
            f"`training.mixed_precision` is {t.mixed_precision!r} but {reason}; "
            "`auto` picks what this device runs fast", "auto")
    for key, names, fix_value in (
            ("distribute.devices", cfg.distribute.devices or [], dataclasses.MISSING),
            ("data.prefetch", [] if d.prefetch == "auto" else [d.prefetch], "auto")):
        missing = [n for n in names if _gpu_index(n) is not None
                   and _gpu_index(n) >= len(info["gpus"])]
        if missing:
            add("device_missing", key,
                f"`{key}` names {', '.join(missing)} but this machine has "
                f"{len(info['gpus'])} GPU(s)", fix_value)
    cache = cfg.path(d.cache_dir)
    if cache is not None:
        from keras_gpufix.data.cache import writable_problem  # the builder's own check

        why = writable_problem(cache)
        if why:
            default = _default_cache_dir()
            add("cache_dir_not_writable", "data.cache_dir",
                f"`data.cache_dir` {cache} cannot be written ({why})",
                *([default] if writable_problem(default) is None else []))
    return problems


def _gpu_index(name):
    """The GPU number of a device name (`/gpu:1`, `/device:GPU:1`, ...), else None."""
    match = re.search(r"(?:^|/)(?:device:)?gpu:(\d+)$", name, re.IGNORECASE)
    return int(match.group(1)) if match else None


def _bad_inputs(corpus, max_seconds):
    from keras_gpufix.data.corpus import Corpus

    try:
        source = Corpus.from_path(corpus)
    except ValueError as exc:
        return [{"line": None, "path": corpus, "reason": str(exc)}]
    return source.scan(on_bad_input="skip", max_seconds=max_seconds)[1]


# -------------------------------------------------------------------- --fix ---

def _scalar(value):
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return repr(value)
    text = str(value)
    try:
        if yaml.safe_load(f"k: {text}") == {"k": text}:
            return text
    except yaml.YAMLError:
        pass
    return json.dumps(text)


def _edits(doc, fix):
    """Text edits `(start, end, replacement)` that apply one fix."""
    path = fix["key"]
    if fix["action"] == "rename":
        key = doc.nodes[path][0]
        return [(key.start_mark.index, key.end_mark.index, fix["to"])]
    value = _scalar(fix["value"])
    if path in doc.nodes:
        node = doc.nodes[path][1]
        end = node.end_mark.index + len(_stale_comment(doc, node))
        return [(node.start_mark.index, end, value)]
    section, name = path.split(".", 1)
    text = doc.text
    if section not in doc.nodes:
        sep = "" if not text or text.endswith("\n") else "\n"
        return [(len(text), len(text), f"{sep}{section}:\n  {name}: {value}\n")]
    node = doc.nodes[section][1]
    if isinstance(node, yaml.MappingNode) and node.flow_style:
        end = node.end_mark.index - 1
        return [(end, end, f"{', ' if node.value else ''}{name}: {value}")]
    if isinstance(node, yaml.MappingNode) and node.value:
        indent = node.value[0][0].start_mark.column
        last = node.value[-1][1].end_mark
        at = last.index if last.column == 0 else text.find("\n", last.index)
        if at == -1:
            return [(len(text), len(text), f"\n{' ' * indent}{name}: {value}\n")]
        at = at if last.column == 0 else at + 1
        return [(at, at, f"{' ' * indent}{name}: {value}\n")]
    # `section:` with no value (null)
    return [(node.start_mark.index, node.end_mark.index, f"\n  {name}: {value}")]


def _stale_comment(doc, node):
    """The `  # ...` ending the line of value `node` when it names the old
    value (it would lie once `--fix` rewrites the value: it is dropped), else ""."""
    match = re.match(r"[ \t]+#[^\n]*", doc.text[node.end_mark.index:])
    old = doc.text[node.start_mark.index:node.end_mark.index].strip("\"'")
    if match and old and re.search(rf"(?<![\w.]){re.escape(old)}(?![\w.])", match.group(0)):
        return match.group(0)
    return ""


def _change(doc, problem):
    """What one fix changes, for people: `before` -> `after` at `line`."""
    fix = problem["fix"]
    if fix["action"] == "rename":
        parent = fix["key"].rpartition(".")[0]
        before, after = fix["key"], f"{parent}.{fix['to']}" if parent else fix["to"]
    else:
        node = doc.nodes.get(fix["key"], (None, None))[1]
        before = None
        if node is not None:
            comment = _stale_comment(doc, node).strip()
            before = doc.text[node.start_mark.index:node.end_mark.index] + (
                f"  {comment}" if comment else "")
        after = _scalar(fix["value"])
    return {"line": problem["line"], "key": fix["key"], "action": fix["action"],
            "before": before, "after": after, "reason": problem["kind"],
            "message": problem["message"]}


def _all_problems(doc, environment):
    cfg, problems = _build(doc)
    return cfg, _in_line_order(problems + check_config(cfg, environment))


def validate_config(path, fix=False, environment=None):
    """Validates a config file; with `fix=True` rewrites what can be fixed.

    Args:
        path: the YAML file.
        fix: write the corrected file in place (atomically: a temporary
            file renamed over it) and keep the original as `<path>.bak`
            (`.bak.1`, ... when that exists). Defaults to False.
        environment: `keras_gpufix.compile.device_info()`-like dict. Defaults
            to this machine's.

    Returns:
        A dict with `path`, `exit_code` (0 valid, 1 problems remain, 2 the
        file is unusable: missing, unreadable, not YAML), `problems` (the
        ones left), `changes` (with `fix`: `line`, `key`, `before`,
        `after`, `reason`, `message`), `backup` (path or None) and `error`
        (message when unusable).
    """
    path = os.fspath(path)
    result = {"path": path, "exit_code": 0, "problems": [], "changes": [],
              "backup": None, "error": None}
    try:
        doc = _read(path)
        if environment is None:
            from keras_gpufix.compile import device_info

            environment = device_info()
        _, problems = _all_problems(doc, environment)
    except ConfigError as exc:
        result.update(exit_code=2, error=str(exc), problems=exc.problems)
        return result
    original = doc.text
    if fix:
        for _ in range(4):  # a rename can reveal a trap in the renamed key
            fixable = [p for p in problems if p["fix"]]
            if not fixable:
                break
            edits, seen = [], set()
            for p in fixable:
                if p["fix"]["key"] in seen:
                    continue
                seen.add(p["fix"]["key"])
                edits.extend(_edits(doc, p["fix"]))
                result["changes"].append(_change(doc, p))
            text = doc.text
            for start, end, new in sorted(edits, reverse=True):
                text = text[:start] + new + text[end:]
            doc = _Doc(text, path)
            _, problems = _all_problems(doc, environment)
        if result["changes"]:
            result["backup"] = _write_atomic(path, doc.text, original)
    result["problems"] = problems
    result["exit_code"] = 1 if problems else 0
    return result


def _write_atomic(path, text, original):
    backup, n = path + ".bak", 0
    while os.path.exists(backup):
        n += 1
        backup = f"{path}.bak.{n}"
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        shutil.copymode(path, tmp)
        with open(backup, "w", encoding="utf-8") as f:
            f.write(original)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return backup


# ------------------------------------------------------------- from_config ---

@dataclasses.dataclass
class Setup:
    """Everything `from_config` made, in the order training needs it.

    Attributes:
        config: the `Config`.
        strategy: the `tf.distribute.Strategy` (`kg.setup_strategy`).
        policy: the Keras dtype policy set (`kg.enable_mixed_precision`).
        builder: the `kg.data.SpeechDatasetBuilder`, None without a corpus.
        build_kwargs: arguments for `builder.build` (the global batch size).
        compile_kwargs: keyword arguments for `kg.compile_model`.
        callbacks: fresh monitor callbacks for `fit`: `GPUOscillationMonitor`,
            `RetracingMonitor` and, with `monitor.log_dir`, a `StepTimer`
            writing per-step and per-epoch `step_timer/*` TensorBoard scalars
            beside the monitor's `oscillation/*` and the `ProfilerTrigger`.
    """

    config: Config
    strategy: Any
    policy: Any
    builder: Any
    build_kwargs: dict
    compile_kwargs: dict
    callbacks: list

    def dataset(self, **overrides):
        """`builder.build(**build_kwargs, **overrides)`."""
        if self.builder is None:
            raise ValueError(
                "`data.corpus` is not set in the config: there is no dataset to build.")
        return self.builder.build(**{**self.build_kwargs, **overrides})


def builder_kwargs(cfg: Config) -> dict:
    """Keyword arguments of `kg.data.SpeechDatasetBuilder` from a config.

    The one place a config becomes builder arguments (`from_config`, the
    `bench-data` and `cache` commands use it).

    Args:
        cfg: a `Config`.

    Returns:
        A dict with `cache_dir` (resolved against the file's folder) and,
        where the config sets them, `audio` (`kg.data.AudioConfig`), `text`
        (`kg.data.TextConfig`) and `on_bad_input`.
    """
    from keras_gpufix import data

    kwargs = {"cache_dir": cfg.path(cfg.data.cache_dir)}
    if cfg.data.audio:
        kwargs["audio"] = data.AudioConfig(**cfg.data.audio)
    if cfg.data.text:
        kwargs["text"] = data.TextConfig(**cfg.data.text)
    if cfg.data.on_bad_input is not None:
        kwargs["on_bad_input"] = cfg.data.on_bad_input
    return kwargs


def from_config(cfg) -> Setup:
    """Builds strategy, policy, dataset builder, compile arguments and callbacks.

    Call it before building the model: it creates the strategy (GPU memory
    growth must be set before any GPU is used) and sets the mixed-precision
    policy (layers take the policy in force when they are created).

    Args:
        cfg: a `Config`, or a path to a YAML file.

    Returns:
        A `Setup`.

    Example:

    >>> setup = kg.from_config(kg.load_config("examples/tts.yaml"))
    >>> with setup.strategy.scope():
    ...     model = build_model()
    ...     kg.compile_model(model, "adam", "mse", **setup.compile_kwargs)
    >>> model.fit(setup.dataset(), epochs=setup.config.training.epochs,
    ...           callbacks=setup.callbacks)
    """
    import keras_gpufix as kg

    if not isinstance(cfg, Config):
        cfg = load_config(cfg)
    d, t, m = cfg.data, cfg.training, cfg.monitor
    strategy = kg.setup_strategy(mode=cfg.distribute.mode, devices=cfg.distribute.devices)
    policy = kg.enable_mixed_precision(_POLICY_NAMES.get(t.mixed_precision, t.mixed_precision))
    builder = None
    if d.corpus is not None:
        builder = kg.data.SpeechDatasetBuilder(cfg.path(d.corpus), **builder_kwargs(cfg))
    build_kwargs = {"batch_size": d.batch_size, "num_buckets": d.num_buckets}
    if d.prefetch != "auto":
        build_kwargs["prefetch_to_device"] = d.prefetch
    if d.service is not None:
        build_kwargs["service"] = d.service
    compile_kwargs = {"jit_compile": t.jit_compile, "mixed_precision": policy,
                      "steps_per_execution": t.steps_per_execution}
    log_dir = cfg.path(m.log_dir)
    callbacks = [
        kg.GPUOscillationMonitor(window=m.window, warmup=m.warmup, min_windows=m.min_windows,
                                 thresholds=m.thresholds, log_dir=log_dir),
        kg.RetracingMonitor(max_new_shapes=d.num_buckets + 1),
    ]
    if log_dir is not None:  # per-step and per-epoch step_timer/* scalars for TensorBoard
        callbacks.append(kg.StepTimer(log_dir=log_dir))  # every step, compiles included
    if m.profiling is not False and log_dir is not None:
        callbacks.append(kg.ProfilerTrigger(log_dir, **dataclasses.asdict(m.profiling)))
    return Setup(cfg, strategy, policy, builder, build_kwargs, compile_kwargs, callbacks)
