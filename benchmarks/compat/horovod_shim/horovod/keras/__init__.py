"""``horovod.keras``: pslink.tf.keras (Keras 3 is TensorFlow's)."""

from pslink.tf.keras import *  # noqa: F401,F403
from pslink.tf.keras import __all__, callbacks  # noqa: F401
