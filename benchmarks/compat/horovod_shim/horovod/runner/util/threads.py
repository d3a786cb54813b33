"""``horovod.runner.util.threads.in_thread``, which Horovod's ``test/utils/common.py`` imports:
start ``target(*args)`` on a thread (its exceptions swallowed when ``silent``)."""

import threading


def in_thread(target, args=(), name=None, daemon=True, silent=False):
    if not isinstance(args, tuple):
        raise ValueError(f"args must be a tuple, not {type(args)}, for a single argument use (arg,)")

    def run(*values):
        try:
            target(*values)
        except Exception:
            if not silent:
                raise

    thread = threading.Thread(target=run, args=args, name=name, daemon=daemon)
    thread.start()
    return thread
