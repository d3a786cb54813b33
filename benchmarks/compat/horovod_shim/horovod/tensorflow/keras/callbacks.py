"""``horovod.tensorflow.keras.callbacks``: pslink.tf.keras.callbacks."""

from pslink.tf.keras.callbacks import *  # noqa: F401,F403
from pslink.tf.keras.callbacks import __all__  # noqa: F401
