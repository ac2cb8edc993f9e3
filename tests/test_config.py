import dataclasses
import os
import shutil

import pytest

from keras_gpufix.cli import main
from keras_gpufix.config import (ConfigError, Config, check_config, load_config,
                                 validate_config)

CPU = {"gpus": [], "cpu_bf16": False, "cpu_bf16_flags": []}
GOOD = """\
# a good config
data:
  batch_size: 32
  num_buckets: 8
  prefetch: auto
training:
  jit_compile: true
  mixed_precision: auto
  epochs: 2
distribute:
  mode: default
monitor:
  window: 32
  thresholds: {slow_factor: 3.0}
  profiling: {trigger: [oscillation, 20], steps: 5}
"""


def write(tmp_path, text, name="cfg.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_load_good_config(tmp_path):
    cfg = load_config(write(tmp_path, GOOD))
    assert cfg.data.batch_size == 32
    assert cfg.training.epochs == 2
    assert cfg.monitor.thresholds == {"slow_factor": 3.0}
    assert cfg.monitor.profiling.trigger == ["oscillation", 20]
    assert cfg.lines["data.batch_size"] == 3
    assert check_config(cfg, CPU) == []


def test_unknown_key_names_line_and_closest_key(tmp_path):
    path = write(tmp_path, "data:\n  batch_size: 8\n  num_bucket: 4\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    (problem,) = info.value.problems
    assert problem["kind"] == "unknown_key"
    assert problem["line"] == 3
    assert problem["suggestion"] == "num_buckets"
    assert "line 3" in str(info.value) and "did you mean `num_buckets`?" in str(info.value)


def test_wrong_type_names_expected_type(tmp_path):
    path = write(tmp_path, "training:\n  jit_compile: yes please\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    msg = str(info.value)
    assert "line 2" in msg and "`training.jit_compile` must be true or false" in msg
    assert "'yes please' (a string)" in msg


def test_nested_unknown_keys(tmp_path):
    path = write(tmp_path, "monitor:\n  thresholds: {slow_factr: 3}\n"
                           "  profiling: {stepz: 3}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    keys = {p["key"]: p["suggestion"] for p in info.value.problems}
    assert keys == {"monitor.thresholds.slow_factr": "slow_factor",
                    "monitor.profiling.stepz": "steps"}


def test_yaml_syntax_error_is_unusable(tmp_path):
    path = write(tmp_path, "data:\n  batch_size: [1,\n  x: 2\n")
    result = validate_config(path, environment=CPU)
    assert result["exit_code"] == 2
    assert result["problems"][0]["kind"] == "yaml_syntax"
    assert result["problems"][0]["line"] is not None


@pytest.mark.parametrize("text, kind, key", [
    ("data:\n  batch_size: 30\ndistribute:\n  mode: mirrored\n"
     "  devices: [/cpu:0, /cpu:1, /cpu:2, /cpu:3]\n",
     "batch_not_divisible", "data.batch_size"),
    ("training:\n  mixed_precision: mixed_float16\n", "mixed_precision_unsupported",
     "training.mixed_precision"),
    ("data:\n  cache_dir: {file}/cache\n", "cache_dir_not_writable", "data.cache_dir"),
    ("data:\n  corpus: no/such/corpus\n", "corpus_missing", "data.corpus"),
    ("data:\n  prefetch: /gpu:0\n", "device_missing", "data.prefetch"),
    ("distribute:\n  mode: mirrored\n  devices: [/gpu:0, /device:GPU:1]\n", "device_missing",
     "distribute.devices"),
])
def test_each_trap_is_found(tmp_path, text, kind, key):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    path = write(tmp_path, text.format(file=blocker))
    problems = validate_config(path, environment=CPU)["problems"]
    assert [(p["kind"], p["key"]) for p in problems] == [(kind, key)]
    assert problems[0]["line"] is not None


def test_a_gpu_the_machine_lacks_is_found_and_prefetch_is_fixed(tmp_path):
    one_gpu = {"gpus": [{"name": "A100", "compute_capability": [8, 0]}], "cpu_bf16": False,
               "cpu_bf16_flags": []}
    path = write(tmp_path, "data:\n  prefetch: /gpu:1\ndistribute:\n  devices: [/gpu:0]\n")
    (problem,) = validate_config(path, environment=one_gpu)["problems"]
    assert (problem["kind"], problem["key"], problem["line"]) == ("device_missing",
                                                                  "data.prefetch", 2)
    assert "names /gpu:1 but this machine has 1 GPU(s)" in problem["message"]
    assert validate_config(path, fix=True, environment=one_gpu)["exit_code"] == 0
    assert load_config(path).data.prefetch == "auto"


def test_bfloat16_needs_hardware_support():
    cfg = Config()
    cfg.training.mixed_precision = "mixed_bfloat16"
    assert [p["kind"] for p in check_config(cfg, CPU)] == ["mixed_precision_unsupported"]
    assert check_config(cfg, {"gpus": [], "cpu_bf16": True, "cpu_bf16_flags": ["amx_bf16"]}) == []
    old_gpu = {"gpus": [{"name": "T4", "compute_capability": [7, 5]}], "cpu_bf16": False,
               "cpu_bf16_flags": []}
    assert [p["kind"] for p in check_config(cfg, old_gpu)] == ["mixed_precision_unsupported"]
    cfg.training.mixed_precision = "mixed_float16"
    assert check_config(cfg, old_gpu) == []


def test_bad_input_unset_only_for_a_corpus_with_bad_files(tmp_path):
    from keras_gpufix.data.synthetic import make_synthetic_corpus

    clean = make_synthetic_corpus(str(tmp_path / "clean"), 3, max_seconds=1.0)
    bad = make_synthetic_corpus(str(tmp_path / "bad"), 3, max_seconds=1.0, bad_files=("not_wav",))
    assert validate_config(write(tmp_path, f"data:\n  corpus: {clean}\n"),
                           environment=CPU)["exit_code"] == 0
    path = write(tmp_path, "data:\n  corpus: bad\n", name="bad.yaml")  # relative to the file
    result = validate_config(path, environment=CPU)
    assert [p["kind"] for p in result["problems"]] == ["bad_input_unset"]
    assert "bad_not_wav.wav" in result["problems"][0]["message"]
    fixed = validate_config(path, fix=True, environment=CPU)
    assert fixed["exit_code"] == 0
    assert load_config(path).data.on_bad_input == "skip"


def test_fix_round_trip(tmp_path):
    text = ("# keep this comment\n"
            "data:\n"
            "  batch_size: \"30\"   # global batch\n"
            "  num_buckets: 0\n"
            "  prefetch: false\n"
            "training: {jit_compile: true, mixed_precision: mixed_float16, epocs: 3}\n"
            "distribute:\n"
            "  mode: mirrored\n"
            "  devices: [/cpu:0, /cpu:1, /cpu:2, /cpu:3]\n")
    path = write(tmp_path, text)
    result = validate_config(path, fix=True, environment=CPU)
    assert result["exit_code"] == 0, result["problems"]
    changes = {(c["key"], c["after"]) for c in result["changes"]}
    assert ("data.num_buckets", "8") in changes
    assert ("data.prefetch", "auto") in changes
    assert ("training.epocs", "training.epochs") in changes
    assert ("training.mixed_precision", "auto") in changes
    assert ("data.batch_size", "32") in changes
    with open(result["backup"]) as f:
        assert f.read() == text
    new = open(path).read()
    assert "# keep this comment" in new and "# global batch" in new
    cfg = load_config(path)
    assert (cfg.data.batch_size, cfg.data.num_buckets, cfg.training.epochs) == (32, 8, 3)
    assert validate_config(path, environment=CPU)["exit_code"] == 0


def test_fix_inserts_missing_key_and_keeps_unfixable(tmp_path):
    path = write(tmp_path, "data:\n  corpus: nowhere\n  num_buckets: null\n  batch_size: 8\n")
    result = validate_config(path, fix=True, environment=CPU)
    assert [p["kind"] for p in result["problems"]] == ["corpus_missing"]
    assert result["exit_code"] == 1
    assert load_config(path).data.num_buckets == 8
    path = write(tmp_path, "training:\n  jit_compile: true\ndata:\n  num_buckets: 0\n",
                 name="two.yaml")
    validate_config(path, fix=True, environment=CPU)
    assert load_config(path).data.num_buckets == 8
    assert os.path.exists(path + ".bak")


def test_validate_cli_exit_codes(tmp_path, capsys):
    good = write(tmp_path, GOOD.replace("mixed_precision: auto", "mixed_precision: float32"),
                 name="good.yaml")
    assert main(["validate", good]) == 0
    assert "valid" in capsys.readouterr().out
    bad = write(tmp_path, "data:\n  num_bucket: 3\n", name="bad.yaml")
    assert main(["validate", bad]) == 1
    out = capsys.readouterr().out
    assert "bad.yaml, line 2" in out and "did you mean `num_buckets`?" in out
    assert main(["validate", str(tmp_path / "missing.yaml")]) == 2
    assert "no such file" in capsys.readouterr().err
    broken = write(tmp_path, "data: [1,\n", name="broken.yaml")
    assert main(["validate", broken]) == 2
    assert "YAML syntax error" in capsys.readouterr().err


def test_validate_cli_fix_prints_changes(tmp_path, capsys):
    path = write(tmp_path, "data:\n  prefetch: 0\n")
    original = open(path).read()
    assert main(["validate", path, "--fix"]) == 0
    out = capsys.readouterr().out
    assert "data.prefetch: 0 -> auto (wrong_type)" in out
    assert open(path + ".bak").read() == original
    assert main(["validate", path]) == 0


def test_example_config_is_valid():
    path = os.path.join(os.path.dirname(__file__), "..", "examples", "tts.yaml")
    if not os.path.exists(path):
        pytest.skip("examples/tts.yaml not present")
    cfg = load_config(path)
    assert cfg.data.num_buckets


@pytest.mark.parametrize("text, key, fixed", [
    ("data:\n  num_buckets: 0\n", "data.num_buckets", 8),
    ("data:\n  num_buckets: null\n", "data.num_buckets", 8),
    ("data:\n  prefetch: false\n", "data.prefetch", "auto"),
    ("data:\n  prefetch: 4\n", "data.prefetch", "auto"),
])
def test_values_the_builder_cannot_honour_are_refused(tmp_path, text, key, fixed):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    (problem,) = info.value.problems
    assert (problem["kind"], problem["key"], problem["line"]) == ("wrong_type", key, 2)
    assert problem["fix"]["value"] == fixed
    assert validate_config(path, fix=True, environment=CPU)["exit_code"] == 0
    section, name = key.split(".")
    assert getattr(getattr(load_config(path), section), name) == fixed


# One value that is not the default for EVERY key load_config accepts, and where
# from_config must deliver it (`setup` -> what the object holds). A key added to a
# section without a row here fails test_every_key_has_a_round_trip_row.
EVERY_KEY = """\
data:
  corpus: corpus
  audio: {{n_mels: 40, max_seconds: 5.0}}
  text: {{unknown: oov}}
  batch_size: 12
  num_buckets: 3
  cache_dir: cache
  on_bad_input: raise
  prefetch: {prefetch}
  service: grpc://localhost:5050
training:
  jit_compile: false
  mixed_precision: {policy}
  steps_per_execution: 4
  epochs: 7
distribute:
  mode: one_device
  devices: ["/cpu:0"]
monitor:
  window: 16
  warmup: 2
  min_windows: 3
  thresholds: {{slow_factor: 4.0}}
  log_dir: logs
  profiling: {{trigger: [slow_step, 7], steps: 2, max_traces: 1, analyze: false,
              cooldown: 5, warmup: 3,
              analysis_timeout: 0.5}}
"""


def _callback(setup, name):
    import keras_gpufix as kg

    (callback,) = [c for c in setup.callbacks if type(c) is getattr(kg, name)]
    return callback


def _trigger(name):
    return lambda setup, tmp: getattr(_callback(setup, "ProfilerTrigger"), name)


REACHES = {
    "data.corpus": (lambda s, tmp: (s.builder.corpus.source, len(s.builder.utterances)),
                    lambda tmp: (str(tmp / "corpus" / "metadata.csv"), 4)),
    "data.audio": (lambda s, tmp: (s.builder.audio.n_mels, s.builder.audio.max_seconds),
                   (40, 5.0)),
    "data.text": (lambda s, tmp: s.builder.text.unknown, "oov"),
    "data.batch_size": (lambda s, tmp: s.build_kwargs["batch_size"], 12),
    "data.num_buckets": (lambda s, tmp: (s.build_kwargs["num_buckets"],
                                         _callback(s, "RetracingMonitor").max_new_shapes),
                         (3, 4)),
    "data.cache_dir": (lambda s, tmp: s.builder.cache_dir, lambda tmp: str(tmp / "cache")),
    "data.on_bad_input": (lambda s, tmp: s.builder.on_bad_input, "raise"),
    "data.prefetch": None,  # per parametrization, below
    "data.service": (lambda s, tmp: s.build_kwargs["service"], "grpc://localhost:5050"),
    "training.jit_compile": (lambda s, tmp: s.compile_kwargs["jit_compile"], False),
    "training.mixed_precision": None,  # per parametrization, below
    "training.steps_per_execution": (lambda s, tmp: s.compile_kwargs["steps_per_execution"], 4),
    "training.epochs": (lambda s, tmp: s.config.training.epochs, 7),  # fit's, not an object's
    "distribute.mode": (lambda s, tmp: type(s.strategy).__name__, "OneDeviceStrategy"),
    "distribute.devices": (lambda s, tmp: s.strategy.extended.worker_devices[0].lower(),
                           "/job:localhost/replica:0/task:0/device:cpu:0"),
    "monitor.window": (lambda s, tmp: _callback(s, "GPUOscillationMonitor").window, 16),
    "monitor.warmup": (lambda s, tmp: _callback(s, "GPUOscillationMonitor").warmup, 2),
    "monitor.min_windows": (lambda s, tmp: _callback(s, "GPUOscillationMonitor").min_windows, 3),
    "monitor.thresholds": (lambda s, tmp: _callback(s, "GPUOscillationMonitor").thresholds,
                           {"slow_factor": 4.0}),
    "monitor.log_dir": (lambda s, tmp: {_callback(s, name).log_dir for name in (
        "GPUOscillationMonitor", "StepTimer", "ProfilerTrigger")}, lambda tmp: {str(tmp / "logs")}),
    "monitor.profiling.trigger": (_trigger("trigger"), ["slow_step", 7]),
    "monitor.profiling.steps": (_trigger("steps"), 2),
    "monitor.profiling.max_traces": (_trigger("max_traces"), 1),
    "monitor.profiling.analyze": (_trigger("analyze"), False),
    "monitor.profiling.cooldown": (_trigger("cooldown"), 5),
    "monitor.profiling.warmup": (_trigger("warmup"), 3),
    "monitor.profiling.analysis_timeout": (_trigger("analysis_timeout"), 0.5),
}


def _every_key():
    from keras_gpufix.config import _SECTIONS, ProfilingConfig

    keys = {f"{name}.{f.name}" for name, cls in _SECTIONS.items()
            for f in dataclasses.fields(cls)} - {"monitor.profiling"}
    return keys | {f"monitor.profiling.{f.name}" for f in dataclasses.fields(ProfilingConfig)}


def test_every_key_has_a_round_trip_row():
    import yaml

    assert set(REACHES) == _every_key()
    written = yaml.safe_load(EVERY_KEY.format(prefetch="auto", policy="auto"))
    paths = {f"{s}.{k}" for s, keys in written.items() for k in keys} - {"monitor.profiling"}
    assert paths | {f"monitor.profiling.{k}" for k in written["monitor"]["profiling"]} == (
        _every_key())


@pytest.mark.parametrize("policy, prefetch, keras_policy", [
    ("auto", "auto", None),
    ("float32", "/cpu:0", "float32"),
    ("false", "auto", "float32"),
    ("bfloat16", "auto", "mixed_bfloat16"),
    ("float16", "auto", "mixed_float16"),
    ("mixed_bfloat16", "auto", "mixed_bfloat16"),
    ("mixed_float16", "auto", "mixed_float16"),
])
def test_every_value_load_config_accepts_reaches_its_object(tmp_path, policy, prefetch,
                                                             keras_policy):
    import keras

    import keras_gpufix as kg
    from keras_gpufix.config import from_config

    kg.data.make_synthetic_corpus(tmp_path / "corpus", 4, max_seconds=1.5)
    path = write(tmp_path, EVERY_KEY.format(policy=policy, prefetch=prefetch))
    try:
        setup = from_config(load_config(path))
        policy_set = keras.config.dtype_policy().name
    finally:
        keras.config.set_dtype_policy("float32")
    if keras_policy is not None:
        assert policy_set == keras_policy == setup.policy
    assert setup.compile_kwargs["mixed_precision"] == setup.policy
    assert setup.build_kwargs.get("prefetch_to_device", "auto") == prefetch
    for key, reach in REACHES.items():
        if reach is None:
            continue
        got, expected = reach
        expected = expected(tmp_path) if callable(expected) else expected
        assert got(setup, tmp_path) == expected, key


def test_sections_follow_the_signatures_they_feed():
    import inspect

    import keras_gpufix as kg
    from keras_gpufix.config import (DataConfig, DistributeConfig, MonitorConfig,
                                     ProfilingConfig, TrainingConfig)

    def params(*owners):
        return {name: p.default for owner in owners
                for name, p in inspect.signature(owner).parameters.items()}

    # The config's own choices: keys the signature lacks or whose default differs
    # on purpose (on_bad_input null = "unset", a trap for validate).
    OWN = {"corpus", "audio", "text", "batch_size", "on_bad_input", "prefetch", "epochs",
           "thresholds", "log_dir", "profiling"}
    sections = [
        (ProfilingConfig, params(kg.ProfilerTrigger), {"log_dir", "verbose"}),
        (MonitorConfig, params(kg.GPUOscillationMonitor), {"on_detect", "nvml", "verbose"}),
        (TrainingConfig, params(kg.compile_model),
         {"model", "optimizer", "loss", "metrics", "sample_batch", "compile_kwargs"}),
        (DistributeConfig, params(kg.setup_strategy), {"memory_growth"}),
    ]
    for cls, fed, left_out in sections:  # the same names as the signature
        assert {f.name for f in dataclasses.fields(cls)} - OWN == set(fed) - left_out - OWN, cls
    data = params(kg.data.SpeechDatasetBuilder, kg.data.SpeechDatasetBuilder.build)
    assert {f.name for f in dataclasses.fields(DataConfig)} - {"prefetch"} <= set(data)
    assert "prefetch_to_device" in data  # prefetch: "auto" or build's prefetch_to_device
    # every default the signature owns is read from it, none written again here
    for cls, fed in [(cls, fed) for cls, fed, _ in sections] + [(DataConfig, data)]:
        for f in dataclasses.fields(cls):
            if f.name not in OWN:
                assert f.default is dataclasses.MISSING, f"{cls.__name__}.{f.name} hard-coded"
                assert getattr(cls(), f.name) == fed[f.name], f"{cls.__name__}.{f.name}"


# What `keras-gpufix validate` says and what from_config does agree on every value
# docs/cli.md documents: accepted -> no schema problem and from_config builds it;
# refused -> the problem names the key and from_config raises the same ConfigError.
DOCUMENTED = [
    ("data:\n  batch_size: 8\n", True),
    ("data:\n  num_buckets: 1\n", True),
    ("data:\n  num_buckets: 0\n", False),
    ("data:\n  num_buckets: null\n", False),
    ("data:\n  prefetch: auto\n", True),
    ("data:\n  prefetch: /cpu:0\n", True),
    ("data:\n  prefetch: /nonsense\n", False),
    ("data:\n  prefetch: false\n", False),
    ("data:\n  prefetch: 4\n", False),
    ("data:\n  on_bad_input: skip\n", True),
    ("data:\n  on_bad_input: ignore\n", False),
    ("data:\n  service: grpc://localhost:5050\n", True),
    ("data:\n  audio: {n_mels: 40}\n", True),
    ("data:\n  audio: {n_mels: -1}\n", False),
    ("data:\n  text: {unknown: oov}\n", True),
    ("data:\n  text: {unknown: raise}\n", False),
    ("training:\n  jit_compile: false\n", True),
    ("training:\n  mixed_precision: auto\n", True),
    ("training:\n  mixed_precision: false\n", True),
    ("training:\n  mixed_precision: float32\n", True),
    ("training:\n  mixed_precision: bfloat16\n", True),
    ("training:\n  mixed_precision: mixed_bfloat16\n", True),
    ("training:\n  mixed_precision: float16\n", True),
    ("training:\n  mixed_precision: mixed_float16\n", True),
    ("training:\n  mixed_precision: half\n", False),
    ("training:\n  steps_per_execution: 1\n", True),
    ("training:\n  steps_per_execution: 0\n", False),
    ("training:\n  epochs: 3\n", True),
    ("distribute:\n  mode: default\n", True),
    ("distribute:\n  mode: one_device\n", True),
    ("distribute:\n  mode: mirrored\n", True),
    ("distribute:\n  mode: sharded\n", False),
    ("distribute:\n  mode: mirrored\n  devices: [/cpu:0]\n", True),
    ("distribute:\n  devices: [cpu0]\n", False),
    ("distribute:\n  mode: one_device\n  devices: [/cpu:0]\n", True),
    ("distribute:\n  mode: one_device\n  devices: [/cpu:0, /cpu:1]\n", False),
    ("distribute:\n  mode: default\n  devices: [/cpu:0]\n", False),
    ("monitor:\n  window: 8\n", True),
    ("monitor:\n  window: 4\n", False),
    ("monitor:\n  warmup: 0\n", True),
    ("monitor:\n  min_windows: 1\n", True),
    ("monitor:\n  min_windows: 0\n", False),
    ("monitor:\n  thresholds: {slow_factor: 2.0}\n", True),
    ("monitor:\n  thresholds: {slow_factor: 0.5}\n", False),
    ("monitor:\n  thresholds: {slow_factor: fast}\n", False),
    ("monitor:\n  log_dir: null\n", True),
    ("monitor:\n  profiling: false\n", True),
    ("monitor:\n  profiling: {trigger: [oscillation, slow_step, 0]}\n", True),
    ("monitor:\n  profiling: {trigger: sometimes}\n", False),
    ("monitor:\n  profiling: {trigger: -3}\n", False),
    ("monitor:\n  profiling: {slow_factor: 1.0}\n", False),
    ("monitor:\n  profiling: {analysis_timeout: 0}\n", True),
    ("monitor:\n  profiling: {analysis_timeout: -1}\n", False),
]


@pytest.mark.parametrize("text, accepted", DOCUMENTED)
def test_validate_and_from_config_agree(tmp_path, text, accepted):
    import keras

    from keras_gpufix.config import from_config

    path = write(tmp_path, text)
    result = validate_config(path, environment=CPU)
    schema = [p for p in result["problems"]
              if p["kind"] in ("wrong_type", "invalid_value", "unknown_key")]
    try:
        if accepted:
            assert schema == []
            from_config(path)
        else:
            lines = text.splitlines()  # the refused value is on the last line
            section, key = lines[0].rstrip(":"), lines[-1].split(":")[0].strip()
            (problem,) = schema  # on that key (or one of its entries)
            assert problem["key"].startswith(f"{section}.{key}")
            assert problem["line"] == len(lines)
            assert result["exit_code"] == 1
            with pytest.raises(ConfigError) as info:
                from_config(path)
            assert info.value.problems == schema
    finally:
        keras.config.set_dtype_policy("float32")


def test_docs_table_lists_every_key():
    docs = os.path.join(os.path.dirname(__file__), "..", "docs", "cli.md")
    with open(docs, encoding="utf-8") as f:
        text = f.read()
    table = text[text.index("### Every documented value"):]
    table = table[:table.index("\n## ")]
    missing = [key for key in _every_key() if f"`{key}`" not in table]
    assert missing == []


def test_builder_kwargs_from_config(tmp_path):
    from keras_gpufix.config import builder_kwargs

    path = write(tmp_path, "data:\n  audio: {n_mels: 40}\n  cache_dir: c\n"
                           "  on_bad_input: raise\n")
    kwargs = builder_kwargs(load_config(path))
    assert kwargs["audio"].n_mels == 40
    assert (kwargs["cache_dir"], kwargs["on_bad_input"]) == (str(tmp_path / "c"), "raise")
    assert "text" not in kwargs


def test_duplicate_keys_name_both_lines(tmp_path):
    path = write(tmp_path, "data:\n  batch_size: 8\n  num_buckets: 4\n  batch_size: 16\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    (problem,) = info.value.problems
    assert (problem["kind"], problem["key"], problem["line"]) == (
        "duplicate_key", "data.batch_size", 4)
    assert "line 2 and line 4" in problem["message"]
    result = validate_config(path, fix=True, environment=CPU)
    assert result["exit_code"] == 1 and result["changes"] == []
    assert [p["kind"] for p in result["problems"]] == ["duplicate_key"]


@pytest.mark.parametrize("text", ["", "# only a comment\n\n# another\n"])
def test_empty_file_is_unusable(tmp_path, capsys, text):
    path = write(tmp_path, text)
    result = validate_config(path, environment=CPU)
    assert result["exit_code"] == 2 and "is empty" in result["error"]
    assert main(["validate", path]) == 2
    assert "is empty" in capsys.readouterr().err


def test_problems_in_line_order(tmp_path):
    path = write(tmp_path, "training:\n  epochs: x\ndata:\n  batch_size: y\n  cache_dir: z\n"
                           "monitor:\n  windw: 3\ndata:\n  prefetch: auto\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    lines = [p["line"] for p in info.value.problems]
    assert lines == sorted(lines) and len(lines) >= 3


def test_fix_drops_a_comment_that_names_the_old_value(tmp_path):
    path = write(tmp_path, "data:\n  num_buckets: 0   # 0: no bucketing\n"
                           "  batch_size: \"8\"  # global batch\n")
    result = validate_config(path, fix=True, environment=CPU)
    assert result["exit_code"] == 0
    assert open(path).read() == "data:\n  num_buckets: 8\n  batch_size: 8  # global batch\n"
    before = {c["key"]: c["before"] for c in result["changes"]}
    assert before["data.num_buckets"] == "0  # 0: no bucketing"


def test_from_config_writes_tensorboard_scalars_only_with_a_log_dir(tmp_path):
    import keras_gpufix as kg
    from keras_gpufix.config import from_config

    with_logs = from_config(load_config(write(tmp_path, "monitor:\n  log_dir: tb\n")))
    timers = [c for c in with_logs.callbacks if type(c) is kg.StepTimer]
    assert len(timers) == 1 and timers[0].log_dir == str(tmp_path / "tb")
    without = from_config(load_config(write(tmp_path, "monitor:\n  log_dir: null\n", "b.yaml")))
    assert {type(c) for c in without.callbacks} == {kg.GPUOscillationMonitor,
                                                    kg.RetracingMonitor}
