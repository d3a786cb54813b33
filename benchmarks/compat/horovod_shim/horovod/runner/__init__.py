"""``horovod.runner``: only what Horovod's test utilities import from it (``test/utils/common.py``)."""
