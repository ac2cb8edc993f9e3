import contextlib
import copy
import functools
import inspect
import io
import os
import resource
import signal
import subprocess
import sys
import time

import keras
import pytest
import yaml

import keras_gpufix as kg
from keras_gpufix.cli import main
from keras_gpufix.config import (ConfigError, builder_kwargs, from_config, load_config,
                                 validate_config)

CPU = {"gpus": [], "cpu_bf16": False, "cpu_bf16_flags": []}
GOOD = """\
# a good config
data:
  audio: {n_mels: 40}
build:
  batch_size: 32
  num_buckets: 8
compile: {jit_compile: true, mixed_precision: float32}
strategy: {mode: default}
callbacks:
  GPUOscillationMonitor: {window: 32, thresholds: {slow_factor: 3.0}}
  ProfilerTrigger: {log_dir: logs, trigger: [oscillation, 20], steps: 5}
fit: {epochs: 2}
"""


@pytest.fixture(autouse=True)
def float32_policy():
    yield
    keras.config.set_dtype_policy("float32")


def write(tmp_path, text, name="cfg.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def only_problem(path):
    with pytest.raises(ConfigError) as info:
        load_config(path)
    (problem,) = info.value.problems
    return problem


def test_load_good_config(tmp_path):
    cfg = load_config(write(tmp_path, GOOD))
    assert cfg.build == {"batch_size": 32, "num_buckets": 8}
    assert cfg.fit == {"epochs": 2}
    assert cfg.data["audio"] == {"n_mels": 40}
    assert cfg.callbacks["ProfilerTrigger"]["log_dir"] == str(tmp_path / "logs")  # the file's
    assert cfg.lines["build.batch_size"] == 5
    assert validate_config(cfg.source, environment=CPU)["problems"] == []


@pytest.mark.parametrize("text, key, line, suggestion", [
    ("build:\n  batch_size: 8\n  num_bucket: 4\n", "build.num_bucket", 3, "num_buckets"),
    ("data:\n  audio: {n_mel: 40}\n", "data.audio.n_mel", 2, "n_mels"),
    ("callbacks:\n  ProfilerTrigger: {log_dir: l, stepz: 3}\n", "callbacks.ProfilerTrigger.stepz",
     2, "steps"),
    ("callbacks:\n  GPUOscilationMonitor: {}\n", "callbacks.GPUOscilationMonitor", 2,
     "GPUOscillationMonitor"),
    ("compile: {steps_per_executon: 4}\n", "compile.steps_per_executon", 1,
     "steps_per_execution"),
    ("fit: {epocs: 3}\n", "fit.epocs", 1, "epochs"),
    ("comple: {jit_compile: true}\n", "comple", 1, "compile"),
])
def test_unknown_key_names_line_and_closest_parameter(tmp_path, text, key, line, suggestion):
    problem = only_problem(write(tmp_path, text))
    assert (problem["kind"], problem["key"], problem["line"]) == ("unknown_key", key, line)
    assert problem["suggestion"] == suggestion
    assert f"line {line}" in problem["message"]
    assert f"did you mean `{suggestion}`?" in problem["message"]


@pytest.mark.parametrize("text, key, line, message", [
    ("compile:\n  jit_compile: yes please\n", "compile.jit_compile", 2,
     "`jit_compile` must be True or False. Received: jit_compile='yes please'"),
    ("data:\n  audio: {n_mels: -1}\n", "data.audio.n_mels", 2, "n_mels"),
    ("callbacks:\n  GPUOscillationMonitor: {window: 4}\n",
     "callbacks.GPUOscillationMonitor.window", 2, "`window` must be >= 8. Received: window=4"),
    ("strategy:\n  mode: sharded\n", "strategy.mode", 2, "sharded"),
    ("strategy:\n  mode: default\n  devices: [/cpu:0]\n", "strategy.mode", 2,
     "uses no device list"),
])
def test_a_refused_value_gives_the_calls_own_message_and_line(tmp_path, text, key, line,
                                                              message):
    problem = only_problem(write(tmp_path, text))
    assert (problem["key"], problem["line"]) == (key, line)
    assert message in problem["message"]
    assert problem["message"].startswith(f"cfg.yaml, line {problem['line']}: ")


def _parameters(signature, method=False):
    """`(name, kind, default)` of each parameter (a method's `self` left out)."""
    parameters = list(signature.parameters.values())[1 if method else 0:]
    return [(p.name, p.kind, p.default) for p in parameters]


def test_the_signatures_read_from_source_are_the_calls_own():
    """`validate` reads the signatures of the calls that import TensorFlow or
    Keras from their source, without importing them: they must be the calls'
    own, every default a literal (the builder, compile_model, model.fit and
    model.compile, each callback)."""
    from keras_gpufix.config import _NOT_LITERAL, _callback_signatures, _keras_model, _targets
    from keras_gpufix.keras_internals import keras_trainer_source

    assert keras_trainer_source().endswith(os.path.join("keras", "src", "trainers", "trainer.py"))
    read, sig = _targets(), inspect.signature
    assert _parameters(read["data"]) == _parameters(sig(kg.data.SpeechDatasetBuilder))
    assert _parameters(read["build"]) == _parameters(sig(kg.data.SpeechDatasetBuilder.build),
                                                     method=True)
    assert _parameters(read["compile"]) == _parameters(sig(kg.compile_model))
    assert _parameters(read["strategy"]) == _parameters(sig(kg.setup_strategy))
    assert _parameters(read["fit"]) == _parameters(sig(keras.Model.fit), method=True)
    assert _parameters(_keras_model("compile")) == _parameters(sig(keras.Model.compile),
                                                               method=True)
    callbacks = _callback_signatures()
    assert sorted(callbacks) == sorted(kg.callbacks.__all__)
    for name, signature in callbacks.items():
        assert _parameters(signature) == _parameters(sig(getattr(kg.callbacks, name))), name
    assert all(p.default is not _NOT_LITERAL for s in [*read.values(), *callbacks.values()]
               if s is not None for p in s.parameters.values())


def test_every_parameter_of_every_call_is_a_key(tmp_path):
    """The schema is the signatures: each parameter with a YAML-able default is
    accepted at its default (a new argument is a key with no change here)."""
    import yaml

    from keras_gpufix.config import _callback_signatures, _keys, _targets

    targets = _targets()
    sections = {"data.audio": inspect.signature(kg.data.AudioConfig),
                "data.text": inspect.signature(kg.data.TextConfig),
                **{name: targets[name] for name in ("data", "build", "compile", "strategy")},
                **{f"callbacks.{n}": s for n, s in _callback_signatures().items()}}
    tree = {"callbacks": {"ProfilerTrigger": {"log_dir": "logs"}}}
    for path, signature in sections.items():
        node = tree
        for part in path.split("."):
            node = node.setdefault(part, {})
        parameters = signature.parameters
        for key in _keys(signature):
            default = parameters[key].default if key in parameters else None  # model.compile's
            if default is not inspect.Parameter.empty and isinstance(
                    default, (type(None), bool, int, float, str)):
                node.setdefault(key, default)
    assert len(tree["data"]["audio"]) >= 15 and "verbose" in tree["callbacks"]["RetracingMonitor"]
    cfg = load_config(write(tmp_path, yaml.safe_dump(tree)))
    assert cfg.data["audio"] == tree["data"]["audio"]
    assert cfg.compile["steps_per_execution"] == "auto"


def test_yaml_syntax_error_is_unusable(tmp_path):
    result = validate_config(write(tmp_path, "build:\n  batch_size: [1,\n  x: 2\n"),
                             environment=CPU)
    assert result["exit_code"] == 2
    assert result["problems"][0]["kind"] == "yaml_syntax"
    assert result["problems"][0]["line"] is not None


@pytest.mark.parametrize("text, kind, key", [
    ("build:\n  batch_size: 30\nstrategy:\n  mode: mirrored\n"
     "  devices: [/cpu:0, /cpu:1, /cpu:2, /cpu:3]\n", "batch_not_divisible", "build.batch_size"),
    ("compile:\n  mixed_precision: mixed_float16\n", "mixed_precision_unsupported",
     "compile.mixed_precision"),
    ("data:\n  cache_dir: {file}/cache\n", "cache_dir_not_writable", "data.cache_dir"),
    ("build:\n  batch_size: 8\n  prefetch_to_device: /gpu:0\n", "device_missing",
     "build.prefetch_to_device"),
    ("strategy:\n  mode: mirrored\n  devices: [/gpu:0, /device:GPU:1]\n", "device_missing",
     "strategy.devices"),
])
def test_each_trap_of_this_machine_is_found(tmp_path, text, kind, key):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    problems = validate_config(write(tmp_path, text.format(file=blocker)),
                               environment=CPU)["problems"]
    assert [(p["kind"], p["key"]) for p in problems] == [(kind, key)]
    assert problems[0]["line"] == text.splitlines().index(
        next(ln for ln in text.splitlines() if ln.strip().startswith(key.split(".")[1]))) + 1


def test_validate_makes_the_builder_and_its_dataset_and_reports_their_refusals(tmp_path):
    kg.data.make_synthetic_corpus(tmp_path / "corpus", 3, max_seconds=1.0)
    path = write(tmp_path, "data:\n  corpus: corpus\n  on_bad_input: ignore\n"
                           "build:\n  batch_size: 2\n  num_buckets: 0\n")
    with pytest.raises(ConfigError) as info:  # `build` is checked without a builder
        load_config(path)
    assert [p["key"] for p in info.value.problems] == ["build.num_buckets"]
    problems = validate_config(path, environment=CPU)["problems"]
    assert [(p["key"], p["line"]) for p in problems] == [("data.on_bad_input", 3),
                                                          ("build.num_buckets", 6)]
    assert "`on_bad_input` must be" in problems[0]["message"]
    assert "`num_buckets` must be an integer >= 1" in problems[1]["message"]
    assert not os.path.exists(tmp_path / "cache")
    missing = validate_config(write(tmp_path, "data:\n  corpus: nowhere\n", "m.yaml"),
                              environment=CPU)["problems"]
    assert [(p["key"], p["line"]) for p in missing] == [("data", 1)] or missing[0]["key"] == (
        "data.corpus")
    assert "nowhere" in missing[0]["message"]


def test_fix_round_trip(tmp_path):
    kg.data.make_synthetic_corpus(tmp_path / "corpus", 3, max_seconds=1.0)
    text = ("# keep this comment\n"
            "data: {corpus: corpus}\n"
            "build:\n"
            "  batch_size: \"30\"   # global batch\n"
            "  num_buckets: 0   # 0: no bucketing\n"
            "compile: {jit_compile: true, mixed_precision: mixed_float16}\n"
            "strategy:\n"
            "  mode: mirrored\n"
            "  devices: [/cpu:0, /cpu:1, /cpu:2, /cpu:3]\n"
            "fit: {epocs: 3}\n")
    path = write(tmp_path, text)
    result = validate_config(path, fix=True, environment=CPU)
    assert result["exit_code"] == 0, result["problems"]
    changes = {(c["key"], c["before"], c["after"]) for c in result["changes"]}
    assert changes == {("build.batch_size", '"30"', "30"),
                       ("build.num_buckets", "0   # 0: no bucketing", "8"),
                       ("compile.mixed_precision", "mixed_float16", "auto"),
                       ("fit.epocs", "fit.epocs", "fit.epochs"),
                       ("build.batch_size", "30", "32")}  # divisible by 4, next round
    with open(result["backup"]) as f:
        assert f.read() == text
    new = open(path).read()
    assert "# keep this comment" in new and "# global batch" in new
    assert "no bucketing" not in new  # a comment naming the old value would lie
    cfg = load_config(path)
    assert (cfg.build, cfg.fit) == ({"batch_size": 32, "num_buckets": 8}, {"epochs": 3})


def test_validate_cli_exit_codes(tmp_path, capsys):
    assert main(["validate", write(tmp_path, GOOD, "good.yaml")]) == 0
    assert "valid" in capsys.readouterr().out
    assert main(["validate", write(tmp_path, "build:\n  num_bucket: 3\n", "bad.yaml")]) == 1
    out = capsys.readouterr().out
    assert "bad.yaml, line 2" in out and "did you mean `num_buckets`?" in out
    assert main(["validate", str(tmp_path / "missing.yaml")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert main(["validate", write(tmp_path, "data: [1,\n", "broken.yaml")]) == 2
    assert "YAML syntax error" in capsys.readouterr().err


def test_validate_on_a_fixable_wrong_type_suggests_fix(tmp_path, capsys):
    """Issue 25: `validate` names `--fix` where it can fix the value."""
    path = write(tmp_path, "compile:\n  steps_per_execution: \"4\"\n")
    assert main(["validate", path]) == 1
    out = capsys.readouterr().out
    assert ("cfg.yaml, line 2: `compile.steps_per_execution`: `steps_per_execution` must be "
            "'auto' or an int >= 1. Received: steps_per_execution='4'; "
            "`keras-gpufix validate --fix` sets it to 4") in out
    assert main(["validate", path, "--fix"]) == 0
    assert "compile.steps_per_execution: \"4\" -> 4 (invalid_value)" in capsys.readouterr().out
    assert load_config(path).compile == {"steps_per_execution": 4}
    unfixable = write(tmp_path, "compile:\n  jit_compile: maybe\n", "u.yaml")
    assert main(["validate", unfixable]) == 1
    assert "--fix" not in capsys.readouterr().out.splitlines()[0]


def test_example_config_is_valid():
    path = os.path.join(os.path.dirname(__file__), "..", "examples", "tts.yaml")
    cfg = load_config(path)
    assert cfg.build["num_buckets"] == 4 and list(cfg.callbacks)[0] == "GPUOscillationMonitor"
    assert validate_config(path, environment=CPU)["problems"] == []  # corpus null: no builder


def test_from_config_makes_what_each_section_says(tmp_path):
    kg.data.make_synthetic_corpus(tmp_path / "corpus", 4, max_seconds=1.5)
    path = write(tmp_path, "data:\n  corpus: corpus\n  audio: {n_mels: 40}\n  cache_dir: c\n"
                           "  on_bad_input: raise\n" + GOOD[GOOD.index("build:"):])
    setup = from_config(path)
    assert type(setup.strategy).__name__ == "_DefaultDistributionStrategy"
    assert setup.policy == "float32" == setup.compile_kwargs["mixed_precision"]
    assert (setup.builder.audio.n_mels, setup.builder.on_bad_input) == (40, "raise")
    assert setup.builder.cache_dir == str(tmp_path / "c")
    assert [type(c).__name__ for c in setup.callbacks] == ["GPUOscillationMonitor",
                                                           "ProfilerTrigger"]
    assert setup.callbacks[0].thresholds == {"slow_factor": 3.0}
    assert setup.callbacks[1].log_dir == str(tmp_path / "logs")
    assert setup.fit_kwargs == {"epochs": 2}
    assert builder_kwargs(setup.config)["audio"].n_mels == 40
    with pytest.raises(ConfigError, match=r"cfg.yaml, line 8: `build.num_buckets`: "):
        setup.dataset(num_buckets=0)


def test_from_config_without_a_callbacks_section_makes_the_two_monitors(tmp_path,
                                                                        auto_hardware):
    setup = from_config(write(tmp_path, "fit: {epochs: 1}\n"))
    assert setup.policy == auto_hardware == setup.compile_kwargs["mixed_precision"]
    assert [type(c).__name__ for c in setup.callbacks] == ["GPUOscillationMonitor",
                                                           "RetracingMonitor"]
    assert setup.builder is None


def test_duplicate_keys_name_both_lines(tmp_path):
    path = write(tmp_path, "build:\n  batch_size: 8\n  num_buckets: 4\n  batch_size: 16\n")
    problem = only_problem(path)
    assert (problem["kind"], problem["key"], problem["line"]) == (
        "duplicate_key", "build.batch_size", 4)
    assert "line 2 and line 4" in problem["message"]
    result = validate_config(path, fix=True, environment=CPU)
    assert result["exit_code"] == 1 and result["changes"] == []


@pytest.mark.parametrize("text", ["", "# only a comment\n\n# another\n"])
def test_empty_file_is_unusable(tmp_path, capsys, text):
    path = write(tmp_path, text)
    result = validate_config(path, environment=CPU)
    assert result["exit_code"] == 2 and "is empty" in result["error"]
    assert main(["validate", path]) == 2
    assert "is empty" in capsys.readouterr().err


def test_problems_in_line_order(tmp_path):
    path = write(tmp_path, "fit:\n  epocs: x\ncompile:\n  jit_compile: y\n"
                           "callbacks:\n  StepTimer: {windw: 3}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert [p["line"] for p in info.value.problems] == [2, 4, 6]


# Issue 31: `validate` ends on every input, names what it refuses, and moves
# the keys of the earlier format.
EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "examples", "tts.yaml")
WRONG = ["sixteen", -3, 0, 10**12, 2.5, None, [1, 2], {"a": 1}, True, "", "auto", float("nan")]


def _scalar_keys(node, path=()):
    for key, value in node.items():
        if isinstance(value, dict):
            yield from _scalar_keys(value, path + (key,))
        else:
            yield ".".join(path + (key,))


EXAMPLE_KEYS = list(_scalar_keys(yaml.safe_load(open(EXAMPLE))))


def _with(base, key, value):
    """`base` (a YAML mapping) with the scalar at `key` replaced, as YAML text."""
    data = copy.deepcopy(base)
    *parents, leaf = key.split(".")
    node = data
    for part in parents:
        node = node[part]
    node[leaf] = value
    return yaml.safe_dump(data, sort_keys=False)


class _Overran(Exception):
    pass


@contextlib.contextmanager
def _deadline(seconds, what):
    """Fails (instead of hanging) when the block runs past `seconds`."""
    def alarm(signum, frame):
        raise _Overran(f"{what} did not end within {seconds} s")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _validate_in_process(path, *flags):
    """`keras-gpufix validate` through `cli.main`, as the console script runs it."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["validate", path, *flags])
    return code, out.getvalue(), err.getvalue()


def _assert_ended_well(key, value, code, out, err):
    what = f"{key}={value!r}: exit {code}\n{out}{err}"
    assert code in (0, 1), what
    assert "Traceback" not in out + err, what
    if code == 1:
        assert f"`{key}`" in out, what  # the refused key itself, not another's


def _fuzz(base, key, path):
    """Validates `base` with each wrong value at `key` in turn, each run
    failing the test past 20 s; yields `(exit code, stdout)` of each."""
    for value in WRONG:
        with open(path, "w") as f:
            f.write(_with(base, key, value))
        with _deadline(20, f"validate with {key}={value!r}"):
            code, out, err = _validate_in_process(path)
        _assert_ended_well(key, value, code, out, err)
        yield code, out


@pytest.mark.parametrize("key", EXAMPLE_KEYS)
def test_validate_ends_on_every_wrong_value_of_each_example_key(tmp_path, key):
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for _ in _fuzz(yaml.safe_load(open(EXAMPLE)), key, str(tmp_path / "cfg.yaml")):
        pass
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak
    assert grown_kib < 1 << 20, f"peak memory grew by {grown_kib >> 10} MiB"


@pytest.mark.parametrize("key", ["build.batch_size", "build.num_buckets"])
def test_validate_ends_on_every_wrong_build_value_beside_a_corpus(tmp_path, monkeypatch, key):
    """The builder is made: `build` is judged against the corpus's plan (the
    wrong batch sizes of the issue looped here for ever), no dataset made."""
    def no_dataset(*args, **kwargs):
        raise AssertionError("validate made a dataset")

    monkeypatch.setattr(kg.data.SpeechDatasetBuilder, "build",
                        functools.wraps(kg.data.SpeechDatasetBuilder.build)(no_dataset))
    kg.data.make_synthetic_corpus(tmp_path / "corpus", 3, max_seconds=1.0)
    base = yaml.safe_load(open(EXAMPLE))
    base["data"].update(corpus="corpus", cache_dir="cache")
    for code, out in _fuzz(base, key, str(tmp_path / "cfg.yaml")):
        if code == 1:
            assert out.count(f"`{key}`") == 1, out  # reported once, the search stopped
    assert not os.path.exists(tmp_path / "cache")  # nothing built


@pytest.mark.parametrize("text, key, message", [
    ("data:\n  audio: {n_mels: true}\n", "data.audio.n_mels",
     "`n_mels` must be an integer >= 1. Received: n_mels=True"),
    ("data:\n  audio: {max_seconds: .nan}\n", "data.audio.max_seconds",
     "`max_seconds` must be a finite number or None. Received: max_seconds=nan"),
    ("compile:\n  mixed_precision: 0\n", "compile.mixed_precision", "mixed_precision=0"),
    ("build:\n  batch_size: sixteen\n", "build.batch_size", "batch_size='sixteen'"),
    ("fit:\n  epochs: sixteen\n", "fit.epochs", "`epochs` must be an integer >= 1"),
])
def test_a_wrong_value_is_refused_where_it_is_given(tmp_path, text, key, message):
    problem = only_problem(write(tmp_path, text))
    assert (problem["key"], problem["line"]) == (key, 2)
    assert message in problem["message"]


@pytest.mark.parametrize("name, content, message", [
    ("binary.yaml", bytes(range(256)) * 64, "cannot read"),
    ("big.yaml", b"fit: {epochs: 2}\n" + b"# padding\n" * (1 << 20), "the file is 10.0 MB"),
    ("deep.yaml", b"a: " + b"[" * 1000 + b"]" * 1000 + b"\n", "nested"),
    ("deep_map.yaml", "".join(f"{'  ' * i}k{i}:\n" for i in range(200)).encode(), "nested"),
    ("aliases.yaml", b"a: &a [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]\n" + b"".join(
        b"%c: &%c [*%c, *%c, *%c, *%c, *%c, *%c, *%c, *%c, *%c, *%c]\n"
        % ((c,) * 2 + (c - 1,) * 10) for c in range(ord("b"), ord("j"))), "values"),
])
def test_unusable_files_end_at_once_with_exit_2(tmp_path, name, content, message):
    path = tmp_path / name
    path.write_bytes(content)
    with _deadline(20, f"validate {name}"):
        code, out, err = _validate_in_process(str(path))
    assert code == 2, out + err
    assert message in err and "Traceback" not in err


OLD_FORMAT = """\
# written for keras-gpufix 0.1
data:
  corpus: corpus
  batch_size: 16
  num_buckets: 8
  prefetch: auto
training:
  jit_compile: true
  epochs: 3
"""


def test_old_format_keys_say_where_they_moved_and_fix_moves_them(tmp_path):
    kg.data.make_synthetic_corpus(tmp_path / "corpus", 4, max_seconds=1.0)
    path = write(tmp_path, OLD_FORMAT)
    code, out, _ = _validate_in_process(path)
    assert code == 1
    for old, new, line in [("data.batch_size", "build.batch_size", 4),
                           ("data.num_buckets", "build.num_buckets", 5),
                           ("training.jit_compile", "compile.jit_compile", 8),
                           ("training.epochs", "fit.epochs", 9)]:
        assert (f"cfg.yaml, line {line}: `{old}` has moved to `{new}`" in out
                and f"--fix` moves it to `{new}`" in out), out
    assert "cfg.yaml, line 6: `data.prefetch` is gone" in out
    assert "unknown key" not in out
    code, out, _ = _validate_in_process(path, "--fix")
    assert code == 0, out
    assert "data.batch_size: data.batch_size -> build.batch_size (moved_key)" in out
    assert open(path + ".bak").read() == OLD_FORMAT
    assert open(path).read().startswith("# written for keras-gpufix 0.1\n")
    setup = from_config(path)
    assert (setup.build_kwargs, setup.fit_kwargs) == ({"batch_size": 16, "num_buckets": 8},
                                                      {"epochs": 3})
    assert setup.compile_kwargs["jit_compile"] is True
    assert setup.builder.corpus is not None


def test_old_format_values_are_judged_where_they_moved(tmp_path):
    problems = validate_config(write(tmp_path, "data:\n  batch_size: sixteen\n"),
                               environment=CPU)["problems"]
    assert [(p["kind"], p["key"], p["line"]) for p in problems] == [
        ("moved_key", "data.batch_size", 2), ("invalid_value", "build.batch_size", 2)]


@pytest.mark.parametrize("text, key, suggestion", [
    ("compile: {epochs: 3}\n", "compile.epochs", "fit.epochs"),
    ("data: {batch_sise: 8}\n", "data.batch_sise", "build.batch_size"),
    ("training: {jit_compil: true}\n", "training.jit_compil", "compile.jit_compile"),
])
def test_unknown_key_suggests_the_closest_key_of_any_section(tmp_path, text, key, suggestion):
    problem = only_problem(write(tmp_path, text))
    assert (problem["kind"], problem["key"], problem["suggestion"]) == ("unknown_key", key,
                                                                       suggestion)
    assert f"did you mean `{suggestion}`?" in problem["message"]


def _limit_memory_and_cpu():
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))
    resource.setrlimit(resource.RLIMIT_CPU, (20, 20))  # a loop is killed at 20 CPU seconds


@pytest.mark.slow
@pytest.mark.parametrize("key", EXAMPLE_KEYS)
def test_validate_process_ends_in_20_s_under_4_gb_on_every_wrong_value(tmp_path, key):
    """The fuzz above as the user runs it: one `keras-gpufix validate` process
    per value, its address space capped at 4 GB and its CPU time at 20 s.
    The wall-clock limit is 20 s as well where the machine is quiet; set
    KG_VALIDATE_WALL_S on a loaded one (importing TensorFlow alone took
    11-30 s of wall time, 5 s of CPU, on a shared 2-core VM)."""
    base = yaml.safe_load(open(EXAMPLE))
    path = str(tmp_path / "cfg.yaml")
    script = os.path.join(os.path.dirname(sys.executable), "keras-gpufix")
    wall = float(os.environ.get("KG_VALIDATE_WALL_S", 20))
    for value in WRONG:
        with open(path, "w") as f:
            f.write(_with(base, key, value))
        before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
        run = subprocess.run([script, "validate", path], capture_output=True, text=True,
                             timeout=wall, preexec_fn=_limit_memory_and_cpu)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
        print(f"{key}={value!r}: exit {run.returncode}, {time.perf_counter() - start:.1f} s "
              f"wall, {cpu:.1f} s CPU")
        _assert_ended_well(key, value, run.returncode, run.stdout, run.stderr)
