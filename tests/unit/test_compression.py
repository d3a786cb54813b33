"""2-bit gradient compression (pslink.core.compression): MXNet's quantization, residuals, packing."""

from __future__ import annotations

import numpy as np
import pytest

from pslink.core.compression import Residuals, check, dequantize, packed_size, quantize
from pslink.core.wire.protocol import Op, decode, encode
from pslink.errors import ConfigError, ProtocolError


def reference(values, residual, threshold):
    """MXNet's quantize_2bit, value by value (src/kvstore/gradient_compression-inl.h)."""
    sent = np.zeros_like(values)
    for i in range(values.size):
        residual[i] += values[i]
        if residual[i] >= threshold:
            residual[i] -= threshold
            sent[i] = threshold
        elif residual[i] <= -threshold:
            residual[i] += threshold
            sent[i] = -threshold
    return sent


def test_quantized_pushes_and_residuals_follow_mxnets_rule_over_rounds():
    rng = np.random.default_rng(0)
    threshold = np.float32(0.3)
    mine, theirs = np.zeros(1001, np.float32), np.zeros(1001, np.float32)
    for _ in range(6):
        values = rng.normal(scale=0.4, size=1001).astype(np.float32)
        packed = quantize(values, mine, float(threshold))
        assert packed.dtype == np.uint8 and packed.size == packed_size(1001) == 251
        got = dequantize(packed, float(threshold), np.empty(1001, np.float32))
        np.testing.assert_array_equal(got, reference(values, theirs, threshold))
        np.testing.assert_array_equal(mine, theirs)


def test_packing_puts_the_first_value_in_the_top_bits():
    residual = np.zeros(5, np.float32)
    packed = quantize(np.array([1, -1, 0, 1, -1], np.float32), residual, 0.5)
    assert packed.tolist() == [0b11100011, 0b10000000]
    assert residual.tolist() == [0.5, -0.5, 0, 0.5, -0.5]


def test_residuals_are_kept_per_key_and_part():
    residuals = Residuals(0.5)
    first = residuals.quantize("w", 0, np.full(4, 0.3, np.float32))
    assert dequantize(first.packed, 0.5, np.empty(4, np.float32)).tolist() == [0, 0, 0, 0]
    again = residuals.quantize("w", 0, np.full(4, 0.3, np.float32))  # 0.6 now: sent
    assert dequantize(again.packed, 0.5, np.empty(4, np.float32)).tolist() == [0.5] * 4
    other = residuals.quantize("w", 1, np.full(4, 0.3, np.float32))  # another part: its own residual
    assert dequantize(other.packed, 0.5, np.empty(4, np.float32)).tolist() == [0, 0, 0, 0]


def test_settings_and_headers_are_checked():
    assert check({"type": "2bit"}) == 0.5 and check({"type": "2bit", "threshold": 2}) == 2.0
    assert check({"type": "none"}) is None and check(None) is None
    for params, match in [({"type": "1bit"}, "type '1bit' is not supported"), ({"type": "2bit", "threshold": 0},
                          "positive number"), ({"type": "2bit", "k": 1}, "not \\['k'\\]"), ("2bit", "must be a map")]:
        with pytest.raises(ConfigError, match=match):
            check(params)
    fields = dict(id=1, job="j", tok=b"t", rank=0, key="w", part=0, rnd=1, dtype="float32", shape=[10], span=[0, 10])
    assert decode(encode(Op.PUSH, cmp=0.5, **fields), [3])["cmp"] == 0.5
    with pytest.raises(ProtocolError, match="needs 40"):
        decode(encode(Op.PUSH, **fields), [3])  # uncompressed: 10 float32
    with pytest.raises(ProtocolError, match="compression threshold -1"):
        decode(encode(Op.PUSH, cmp=-1, **fields), [3])
    with pytest.raises(ProtocolError, match="on a push of a floating dtype"):
        decode(encode(Op.PUSH, cmp=0.5, **dict(fields, dtype="int32")), [3])
