"""``horovod.tensorflow.util._executing_eagerly``, a helper Horovod's TensorFlow tests import."""

import tensorflow as tf


def _executing_eagerly():
    return tf.executing_eagerly()
