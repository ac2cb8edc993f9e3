"""YAML configuration: each section is the keyword arguments of one call.

```yaml
data:                 # kg.data.SpeechDatasetBuilder(**data)
  corpus: data/LJSpeech-1.1       # relative paths are relative to this file
  audio: {sample_rate: 22050, n_mels: 80}   # kg.data.AudioConfig(**audio)
  text: {}                        # kg.data.TextConfig(**text)
  cache_dir: cache/
build: {batch_size: 32, num_buckets: 8}     # builder.build(**build)
compile: {jit_compile: true, mixed_precision: auto, steps_per_execution: auto}
                                  # kg.compile_model(model, optimizer, loss, **compile)
strategy: {mode: auto}            # kg.setup_strategy(**strategy)
callbacks:                        # kg.<name>(**arguments), in this order
  GPUOscillationMonitor: {window: 96, log_dir: logs}
  RetracingMonitor: {max_new_shapes: 9}
  ProfilerTrigger: {log_dir: logs, trigger: oscillation}
fit: {epochs: 10}                 # model.fit(..., **fit)
```

There is no schema of its own: a section's keys are the parameters of its
call (read from the signature, so a new argument needs no change here) and
its values are judged by the call's own checks. Neither needs TensorFlow or
Keras: the signatures of the calls whose modules import them (the builder,
`compile_model`, the callbacks, `model.fit` and `model.compile`) are read
from their source, and the checks those calls run first load without them
(`AudioConfig`, `TextConfig`, `data/checks.py`, `compile/arguments.py`,
`callbacks/_arguments.py`). TensorFlow is imported only for `data.corpus`
(the builder) and `strategy.devices` (device names). An unknown key names the
closest parameter (difflib), else the closest key of any section; a value
the call refuses gives the call's own message with the file and line, once
per key (a key whose default is refused too ends the search, so every input
ends). `corpus`, `cache_dir` and `log_dir` are paths relative to the file.
Keys of the 0.1 format (`data.batch_size`, `training`, `distribute`,
`monitor`; `_MOVED`) are reported with where they moved, and their values
judged there.

- `load_config(path)` reads the file and runs the checks that have no side
  effects (`AudioConfig`, `TextConfig`, `compile_model`'s,
  `setup_strategy`'s, `build`'s and the callbacks' argument checks).
- `validate_config(path, fix=False)` also makes the dataset builder on the
  corpus and its epoch plan for `build` (no feature computed, no dataset
  made, no cache written), and checks this machine: a batch the replicas
  cannot share, a mixed-precision policy the device does not run fast, a
  device it lacks, a `cache_dir` it cannot write. With `fix=True` it
  rewrites what it can (a key of the 0.1 format to its place, a typo to the
  closest key, a quoted number, an empty value to the default, the
  machine's traps) in place, atomically, the original kept as `<file>.bak`.
- `from_config(cfg)` makes the strategy, the dtype policy, the builder and
  the callbacks, and holds the `compile_model`, `build` and `fit` arguments.
"""

import ast
import copy
import dataclasses
import difflib
import functools
import importlib.util
import inspect
import itertools
import json
import os
import re
import reprlib
from typing import Any, Optional

import yaml

__all__ = ["Config", "ConfigError", "Setup", "builder_kwargs", "from_config", "load_config",
           "validate_config"]

_PATH_KEYS = ("corpus", "cache_dir", "log_dir")
_NOT_FROM_YAML = {"self", "model", "optimizer", "loss", "metrics", "sample_batch", "x", "y",
                  "callbacks"}  # given in code
_NESTED = {"audio": "AudioConfig", "text": "TextConfig"}
_MAX_BYTES = 1 << 20  # a config is a few KB; PyYAML would parse 10 MB for minutes
_MAX_NODES = 100_000  # YAML aliases can make a small file a huge tree
_MAX_DEPTH = 32
# A value a call refuses raises one of these (a wrong type, a number out of range).
_REFUSALS = (TypeError, ValueError, ArithmeticError)
# Keys of the format before 0.2.0 (one section per topic) -> where they are now.
_MOVED = {
    "data.batch_size": "build.batch_size",
    "data.num_buckets": "build.num_buckets",
    "data.service": "build.service",
    "data.prefetch": "build.prefetch_to_device",
    "training.jit_compile": "compile.jit_compile",
    "training.mixed_precision": "compile.mixed_precision",
    "training.steps_per_execution": "compile.steps_per_execution",
    "training.epochs": "fit.epochs",
    "distribute.mode": "strategy.mode",
    "distribute.devices": "strategy.devices",
    "monitor.window": "callbacks.GPUOscillationMonitor.window",
    "monitor.warmup": "callbacks.GPUOscillationMonitor.warmup",
    "monitor.min_windows": "callbacks.GPUOscillationMonitor.min_windows",
    "monitor.thresholds": "callbacks.GPUOscillationMonitor.thresholds",
    "monitor.log_dir": "callbacks.GPUOscillationMonitor.log_dir",
    "monitor.profiling": "callbacks.ProfilerTrigger",
}
_OLD_SECTIONS = ("training", "distribute", "monitor")
_short = reprlib.Repr()
_short.maxstring = _short.maxother = 60


def _targets():
    """Section -> the signature of the call whose keyword arguments it holds."""
    from keras_gpufix.distribute import setup_strategy

    return {"data": _source("keras_gpufix.data.builder", "SpeechDatasetBuilder.__init__"),
            "build": _source("keras_gpufix.data.builder", "SpeechDatasetBuilder.build"),
            "compile": _source("keras_gpufix.compile.entry", "compile_model"),
            "strategy": inspect.signature(setup_strategy), "callbacks": None,
            "fit": _keras_model("fit")}


def _callback_signatures():
    """Each public callback's name -> its constructor's signature."""
    from keras_gpufix import callbacks

    return {name: _source(callbacks._EXPORTS[name], f"{name}.__init__")
            for name in callbacks.__all__}


class _NotLiteral:
    """The default of a parameter whose source default is not a literal."""

    def __repr__(self):
        return "<not a literal>"


_NOT_LITERAL = _NotLiteral()


@functools.lru_cache(maxsize=None)
def _text(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def _source_signature(path, qualname) -> inspect.Signature:
    """The parameters of `qualname` (`"f"`, or `"Class.method"` of a
    top-level class) read from the source file `path` without importing it:
    names, kinds and defaults (a default that is not a literal is
    `_NOT_LITERAL`); a method's first parameter (`self`) left out. Only the
    `def` line(s) are parsed (a whole module takes 10-50 ms).

    Raises:
        LookupError: when `path` defines no `qualname`.
    """
    text, start = _text(path), 0
    *owner, name = qualname.split(".")
    if owner:
        found = re.search(rf"^class {owner[0]}\b.*?:[ \t]*(#.*)?$", text, re.M)
        start = found.end() if found else len(text)
        end = re.compile(r"^\S", re.M).search(text, start)
        text = text[:end.start() if end else len(text)]
    found = re.compile(rf"^{'    ' if owner else ''}def {name}\(", re.M).search(text, start)
    node, lines = None, []
    for line in text[found.start():].splitlines() if found else ():
        lines.append(line.strip())
        try:
            node = ast.parse("\n".join(lines) + "\n pass").body[0]
            break
        except SyntaxError:
            if len(lines) > 40:
                break
    if not isinstance(node, ast.FunctionDef):
        raise LookupError(f"{path} defines no {qualname}")
    args, P = node.args, inspect.Parameter

    def default(value):
        if value is None:
            return P.empty
        try:
            return ast.literal_eval(value)
        except ValueError:
            return _NOT_LITERAL

    positional = ([(a, P.POSITIONAL_ONLY) for a in args.posonlyargs]
                  + [(a, P.POSITIONAL_OR_KEYWORD) for a in args.args])
    defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    parameters = [P(a.arg, kind, default=default(d)) for (a, kind), d in zip(positional, defaults)]
    if args.vararg:
        parameters.append(P(args.vararg.arg, P.VAR_POSITIONAL))
    parameters += [P(a.arg, P.KEYWORD_ONLY, default=default(d))
                   for a, d in zip(args.kwonlyargs, args.kw_defaults)]
    if args.kwarg:
        parameters.append(P(args.kwarg.arg, P.VAR_KEYWORD))
    return inspect.Signature(parameters[1:] if "." in qualname else parameters)


def _source(module, qualname) -> inspect.Signature:
    """`_source_signature` of a module of this package (found, not imported:
    the data builder, `compile_model` and the callbacks import TensorFlow or
    Keras)."""
    return _source_signature(importlib.util.find_spec(module).origin, qualname)


@functools.lru_cache(maxsize=None)
def _keras_model(method) -> inspect.Signature:
    """`keras.Model.<method>`'s parameters (`self` left out), read from Keras's
    source without importing Keras (which imports its backend: TensorFlow on
    the TensorFlow backend); from Keras itself where its source is not where
    `keras_internals.keras_trainer_source` looks."""
    from keras_gpufix.keras_internals import keras_trainer_source

    path = keras_trainer_source()
    if path is not None:
        try:
            return _source_signature(path, f"Trainer.{method}")
        except (LookupError, OSError):
            pass
    import keras

    signature = inspect.signature(getattr(keras.Model, method))
    return signature.replace(parameters=list(signature.parameters.values())[1:])


def _keys(signature) -> list:
    """The keyword arguments a section may hold: the parameters of its
    call's `signature` (and `model.compile`'s for `compile_model`'s
    `**compile_kwargs`)."""
    names = []
    for p in signature.parameters.values():
        if p.kind is p.VAR_KEYWORD:
            names += [k for k in _keys(_keras_model("compile")) if k not in names]
        elif p.kind is not p.VAR_POSITIONAL and p.name not in _NOT_FROM_YAML:
            names.append(p.name)
    return names


def _default(signature, key):
    parameter = signature.parameters.get(key)
    if parameter is None or parameter.default is _NOT_LITERAL:
        return inspect.Parameter.empty
    return parameter.default


@dataclasses.dataclass
class Config:
    """A loaded configuration: the keyword arguments of each call.

    Attributes:
        data, build, compile, strategy, fit: dicts of keyword arguments
            (paths resolved against the file's folder; `data["audio"]` and
            `data["text"]` dicts of `AudioConfig` / `TextConfig` fields).
        callbacks: callback class name -> its keyword arguments, in file order.
        source: the file it came from.
        lines: `"section.key"` -> line number in `source`.
    """

    data: dict = dataclasses.field(default_factory=dict)
    build: dict = dataclasses.field(default_factory=dict)
    compile: dict = dataclasses.field(default_factory=dict)
    strategy: dict = dataclasses.field(default_factory=dict)
    callbacks: dict = dataclasses.field(default_factory=dict)
    fit: dict = dataclasses.field(default_factory=dict)
    source: Optional[str] = None
    lines: dict = dataclasses.field(default_factory=dict)


class ConfigError(ValueError):
    """A configuration that cannot be used as written.

    Attributes:
        problems: list of problem dicts (`kind`, `key`, `line`, `message`,
            `suggestion`, `fix`); one per error found.
        unusable: True when the file cannot be read or parsed at all.
    """

    def __init__(self, problems, unusable=False):
        self.problems = problems
        self.unusable = unusable
        super().__init__("\n".join(p["message"] for p in problems))


def _problem(kind, key, line, source, message, suggestion=None, fix=None):
    where = os.path.basename(source) if source else "config"
    where = f"{where}, line {line}" if line else where
    if fix is not None:
        message += "; `keras-gpufix validate --fix` " + {
            "rename": lambda: f"renames it to `{fix['to']}`",
            "move": lambda: f"moves it to `{fix['to']}`" if fix["to"] else "deletes it",
            "set": lambda: f"sets it to {_scalar(fix['value'])}"}[fix["action"]]()
    return {"kind": kind, "key": key, "line": line, "message": f"{where}: {message}",
            "suggestion": suggestion, "fix": fix}


def _migrate(data):
    """`data` with the keys of the format before 0.2.0 moved where they are
    now, and the moves: `(old, new, note)` (`new` None: the key is dropped,
    `note` says why)."""
    moves = [(old, new) for old, new in _MOVED.items() if isinstance(
        data.get(old.split(".")[0]), dict) and old.split(".")[1] in data[old.split(".")[0]]]
    if not moves:
        return data, []
    data, done = copy.deepcopy(data), []
    made_callbacks = "callbacks" not in data
    for old, new in moves:
        section, key = old.split(".")
        value = data[section].pop(key)
        note = None
        if old == "data.prefetch" and value in ("auto", None, False):
            new, note = None, "batches are always prefetched now, with tf.data AUTOTUNE"
        elif old == "monitor.profiling" and value in (None, False):
            new, note = None, "no ProfilerTrigger is made unless `callbacks` names it"
        elif old == "monitor.profiling" and value is True:
            value = {}
        *parents, leaf = new.split(".") if new else [None]
        node = data
        for part in parents if new else ():
            node = node.setdefault(part, {}) if isinstance(node, dict) else None
        if new and not isinstance(node, dict):
            data[section][key] = value  # its new section is not a mapping: left where it is
            continue
        if new and leaf in node:
            new, note = None, f"`{new}` is set too, and kept"
        elif new:
            node[leaf] = value
        done.append((old, new, note))
    callbacks = data.get("callbacks")
    if isinstance(callbacks, dict):
        monitor, trigger = callbacks.get("GPUOscillationMonitor"), callbacks.get("ProfilerTrigger")
        log_dir = monitor.get("log_dir") if isinstance(monitor, dict) else None
        if "monitor.profiling" in dict(moves) and isinstance(trigger, dict) and log_dir:
            trigger.setdefault("log_dir", log_dir)  # the earlier format's one log_dir
        if made_callbacks:  # the monitors a config without `callbacks` gets
            callbacks.setdefault("RetracingMonitor", {})
            data["callbacks"] = {name: callbacks[name] for name in
                                 ("GPUOscillationMonitor", "RetracingMonitor", "ProfilerTrigger")
                                 if name in callbacks}
    for section in _OLD_SECTIONS:
        if data.get(section) == {}:
            del data[section]
    return data, done


class _Doc:
    """A parsed YAML text with the nodes of every key (for lines and edits)."""

    def __init__(self, text, source):
        self.text, self.source = text, source
        try:
            self._check_depth(text)  # before composing, which recurses per level
            self.root = yaml.compose(text, Loader=yaml.SafeLoader)
            self._check_size(self.root)
            self.data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
            what = getattr(exc, "problem", None) or str(exc).splitlines()[0]
            raise ConfigError([_problem("yaml_syntax", None, mark and mark.line + 1, source,
                                        f"YAML syntax error: {what}")], unusable=True)
        if self.data is None:
            raise ConfigError([_problem(
                "empty_file", None, None, source, "the file is empty (or only comments): "
                "nothing is configured. Start from examples/tts.yaml")], unusable=True)
        if not isinstance(self.data, dict):
            raise ConfigError([_problem(
                "not_a_mapping", None, 1, source,
                "the top level must be a mapping of sections. Received: "
                + _short.repr(self.data))], unusable=True)
        self.nodes = {}  # "a.b" -> (key node, value node)
        self.problems = []
        self.data, self.moves = _migrate(self.data)
        self.moved = {new: old for old, new, _ in self.moves if new}
        self._walk(self.root, "")

    def _check_depth(self, text):
        """Refuses a text nested deeper than any config (read as a stream of events)."""
        depth = 0
        for event in yaml.parse(text, Loader=yaml.SafeLoader):
            if isinstance(event, yaml.CollectionStartEvent):
                depth += 1
                if depth > _MAX_DEPTH:
                    raise ConfigError([_problem(
                        "too_large", None, event.start_mark.line + 1, self.source,
                        f"the YAML is nested more than {_MAX_DEPTH} levels deep; a config has "
                        "4 (callbacks.<name>.<argument>.<key>)")], unusable=True)
            elif isinstance(event, yaml.CollectionEndEvent):
                depth -= 1

    def _check_size(self, root):
        """Refuses a tree that (through YAML aliases) holds more values than any config."""
        stack, count = [root], 0
        while stack:
            node = stack.pop()
            count += 1
            if count > _MAX_NODES:
                raise ConfigError([_problem(
                    "too_large", None, node.start_mark.line + 1, self.source,
                    f"the YAML holds more than {_MAX_NODES} values (YAML aliases?)")],
                    unusable=True)
            if isinstance(node, yaml.MappingNode):
                stack += [n for pair in node.value for n in pair]
            elif isinstance(node, yaml.SequenceNode):
                stack += node.value

    def _walk(self, node, prefix):
        for key, value in node.value:
            path = f"{prefix}{key.value}"
            if path in self.nodes:
                first, again = self.line(path), key.start_mark.line + 1
                self.problems.append(_problem(
                    "duplicate_key", path, again, self.source,
                    f"`{path}` is set twice, on line {first} and line {again} (YAML keeps only "
                    f"line {again}'s value); delete one of them"))
            self.nodes[path] = (key, value)
            if isinstance(value, yaml.MappingNode):
                self._walk(value, path + ".")

    def line(self, path):
        for new, old in self.moved.items():  # a key of the earlier format: where it is written
            if path == new or path.startswith(new + "."):
                path = old + path[len(new):]
                break
        while path and path not in self.nodes:
            path = path.rpartition(".")[0]  # a key the call lacks: its section's line
        return self.nodes[path][0].start_mark.line + 1 if path else None

    def add(self, kind, path, message, suggestion=None, fix=None):
        self.problems.append(_problem(kind, path, self.line(path), self.source, message,
                                      suggestion, fix))

    def resolve(self, key, value):
        if key not in _PATH_KEYS or not isinstance(value, str):
            return value
        value = os.path.expanduser(value)
        return os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(self.source)),
                                             value))


def _unknown(doc, raw, path, key, valid):
    """The problem of an unknown key: the closest key of its own section
    (`--fix` renames it), else the closest key of any section."""
    full = f"{path}.{key}" if path else str(key)
    guess = next(iter(difflib.get_close_matches(str(key), valid, n=1)), None)
    fix = ({"action": "rename", "key": full, "to": guess}
           if guess and guess not in raw else None)
    if guess is None:
        leaves = {}
        for known in doc.known:
            leaves.setdefault(known.rpartition(".")[2], known)
        close = difflib.get_close_matches(str(key), list(leaves), n=1)
        guess = leaves[close[0]] if close else None
    doc.add("unknown_key", full,
            f"unknown key `{full}`" + (f"; did you mean `{guess}`?" if guess else "")
            + (f" Valid keys{f' in `{path}`' if path else ''}: " + ", ".join(sorted(valid))
               if valid else f" (`{path}` is a section of the format before 0.2.0)"),
            guess, fix)


def _mapping(doc, raw, path, valid):
    """`raw` as a dict of the keys in `valid`; a problem per unknown key."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        doc.add("invalid_value", path,
                f"`{path}` must be a mapping. Received: {_short.repr(raw)}")
        return {}
    for key in raw:
        if key not in valid:
            _unknown(doc, raw, path, key, valid)
        elif key in _PATH_KEYS and not isinstance(raw[key], (str, type(None))):
            doc.add("invalid_value", f"{path}.{key}", f"`{path}.{key}` must be a path (a "
                    f"string) or null. Received: {key}={_short.repr(raw[key])}")
    return {k: doc.resolve(k, v) for k, v in raw.items() if k in valid}


def _named(kwargs, message):
    return [k for k in kwargs if re.search(rf"(?<![\w.]){re.escape(k)}(?!\w)", message)]


def _culprit(call, kwargs, message):
    """The key whose value `call(**kwargs)` refused: the one its message names,
    else the one without which the call passes; None when neither tells."""
    named = _named(kwargs, message)
    if len(named) == 1:
        return named[0]
    for key in named or kwargs:
        try:
            call(**{k: v for k, v in kwargs.items() if k != key})
            return key
        except _REFUSALS:
            continue
    return None


def _refusal(exc):
    """The message of a refusal (the error's type when it has none)."""
    return str(exc).strip() or type(exc).__name__


def _accepted(call, kwargs, key, default):
    """A value of `key` that `call` does not refuse, for `--fix`: a quoted
    scalar unquoted, or an empty value (null, false, 0, "") the default."""
    value, candidates = kwargs[key], []
    if isinstance(value, str):
        try:
            parsed = yaml.safe_load(value)
            candidates += [] if isinstance(parsed, str) else [parsed]
        except yaml.YAMLError:
            pass
    if value in (None, False, 0, "") and default is not inspect.Parameter.empty:
        candidates.append(default)
    for candidate in candidates:
        try:
            call(**{**kwargs, key: candidate})
        except _REFUSALS as exc:
            if key in _named(kwargs, str(exc)):
                continue  # refused too; another key's refusal is not this value's
        return candidate
    return inspect.Parameter.empty


def _judge(doc, path, call, kwargs, signature):
    """`call(**kwargs)`, its own checks being the schema (`signature` gives
    the defaults): each value it refuses
    becomes a problem with its line (the call's message), replaced by the
    fixed value or the default to find the next. Each key is reported once:
    a key refused again (its default refused too: `build.batch_size`'s None
    without `batch_frames`) ends the search, so it ends after at most one
    call per key. Returns the call's result, or None when it never passed."""
    kwargs, refused = dict(kwargs), set()
    while True:
        try:
            return call(**kwargs)
        except _REFUSALS as exc:
            message = _refusal(exc)
            key = _culprit(call, kwargs, message)
            if key in refused:
                return None
            if key is None:
                doc.add("invalid_value", path, f"`{path}`: {message}")
                return None
            refused.add(key)
            default = _default(signature, key)
            value = _accepted(call, kwargs, key, default)
            fix = (None if value is inspect.Parameter.empty else
                   {"action": "set", "key": f"{path}.{key}", "value": value})
            doc.add("invalid_value", f"{path}.{key}", f"`{path}.{key}`: {message}", fix=fix)
            if fix is None and default is inspect.Parameter.empty:
                return None
            kwargs[key] = default if fix is None else value


def _check_compile(signature):
    """`compile_model`'s argument check, on the `compile` section."""
    from keras_gpufix.compile.arguments import check_args

    def check(**kwargs):
        bound = signature.bind(None, None, None, **kwargs)
        bound.apply_defaults()
        check_args(*(bound.arguments[k] for k in
                     ("jit_compile", "mixed_precision", "steps_per_execution", "sample_batch")))
    return check


def _check_strategy(signature, quiet):
    """`setup_strategy`'s argument checks; device names are parsed by
    TensorFlow (imported only for a config that names devices; `quiet`:
    with its log lines hidden, as `validate` does)."""
    from keras_gpufix.distribute import resolve_strategy_mode
    from keras_gpufix.output import import_tensorflow_quietly

    def check(**kwargs):
        bound = signature.bind(**kwargs)
        bound.apply_defaults()
        devices = bound.arguments["devices"]
        if devices is not None and not (isinstance(devices, list) and devices):
            raise ValueError("`devices` must be a non-empty list of device names such as "
                             f"['/gpu:0', '/gpu:1']. Received: devices={devices!r}")
        if devices:
            if quiet:
                import_tensorflow_quietly()
            import tensorflow as tf

            for device in devices:
                tf.DeviceSpec.from_string(device)
        resolve_strategy_mode(bound.arguments["mode"], device_count=len(devices or ()),
                              devices_given=devices is not None)
    return check


def _check_build(builder, signature):
    """`build`'s argument checks: without a corpus those `build` makes
    before it reads anything, with `builder` also its epoch plan (no
    feature computed, no dataset made)."""
    from keras_gpufix.data.checks import check_build_args

    def check(**kwargs):
        bound = signature.bind(**kwargs)
        bound.apply_defaults()
        a = bound.arguments
        if builder is None and a["batch_size"] is None and a["batch_frames"] is None:
            a["batch_size"] = 1  # may be given in code: setup.dataset(batch_size=...)
        check_build_args(a["batch_size"], a["num_buckets"], a["service"], a["batch_frames"],
                         a["batch_multiple"])
        if builder is not None:
            builder.plan(a["batch_size"], a["num_buckets"], a["batch_frames"],
                         a["drop_remainder"], a["batch_multiple"])
    return check


def _check_callback(name, signature):
    """A callback's argument checks (`callbacks/_arguments.py`, what its
    constructor runs first), with the constructor's defaults."""
    from keras_gpufix.callbacks._arguments import CHECKS

    wanted = inspect.signature(CHECKS[name]).parameters

    def check(**kwargs):
        bound = signature.bind(**kwargs)
        bound.apply_defaults()
        return CHECKS[name](**{k: v for k, v in bound.arguments.items() if k in wanted})
    return check


def _known(targets, callbacks):
    """Every key of every section, as `section.key` paths."""
    from keras_gpufix import data as kg_data

    sections = {**{name: t for name, t in targets.items() if t is not None},
                **{f"data.{k}": inspect.signature(getattr(kg_data, c))
                   for k, c in _NESTED.items()},
                **{f"callbacks.{name}": signature for name, signature in callbacks.items()}}
    return [f"{path}.{key}" for path, target in sections.items() for key in _keys(target)]


def _check_fit(signature):
    """`model.fit`'s counts, which Keras checks only once training starts."""

    def check(**kwargs):
        bound = signature.bind(**kwargs)
        for name, low in (("epochs", 1), ("initial_epoch", 0), ("steps_per_epoch", 1),
                          ("batch_size", 1), ("validation_steps", 1),
                          ("validation_batch_size", 1), ("validation_freq", 1)):
            value = bound.arguments.get(name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or value < low):
                raise ValueError(
                    f"`{name}` must be an integer >= {low}. Received: {name}={value!r}")
    return check


def _parse(doc, dry_run):
    """(Config, builder or None) from a parsed document; problems go to `doc.problems`."""
    from keras_gpufix import data as kg_data
    from keras_gpufix.output import import_tensorflow_quietly

    targets, callbacks = _targets(), _callback_signatures()
    doc.known = _known(targets, callbacks)
    for old, new, note in doc.moves:
        doc.add("moved_key", old,
                (f"`{old}` has moved to `{new}` (the config format of keras-gpufix 0.2.0: "
                 "each section holds one call's arguments" if new else
                 f"`{old}` is gone in keras-gpufix 0.2.0 ({note}") + "; CHANGELOG.md lists "
                "what moved)", new, {"action": "move", "key": old, "to": new})
    data = dict(doc.data)
    for section in _OLD_SECTIONS:  # what is left of a section of the earlier format
        if isinstance(data.get(section), dict):
            for key in data.pop(section):
                _unknown(doc, {}, section, key, [])
    raw = _mapping(doc, data, "", list(targets))
    cfg = Config(source=doc.source, lines={p: doc.line(p) for p in [*doc.nodes, *doc.moved]})
    for name in ("build", "compile", "strategy", "fit"):
        setattr(cfg, name, _mapping(doc, raw.get(name), name, _keys(targets[name])))
    cfg.data = _mapping(doc, raw.get("data"), "data", _keys(targets["data"]))
    objects = {}
    for key, cls_name in _NESTED.items():
        if key in cfg.data:
            cls = getattr(kg_data, cls_name)
            signature = inspect.signature(cls)
            fields = _mapping(doc, cfg.data[key], f"data.{key}", _keys(signature))
            cfg.data[key] = fields
            objects[key] = _judge(doc, f"data.{key}", cls, fields, signature)
    for name, check in (("compile", _check_compile(targets["compile"])),
                        ("strategy", _check_strategy(targets["strategy"], quiet=dry_run)),
                        ("fit", _check_fit(targets["fit"]))):
        _judge(doc, name, check, getattr(cfg, name), targets[name])
    raw_callbacks = raw.get("callbacks")
    if raw_callbacks is None and "callbacks" not in raw:
        raw_callbacks = {"GPUOscillationMonitor": {}, "RetracingMonitor": {}}
    for name in _mapping(doc, raw_callbacks, "callbacks", list(callbacks)):
        path, signature = f"callbacks.{name}", callbacks[name]
        kwargs = _mapping(doc, raw_callbacks[name], path, _keys(signature))
        cfg.callbacks[name] = kwargs
        _judge(doc, path, _check_callback(name, signature), kwargs, signature)
    builder = None
    if dry_run and cfg.data.get("corpus") is not None and None not in objects.values():
        kwargs = {**cfg.data, **objects, "cache_dir": None, "verbose": 0}  # writes nothing
        if getattr(objects.get("audio"), "trim_top_db", None) is not None:  # reads every file
            kwargs["audio"] = dataclasses.replace(objects["audio"], trim_top_db=None)
        import_tensorflow_quietly()  # the builder (tf.data) is what the config asks for
        builder = _judge(doc, "data", kg_data.SpeechDatasetBuilder, kwargs, targets["data"])
    if cfg.build:
        _judge(doc, "build", _check_build(builder, targets["build"]), cfg.build,
               targets["build"])
    return cfg, builder


def _read(path):
    path = os.fspath(path)
    if not os.path.exists(path):
        raise ConfigError([_problem("missing_file", None, None, path, f"no such file: {path}")],
                          unusable=True)
    try:
        size = os.path.getsize(path)
        if size > _MAX_BYTES:
            raise ConfigError([_problem(
                "too_large", None, None, path, f"the file is {size / 2**20:.1f} MB; a config "
                f"is a few KB (at most {_MAX_BYTES >> 20} MB is read)")], unusable=True)
        with open(path, encoding="utf-8") as f:
            return _Doc(f.read(), path)
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError([_problem("unreadable", None, None, path,
                                    f"cannot read {path}: {exc}")], unusable=True) from exc


def _in_line_order(problems):
    return sorted(problems, key=lambda p: (p["line"] is None, p["line"] or 0))


def load_config(path) -> Config:
    """Reads a YAML config and checks it against the calls it feeds.

    Args:
        path: the YAML file.

    Returns:
        A `Config`. The corpus and the `data` values are checked when the
        builder is made (`from_config`, `validate_config`); this machine's
        traps only by `validate_config`.

    Raises:
        ConfigError: (a `ValueError`) listing every unknown key (with the
            closest valid one), key of the 0.1 format (with its new place),
            value a call refuses (with its message) and YAML syntax error,
            each with its file and line.

    Example:

    >>> cfg = kg.load_config("examples/tts.yaml")
    >>> cfg.build["batch_size"]
    16
    """
    doc = _read(path)
    cfg, _ = _parse(doc, dry_run=False)
    if doc.problems:
        raise ConfigError(_in_line_order(doc.problems))
    return cfg


def _traps(cfg, doc, info):
    """This machine's performance traps in `cfg`, added to `doc.problems`
    (only for values that no call refused)."""
    from keras_gpufix.analysis import divisible_batch, missing_gpus
    from keras_gpufix.compile.hardware import precision_support
    from keras_gpufix.data.checks import writable_problem
    from keras_gpufix.distribute import resolve_strategy_mode, tf_config_cluster

    def fix(key, value):
        return {"action": "set", "key": key, "value": value}

    refused = {p["key"] for p in doc.problems}
    checked = {key: value for key, value in (
        ("strategy.devices", cfg.strategy.get("devices")),
        ("build.batch_size", cfg.build.get("batch_size")),
        ("compile.mixed_precision", cfg.compile.get("mixed_precision")),
        ("build.prefetch_to_device", cfg.build.get("prefetch_to_device")),
        ("data.cache_dir", cfg.data.get("cache_dir"))) if key not in refused}
    devices = checked.get("strategy.devices") or []
    try:
        cluster = tf_config_cluster()
        mode, _ = resolve_strategy_mode(cfg.strategy.get("mode", "auto"),
                                        device_count=len(devices) or len(info["gpus"]),
                                        devices_given=bool(devices), cluster=cluster)
    except _REFUSALS:  # setup_strategy names it
        mode, cluster = "default", None
    replicas = 1 if mode in ("default", "one_device") else (
        max(1, len(devices) or len(info["gpus"])) * (sum(cluster.values()) if cluster else 1))
    batch = checked.get("build.batch_size")
    shared = divisible_batch(batch, replicas) if isinstance(batch, int) else None
    if shared is not None:
        doc.add("batch_not_divisible", "build.batch_size",
                f"`build.batch_size` {batch} is not divisible by the {replicas} replicas of "
                "`strategy`: replicas get unequal batches and the last one a different shape",
                fix=fix("build.batch_size", shared))
    policy = checked.get("compile.mixed_precision")
    if isinstance(policy, str) and policy != "auto":
        fast, reason = precision_support(policy, info)
        if not fast:
            doc.add("mixed_precision_unsupported", "compile.mixed_precision",
                    f"`compile.mixed_precision` is {policy!r} but {reason}; `auto` picks what "
                    "this device runs fast", fix=fix("compile.mixed_precision", "auto"))
    prefetch = checked.get("build.prefetch_to_device")
    for key, names in (("strategy.devices", devices),
                       ("build.prefetch_to_device", [prefetch] if prefetch else [])):
        missing = missing_gpus(names, len(info["gpus"]))
        if missing:
            doc.add("device_missing", key, f"`{key}` names {', '.join(missing)} but this "
                    f"machine has {len(info['gpus'])} GPU(s)",
                    fix=fix(key, None) if key.startswith("build") else None)
    cache = checked.get("data.cache_dir")
    why = isinstance(cache, str) and writable_problem(cache)
    if why:
        doc.add("cache_dir_not_writable", "data.cache_dir",
                f"`data.cache_dir` {cache} cannot be written ({why})")


def _scalar(value):
    text = json.dumps(value) if not isinstance(value, str) else value
    if isinstance(value, str):
        try:
            if yaml.safe_load(f"k: {value}") != {"k": value}:
                text = json.dumps(value)
        except yaml.YAMLError:
            text = json.dumps(value)
    return text


def _edit(doc, fix):
    """`(start, end, replacement, before)` of one fix in `doc.text`."""
    key, value = doc.nodes[fix["key"]]
    if fix["action"] == "rename":
        return key.start_mark.index, key.end_mark.index, fix["to"], fix["key"]
    start, end = value.start_mark.index, value.end_mark.index
    comment = re.match(r"[ \t]+#[^\n]*", doc.text[end:])
    old = doc.text[start:end].strip("\"'")
    if comment and old and re.search(rf"(?<![\w.]){re.escape(old)}(?![\w.])", comment.group(0)):
        end += len(comment.group(0))  # a comment naming the old value would lie
    return start, end, _scalar(fix["value"]), doc.text[start:end].rstrip()


def validate_config(path, fix=False, environment=None) -> dict:
    """Validates a config file on this machine; with `fix=True` rewrites what it can.

    Args:
        path: the YAML file.
        fix: write the corrected file in place (atomically: a temporary
            file renamed over it) and keep the original as `<path>.bak`
            (`.bak.1`, ... when that exists). Defaults to False.
        environment: a `keras_gpufix.compile.device_info()`-like dict.
            Defaults to this machine's.

    Returns:
        A dict with `path`, `exit_code` (0 valid, 1 problems remain, 2 the
        file is unusable: missing, unreadable, not YAML), `problems` (the
        ones left), `changes` (with `fix`: `line`, `key`, `before`, `after`,
        `reason`, `message`), `backup` (path or None) and `error` (message
        when unusable).
    """
    path = os.fspath(path)
    result = {"path": path, "exit_code": 0, "problems": [], "changes": [], "backup": None,
              "error": None}
    if environment is None:
        from keras_gpufix.compile import device_info

        environment = device_info()

    def check(doc):
        cfg, _ = _parse(doc, dry_run=True)
        _traps(cfg, doc, environment)
        return _in_line_order(doc.problems)

    try:
        doc = _read(path)
        problems = check(doc)
    except ConfigError as exc:
        result.update(exit_code=2, error=str(exc), problems=exc.problems)
        return result
    original = doc.text
    for _ in range(4 if fix else 0):  # a rename can reveal a problem in the renamed key
        edits = {p["fix"]["key"]: p for p in problems if p["fix"]}
        moves = [p for p in edits.values() if p["fix"]["action"] == "move"]
        if not edits:
            break
        if moves:  # first the keys of the earlier format; their values are judged where they go
            result["changes"] += [{"line": p["line"], "key": p["key"], "before": p["key"],
                                   "after": p["fix"]["to"] or "(deleted)", "reason": p["kind"],
                                   "message": p["message"]} for p in moves]
            doc = _Doc(_migrated_text(doc), path)
            problems = check(doc)
            continue
        text, changes = doc.text, []
        for start, end, new, before, p in sorted(
                ((*_edit(doc, p["fix"]), p) for p in edits.values()), key=lambda e: -e[0]):
            text = text[:start] + new + text[end:]
            parent = p["fix"]["key"].rpartition(".")[0]
            after = (f"{parent}.{new}" if parent else new) if p["fix"]["action"] == "rename" \
                else new
            changes.insert(0, {"line": p["line"], "key": p["fix"]["key"], "before": before,
                               "after": after, "reason": p["kind"], "message": p["message"]})
        result["changes"] += changes
        doc = _Doc(text, path)
        problems = check(doc)
    if result["changes"]:
        result["backup"] = _write_atomic(path, doc.text, original)
    result["problems"] = problems
    result["exit_code"] = 1 if problems else 0
    return result


def _migrated_text(doc):
    """`doc` in the format of 0.2.0: its leading comments, then its values
    (the keys of the earlier format moved) written by YAML, sections in the
    order of the calls; other comments are in the backup."""
    lines = doc.text.splitlines(keepends=True)
    head = "".join(itertools.takewhile(lambda ln: ln.lstrip().startswith("#") or not ln.strip(),
                                       lines))
    order = ["data", "build", "compile", "strategy", "callbacks", "fit"]
    data = {k: doc.data[k] for k in sorted(doc.data, key=lambda k: (
        order.index(k) if k in order else len(order)))}
    return head + yaml.safe_dump(data, sort_keys=False, allow_unicode=True)


def _write_atomic(path, text, original):
    """Keeps `original` in the first free `path.bak`, `path.bak.1`, ..., then writes
    `text` to `path` atomically (`output.write_text_atomically`); returns the backup."""
    from keras_gpufix.output import write_text_atomically

    backup, n = path + ".bak", 0
    while os.path.exists(backup):
        n += 1
        backup = f"{path}.bak.{n}"
    with open(backup, "w", encoding="utf-8") as f:
        f.write(original)
    write_text_atomically(path, text)
    return backup


@dataclasses.dataclass
class Setup:
    """Everything `from_config` made, in the order training needs it.

    Attributes:
        config: the `Config`.
        strategy: the `tf.distribute.Strategy` (`kg.setup_strategy(**strategy)`).
        policy: the Keras dtype policy in force (`kg.enable_mixed_precision`
            with `compile.mixed_precision`, unless that is null).
        builder: the `kg.data.SpeechDatasetBuilder`, None without `data.corpus`.
        build_kwargs: the `build` section, for `builder.build`.
        compile_kwargs: the `compile` section, for `kg.compile_model`
            (`mixed_precision` the policy set).
        callbacks: the `callbacks` section's callbacks, made fresh.
        fit_kwargs: the `fit` section, for `model.fit`.
    """

    config: Config
    strategy: Any
    policy: str
    builder: Any
    build_kwargs: dict
    compile_kwargs: dict
    callbacks: list
    fit_kwargs: dict

    def dataset(self, **overrides):
        """`builder.build(**build_kwargs, **overrides)`; a value `build`
        refuses is a `ConfigError` naming the file and line."""
        if self.builder is None:
            raise ValueError("`data.corpus` is not set in the config: there is no dataset "
                             "to build.")
        return _made(self.config, "build", self.builder.build, {**self.build_kwargs,
                                                                 **overrides})


def _made(cfg, path, call, kwargs):
    """`call(**kwargs)`; its TypeError/ValueError a `ConfigError` naming the line."""
    try:
        return call(**kwargs)
    except _REFUSALS as exc:
        key = _culprit(call, kwargs, str(exc))
        path = f"{path}.{key}" if key else path
        line = cfg.lines.get(path) or cfg.lines.get(path.split(".")[0])
        raise ConfigError([_problem("invalid_value", path, line, cfg.source,
                                    f"`{path}`: {str(exc).strip()}")]) from exc


def builder_kwargs(cfg: Config) -> dict:
    """`kg.data.SpeechDatasetBuilder` keyword arguments of a config's `data`
    section (`audio`, `text` as their config objects), without `corpus`.

    Args:
        cfg: a `Config`.

    Returns:
        A dict (the paths resolved against the file's folder).
    """
    from keras_gpufix import data

    kwargs = {k: v for k, v in cfg.data.items() if k != "corpus"}
    for key, cls_name in _NESTED.items():
        if key in kwargs:
            kwargs[key] = getattr(data, cls_name)(**kwargs[key])
    return kwargs


def from_config(cfg) -> Setup:
    """Makes the strategy, dtype policy, dataset builder and callbacks of a config.

    Call it before building the model: it creates the strategy (GPU memory
    growth must be set before any GPU is used) and sets the mixed-precision
    policy (layers take the policy in force when they are created).

    Args:
        cfg: a `Config`, or a path to a YAML file.

    Returns:
        A `Setup`.

    Raises:
        ConfigError: for a value a call refuses, naming the file and line.

    Example:

    >>> setup = kg.from_config("examples/tts.yaml")
    >>> with setup.strategy.scope():
    ...     model = build_model()
    ...     kg.compile_model(model, "adam", "mse", **setup.compile_kwargs)
    >>> model.fit(setup.dataset(), callbacks=setup.callbacks, **setup.fit_kwargs)
    """
    import keras

    import keras_gpufix as kg
    from keras_gpufix.compile.compile_cache import CompileCache

    if not isinstance(cfg, Config):
        cfg = load_config(cfg)
    compile_kwargs = dict(cfg.compile)
    if compile_kwargs.get("jit_compile", True):  # before TensorFlow starts (the strategy)
        asked = compile_kwargs.get("compile_cache", "auto")
        cache = _made(cfg, "compile", lambda compile_cache: CompileCache.enable(
            compile_cache, beside=cfg.data.get("cache_dir")), {"compile_cache": asked})
        compile_kwargs["compile_cache"] = cache.directory if cache.active else asked
    strategy = _made(cfg, "strategy", kg.setup_strategy, cfg.strategy)
    policy = compile_kwargs.get("mixed_precision", "auto")
    if policy is not None:
        policy = compile_kwargs["mixed_precision"] = kg.enable_mixed_precision(policy)
    builder = None
    if cfg.data.get("corpus") is not None:
        builder = _made(cfg, "data", kg.data.SpeechDatasetBuilder,
                        {"corpus": cfg.data["corpus"], **builder_kwargs(cfg)})
    callbacks = [_made(cfg, f"callbacks.{name}", getattr(kg.callbacks, name), kwargs)
                 for name, kwargs in cfg.callbacks.items()]
    return Setup(cfg, strategy, policy or keras.mixed_precision.global_policy().name, builder,
                 dict(cfg.build), compile_kwargs, callbacks, dict(cfg.fit))
