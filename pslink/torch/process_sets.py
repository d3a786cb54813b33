"""Horovod's process sets for ``pslink.torch`` (:mod:`pslink.core.worker.process_sets`, shared with
``pslink.mxnet.horovod``): this adapter's ProcessSet, its ``global_process_set``, and the
ProcessSets a torch Session keeps."""

from __future__ import annotations

from pslink.core.worker import process_sets


class ProcessSet(process_sets.ProcessSet):
    __doc__ = process_sets.ProcessSet.__doc__

    @staticmethod
    def current():
        from pslink.torch.horovod import current_session

        return current_session()


global_process_set = ProcessSet()


def ProcessSets() -> process_sets.ProcessSets:
    from pslink.torch.session import Session

    return process_sets.ProcessSets(ProcessSet, Session)
