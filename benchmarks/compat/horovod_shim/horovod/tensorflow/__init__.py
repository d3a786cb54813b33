"""``horovod.tensorflow``: pslink.tf."""

import sys

if "tensorflow" not in sys.modules:  # MXNet, if installed, must load before TensorFlow in one process
    try:
        import mxnet  # noqa: F401
    except ImportError:
        pass
from pslink.tf import *  # noqa: F401,F403
from pslink.tf import __all__  # noqa: F401
from horovod.tensorflow.util import _executing_eagerly  # noqa: E402,F401  (the tests call hvd._executing_eagerly)
