"""``horovod.common.util.is_version_greater_equal_than``, which Horovod's Keras tests import."""

from packaging import version


def is_version_greater_equal_than(ver, target):
    if not isinstance(ver, str) or not isinstance(target, str):
        raise ValueError(f"This function only accepts string arguments, got {ver!r} and {target!r}")
    return version.parse(ver) >= version.parse(target)
