"""``horovod.tensorflow``: pslink.tf."""

try:  # MXNet, if installed, must load before TensorFlow in one process
    import mxnet  # noqa: F401
except ImportError:
    pass
from pslink.tf import *  # noqa: F401,F403
from pslink.tf import __all__  # noqa: F401
