"""Port of ps-lite's tests/test_simple_app.cc: the scheduler sends 100 requests to every node.

Every node (scheduler, servers, workers) runs this program; the scheduler's requests go to the
whole group (itself included), every node's handle checks and answers them, and each node counts
exactly 100 at the end::

    pslink launch --pslite -s 2 -n 2 python examples/pslite/simple_app.py
"""

import sys

from pslink import pslite as ps

N = 100
handled = 0


def req_handle(req: ps.SimpleData, app: ps.SimpleApp) -> None:
    global handled
    if (req.head, req.body) != (1, "test"):
        raise ValueError(f"unexpected request {req!r}")
    app.response(req)
    handled += 1


def main() -> int:
    app = ps.SimpleApp(0)
    app.set_request_handle(req_handle)
    ps.start()
    if ps.is_scheduler():
        everyone = ps.kScheduler + ps.kServerGroup + ps.kWorkerGroup
        timestamps = [app.request(1, "test", everyone) for _ in range(N)]
        for ts in timestamps:
            app.wait(ts)
    ps.finalize()
    print(f"handled {handled} requests")
    return 0 if handled == N else 1


if __name__ == "__main__":
    sys.exit(main())
