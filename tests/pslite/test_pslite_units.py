"""Pure pieces of pslink.pslite: DMLC_* configuration, the wire format, the scheduler's
decisions, key checks and slicing. No sockets, no threads."""

from __future__ import annotations

import numpy as np
import pytest

from pslink.errors import ConfigError, ProtocolError
from pslink.pslite import K_MAX_KEY, Config, KVPairs, Range, default_slicer, wire
from pslink.pslite.kv import check_keys, value_dtype
from pslink.pslite.scheduler import SchedulerState
from pslink.pslite.wire import Kind

ENV = {
    "DMLC_ROLE": "worker",
    "DMLC_PS_ROOT_URI": "127.0.0.1",
    "DMLC_PS_ROOT_PORT": "9091",
    "DMLC_NUM_SERVER": "2",
    "DMLC_NUM_WORKER": "3",
}


# -- configuration ------------------------------------------------------------------------------


def test_ps_lite_variables_carry_over():
    config = Config.from_env(dict(ENV, DMLC_NODE_HOST="10.1.2.3", PORT="9000", PS_VERBOSE="1",
                                  PS_HEARTBEAT_INTERVAL="2", PS_HEARTBEAT_TIMEOUT="10", PS_RESEND="1",
                                  PS_RESEND_TIMEOUT="500"))
    assert (config.role, config.root_uri, config.root_port, config.num_servers, config.num_workers) == \
        ("worker", "127.0.0.1", 9091, 2, 3)
    assert (config.node_host, config.port, config.verbose) == ("10.1.2.3", 9000, 1)
    assert (config.heartbeat_interval, config.heartbeat_timeout, config.resend, config.resend_timeout) == \
        (2.0, 10.0, True, 500)
    assert config.scheduler_address == "tcp://127.0.0.1:9091"
    assert config.listen_address() == "tcp://10.1.2.3:9000"
    assert config.mode == "classic" and config.expected_servers == 2


@pytest.mark.parametrize("role", ["worker", "server", "scheduler"])
def test_a_role_without_its_required_variables_names_them(role):
    with pytest.raises(ConfigError) as err:
        Config.from_env({"DMLC_ROLE": role, "DMLC_NUM_WORKER": "1"})
    message = str(err.value)
    assert f"DMLC_ROLE={role} cannot start" in message
    for name in ("DMLC_PS_ROOT_URI", "DMLC_PS_ROOT_PORT", "DMLC_NUM_SERVER"):
        assert name in message
    assert "DMLC_NUM_WORKER" not in message


def test_no_role_at_all_names_every_missing_variable():
    with pytest.raises(ConfigError, match="a ps-lite node cannot start: DMLC_ROLE, DMLC_PS_ROOT_URI"):
        Config.from_env({})


@pytest.mark.parametrize("name,value,message", [
    ("DMLC_ROLE", "master", "DMLC_ROLE='master' is not a role"),
    ("DMLC_PS_ROOT_PORT", "http", "DMLC_PS_ROOT_PORT='http' is not an integer"),
    ("DMLC_PS_ROOT_PORT", "70000", "DMLC_PS_ROOT_PORT='70000' must be between 1 and 65535"),
    ("DMLC_NUM_WORKER", "0", "DMLC_NUM_WORKER='0' must be >= 1"),
    ("DMLC_NUM_SERVER", "-1", "DMLC_NUM_SERVER='-1' must be >= 0"),
    ("PORT", "x", "PORT='x' is not an integer"),
    ("PS_HEARTBEAT_TIMEOUT", "soon", "PS_HEARTBEAT_TIMEOUT='soon' is not a number"),
    ("PS_RESEND", "2", "PS_RESEND='2' must be between 0 and 1"),
    ("DMLC_INTERFACE", "nosuch0", "DMLC_INTERFACE='nosuch0': no such network interface"),
    ("PSLINK_PSLITE_MODE", "shared", "PSLINK_PSLITE_MODE='shared' is not a server mode"),
    ("PSLINK_PSLITE_RANK", "3", "PSLINK_PSLITE_RANK=3 is out of range for 3 worker"),
])
def test_a_malformed_value_names_its_variable(name, value, message):
    with pytest.raises(ConfigError, match=message):
        Config.from_env(dict(ENV, **{name: value}))


def test_service_mode_workers_need_the_service_address_and_job():
    with pytest.raises(ConfigError, match="PSLINK_PSLITE_MODE=service: a worker needs PSLINK_MASTER and PSLINK_JOB"):
        Config.from_env(dict(ENV, PSLINK_PSLITE_MODE="service"), master=None, job=None)
    config = Config.from_env(dict(ENV, PSLINK_PSLITE_MODE="service", PSLINK_MASTER="tcp://h:1", PSLINK_JOB="j"))
    assert config.expected_servers == 0
    # Servers and the scheduler do not talk to the service.
    Config.from_env(dict(ENV, DMLC_ROLE="scheduler", PSLINK_PSLITE_MODE="service"), master=None, job=None)


def test_the_interface_and_the_route_to_the_scheduler_give_the_advertised_host():
    config = Config.from_env(dict(ENV, DMLC_INTERFACE="lo"))
    assert config.advertised_host() == "127.0.0.1"
    assert Config.from_env(ENV).advertised_host() == "127.0.0.1"  # the scheduler is local


# -- wire ----------------------------------------------------------------------------------------


def test_kv_headers_round_trip_and_sizes_are_checked_before_payloads():
    raw = wire.encode(Kind.KV_REQUEST, flags=wire.PUSH | wire.LENS, dtype=wire.DTYPE_CODES["float32"], app=2,
                      customer=3, ts=4, sender=9, cmd=-5, priority=6)
    header = wire.decode(raw, (16, 12, 8))
    assert (header.kind, header.push, header.pull, header.dtype, header.app, header.customer, header.ts,
            header.sender, header.cmd, header.priority) == \
        (Kind.KV_REQUEST, True, False, np.dtype("float32"), 2, 3, 4, 9, -5, 6)
    with pytest.raises(ProtocolError, match="not a whole number of uint64"):
        wire.decode(raw, (15, 12, 8))
    with pytest.raises(ProtocolError, match="not a whole number of float32"):
        wire.decode(raw, (16, 10, 8))
    with pytest.raises(ProtocolError, match="12 bytes of lengths for 2 keys"):
        wire.decode(raw, (16, 12, 12))
    with pytest.raises(ProtocolError, match="2 payloads with flags"):
        wire.decode(raw, (16, 12))
    plain = wire.encode(Kind.KV_REQUEST, flags=wire.PUSH, dtype=wire.DTYPE_CODES["float32"])
    with pytest.raises(ProtocolError, match="3 values do not divide among 2 keys"):
        wire.decode(plain, (16, 12))
    with pytest.raises(ProtocolError, match="KV_REQUEST carries no keys"):
        wire.decode(plain, ())


@pytest.mark.parametrize("raw,message", [
    (b"PK", "shorter than"),
    (b"XX" + wire.encode(Kind.HEARTBEAT)[2:], "not a pslite message"),
    (wire.encode(Kind.HEARTBEAT)[:2] + b"\x07" + wire.encode(Kind.HEARTBEAT)[3:], "version 7"),
    (wire.encode(Kind.HEARTBEAT)[:3] + b"\x63" + wire.encode(Kind.HEARTBEAT)[4:], "unknown pslite message kind 99"),
    (wire.encode(Kind.KV_RESPONSE, dtype=200), "unknown dtype code 200"),
    (wire.encode(Kind.KV_RESPONSE, flags=0x40), "unknown flags"),
    (wire.encode(Kind.REGISTER, tail=b"\xc1"), "not valid msgpack"),
    (wire.encode_fields(Kind.REGISTER, {"role": "king"}), "role 'king' must be worker or server"),
    (wire.encode_fields(Kind.BARRIER, {"group": 9}), "'group' must be an int in \\[1, 7\\]"),
    (wire.encode(Kind.SIMPLE_REQUEST, tail=b"\xff\xfe"), "body is not UTF-8"),
])
def test_malformed_headers_are_refused_naming_the_fault(raw, message):
    with pytest.raises(ProtocolError, match=message):
        wire.decode(raw, ())


def test_ints_must_fit_ps_lite_32_bit_fields():
    assert wire.check_i32("cmd", np.int64(5)) == 5
    with pytest.raises(ProtocolError, match="head=4294967296 does not fit in 32 bits"):
        wire.check_i32("head", 1 << 32)
    with pytest.raises(ProtocolError, match="cmd must be an int"):
        wire.check_i32("cmd", True)


# -- the scheduler's decisions --------------------------------------------------------------------


def registration(role, port, rank=-1, nw=2, ns=1, mode="classic"):
    return {"role": role, "addr": f"tcp://127.0.0.1:{port}", "host": "h", "pid": port, "rank": rank,
            "nw": nw, "ns": ns, "mode": mode}


def state(nw=2, ns=1, mode="classic"):
    return SchedulerState(nw, ns, mode, "tcp://127.0.0.1:1", 1, "local")


def test_everyone_gets_the_table_once_the_last_node_registered_with_asked_ranks_honoured():
    s = state()
    assert s.register("w-a", registration("worker", 10), 0.0) == []
    assert s.register("w-b", registration("worker", 11, rank=0), 0.0) == []
    outs = s.register("s-a", registration("server", 12), 0.0)
    assert sorted(o.target for o in outs) == [1, 8, 9, 11]
    table = outs[0].fields["nodes"]
    assert [row[:3] for row in table] == [[1, "scheduler", 0], [8, "server", 0], [9, "worker", 0], [11, "worker", 1]]
    assert s.members[9].origin == "w-b" and s.members[11].origin == "w-a"  # w-b asked for rank 0


@pytest.mark.parametrize("fields,message", [
    (registration("worker", 13, nw=3), "DMLC_NUM_WORKER=3 DMLC_NUM_SERVER=1, but the scheduler has DMLC_NUM_WORKER=2"),
    (registration("worker", 13, mode="service"), "PSLINK_PSLITE_MODE=service, but the scheduler in classic"),
    (registration("worker", 13, rank=5), "asks for rank 5 \\(PSLINK_PSLITE_RANK\\), but there are only 2"),
    (registration("worker", 13, rank=0), "rank 0 \\(PSLINK_PSLITE_RANK\\), which another worker already has"),
    (registration("server", 13), "one server too many: DMLC_NUM_SERVER=1"),
])
def test_registrations_that_do_not_fit_are_refused_naming_why(fields, message):
    s = state()
    s.register("w-a", registration("worker", 10, rank=0), 0.0)
    s.register("s-a", registration("server", 12), 0.0)
    outs = s.register("x", fields, 0.0)
    assert len(outs) == 1 and outs[0].kind == "REFUSED" and outs[0].target == "x"
    assert outs[0].fields["msg"].count("pid 13") == 1
    assert __import__("re").search(message, outs[0].fields["msg"])


def test_service_mode_refuses_server_processes():
    s = state(mode="service")
    outs = s.register("s", registration("server", 12, mode="service"), 0.0)
    assert outs[0].kind == "REFUSED" and "no server process may register" in outs[0].fields["msg"]


def complete(s):
    s.register("w-a", registration("worker", 10), 0.0)
    s.register("w-b", registration("worker", 11), 0.0)
    s.register("s-a", registration("server", 12), 0.0)


def test_a_barrier_completes_when_every_member_of_its_group_voted():
    s = state()
    complete(s)
    assert s.barrier("w-a", 4, 0, False) == []
    assert s.barrier("w-a", 4, 0, False) == []  # a second vote waits for a second round
    first = s.barrier("w-b", 4, 0, False)
    assert sorted(o.target for o in first) == [9, 11] and all(o.kind == "RELEASE" for o in first)
    second = s.barrier("w-b", 4, 0, False)
    assert sorted(o.target for o in second) == [9, 11]
    assert s.barrier("w-a", 4, 1, False) == []  # another customer id is another barrier
    refused = s.barrier("s-a", 4, 0, False)
    assert refused[0].kind == "REFUSED" and "not in barrier group 4" in refused[0].fields["msg"]


def test_finalize_waits_for_everyone_but_not_for_nodes_that_left_without_a_barrier():
    s = state()
    complete(s)
    assert s.leave("w-b") == []
    assert s.barrier("local", 7, -1, True) == []
    assert s.barrier("s-a", 7, -1, True) == []
    outs = s.barrier("w-a", 7, -1, True)
    assert sorted(o.target for o in outs) == [1, 8, 9] and all(o.flags == wire.FINAL for o in outs)
    assert s.lost("w-b", "closed") == [] and s.lost("w-a", "closed") == []  # expected goodbyes


def test_a_node_lost_before_finalize_fails_the_others_naming_it():
    s = state()
    complete(s)
    outs = s.lost("w-b", "connection reset")
    assert sorted(o.target for o in outs) == [1, 8, 9]
    assert all(o.kind == "NODE_FAILED" for o in outs)
    assert "worker 1 (node id 11, pid 11, tcp://127.0.0.1:11) went away before finalize: connection reset" in \
        outs[0].fields["msg"]


def test_a_node_lost_before_the_table_was_complete_voids_the_start():
    s = state()
    s.register("w-a", registration("worker", 10), 0.0)
    s.register("s-a", registration("server", 12), 0.0)
    outs = s.lost("w-a", "closed")
    assert [o.target for o in outs] == ["s-a", 1]
    assert "went away before every node registered" in outs[0].fields["msg"]
    late = s.register("w-c", registration("worker", 14), 0.0)
    assert late[0].kind == "REFUSED"


def test_silent_nodes_fail_after_the_heartbeat_timeout():
    s = state()
    complete(s)
    s.heard("w-a", 50.0)
    s.heard("s-a", 50.0)
    s.heard("w-b", 30.0)
    outs = s.expired(55.0, timeout=20.0)
    assert sorted(o.target for o in outs) == [1, 8, 9]
    assert "worker 1" in outs[0].fields["msg"] and "PS_HEARTBEAT_TIMEOUT=20" in outs[0].fields["msg"]


# -- keys, values, slicing -------------------------------------------------------------------------


def test_keys_are_checked_unique_and_ascending_with_the_offending_index():
    assert check_keys([1, 2, K_MAX_KEY - 1], "push").tolist() == [1, 2, K_MAX_KEY - 1]
    assert check_keys(np.array([3], np.int32), "push").dtype == np.uint64
    with pytest.raises(ConfigError, match=r"keys\[2\]=2 follows keys\[1\]=5"):
        check_keys([1, 5, 2], "push")
    with pytest.raises(ConfigError, match=r"keys\[1\]=4 repeats"):
        check_keys([4, 4], "pull")
    with pytest.raises(ConfigError, match="key -1 is negative"):
        check_keys([-1, 3], "push")
    with pytest.raises(ConfigError, match="got float64 values"):
        check_keys(np.array([1.5]), "push")
    with pytest.raises(ConfigError, match=r"keys\[1\] is 18446744073709551616"):
        check_keys([1, 1 << 64], "push")


def test_value_dtypes_are_the_ones_pslink_carries():
    assert value_dtype("float32") == np.dtype("<f4")
    with pytest.raises(ConfigError, match="cannot be carried"):
        value_dtype(np.complex64)


def test_the_default_slicer_cuts_by_server_key_ranges():
    ranges = [Range(K_MAX_KEY // 2 * i, K_MAX_KEY // 2 * (i + 1)) for i in range(2)]
    keys = np.array([1, 5, K_MAX_KEY // 2, K_MAX_KEY - 5], np.uint64)
    vals = np.arange(8, dtype=np.float32)
    sliced = default_slicer(KVPairs(keys, vals), ranges)
    assert [s[0] for s in sliced] == [True, True]
    assert sliced[0][1].keys.tolist() == [1, 5] and sliced[0][1].vals.tolist() == [0, 1, 2, 3]
    assert sliced[1][1].vals.tolist() == [4, 5, 6, 7]
    lens = np.array([1, 3, 2, 2], np.int32)
    sliced = default_slicer(KVPairs(keys, vals, lens), ranges)
    assert sliced[0][1].vals.tolist() == [0, 1, 2, 3] and sliced[1][1].lens.tolist() == [2, 2]
    only_low = default_slicer(KVPairs(keys[:2], vals[:4]), ranges)
    assert [s[0] for s in only_low] == [True, False]
    with pytest.raises(ConfigError, match="beyond the last server's key range"):
        default_slicer(KVPairs(np.array([K_MAX_KEY - 1], np.uint64), vals[:1]), ranges)


def test_a_pull_answered_with_other_keys_than_asked_is_refused_naming_the_server():
    """KVWorker checks each server's answer against the keys it asked that server for (one
    slice or several), before anything lands in the caller's buffer."""
    from types import SimpleNamespace

    from pslink.pslite.kv_worker import KVWorker, _KVRequest, _Slice

    worker = SimpleNamespace(app_id=0, customer_id=0, dtype=np.dtype(np.float32))

    def answered(*slices) -> None:
        request = _KVRequest(7, None, "pull", worker, np.array([3, 5, 9], wire.KEY_DTYPE), True,
                             np.zeros(3, np.float32), None)
        for target, start, keys in slices:
            sl = request.slices[target] = _Slice(target, start, len(keys))
            sl.keys, sl.vals = np.array(keys, wire.KEY_DTYPE), np.arange(len(keys), dtype=np.float32) + start
        KVWorker._assemble(worker, request)
        return request.vals_out

    assert list(answered((8, 0, [3, 5, 9]))) == [0, 1, 2]
    assert list(answered((10, 1, [5, 9]), (8, 0, [3]))) == [0, 1, 2]
    with pytest.raises(ProtocolError, match="server node 8 answered 3 key.*other keys"):
        answered((8, 0, [3, 5, 8]))
    with pytest.raises(ProtocolError, match="server node 10 answered"):
        answered((8, 0, [3]), (10, 1, [5, 7]))
