"""The cost model: its formula, its file, and the calibration that measures it on the Aggregator core."""

from __future__ import annotations

import json

import pytest

from pslink.errors import ConfigError
import numpy as np

from pslink.sim.calibrate import SMALL_BYTES, fit, held_out_errors, measure, nonnegative_least_squares
from pslink.sim.costmodel import CostModel, load_cost_model, save_cost_model

MODEL = CostModel(per_message=1e-5, per_byte_worker={"sum": 3e-10, "sgd": 2e-10, "adam": 2e-10},
                  per_byte_round={"sum": 0.0, "sgd": 2e-10, "adam": 1e-9})


def test_a_round_costs_per_message_per_worker_and_per_byte():
    # 8 workers, 4 MiB, SGD: 8 messages + 4 MiB x (8 x 2e-10 + 2e-10)
    assert MODEL.task_cost(4 << 20, 8, "sgd") == pytest.approx(8e-5 + (4 << 20) * 1.8e-9)
    assert MODEL.task_cost(1000, 1, "sum") == pytest.approx(1e-5 + 1000 * 3e-10)
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
    path.write_text(json.dumps({**MODEL.to_dict(), "per_byte_round": {**MODEL.per_byte_round, "sum": -1e-10}}))
    with pytest.raises(ConfigError, match=r"per_byte_round must be >= 0, got \{'sum': -1e-10\}.*calibrate"):
        load_cost_model(path)


def test_the_fit_never_predicts_a_negative_cost():
    # The packaged measurements, fitted without the constraint, gave sum -1.78e-10 s per byte per
    # round; and noisy measurements of any machine can do the same.
    packaged = load_cost_model().measured["samples"]
    rng = np.random.default_rng(0)
    for trial in range(40):
        samples = [dict(s, seconds=s["seconds"] * float(rng.lognormal(0, 0.5))) for s in packaged] if trial else packaged
        per_message, per_worker, per_round = fit(samples)
        assert per_message >= 0 and min(per_worker.values()) >= 0 and min(per_round.values()) >= 0, trial
        model = CostModel(per_message, per_worker, per_round)  # its own check refuses negative terms
        for name in ("sum", "sgd", "adam"):
            assert min(model.task_cost(b, w, name) for b in (1, 4096, 1 << 30) for w in (1, 64)) >= 0


def test_nonnegative_least_squares_is_exact_where_the_answer_is_known():
    a = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    assert nonnegative_least_squares(a, np.array([1.0, 2.0, 3.0])) == pytest.approx([1.0, 2.0])
    # the unconstrained optimum has x1 < 0: the constrained one puts it at 0 and refits x0
    assert np.linalg.lstsq(a, np.array([2.0, -1.0, 1.0]), rcond=None)[0][1] < 0
    assert nonnegative_least_squares(a, np.array([2.0, -1.0, 1.0])) == pytest.approx([1.5, 0.0])


def test_the_held_out_check_predicts_each_round_from_the_others():
    exact = [{"optimizer": o, "workers": w, "bytes": size, "seconds": MODEL.task_cost(size, w, o)}
             for o in ("sum", "sgd", "adam") for w in (1, 2, 4, 8) for size in (4 << 20, SMALL_BYTES)]
    errors = held_out_errors(exact)
    assert len(errors) == 24 and max(abs(e["error"]) for e in errors) < 1e-6
    off = [dict(s, seconds=s["seconds"] * 2) if (s["optimizer"], s["workers"], s["bytes"]) == ("sgd", 4, 4 << 20)
           else s for s in exact]
    # the fit of the 23 others does not know of the doubling: it predicts about half the round
    doubled = next(e for e in held_out_errors(off) if (e["optimizer"], e["workers"], e["bytes"]) == ("sgd", 4, 4 << 20))
    assert -0.6 < doubled["error"] < -0.3
    held = load_cost_model().measured["held_out"]  # the packaged model carries its check
    assert held["method"] == "leave-one-out" and held["all"]["points"] == 24


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
    assert model.measured["held_out"]["all"]["points"] == 12 and "held-out check" in result.output
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
