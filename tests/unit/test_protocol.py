"""The wire protocol: exact bytes, and every way a header can be wrong."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from pslink.core.wire.protocol import (
    DTYPES,
    PROTOCOL_VERSION,
    HeaderTemplate,
    Limits,
    Op,
    decode,
    encode,
    encode_error,
    wire_dtype,
)
from pslink.errors import ProtocolError, ShapeMismatchError


def push_header(**overrides):
    fields = dict(
        id=7, job="mnist", tok=b"\x01" * 16, rank=1, key=3, part=0, rnd=5, dtype="float32",
        shape=[2, 3], span=[0, 6],
    )
    fields.update(overrides)
    return encode(Op.PUSH, **fields)


# Golden bytes: changing them means changing the wire format, which needs a new protocol version.
GOLDEN_PUSH = bytes.fromhex(
    "8c"  # a map of 12 fields, in this order:
    "a17601" "a26f7002" "a2696407"  # v=1, op=2 (PUSH), id=7
    "a36a6f62a56d6e697374"  # job="mnist"
    "a3746f6bc41001010101010101010101010101010101"  # tok=bin(16)
    "a472616e6b01" "a36b657903" "a47061727400" "a3726e6405"  # rank=1, key=3, part=0, rnd=5
    "a56474797065a7666c6f61743332"  # dtype="float32"
    "a57368617065920203"  # shape=[2, 3]
    "a47370616e920006"  # span=[0, 6]
)


def test_golden_bytes_of_a_push_header():
    assert push_header() == GOLDEN_PUSH
    decoded = decode(GOLDEN_PUSH, [24])
    assert decoded["op"] is Op.PUSH
    assert decoded["v"] == PROTOCOL_VERSION == 1
    assert (decoded["key"], decoded["shape"], decoded["span"]) == (3, [2, 3], [0, 6])


def test_golden_bytes_of_an_error_reply():
    raw = encode_error(9, ShapeMismatchError("key 3: bad", key=3, shapes=[[2], [3]]))
    assert raw == bytes.fromhex(
        "86" "a17601" "a26f700b" "a2696409"  # v=1, op=11 (ERROR), id=9
        "a4636f6465ae73686170655f6d69736d61746368"  # code="shape_mismatch"
        "a36d7367aa6b657920333a20626164"  # msg="key 3: bad"
        "a764657461696c7382a36b657903a67368617065739291029103"  # details={key: 3, shapes: [[2], [3]]}
    )
    header = decode(raw)
    assert header["code"] == "shape_mismatch" and header["details"]["shapes"] == [[2], [3]]


def test_round_trip_of_every_data_op():
    for op, payloads in [(Op.INIT, [24]), (Op.INIT, []), (Op.PUSH, [24]), (Op.PULL, []), (Op.PUSHPULL, [24])]:
        raw = encode(op, id=1, job="j", tok=b"t", rank=0, key="w", part=0, rnd=0, dtype="float32",
                     shape=[6], span=[0, 6])
        assert decode(raw, payloads)["op"] is op


@pytest.mark.parametrize("op", [Op.INIT, Op.PUSH, Op.PULL, Op.PUSHPULL])
@pytest.mark.parametrize("key", [3, "layer1.weight", 2**64 - 1])
@pytest.mark.parametrize("extra", [{}, {"avg": True}])
def test_a_header_template_decodes_as_the_header_encode_makes(op, key, extra):
    fixed = dict(job="mnist", tok=b"\x01" * 16, rank=1, key=key, part=2, dtype="float32", shape=[2, 3], span=[0, 6])
    if op in (Op.PUSH, Op.PUSHPULL) or not extra:
        template = HeaderTemplate(op, **fixed, **extra)
        sizes = [24] if op != Op.PULL else []
        for rid, rnd in [(1, 0), (127, 128), (70_000, 2**33), (2**63 - 1, 2**40)]:
            made = template.make(rid, rnd)
            assert decode(made, sizes) == decode(encode(op, id=rid, rnd=rnd, **fixed, **extra), sizes)
            assert len(made) == len(encode(op, id=rid, rnd=rnd, **fixed, **extra))
            for idle in (0, 400, 70_000):  # a push's worker's compute before it, in ms
                made = template.make(rid, rnd, idle)
                assert decode(made, sizes) == decode(encode(op, id=rid, rnd=rnd, idl=idle, **fixed, **extra), sizes)
                assert decode(made, sizes)["idl"] == idle


def test_a_header_template_takes_id_and_round_per_request_only():
    with pytest.raises(ValueError, match="id and rnd"):
        HeaderTemplate(Op.PUSH, id=1, job="j")


def test_plain_replies_are_decoded_and_their_fields_checked():
    header = decode(encode(Op.REPLY, id=5, rnd=2, n=2, ep=1), [24])
    assert (header["op"], header["id"], header["rnd"], header["n"], header["ep"]) == (Op.REPLY, 5, 2, 2, 1)
    assert decode(encode(Op.REPLY, id=5), [])["id"] == 5
    for field, value in [("id", -1), ("rnd", 1.5), ("n", True), ("ep", "1"), ("id", 2**63)]:
        fields = dict(id=5, rnd=2, n=2, ep=1)
        fields[field] = value
        with pytest.raises(ProtocolError, match=f"field '{field}'"):
            decode(encode(Op.REPLY, **fields), [24])
    with pytest.raises(ProtocolError, match="field 'moved'"):
        decode(encode(Op.REPLY, id=5, rnd=2, moved="elsewhere"), [24])
    assert decode(encode(Op.REPLY, id=5, rnd=2, moved=["agg-1", "tcp://h:1"]), [24])["moved"] == ["agg-1", "tcp://h:1"]
    with pytest.raises(ProtocolError, match="lacks field 'id'"):
        decode(encode(Op.REPLY, rnd=2), [24])


def test_string_and_large_int_keys():
    assert decode(push_header(key="layer1.weight"), [24])["key"] == "layer1.weight"
    assert decode(push_header(key=2**64 - 1), [24])["key"] == 2**64 - 1


@pytest.mark.parametrize(
    "raw, match",
    [
        (b"", "not valid msgpack"),
        (b"\xc1", "not valid msgpack"),
        (msgpack.packb([1, 2, 3]), "must be a msgpack map"),
        (msgpack.packb({"op": 2}), "version None"),
        (msgpack.packb({"v": 2, "op": 2}), "version 2 is not supported"),
        (msgpack.packb({"v": 1, "op": 99}), "unknown op 99"),
        (msgpack.packb({"v": 1, "op": "push"}), "unknown op 'push'"),
        (msgpack.packb({"v": 1, "op": 2, "id": 1}), "lacks field"),
        (push_header()[:-3], "not valid msgpack"),  # truncated
    ],
)
def test_malformed_headers_are_refused(raw, match):
    with pytest.raises(ProtocolError, match=match):
        decode(raw, [24])


@pytest.mark.parametrize(
    "overrides, sizes, match",
    [
        (dict(dtype="float128"), [24], "dtype 'float128' is not supported"),
        (dict(dtype="object"), [24], "not supported"),
        (dict(shape=[2, -3]), [24], "field 'shape'"),
        (dict(shape="2x3"), [24], "field 'shape'"),
        (dict(shape=[1] * 40), [24], "field 'shape'"),
        (dict(span=[4, 2]), [24], "field 'span'"),
        (dict(span=[0, 7]), [28], "exceeds the 6 elements"),
        (dict(rank=-1), [24], "field 'rank'"),
        (dict(rank=True), [24], "field 'rank'"),
        (dict(key=-1), [24], "field 'key'"),
        (dict(key=""), [24], "field 'key'"),
        (dict(key=1.5), [24], "field 'key'"),
        (dict(job=""), [24], "field 'job'"),
        (dict(tok="secret"), [24], "field 'tok'"),
        ({}, [20], "payload of 20 bytes, but span \\[0, 6\\] of float32 needs 24"),
        ({}, [], "PUSH carries 0 payload frames"),
        ({}, [24, 24], "PUSH carries 2 payload frames"),
    ],
)
def test_bad_data_fields_are_named(overrides, sizes, match):
    with pytest.raises(ProtocolError, match=match):
        decode(push_header(**overrides), sizes)


def test_size_limits_are_enforced_before_payloads_are_read():
    limits = Limits(max_header_bytes=100, max_message_bytes=100, max_frames=2)
    with pytest.raises(ProtocolError, match="header of .* exceeds the limit of 100"):
        decode(push_header(job="x" * 100), [24], limits)
    with pytest.raises(ProtocolError, match="payload of 200 bytes exceeds the limit of 100"):
        decode(encode(Op.PUSH, id=1, job="j", tok=b"", rank=0, key=1, part=0, rnd=1, dtype="uint8",
                      shape=[200], span=[0, 200]), [200], limits)
    with pytest.raises(ProtocolError, match="3 payload frames; the limit is 2"):
        decode(push_header(), [1, 1, 1], limits)


def test_hostile_msgpack_cannot_allocate_its_way_out():
    # a map that claims 2**31 entries, and a huge binary length
    with pytest.raises(ProtocolError):
        decode(b"\xdf\x7f\xff\xff\xff", [])
    with pytest.raises(ProtocolError):
        decode(b"\x81\xa1v\xc6\x7f\xff\xff\xff", [])


def test_control_ops_are_validated_too():
    with pytest.raises(ProtocolError, match="field 'num_workers'"):
        decode(encode(Op.REGISTER_WORKER, id=1, job="j", rank=0, num_workers="two"))
    with pytest.raises(ProtocolError, match="LOOKUP carries 1 payload"):
        decode(encode(Op.LOOKUP, id=1, job="j", tok=b"", rank=0, items=[]), [4])


def test_wire_dtypes():
    assert set(DTYPES) >= {"float16", "float32", "float64", "int32", "int64", "uint8"}
    assert wire_dtype(np.float32) == "float32"
    with pytest.raises(ProtocolError, match="not supported"):
        wire_dtype(np.complex64)
    with pytest.raises(ProtocolError, match="little-endian"):
        wire_dtype(np.dtype(">f4"))


def test_errors_of_other_kinds_are_reported_as_internal():
    header = decode(encode_error(3, ValueError("boom")))
    assert header["code"] == "service" and "ValueError: boom" in header["msg"]


def test_state_set_frames_match_their_names_and_the_part_size():
    fields = dict(id=1, job="j", tok=b"t", rank=0, key="w", part=0, rnd=0, dtype="float32", shape=[6], span=[0, 6])
    ok = decode(encode(Op.STATE_SET, **fields, names=["exp_avg", "exp_avg_sq"], scalars={"step": 3}), [24, 24])
    assert ok["names"] == ["exp_avg", "exp_avg_sq"] and ok["scalars"] == {"step": 3}
    with pytest.raises(ProtocolError, match="names .* must be 1 short strings"):
        decode(encode(Op.STATE_SET, **fields, names=["a", "b"]), [24])
    with pytest.raises(ProtocolError, match="payload of 20 bytes"):
        decode(encode(Op.STATE_SET, **fields, names=["a", "b"]), [20, 20])
    with pytest.raises(ProtocolError, match="unequal sizes"):
        decode(encode(Op.STATE_SET, **fields, names=["a", "b"]), [24, 20])
    with pytest.raises(ProtocolError, match="STATE_GET carries 1 payload"):
        decode(encode(Op.STATE_GET, **fields), [24])
