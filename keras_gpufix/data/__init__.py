"""Speech corpus -> `tf.data` input path (TensorFlow only, loaded lazily)."""

import importlib

_EXPORTS = {
    "instrument": "keras_gpufix.data.instrument",
    "InputProbe": "keras_gpufix.data.instrument",
    "SpeechDatasetBuilder": "keras_gpufix.data.builder",
    "AudioConfig": "keras_gpufix.data.audio",
    "LogMelSpectrogram": "keras_gpufix.data.audio",
    "log_mel": "keras_gpufix.data.audio",
    "mel_filterbank": "keras_gpufix.data.audio",
    "TextConfig": "keras_gpufix.data.text",
    "encode_text": "keras_gpufix.data.text",
    "normalize_text": "keras_gpufix.data.text",
    "Corpus": "keras_gpufix.data.corpus",
    "read_wav_header": "keras_gpufix.data.corpus",
    "BucketPlan": "keras_gpufix.data.bucketing",
    "FeatureCache": "keras_gpufix.data.cache",
    "make_corpus": "keras_gpufix.data.synthetic",
    "make_synthetic_corpus": "keras_gpufix.data.synthetic",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
