"""The four models reproduce the figures of the data README; tasks are split like the Agents split them."""

from __future__ import annotations

import pytest

from pslink.core.partition import DEFAULT_PARTITION_BYTES
from pslink.sim.models import MODELS, parse_mix

MiB = 1 << 20


@pytest.mark.parametrize("name, tensors, params_m, over_1mib, largest_mib", [
    ("alexnet", 16, 61.1, None, 144),
    ("vgg19", 38, 143.7, None, 392),
    ("resnet50", 161, 25.6, 18, 9),
    ("bert-base", 199, 109.5, 75, 89),
])
def test_models_match_the_data_readme(name, tensors, params_m, over_1mib, largest_mib):
    model = MODELS[name]
    assert len(model.tensors) == tensors
    assert round(model.params / 1e6, 1) == params_m
    assert int(max(model.tensors) * 4 / MiB) == largest_mib
    if over_1mib is not None:
        assert sum(1 for t in model.tensors if t * 4 > MiB) == over_1mib


def test_parts_cover_every_byte_in_partitions_of_at_most_4_mib():
    for model in MODELS.values():
        parts = model.parts()
        assert sum(size for _, _, size in parts) == model.nbytes
        assert max(size for _, _, size in parts) <= DEFAULT_PARTITION_BYTES
        assert len({(key, part) for key, part, _ in parts}) == len(parts)
    # VGG19's 392 MiB layer alone is 98 parts of 4 MiB
    assert sum(1 for key, _, _ in MODELS["vgg19"].parts() if key == 32) == 98


def test_iterations_are_the_cited_one_gpu_figures():
    assert MODELS["resnet50"].iteration == pytest.approx(64 / 219)
    assert MODELS["alexnet"].iteration == pytest.approx(512 / 2987)
    assert 0.4 < MODELS["vgg19"].iteration < 0.6 and MODELS["bert-base"].optimizer == "adam"


def test_a_mix_is_normalised_and_bad_mixes_are_named():
    assert parse_mix("alexnet=1, vgg19=3") == {"alexnet": 0.25, "vgg19": 0.75}
    assert parse_mix("resnet50") == {"resnet50": 1.0}
    with pytest.raises(ValueError, match="unknown model 'gpt'"):
        parse_mix("gpt=1")
    with pytest.raises(ValueError, match="weight 'x' is not a number"):
        parse_mix("vgg19=x")
    with pytest.raises(ValueError, match="no positive weight"):
        parse_mix("vgg19=0")
