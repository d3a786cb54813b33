"""``horovod.torch``: pslink.torch."""

from pslink.torch import *  # noqa: F401,F403
from pslink.torch import __all__  # noqa: F401
