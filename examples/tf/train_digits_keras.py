"""Train a small Keras MLP on scikit-learn's digits with model.fit under ParameterServiceStrategy.

    pslink launch -n 2 python examples/tf/train_digits_keras.py

``pslink launch`` starts a parameter service and two workers (or pass ``--service ADDR`` for a
running one). Each worker fits on its own shard of the training set (rows rank, rank + N, ...);
the strategy sums every step's gradients through the service, so both workers hold the same model
throughout, as if one process had trained on their combined batches. Keras prints its progress
per worker (prefixed ``[rankN]:`` by pslink launch); MetricAverageCallback makes the printed
epoch figures the mean over the workers. The data set ships with scikit-learn (no download).
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow's start-up chatter


def parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32, help="per worker")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--verbose", type=int, default=2, choices=(0, 1, 2),
                        help="Keras' verbosity: 2 prints a line per epoch (1, the progress bar, redraws "
                             "its line, which suits a terminal more than pslink launch's prefixed output)")
    return parser.parse_args(argv)


def load(rank: int, workers: int):
    import numpy as np
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.25, random_state=0, stratify=y)
    shard = slice(rank, None, workers)
    return (x_train[shard], y_train[shard]), (x_test[shard], y_test[shard]), (x_test, y_test)


def main(argv=None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    import keras
    import numpy as np

    import pslink.tf
    from pslink.tf.keras.callbacks import MetricAverageCallback

    strategy = pslink.tf.ParameterServiceStrategy()  # PSLINK_* from pslink launch
    rank, workers = strategy.rank, strategy.num_workers
    (x, y), validation, (x_test, y_test) = load(rank, workers)
    print(f"worker {rank} of {workers}: {len(x)} training samples, "
          f"{strategy.num_replicas_in_sync} replicas in sync", flush=True)

    with strategy.scope():
        model = keras.Sequential([
            keras.Input((64,)),
            keras.layers.Dense(args.hidden, activation="relu"),
            keras.layers.Dense(10),
        ])
        model.compile(
            optimizer=keras.optimizers.SGD(args.lr, momentum=0.9),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    model.fit(x, y, batch_size=args.batch_size, epochs=args.epochs, validation_data=validation,
              callbacks=[MetricAverageCallback()], verbose=args.verbose)

    accuracy = float(np.mean(np.argmax(model.predict(x_test, verbose=0), axis=1) == y_test))
    print(f"worker {rank}: test accuracy {accuracy:.3f} on all {len(y_test)} test samples", flush=True)
    pslink.tf.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
