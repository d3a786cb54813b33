"""The four models of the simulated workload: their tensors and how long one iteration takes.

Tensor shapes are the published architectures, written out layer by layer (no framework is
imported), and they reproduce the figures of ``../shared/data/README.md``: AlexNet 61.1 M
parameters in 16 tensors, VGG19 143.7 M in 38, ResNet-50 25.6 M in 161 (18 over 1 MiB) and
BERT-base 109.5 M in 199 (75 over 1 MiB); :mod:`tests.sim.test_models` checks every figure.

Iteration durations are one GPU's forward-backward time at the batch size a user of a 16 GB
P100 (Philly's GPUs) would pick, with the gradient exchange overlapped with compute (what a
parameter server that keeps up gives). Sources, for the three CNNs: TensorFlow's published
tf_cnn_benchmarks results on an NVIDIA DGX-1 (Tesla P100, synthetic data, May 2017), one GPU:
ResNet-50 219 images/s at batch 64, AlexNet 2,987 images/s at batch 512, VGG16 154 images/s at
batch 64. VGG19 is not in that table: VGG16's rate scaled by their forward FLOPs (15.5 G against
19.6 G per image) gives 122 images/s. BERT-base has no P100 figure we can cite: 6 x 86 M
non-embedding parameters x 128 tokens = 66 GFLOP per sequence, at the ~4 TFLOP/s a P100 sustains
on large GEMMs, is about 60 sequences/s, so 0.55 s for a batch of 32 sequences of 128 tokens.
docs/simulator.md discusses how the results move with these figures.
"""

from __future__ import annotations

import dataclasses
import functools
import math

from pslink.core.partition import DEFAULT_PARTITION_BYTES, partition_spans

FLOAT32 = 4


@dataclasses.dataclass(frozen=True)
class Model:
    """A model as the parameter service sees it: fp32 tensors, an optimizer, an iteration."""

    name: str
    tensors: tuple[int, ...]  # element counts, in declaration order
    iteration: float  # seconds per iteration on one GPU, alone
    batch: int
    optimizer: str  # the optimizer its servers run: "sgd" (momentum) or "adam"
    source: str

    @property
    def params(self) -> int:
        return sum(self.tensors)

    @property
    def nbytes(self) -> int:
        return self.params * FLOAT32

    def parts(self, partition_bytes: int = DEFAULT_PARTITION_BYTES) -> tuple[tuple[int, int, int], ...]:
        """Model aggregation tasks: (key, part, bytes), split as the Agents split tensors."""
        return _parts(self.tensors, partition_bytes)


@functools.lru_cache(maxsize=None)
def _parts(tensors: tuple[int, ...], partition_bytes: int) -> tuple[tuple[int, int, int], ...]:
    out = []
    for key, numel in enumerate(tensors):
        for part, (start, stop) in enumerate(partition_spans(numel, FLOAT32, partition_bytes)):
            out.append((key, part, (stop - start) * FLOAT32))
    return tuple(out)


def _conv(cin: int, cout: int, k: int, bias: bool = True) -> list[int]:
    return [cout * cin * k * k] + ([cout] if bias else [])


def _dense(nin: int, nout: int) -> list[int]:
    return [nout * nin, nout]


def alexnet_tensors() -> tuple[int, ...]:
    """torchvision's AlexNet (the one-GPU variant of Krizhevsky et al.)."""
    t = _conv(3, 64, 11) + _conv(64, 192, 5) + _conv(192, 384, 3) + _conv(384, 256, 3) + _conv(256, 256, 3)
    return tuple(t + _dense(256 * 6 * 6, 4096) + _dense(4096, 4096) + _dense(4096, 1000))


def vgg19_tensors() -> tuple[int, ...]:
    """VGG19 (configuration E of Simonyan and Zisserman), no batch norm."""
    widths = [64, 64, 128, 128, 256, 256, 256, 256, 512, 512, 512, 512, 512, 512, 512, 512]
    t: list[int] = []
    cin = 3
    for cout in widths:
        t += _conv(cin, cout, 3)
        cin = cout
    return tuple(t + _dense(512 * 7 * 7, 4096) + _dense(4096, 4096) + _dense(4096, 1000))


def resnet50_tensors() -> tuple[int, ...]:
    """ResNet-50 v1.5 (He et al., torchvision layout): bias-free convolutions, each followed by a
    batch norm with a weight and a bias (its running statistics are not trained)."""

    def conv_bn(cin: int, cout: int, k: int) -> list[int]:
        return _conv(cin, cout, k, bias=False) + [cout, cout]

    t = conv_bn(3, 64, 7)
    cin = 64
    for width, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for block in range(blocks):
            t += conv_bn(cin, width, 1) + conv_bn(width, width, 3) + conv_bn(width, width * 4, 1)
            if block == 0:
                t += conv_bn(cin, width * 4, 1)  # the projection shortcut
            cin = width * 4
    return tuple(t + _dense(2048, 1000))


def bert_base_tensors() -> tuple[int, ...]:
    """BERT-base, uncased (Devlin et al.): embeddings, 12 encoder layers, the pooler."""
    hidden, ffn, vocab = 768, 3072, 30522
    t = [vocab * hidden, 512 * hidden, 2 * hidden, hidden, hidden]  # word, position, type, LayerNorm
    for _ in range(12):
        t += _dense(hidden, hidden) * 3  # query, key, value
        t += _dense(hidden, hidden) + [hidden, hidden]  # attention output, LayerNorm
        t += _dense(hidden, ffn) + _dense(ffn, hidden) + [hidden, hidden]  # feed-forward, LayerNorm
    return tuple(t + _dense(hidden, hidden))


_TF_BENCH = "tf_cnn_benchmarks, DGX-1 P100, 1 GPU, synthetic data (TensorFlow performance guide, May 2017)"

MODELS: dict[str, Model] = {
    m.name: m
    for m in (
        Model("alexnet", alexnet_tensors(), iteration=512 / 2987, batch=512, optimizer="sgd",
              source=f"{_TF_BENCH}: 2,987 images/s at batch 512"),
        Model("vgg19", vgg19_tensors(), iteration=64 / (154 * 15.5 / 19.6), batch=64, optimizer="sgd",
              source=f"{_TF_BENCH}: VGG16 154 images/s at batch 64, scaled by forward FLOPs 15.5 G / 19.6 G"),
        Model("resnet50", resnet50_tensors(), iteration=64 / 219, batch=64, optimizer="sgd",
              source=f"{_TF_BENCH}: 219 images/s at batch 64"),
        Model("bert-base", bert_base_tensors(), iteration=0.55, batch=32, optimizer="adam",
              source="estimate: 6 x 86 M non-embedding parameters x 128 tokens at ~4 TFLOP/s on a P100, "
                     "batch 32 of 128 tokens"),
    )
}


def parse_mix(text: str) -> dict[str, float]:
    """``"alexnet=1,vgg19=1,resnet50=2"`` -> normalised weights; names must be in :data:`MODELS`."""
    weights: dict[str, float] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        name, _, value = item.partition("=")
        name = name.strip()
        if name not in MODELS:
            raise ValueError(f"unknown model {name!r} in the mix; known: {', '.join(MODELS)}")
        try:
            weight = float(value) if value else 1.0
        except ValueError:
            raise ValueError(f"model {name!r}: weight {value!r} is not a number") from None
        if not math.isfinite(weight) or weight < 0:
            raise ValueError(f"model {name!r}: weight must be a finite number >= 0, got {value!r}")
        weights[name] = weights.get(name, 0.0) + weight
    total = sum(weights.values())
    if total <= 0:
        raise ValueError(f"the model mix {text!r} has no positive weight")
    return {name: w / total for name, w in weights.items() if w > 0}


DEFAULT_MIX = "alexnet=1,vgg19=1,resnet50=1,bert-base=1"
