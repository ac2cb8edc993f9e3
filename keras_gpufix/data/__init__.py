"""Speech corpus -> `tf.data` input path (TensorFlow only, loaded lazily;
`AudioConfig`, `TextConfig` and the checks of `data/checks.py` load without it)."""

from keras_gpufix._lazy import lazy_getattr

_EXPORTS = {
    "instrument": "keras_gpufix.data.input_probe",
    "InputProbe": "keras_gpufix.data.input_probe",
    "SpeechDatasetBuilder": "keras_gpufix.data.builder",
    "AudioConfig": "keras_gpufix.data.audio_config",
    "LogMelSpectrogram": "keras_gpufix.data.audio",
    "log_mel": "keras_gpufix.data.audio",
    "log_linear": "keras_gpufix.data.audio",
    "extract_features": "keras_gpufix.data.audio",
    "feature_frames": "keras_gpufix.data.audio",
    "trim_bounds": "keras_gpufix.data.audio",
    "mel_filterbank": "keras_gpufix.data.audio",
    "TextConfig": "keras_gpufix.data.text_config",
    "encode_text": "keras_gpufix.data.text",
    "normalize_text": "keras_gpufix.data.text",
    "Corpus": "keras_gpufix.data.corpus",
    "read_wav_header": "keras_gpufix.data.corpus",
    "BucketPlan": "keras_gpufix.data.bucketing",
    "FeatureCache": "keras_gpufix.data.cache",
    "make_synthetic_corpus": "keras_gpufix.data.synthetic",
}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_getattr(__name__, _EXPORTS)
