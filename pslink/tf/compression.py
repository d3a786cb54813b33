"""Horovod's gradient compression for TensorFlow: ``Compression.none`` and ``Compression.fp16``."""

from __future__ import annotations

import tensorflow as tf

from pslink.core.worker.horovod import NoneCompressor


class _FP16Compressor:
    """Send floating-point tensors as float16, halving the bytes on the wire."""

    @staticmethod
    def compress(tensor):
        if tensor.dtype.is_floating and tensor.dtype != tf.float16:
            return tf.cast(tensor, tf.float16), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor if ctx is None else tf.cast(tensor, ctx)


class Compression:
    """Horovod's compression choices: ``Compression.none`` and ``Compression.fp16``."""

    none = NoneCompressor
    fp16 = _FP16Compressor
