"""The ``pslink`` command: run the service, look at it, try it, measure it."""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
from typing import Optional

import typer
from rich.console import Console
from rich.panel import Panel
from rich.table import Table

from pslink.core.config import DEFAULT_MASTER, ENV_MASTER
from pslink.errors import PslinkError
from pslink.status_view import render_status
from pslink.sim.cli import simulate_app

app = typer.Typer(help="pslink: a shared, elastic parameter service for training jobs.", no_args_is_help=True,
                  add_completion=False)
service_app = typer.Typer(help="Run and inspect the parameter service.", no_args_is_help=True)
job_app = typer.Typer(help="Manage jobs on a running service.", no_args_is_help=True)
bench_app = typer.Typer(help="Benchmarks.", no_args_is_help=True)
app.add_typer(service_app, name="service")
app.add_typer(job_app, name="job")
app.add_typer(bench_app, name="bench")
app.add_typer(simulate_app, name="simulate")
console = Console()
err_console = Console(stderr=True)

MasterOption = typer.Option(None, "--master", "-m", help=f"pMaster address, or every pMaster's as a comma list (a "
                            f"leader and its standbys: the one that answers is used; default ${ENV_MASTER} or "
                            f"{DEFAULT_MASTER})")


CredentialsOption = typer.Option(None, "--credentials", help="file with the service's operator credential (default "
                                 "$PSLINK_CREDENTIALS, else the file `pslink service up` wrote on this host)")


def _master(address: Optional[str]) -> str:
    return address or os.environ.get(ENV_MASTER) or DEFAULT_MASTER


def _client(master: Optional[str], timeout: float, credentials: Optional[str]):
    from pslink.core.service.client import ControlClient

    return ControlClient(_master(master), timeout=timeout, credentials_file=credentials)


TlsCertOption = typer.Option(None, "--tls-cert", help="PEM certificate for TLS on TCP (default $PSLINK_TLS_CERT)")
TlsKeyOption = typer.Option(None, "--tls-key", help="its PEM key (default $PSLINK_TLS_KEY)")
TlsCaOption = typer.Option(None, "--tls-ca", help="PEM CA that signs every peer's certificate (default $PSLINK_TLS_CA)")
CurveKeyOption = typer.Option(None, "--curve-key", help="the service's CURVE key file, for zmq+tcp:// (default "
                              "$PSLINK_CURVE_KEY; `pslink service curve-key PATH` makes one)")


def _tls_env(cert: Optional[str], key: Optional[str], ca: Optional[str], curve_key: Optional[str] = None) -> None:
    """TLS and CURVE flags become the environment this process's transports read and its children
    inherit."""
    from pslink.core.transport.curve import ENV_CURVE_KEY
    from pslink.core.transport.tls import ENV_CA, ENV_CERT, ENV_KEY

    for name, value in ((ENV_CERT, cert), (ENV_KEY, key), (ENV_CA, ca), (ENV_CURVE_KEY, curve_key)):
        if value:
            os.environ[name] = os.path.abspath(value)


def _state_dir(state: Optional[str]) -> Optional[str]:
    """--state checked at once: a directory this process can make and write in (a store's URL,
    redis://..., is checked by connecting to it)."""
    from pslink.core.master.store_redis import is_store_url

    if state is None or is_store_url(state):
        return state
    try:
        os.makedirs(state, mode=0o700, exist_ok=True)
        probe = os.path.join(state, f".probe-{os.getpid()}")
        open(probe, "w").close()
        os.remove(probe)
    except OSError as exc:
        _fail(PslinkError(f"--state {state}: cannot make or write that directory ({exc.strerror or exc})"))
    return state


def _shared_state(state: Optional[str], secret_file: Optional[str]) -> bool:
    """--state redis://...: pMasters on several hosts share it, so they must share the secret too."""
    from pslink.core.credential_files import ENV_SECRET_FILE
    from pslink.core.master.store_redis import is_store_url

    if not is_store_url(state):
        return False
    if not (secret_file or os.environ.get(ENV_SECRET_FILE)):
        _fail(PslinkError(f"--state {state} is shared by every pMaster of the service: give each the same "
                          f"--secret-file (or ${ENV_SECRET_FILE}), or Agents and Aggregators are refused by the "
                          "one that takes over"))
    return True


def _addresses(addresses: Optional[str]) -> list[str]:
    """--standbys checked at once (each entry a pMaster address), before anything starts."""
    from pslink.core.master_addresses import MasterAddresses

    if not addresses:
        return []
    try:
        return list(MasterAddresses.parse(addresses, "--standbys").addresses)
    except PslinkError as exc:
        _fail(exc)


def _lead_now(state: str, listen: str, advertise: Optional[str], interface: Optional[str], lease: float):
    """The lease of the state at ``state`` (a ServiceError names the pMaster that holds it): the
    terms and the state opened under them."""
    from pslink.core import hosts
    from pslink.core.service.standby import Terms

    terms = Terms(state, hosts.advertised_address(listen, advertise=advertise, interface=interface), ttl=lease)
    return terms, terms.lead_now()


def _pmaster_listen(transport: str, host: str, port: int) -> str:
    """Where pMaster listens, from --transport, --host and --port (a wrong transport refused by name)."""
    scheme = {"tcp": "tcp", "zmq": "zmq+tcp"}.get(transport)
    if scheme is None:
        _fail(PslinkError(f"unknown --transport {transport!r}: use tcp or zmq"))
    return f"{scheme}://{'[' + host + ']' if ':' in host else host}:{port}"


def _stop_on_signals() -> threading.Event:
    """Set by Ctrl-C or SIGTERM: the command stops what it started."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    return stop


def _fail(exc: Exception) -> None:
    err_console.print(f"[bold red]error:[/] {exc}")
    raise typer.Exit(1)


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
PROVIDERS = ("local", "ray")


def _logging(level: str) -> str:
    """--log-level checked before anything starts (logging's own error is a traceback)."""
    if level.upper() not in LOG_LEVELS:
        _fail(PslinkError(f"unknown --log-level {level!r}: choose {', '.join(LOG_LEVELS)} (any case)"))
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return level.upper()


@service_app.command("up")
def service_up(
    aggregators: int = typer.Option(2, "--aggregators", "-n", min=1, help="Aggregator processes to start"),
    host: str = typer.Option("127.0.0.1", help="address to listen on (0.0.0.0 for every interface); other hosts "
                             "reach the service only through an address that is not loopback"),
    port: int = typer.Option(7770, "--port", "-p", help="pMaster port (0: any free port)"),
    advertise: Optional[str] = typer.Option(None, help="address workers and Aggregators on other hosts dial "
                                            "(default $PSLINK_ADVERTISE, else --host, else this host's "
                                            "default-route address)"),
    interface: Optional[str] = typer.Option(None, help="advertise this network interface's address (default "
                                            "$PSLINK_INTERFACE)"),
    state: Optional[str] = typer.Option(None, "--state", help="durable state: a directory (SQLite; a restart resumes "
                                        "from it), or redis://HOST:PORT/N, off this host, shared with standbys "
                                        "(`pslink master --standby`)"),
    standbys: Optional[str] = typer.Option(None, "--standbys", help="addresses of the pMasters standing by for this "
                                           "one (comma list): given to its Aggregators and printed for workers"),
    lease: float = typer.Option(3.0, "--lease", min=0.5, help="with --state redis://: seconds the leader's lease "
                                "lasts unrenewed (a standby takes over within about this)"),
    transport: str = typer.Option("tcp", help="tcp (native, fastest) or zmq"),
    provider: str = typer.Option("local", help="local (subprocesses) or ray (Ray actors, any node)"),
    ray_address: Optional[str] = typer.Option(None, help="Ray cluster to join with --provider ray (e.g. auto)"),
    log_level: str = typer.Option("WARNING", help="log level of pMaster and the Aggregators"),
    secret_file: Optional[str] = typer.Option(None, help="the service secret (hex, mode 0600; default "
                                              "$PSLINK_SECRET_FILE, else STATE/secret, made if missing, else a new "
                                              "one in memory)"),
    allow_first_join: bool = typer.Option(False, help="let workers create a job by joining, without a token, from "
                                          "any host (always allowed from this host)"),
    job_max_mib: Optional[int] = typer.Option(None, min=1, help="default quota: MiB a job may hold (replicas "
                                              "counted); `job create --max-mib` sets one job's"),
    job_max_keys: Optional[int] = typer.Option(None, min=1, help="default quota: keys a job may hold"),
    metrics_port: int = typer.Option(0, min=0, help="port of the metrics endpoint and status page (0: any free "
                                     "port, printed)"),
    metrics_host: str = typer.Option("127.0.0.1", help="address the metrics endpoint and page listen on (read-only, "
                                     "no credentials: 0.0.0.0 shows the pool's status to the whole network)"),
    no_metrics: bool = typer.Option(False, "--no-metrics", help="serve no metrics endpoint or page"),
    stall_seconds: Optional[float] = typer.Option(None, min=0, help="a round waiting longer than this for some "
                                                  "rank is logged and listed as stalled (default "
                                                  "$PSLINK_STALL_SECONDS, else 10; 0: never)"),
    loss_limit: float = typer.Option(0.1, min=0.001, max=0.999, help="the slowdown a job accepts from sharing "
                                     "Aggregators unless it states its own (slo=)"),
    nic_gbit: Optional[float] = typer.Option(None, min=0.001, help="each Aggregator host's NIC, Gbit/s each way: "
                                             "placement keeps every NIC within it (default: not limited)"),
    copy_gbit: Optional[float] = typer.Option(None, min=0.001, help="Gbit/s a migration's copy is expected to "
                                              "cross at: when moves pay, and how much of a job one hand-over "
                                              "moves (what it copies while the job computes; default 8)"),
    tls_cert: Optional[str] = TlsCertOption,
    tls_key: Optional[str] = TlsKeyOption,
    tls_ca: Optional[str] = TlsCaOption,
    curve_key: Optional[str] = CurveKeyOption,
):
    """Run pMaster and an elastic Aggregator pool in the foreground (it never shrinks below
    --aggregators); Ctrl-C stops every process it started. Operators and Aggregators need the
    credentials it writes (docs/security.md)."""
    from pslink.core.faults import Faults
    from pslink.core.service import Service
    from pslink.core.credential_files import client_file_for, load_or_create_secret, write_client_file

    # Every flag checked before anything starts: a wrong one is an error naming it, never a service
    # started on the defaults.
    if provider not in PROVIDERS:
        _fail(PslinkError(f"unknown --provider {provider!r}: choose {' or '.join(PROVIDERS)}"))
    if ray_address is not None and provider != "ray":
        _fail(PslinkError(f"--ray-address {ray_address} joins a Ray cluster: it goes with --provider ray "
                          f"(this is --provider {provider})"))
    listen = _pmaster_listen(transport, host, port)
    log_level = _logging(log_level)
    stop = _stop_on_signals()
    state = _state_dir(state)
    shared = _shared_state(state, secret_file)
    standbys_given = _addresses(standbys)
    _tls_env(tls_cert, tls_key, tls_ca, curve_key)
    terms = None
    try:
        secret = load_or_create_secret(None if shared else state, secret_file)
        quota = {"max_bytes": job_max_mib << 20 if job_max_mib else None, "max_keys": job_max_keys}
        if stall_seconds is not None:
            from pslink.core.aggregator.stalls import ENV_STALL_SECONDS

            os.environ[ENV_STALL_SECONDS] = str(stall_seconds)  # the Aggregators it starts inherit it
        master_options = {"quota": quota, "on_stop": stop.set,
                          **({} if no_metrics else {"metrics_port": metrics_port, "metrics_host": metrics_host})}
        control = {"loss_limit": loss_limit, **({"nic_bandwidth": nic_gbit * 1e9 / 8} if nic_gbit else {}),
                   **({"copy_bandwidth": copy_gbit * 1e9 / 8} if copy_gbit else {})}
        faults = Faults.from_env()  # PSLINK_FAULTS=kill=pmaster@POINT: this process dies there (tests, chaos)
        if faults is not None:
            faults.bind("pmaster").arm()
        if shared:
            # The lease first: a second leader must never start, and the state is read under the epoch.
            terms, store = _lead_now(state, listen, advertise, interface, lease)
            master_options.update(store=store, leadership=terms.lease.status)
        common = dict(state_dir=None if shared else state, advertise=advertise, interface=interface, secret=secret,
                      allow_first_join=allow_first_join, master_options=master_options, control=control,
                      standbys=standbys_given)
        if provider == "ray":
            service = Service(listen, aggregators, provider="ray", provider_options={"address": ray_address},
                              **common).start()
        else:
            service = Service(listen, aggregators, aggregator_options={"log_level": log_level}, **common).start()
    except PslinkError as exc:
        _fail(exc)
    except OSError as exc:
        _fail(PslinkError(f"cannot start the service: {exc}"))
    if terms is not None:
        terms.keep(service.master, on_deposed=lambda: console.print(
            "[bold red]deposed:[/] another pMaster leads this service's state now; this one stopped serving. Its "
            "Aggregators serve on for the leader; Ctrl-C stops them."))
    credentials = write_client_file(client_file_for(int(service.address.rsplit(":", 1)[1])), service.addresses, secret)
    try:
        # Every Aggregator registered: those it started, and (after a restart) those it found serving.
        started = set(service.provider.names())
        pids = ", ".join(f"{record.name} (pid {record.pid}{'' if record.name in started else ', adopted'})"
                         for record in sorted(service.master.state.aggregators.values(), key=lambda r: r.name)
                         if record.alive)
        pids += f"  \\[{provider} provider, grows with load]"  # (escaped: not rich markup)
        console.print(Panel.fit(
            f"pMaster    [bold]{service.address}[/]\n"
            f"Aggregators {pids}\n"
            f"state      {state or 'not kept (pass --state DIR to survive restarts)'}\n\n"
            f"workers:   export {ENV_MASTER}={service.addresses}\n"
            f"more Aggregators, from any host: pslink aggregator --master {service.addresses}\n"
            f"status:    pslink service status -m {service.address}\n"
            + (f"page:      {service.master.observing.http_address}/   metrics: "
               f"{service.master.observing.http_address}/metrics\n" if not no_metrics else "")
            + f"stop:      pslink service stop -m {service.address}\n"
            f"credentials (operator, aggregator): {credentials}\n"
            f"  this user on this host finds them; elsewhere: export PSLINK_CREDENTIALS=<a copy>\n"
            "Ctrl-C stops the service and every process it started.",
            title="pslink service up", border_style="green"))
        stop.wait()
    finally:
        console.print("stopping...")
        if terms is not None:
            terms.end()
        service.stop()
        try:
            os.remove(credentials)
        except OSError:
            pass
    console.print("stopped.")


@app.command("master")
def master_command(
    state: str = typer.Option(..., "--state", help="the service's state: redis://HOST:PORT/N (shared with the other "
                              "pMasters; needed for --standby), or a directory (SQLite, this host only)"),
    standby: bool = typer.Option(False, "--standby", help="stand by: take over when the leader's lease lapses "
                                 "(its host lost, or it stopped), and stand by again if deposed"),
    host: str = typer.Option("127.0.0.1", help="address to listen on once leading (0.0.0.0: every interface)"),
    port: int = typer.Option(7770, "--port", "-p", help="pMaster port"),
    advertise: Optional[str] = typer.Option(None, help="address peers dial (default $PSLINK_ADVERTISE, else --host, "
                                            "else the default-route address)"),
    interface: Optional[str] = typer.Option(None, help="advertise this interface's address"),
    lease: float = typer.Option(3.0, "--lease", min=0.5, help="seconds the leader's lease lasts unrenewed: a "
                                "standby takes over within about this after the leader is lost"),
    transport: str = typer.Option("tcp", help="tcp (native, fastest) or zmq"),
    log_level: str = typer.Option("WARNING", help="log level"),
    secret_file: Optional[str] = typer.Option(None, help="the service secret (hex, mode 0600; default "
                                              "$PSLINK_SECRET_FILE): the same file on every pMaster of the service"),
    allow_first_join: bool = typer.Option(False, help="let workers create a job by joining, without a token, from "
                                          "any host"),
    worker_timeout: float = typer.Option(15.0, min=0.5, help="seconds without a worker's heartbeat before it is "
                                         "taken out of its job (a job with none left ends)"),
    metrics_port: int = typer.Option(0, min=0, help="port of the metrics endpoint and status page while leading "
                                     "(0: any free port)"),
    metrics_host: str = typer.Option("127.0.0.1", help="address the metrics endpoint listens on"),
    no_metrics: bool = typer.Option(False, "--no-metrics", help="serve no metrics endpoint or page"),
    tls_cert: Optional[str] = TlsCertOption,
    tls_key: Optional[str] = TlsKeyOption,
    tls_ca: Optional[str] = TlsCaOption,
    curve_key: Optional[str] = CurveKeyOption,
):
    """Run pMaster alone, for Aggregators that join from any host (`pslink aggregator --master A,B`).
    With --state redis://... one pMaster leads at a time; start one more with --standby on another
    host and it takes over when the leader's host is lost (docs/failures.md)."""
    from pslink.core import hosts
    from pslink.core.credential_files import client_file_for, load_or_create_secret, write_client_file
    from pslink.core.credentials import ServiceCredentials
    from pslink.core.master import Master
    from pslink.core.service.standby import Terms

    listen = _pmaster_listen(transport, host, port)
    _logging(log_level)
    shared = _shared_state(state, secret_file)
    if standby and not shared:
        _fail(PslinkError(f"--standby takes over a state the leader keeps off its host: give --state redis://..., "
                          f"not the directory {state}"))
    state = _state_dir(state)
    _tls_env(tls_cert, tls_key, tls_ca, curve_key)
    stop = _stop_on_signals()
    metrics = {} if no_metrics else {"metrics_port": metrics_port, "metrics_host": metrics_host}
    try:
        secret = load_or_create_secret(None if shared else state, secret_file)
        credentials = ServiceCredentials(secret, allow_first_join)

        def make_master(store=None, leadership=None) -> Master:
            return Master(listen, state_dir=None if shared else state, store=store, leadership=leadership,
                          advertise=advertise, interface=interface, credentials=credentials, on_stop=stop.set,
                          worker_timeout=worker_timeout, **metrics)

        def leading(master: Master) -> None:
            write_client_file(client_file_for(port), master.address, secret)
            console.print(f"pMaster [bold]leading[/] at {master.address} (state {state})", highlight=False)

        if not shared:
            master = make_master().start()
            leading(master)
            stop.wait()
            master.stop()
            return
        address = hosts.advertised_address(listen, advertise=advertise, interface=interface)
        terms = Terms(state, address, ttl=lease)
        if standby:
            console.print(f"pMaster [bold]standing by[/] for the state in {terms.lease.url}: it leads at {address} "
                          f"once the leader's lease ({lease:g} s) lapses", highlight=False)
        terms.run(make_master, stop, standby=standby, on_lead=leading)
    except PslinkError as exc:
        _fail(exc)
    except OSError as exc:
        _fail(PslinkError(f"cannot start pMaster: {exc}"))
    console.print("stopped.")


@service_app.command("stop")
def service_stop(
    master: Optional[str] = MasterOption,
    credentials: Optional[str] = CredentialsOption,
):
    """Stop a running service cleanly: pMaster, and every Aggregator it started (as Ctrl-C in
    its terminal does). Needs the operator credential."""
    try:
        with _client(master, 10.0, credentials) as client:
            body = client.stop_service()
    except PslinkError as exc:
        _fail(exc)
    console.print(f"[green]stopping[/] the service at {body.get('stopping', _master(master))}")


@service_app.command("curve-key")
def service_curve_key(path: str = typer.Argument(..., help="where to write the key (must not exist)")):
    """Make a CURVE key file for a service on zmq+tcp:// (give it to every process: --curve-key or
    PSLINK_CURVE_KEY)."""
    from pslink.core.transport.curve import make_key_file

    try:
        console.print(f"CURVE key written to {make_key_file(path)} (mode 0600): export PSLINK_CURVE_KEY={path}")
    except OSError as exc:
        _fail(PslinkError(f"cannot write a CURVE key to {path}: {exc.strerror or exc}"))


@service_app.command("status")
def service_status(
    master: Optional[str] = MasterOption,
    as_json: bool = typer.Option(False, "--json", help="print the raw status as JSON"),
    credentials: Optional[str] = CredentialsOption,
):
    """Show Aggregators, jobs, tasks, bytes and rounds per second."""
    try:
        with _client(master, 5.0, credentials) as client:
            status = client.status()
    except PslinkError as exc:
        _fail(exc)
    if as_json:
        console.print_json(json.dumps(status))
        return
    # Piped or captured output has no terminal width to fit; wide rows keep names and addresses
    # whole for grep and scripts (a terminal gets tables fitted to it).
    render_status(status, console if console.is_terminal else Console(width=max(console.width, 200)))


@service_app.command("add")
def service_add(
    count: int = typer.Option(1, "--count", "-n", min=1, help="Aggregators to add"),
    master: Optional[str] = MasterOption,
    timeout: float = typer.Option(60.0, help="seconds to wait for them to register"),
    credentials: Optional[str] = CredentialsOption,
):
    """Add Aggregators to a running service (started through its provider); jobs keep running, and
    the pool no longer shrinks below its new size."""
    try:
        with _client(master, timeout, credentials) as client:
            body = client.add_aggregators(count)
            status = client.status()
    except PslinkError as exc:
        _fail(exc)
    addresses = {a["name"]: a["address"] for a in status["aggregators"]}
    for name in body["added"]:
        console.print(f"[green]added[/] {name} at {addresses.get(name, '?')}")
    console.print(f"pool: {len(status['aggregators'])} Aggregators (kept at least {body['min_aggregators']})")


@service_app.command("remove")
def service_remove(
    name: str = typer.Argument(..., help="the Aggregator to remove (as `pslink service status` names it)"),
    master: Optional[str] = MasterOption,
    timeout: float = typer.Option(120.0, help="seconds to wait for it to drain and stop"),
    credentials: Optional[str] = CredentialsOption,
):
    """Remove an Aggregator from a running service: it drains first (its tasks move to others by
    live migration, its replicas are re-made elsewhere), then it stops. Jobs keep running."""
    try:
        with _client(master, timeout, credentials) as client:
            body = client.remove_aggregator(name)
    except PslinkError as exc:
        _fail(exc)
    if body["moved"]:
        moved = Table(title=f"Tasks moved off {body['removed']}")
        for column in ("job", "key", "part", "now on"):
            moved.add_column(column)
        for job, key, part, where in body["moved"]:
            moved.add_row(job, str(key), str(part), where)
        console.print(moved)
    for job, key, part, holders in body["replicas"]:
        console.print(f"replica of {job} key {key} part {part} now on {', '.join(holders) or '[red]none left[/]'}")
    console.print(f"[green]removed[/] {body['removed']} ({len(body['moved'])} task(s) and "
                  f"{len(body['replicas'])} replica(s) moved)")


def _listen_address(listen: str, scheme: str) -> str:
    """``HOST``, ``HOST:PORT``, ``[V6]:PORT`` or a whole address -> ``scheme://host:port``."""
    if "://" in listen:
        return listen
    if listen.startswith("["):
        return f"{scheme}://{listen if ']:' in listen else listen + ':0'}"
    if listen.count(":") == 1:
        return f"{scheme}://{listen}"
    return f"{scheme}://{'[' + listen + ']' if ':' in listen else listen}:0"


@app.command("aggregator")
def aggregator_command(
    master: Optional[str] = MasterOption,
    listen: str = typer.Option("0.0.0.0", "--listen", help="address to bind: HOST or HOST:PORT (default: every "
                               "interface, any free port)"),
    advertise: Optional[str] = typer.Option(None, help="address peers on other hosts dial (default "
                                            "$PSLINK_ADVERTISE, else the local address that routes to pMaster)"),
    interface: Optional[str] = typer.Option(None, help="advertise this network interface's address (default "
                                            "$PSLINK_INTERFACE)"),
    name: Optional[str] = typer.Option(None, help="its name in the pool (default: pMaster names it)"),
    timeout: float = typer.Option(10.0, help="seconds to wait for pMaster to accept it"),
    drain_timeout: float = typer.Option(300.0, help="seconds Ctrl-C waits for its tasks to move off"),
    log_level: str = typer.Option("WARNING", help="log level"),
    credentials: Optional[str] = typer.Option(None, "--credentials", help="file with the service's aggregator "
                                              "credential (and, to drain it on Ctrl-C, the operator's; default "
                                              "$PSLINK_CREDENTIALS, else the file `pslink service up` wrote here)"),
    tls_cert: Optional[str] = TlsCertOption,
    tls_key: Optional[str] = TlsKeyOption,
    tls_ca: Optional[str] = TlsCaOption,
    curve_key: Optional[str] = CurveKeyOption,
):
    """Join a running service's pool from this host: one Aggregator that serves any job, kept by
    the pool's scaling. Ctrl-C drains it first (its tasks and replicas move to the others while jobs
    keep training, as `pslink service remove` does), then it stops; a second Ctrl-C stops it at once."""
    from pslink.core.aggregator import Aggregator
    from pslink.core.transport import scheme_of

    _logging(log_level)
    _tls_env(tls_cert, tls_key, tls_ca, curve_key)
    address = _master(master)
    bind = _listen_address(listen, scheme_of(address))
    try:
        from pslink.core.credentials import AGGREGATOR
        from pslink.core.credential_files import credential_for

        aggregator = Aggregator(address, bind, name=name, advertise=advertise, interface=interface, keep=True,
                                credential=credential_for(address, AGGREGATOR, credentials)).start()
    except PslinkError as exc:
        _fail(exc)
    try:
        if not aggregator.registered.wait(timeout):
            why = f" ({aggregator.master_error})" if aggregator.master_error is not None else ""
            _fail(PslinkError(f"pMaster at {address} did not accept this Aggregator within {timeout:.0f} s{why}; "
                              f"is `pslink service up` running there, and is {address} its address as seen "
                              "from this host?"))
        if aggregator.registration_error is not None:
            _fail(aggregator.registration_error)
        console.print(Panel.fit(
            f"aggregator [bold]{aggregator.name}[/] at {aggregator.address}\n"
            f"pMaster    {address}\n"
            "Ctrl-C drains it (its tasks move to the others), then stops it; twice stops it at once.",
            title="pslink aggregator", border_style="green"))
        interrupts = threading.Event()
        signals: list = []

        def on_signal(*_):
            signals.append(1)
            interrupts.set()
            if len(signals) > 1:
                aggregator.reactor.stop()

        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, on_signal)
        while not interrupts.wait(0.5):
            if aggregator.exit_code is not None:  # pMaster told it to stop, or it gave up on pMaster
                console.print(f"aggregator {aggregator.name} stopped (status {aggregator.exit_code})")
                raise typer.Exit(aggregator.exit_code)
        console.print(f"draining {aggregator.name}: its tasks move to the other Aggregators...")
        try:
            with _client(address, drain_timeout, credentials) as client:
                body = client.remove_aggregator(aggregator.name)
            console.print(f"[green]drained[/] {aggregator.name}: {len(body['moved'])} task(s) and "
                          f"{len(body['replicas'])} replica(s) moved")
        except PslinkError as exc:
            err_console.print(f"[bold red]error:[/] could not drain {aggregator.name} ({exc}); stopping it: "
                              "pMaster fails its tasks over to replicas or elsewhere")
            raise typer.Exit(1)
    finally:
        aggregator.stop()


@job_app.command("create")
def job_create(
    name: str = typer.Argument(..., help="job name"),
    workers: int = typer.Option(..., "--workers", "-w", min=1, help="number of workers"),
    mode: str = typer.Option("sum", help="sum or optimizer"),
    optimizer: Optional[str] = typer.Option(None, help='e.g. \'{"type": "sgd", "lr": 0.1}\' (implies --mode optimizer)'),
    master: Optional[str] = MasterOption,
    credentials: Optional[str] = CredentialsOption,
    token: Optional[str] = typer.Option(None, "--token", help="re-create a job that exists (and has no live workers) "
                                        "with its token instead of the operator credential"),
    max_mib: Optional[int] = typer.Option(None, min=1, help="quota: MiB the job may hold (replicas counted)"),
    max_keys: Optional[int] = typer.Option(None, min=1, help="quota: keys the job may hold"),
):
    """Register a job ahead of its workers; prints the token they must present (PSLINK_TOKEN).
    A job that exists is re-created (its state dropped, a new token) only with the operator
    credential or its token, and only while none of its workers is live."""

    config: dict = {"mode": mode}
    if optimizer:
        try:
            config["optimizer"] = json.loads(optimizer)
        except json.JSONDecodeError as exc:
            _fail(PslinkError(f"--optimizer is not valid JSON: {exc}"))
        config["mode"] = "optimizer"
    try:
        token_bytes = bytes.fromhex(token) if token else None
    except ValueError:
        _fail(PslinkError(f"--token must be the hex token `pslink job create` printed, got {token!r}"))
    try:
        with _client(master, 5.0, credentials) as client:
            quota = {"max_bytes": max_mib << 20 if max_mib else None, "max_keys": max_keys}
            settings = client.register_job(name, workers, config, token=token_bytes,
                                           quota={k: v for k, v in quota.items() if v is not None})
    except PslinkError as exc:
        _fail(exc)
    console.print(f"export PSLINK_JOB={name} PSLINK_NUM_WORKERS={workers} PSLINK_TOKEN={settings['token'].hex()}")


@app.command("demo")
def demo(
    workers: int = typer.Option(2, "--workers", "-w", min=1, help="worker processes"),
    aggregators: int = typer.Option(2, "--aggregators", "-n", min=1, help="Aggregator processes"),
    epochs: int = typer.Option(15, min=1),
    mode: str = typer.Option("sum", help="sum (workers step) or optimizer (the service steps)"),
):
    """Train an MLP on scikit-learn's digits with worker processes and an embedded service."""
    from pslink.demo import run_demo

    if mode not in ("sum", "optimizer"):
        _fail(PslinkError(f"--mode must be sum or optimizer, got {mode!r}"))
    try:
        run_demo(workers=workers, aggregators=aggregators, epochs=epochs, mode=mode, console=console)
    except PslinkError as exc:
        _fail(exc)


@app.command("launch", context_settings={"allow_interspersed_args": False, "ignore_unknown_options": True})
def launch_command(
    command: list[str] = typer.Argument(..., help="the worker command, e.g. python train.py --epochs 3"),
    num_workers: Optional[int] = typer.Option(None, "-n", "--num-workers", "--np", min=1,
                                              help="worker processes (elastic: how many to start, default --min-np)"),
    service: Optional[str] = typer.Option(None, "--service", help="use this running service (pMaster address) "
                                          "instead of starting one"),
    aggregators: int = typer.Option(2, "--aggregators", min=1, help="Aggregators of the embedded service"),
    job: Optional[str] = typer.Option(None, "--job", help="job name (default: script name, pid and time)"),
    no_prefix: bool = typer.Option(False, "--no-prefix", help="do not prefix output lines with the rank"),
    pslite: bool = typer.Option(False, "--pslite", help="run a ps-lite program: a scheduler, -s servers and -n "
                                "workers with ps-lite's DMLC_* environment (as ps-lite's local launcher)"),
    num_servers: Optional[int] = typer.Option(None, "-s", "--num-servers", min=0,
                                              help="ps-lite server processes (with --pslite; default 1)"),
    server_mode: str = typer.Option("classic", "--server-mode", help="with --pslite: classic (the program's own "
                                    "servers) or service (the parameter service serves the workers)"),
    min_np: Optional[int] = typer.Option(None, "--min-np", min=1, help="elastic job: the fewest workers it runs "
                                         "with (below it the launch fails)"),
    max_np: Optional[int] = typer.Option(None, "--max-np", min=1, help="elastic job: the most workers it may have"),
    discovery: Optional[str] = typer.Option(None, "--discovery", "--host-discovery-script",
                                            help="elastic: a file holding, or an executable printing, the number "
                                            "of workers wanted (or lines host:slots); polled"),
    discovery_interval: float = typer.Option(1.0, "--discovery-interval", help="elastic: seconds between polls"),
    max_restarts: int = typer.Option(3, "--max-restarts", min=0, help="elastic: dead workers replaced, at most"),
    heartbeat_timeout: Optional[float] = typer.Option(None, "--heartbeat-timeout",
                                                      help="elastic, embedded service: seconds after which a dead "
                                                      "worker is dropped from the job (default 5)"),
    nnodes: int = typer.Option(1, "--nnodes", min=1, help="hosts the job runs on (torchrun's multi-node form: "
                               "run this command on each, with its --node-rank; -n workers per host)"),
    node_rank: int = typer.Option(0, "--node-rank", min=0, help="this host's index among --nnodes (its workers "
                                  "get global ranks node-rank * n ... )"),
    master_addr: Optional[str] = typer.Option(None, "--master-addr", help="with --nnodes > 1: node 0's address, "
                                              "for torch.distributed's rendezvous (MASTER_ADDR)"),
    master_port: Optional[int] = typer.Option(None, "--master-port", min=1, max=65535,
                                              help="torch.distributed's rendezvous port (MASTER_PORT; default: "
                                              "a free one, 29500 on several nodes)"),
    timeline: Optional[str] = typer.Option(None, "--timeline", help="write every rank's Chrome trace, merged, to "
                                           "this file (window: $PSLINK_TIMELINE_STEPS=a:b)"),
    sync: Optional[str] = typer.Option(None, "--sync", help="local:T: the workers train as groups (one a host, or "
                                       "--groups) that average their weights every T steps (docs/hierarchy.md)"),
    groups: Optional[int] = typer.Option(None, "--groups", min=1, help="with --sync local:T: groups of "
                                         "consecutive ranks (default: one a host)"),
):
    """Run N workers of a training script (as horovodrun or torchrun), with a service if none is given;
    with --min-np/--max-np, an elastic job whose workers come and go (see docs/elastic.md); with
    --pslite, a ps-lite program's scheduler, servers and workers (as ps-lite's launcher)."""
    from pslink.launch import launch, launch_pslite

    try:
        if nnodes > 1 and (pslite or min_np is not None or max_np is not None):
            raise PslinkError("--nnodes runs a fixed job on several hosts; a ps-lite program runs each role on its "
                              "host with DMLC_* (see docs/pslite.md), and elastic jobs (--min-np/--max-np) run "
                              "from one host")
        if timeline and (pslite or min_np is not None or max_np is not None):
            raise PslinkError("--timeline merges the traces of a fixed job's ranks; for an elastic or ps-lite job set "
                              "PSLINK_TIMELINE=DIR/trace-{rank}.json in the workers' environment instead")
        if (sync is not None or groups is not None) and (pslite or min_np is not None or max_np is not None):
            raise PslinkError("--sync and --groups make a fixed job's workers groups; not for ps-lite or elastic jobs")
        if min_np is not None or max_np is not None:
            from pslink.launch_elastic import launch_elastic

            if pslite:
                raise PslinkError("--min-np and --max-np describe an elastic job; --pslite jobs have fixed roles")
            low = min_np if min_np is not None else (num_workers or 1)
            high = max_np if max_np is not None else max(low, num_workers or low)
            code = launch_elastic(command, low, high, num_workers, discovery=discovery,
                                  discovery_interval=discovery_interval, max_restarts=max_restarts,
                                  heartbeat_timeout=heartbeat_timeout, service=service, aggregators=aggregators,
                                  job=job, prefix=not no_prefix)
            raise typer.Exit(code)
        if discovery is not None or heartbeat_timeout is not None:
            raise PslinkError("--discovery and --heartbeat-timeout belong to elastic jobs: add --min-np/--max-np")
        if num_workers is None:
            raise PslinkError("pslink launch needs -n N (or --min-np A --max-np B for an elastic job)")
        if pslite:
            code = launch_pslite(command, num_workers, 1 if num_servers is None else num_servers,
                                 server_mode=server_mode, service=service, aggregators=aggregators, job=job,
                                 prefix=not no_prefix)
        else:
            if num_servers is not None or server_mode != "classic":
                raise PslinkError("-s and --server-mode describe a ps-lite deployment: add --pslite")
            code = launch(command, num_workers, service=service, aggregators=aggregators, job=job,
                          prefix=not no_prefix, nnodes=nnodes, node_rank=node_rank, master_addr=master_addr,
                          master_port=master_port, timeline=timeline, env=_group_env(sync, groups))
    except PslinkError as exc:
        _fail(exc)
    raise typer.Exit(code)


def _group_env(sync: str | None, groups: int | None) -> dict | None:
    """The workers' environment with ``--sync`` / ``--groups`` (None: the launcher's own)."""
    from pslink.core.config import ENV_GROUPS, ENV_SYNC, parse_local_sync

    if sync is None and groups is None:
        return None
    if sync is None:
        raise PslinkError("--groups goes with --sync local:T (the local steps between the groups' syncs)")
    parse_local_sync(sync)
    env = dict(os.environ, **{ENV_SYNC: sync})
    if groups is not None:
        env[ENV_GROUPS] = str(groups)
    return env


@bench_app.command("pushpull", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def bench_pushpull(ctx: typer.Context):
    """Push/pull/pushpull throughput and latency against raw loopback TCP (see --help of benchmarks/pushpull.py)."""
    from pslink.bench.pushpull import main as bench_main

    raise typer.Exit(bench_main(list(ctx.args)))


@bench_app.command("report", add_help_option=False,
                   context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def bench_report(ctx: typer.Context):
    """The quick form of every benchmark that needs no root, as one table (report.md) and a PNG of the ratios,
    each against its anchor measured in the same run (options: pslink bench report --help)."""
    from pslink.bench.report import main as report_main

    raise typer.Exit(report_main(list(ctx.args)))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
