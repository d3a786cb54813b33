"""``horovod.mxnet``: pslink.mxnet.horovod."""

from pslink.mxnet.horovod import *  # noqa: F401,F403
from pslink.mxnet.horovod import __all__  # noqa: F401
