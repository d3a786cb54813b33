"""The cost model: its formula, its file, and the calibration that measures it on the Aggregator core."""

from __future__ import annotations

import json

import pytest

from pslink.errors import ConfigError
from pslink.sim.calibrate import SMALL_BYTES, fit, measure
from pslink.sim.costmodel import CostModel, load_cost_model, save_cost_model

MODEL = CostModel(per_message=1e-5, per_byte_worker={"sum": 3e-10, "sgd": 2e-10, "adam": 2e-10},
                  per_byte_round={"sum": -1e-10, "sgd": 2e-10, "adam": 1e-9})


def test_a_round_costs_per_message_per_worker_and_per_byte():
    # 8 workers, 4 MiB, SGD: 8 messages + 4 MiB x (8 x 2e-10 + 2e-10)
    assert MODEL.task_cost(4 << 20, 8, "sgd") == pytest.approx(8e-5 + (4 << 20) * 1.8e-9)
    assert MODEL.task_cost(1000, 1, "sum") == pytest.approx(1e-5 + 1000 * 2e-10)
    with pytest.raises(ConfigError, match="no optimizer 'lamb'"):
        MODEL.task_cost(1, 1, "lamb")


def test_the_file_round_trips_and_bad_files_are_named(tmp_path):
    path = tmp_path / "m.json"
    save_cost_model(MODEL, path)
    assert load_cost_model(path) == MODEL
    with pytest.raises(ConfigError, match="not found"):
        load_cost_model(tmp_path / "none.json")
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="is not valid JSON"):
        load_cost_model(path)
    data = MODEL.to_dict()
    del data["per_byte_worker"]["adam"]
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match="per_byte_worker lacks adam"):
        load_cost_model(path)
    path.write_text(json.dumps({**MODEL.to_dict(), "per_message": -1}))
    with pytest.raises(ConfigError, match="per_message must be a finite number >= 0"):
        load_cost_model(path)


def test_the_packaged_calibration_names_its_machine_and_is_plausible():
    model = load_cost_model()
    assert model.machine["cores"] >= 1 and model.machine["cpu"]
    assert len(model.measured["samples"]) == 24
    # receiving, adding and sending a byte costs well under a nanosecond per worker on any CPU
    for name in ("sum", "sgd", "adam"):
        assert 1e-11 < model.per_byte_worker[name] < 5e-9
    assert model.per_byte_round["adam"] > model.per_byte_round["sgd"]  # Adam does more per element


def test_the_fit_recovers_the_coefficients_it_was_given():
    samples = [{"optimizer": o, "workers": w, "bytes": size, "seconds": MODEL.task_cost(size, w, o)}
               for o in ("sum", "sgd", "adam") for w in (1, 2, 4, 8) for size in (4 << 20, SMALL_BYTES)]
    per_message, per_worker, per_round = fit(samples)
    assert per_message == pytest.approx(MODEL.per_message)
    for name in ("sum", "sgd", "adam"):
        assert per_worker[name] == pytest.approx(MODEL.per_byte_worker[name])
        assert per_round[name] == pytest.approx(MODEL.per_byte_round[name])


def test_measuring_the_real_aggregator_core_costs_more_with_more_workers():
    one = measure(1 << 20, 1, "sum", rounds=3)
    eight = measure(1 << 20, 8, "sum", rounds=3)
    assert 0 < one < eight  # seven more pushes to receive and add, seven more replies to send
    assert measure(1 << 20, 2, "adam", rounds=3) > 0


def test_the_calibrate_command_on_tiny_sizes_writes_a_model_the_simulator_then_reads(tmp_path):
    from typer.testing import CliRunner

    from pslink.cli import app

    path = tmp_path / "tiny.json"
    result = CliRunner().invoke(app, ["simulate", "calibrate", "--out", str(path), "--bytes", "65536",
                                      "--small-bytes", "1024", "--workers", "1,2", "--rounds", "3", "--passes", "1"])
    assert result.exit_code == 0, result.output
    model = load_cost_model(path)
    samples = model.measured["samples"]
    # 3 optimizers x 2 worker counts x 2 sizes, each a real median of thread CPU time
    assert sorted({(s["workers"], s["bytes"]) for s in samples}) == [(1, 1024), (1, 65536), (2, 1024), (2, 65536)]
    assert len(samples) == 12 and all(s["seconds"] > 0 for s in samples)
    assert model.per_message > 0 and model.machine["cores"] >= 1
    assert model.task_cost(65536, 2, "adam") > model.task_cost(65536, 1, "adam")
    # the simulator takes it instead of the packaged one
    trace = tmp_path / "t.csv"
    trace.write_text("jobid,submit_time,num_gpus,duration_s\na,0,2,600\nb,60,4,600\n")
    out = tmp_path / "sim"
    ran = CliRunner().invoke(app, ["simulate", "--trace", str(trace), "--cost-model", str(path), "--no-plots",
                                   "--out", str(out)])
    assert ran.exit_code == 0, ran.output
    report = json.loads((out / "summary.json").read_text())
    assert report["cost_model"]["file"] == str(path)
    assert report["cost_model"]["per_message"] == model.per_message and report["results"]["jobs"] == 2


@pytest.mark.parametrize("args, message", [
    (["--workers", "4"], "at least two numbers of workers"),
    (["--workers", "1,x"], "not a comma-separated list"),
    (["--bytes", "4096", "--small-bytes", "4096"], "below the large one"),
    (["--bytes", "4098"], "multiples of 4 bytes"),
])
def test_the_calibrate_command_refuses_sizes_and_workers_it_cannot_fit(tmp_path, args, message):
    from typer.testing import CliRunner

    from pslink.cli import app

    result = CliRunner().invoke(app, ["simulate", "calibrate", "--out", str(tmp_path / "m.json"), *args])
    assert result.exit_code == 1 and message in " ".join(result.output.split())
    assert not (tmp_path / "m.json").exists()
