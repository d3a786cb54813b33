"""``python -m pslink.core.aggregator``: an Aggregator's process, as the local provider and
``pslink aggregator`` start it (its command line; the process itself is
:class:`~pslink.core.aggregator.process.Aggregator`)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

from pslink.core.config import aggregator_spin
from pslink.core import hosts
from pslink.core.credential_files import credential_for
from pslink.core.credentials import AGGREGATOR
from pslink.core.aggregator import process
from pslink.core.aggregator.process import Aggregator
from pslink.core.memory import keep_freed_memory
from pslink.errors import PslinkError

log = logging.getLogger("pslink.core.aggregator.process")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pslink.core.aggregator", description=process.__doc__.split("\n")[0])
    parser.add_argument("--master", required=True, help="pMaster address, e.g. tcp://127.0.0.1:7770, or every "
                        "pMaster's as a comma list (a leader and its standbys)")
    parser.add_argument("--listen", default="tcp://127.0.0.1:0", help="data address to bind (port 0: any)")
    parser.add_argument("--advertise", default=None,
                        help=f"address peers dial (default ${hosts.ENV_ADVERTISE}, else the bound address, else the "
                        "local address that routes to pMaster)")
    parser.add_argument("--interface", default=None,
                        help=f"advertise this network interface's address (default ${hosts.ENV_INTERFACE})")
    parser.add_argument("--name", default=None, help="stable name (pMaster assigns one if omitted)")
    parser.add_argument("--orphan-timeout", type=float, default=60.0, help="exit after this long without pMaster")
    parser.add_argument("--log-level", default=os.environ.get("PSLINK_LOG_LEVEL", "WARNING"))
    parser.add_argument("--credentials", default=None,
                        help="file with the service's aggregator (or operator) credential (default $PSLINK_CREDENTIALS, "
                        "$PSLINK_AGGREGATOR_CREDENTIAL, or the file `pslink service up` wrote on this host)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format=f"%(asctime)s aggregator {args.name or ''} %(levelname)s %(message)s")
    keep_freed_memory()  # this process is the Aggregator's own
    try:
        credential = credential_for(args.master, AGGREGATOR, args.credentials)
        aggregator = Aggregator(args.master, args.listen, name=args.name, orphan_timeout=args.orphan_timeout,
                                advertise=args.advertise, interface=args.interface, credential=credential,
                                spin=aggregator_spin())
    except PslinkError as exc:
        log.error("aggregator %s cannot start: %s", args.name or "", exc.message)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: aggregator.reactor.stop())
    signal.signal(signal.SIGINT, lambda *_: aggregator.reactor.stop())
    try:
        aggregator.serve_forever()
    finally:
        aggregator.core.summer.close()
    return aggregator.exit_code or 0


if __name__ == "__main__":
    sys.exit(main())
