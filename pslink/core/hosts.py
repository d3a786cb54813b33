"""Which host a process is on, and which address its peers can dial.

**Host identity.** Two processes share a host, for pslink, when they share a kernel (its boot id)
and a network namespace (its inode): only then can they reach each other's abstract Unix sockets
and hand over shared memory. Host names do not tell that apart: containers and network
namespaces on one machine share one name, and a name may resolve to loopback. pMaster learns every
Aggregator's and worker's identity when it registers, and places a job's parts and replicas by it.

**Advertised addresses.** A listener bound to a wildcard (``0.0.0.0``) cannot tell peers "dial
0.0.0.0", nor its host name (which often resolves to loopback). It advertises, in this order:
the address given (``--advertise`` / ``PSLINK_ADVERTISE``, as ps-lite's ``DMLC_NODE_HOST``), the
address of a named interface (``--interface`` / ``PSLINK_INTERFACE``, as ``DMLC_INTERFACE``), the
host it bound to when that is an address, the local address that routes to pMaster, and last the
address of this host's default route.
"""

from __future__ import annotations

import functools
import ipaddress
import os
import socket

from pslink.errors import ConfigError

ENV_ADVERTISE = "PSLINK_ADVERTISE"
ENV_INTERFACE = "PSLINK_INTERFACE"

WILDCARDS = frozenset({"0.0.0.0", "::", "", "*"})


# -- identity ------------------------------------------------------------------------------------------


def netns_inode() -> int:
    """The network namespace of the calling thread (0 where there is none to read)."""
    for path in ("/proc/thread-self/ns/net", "/proc/self/ns/net"):
        try:
            return os.stat(path).st_ino
        except OSError:
            continue
    return 0


@functools.lru_cache(maxsize=1)
def boot_id() -> str:
    """This kernel's boot id: one per machine (and per boot), shared by its containers."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname()


def host_id() -> str:
    """This process's host identity: ``boot id/network namespace``."""
    return f"{boot_id()}/{netns_inode()}"


def host_name() -> str:
    return socket.gethostname()


# -- addresses -----------------------------------------------------------------------------------------


def is_wildcard(host: str) -> bool:
    return host.strip("[]") in WILDCARDS


def is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
        return True
    except ValueError:
        return False


def local_addresses() -> frozenset[str]:
    """The addresses of this network namespace's interfaces (read for the calling thread's
    namespace: tests move threads between namespaces)."""
    return _addresses_of(netns_inode())


@functools.lru_cache(maxsize=64)
def _addresses_of(namespace: int) -> frozenset[str]:
    import psutil

    found = {"127.0.0.1", "::1"}
    for entries in psutil.net_if_addrs().values():
        for entry in entries:
            if entry.family in (socket.AF_INET, socket.AF_INET6):
                found.add(entry.address.split("%", 1)[0])
    return frozenset(found)


def is_local(host: str) -> bool:
    """Whether ``host`` is this network namespace itself: loopback, a wildcard, or an address of
    one of its interfaces. Host names are not resolved (a name costs a lookup on every connect;
    peers advertise addresses)."""
    host = host.strip("[]")
    return is_wildcard(host) or is_loopback(host) or host in local_addresses()


def interfaces() -> dict[str, list[str]]:
    """Interface name -> its IPv4 addresses."""
    import psutil

    return {name: [e.address for e in entries if e.family == socket.AF_INET]
            for name, entries in psutil.net_if_addrs().items()}


def interface_address(name: str, setting: str = "--interface") -> str:
    """The IPv4 address of the network interface ``name``; a clear error naming ``setting`` and the
    interfaces that exist otherwise."""
    known = interfaces()
    if name not in known:
        listing = ", ".join(f"{n} ({', '.join(a) or 'no IPv4 address'})" for n, a in sorted(known.items()))
        raise ConfigError(f"{setting}={name!r}: no such network interface; this host has {listing}")
    if not known[name]:
        raise ConfigError(f"{setting}={name!r} has no IPv4 address")
    return known[name][0]


def route_to(host: str, port: int = 9) -> str | None:
    """The local address this host uses to reach ``host`` (asks the routing table; no packet is
    sent), or None when there is no route."""
    try:
        family, _, _, _, target = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_DGRAM)[0]
    except (OSError, UnicodeError):
        return None
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(target)
            return probe.getsockname()[0]
        except OSError:
            return None


def primary_address() -> str:
    """The address other hosts most likely reach this one at: the source of the default route,
    else the first non-loopback IPv4 address, else loopback (then only this host can)."""
    routed = route_to("192.0.2.1")  # TEST-NET-1: never answered, only routed
    if routed and not is_loopback(routed):
        return routed
    for addresses in interfaces().values():
        for address in addresses:
            if not is_loopback(address):
                return address
    return "127.0.0.1"


def settings(advertise: str | None = None, interface: str | None = None, environ=os.environ) -> tuple[str | None, str | None]:
    """``--advertise`` and ``--interface``, falling back to PSLINK_ADVERTISE and PSLINK_INTERFACE;
    both at once is an error (which one would win?)."""
    advertise = advertise or (environ.get(ENV_ADVERTISE) or "").strip() or None
    interface = interface or (environ.get(ENV_INTERFACE) or "").strip() or None
    if advertise is not None and interface is not None:
        raise ConfigError(f"give the address to advertise (--advertise / {ENV_ADVERTISE}={advertise!r}) or an "
                          f"interface to take it from (--interface / {ENV_INTERFACE}={interface!r}), not both")
    if advertise is not None and is_wildcard(advertise):
        raise ConfigError(f"--advertise / {ENV_ADVERTISE}={advertise!r} is a wildcard: advertise an address other "
                          "hosts can dial")
    if interface is not None:
        interface_address(interface, f"--interface / {ENV_INTERFACE}")  # fail now, naming it
    return advertise, interface


def advertise_host(bound: str, *, advertise: str | None = None, interface: str | None = None,
                   toward: str | None = None) -> str:
    """The host part peers dial for a listener bound to ``bound`` (see the module's docstring).
    ``toward``: the host of the pMaster this process registers with, if any."""
    if advertise:
        return advertise.strip("[]")
    if interface:
        return interface_address(interface, f"--interface / {ENV_INTERFACE}")
    if not is_wildcard(bound):
        return bound.strip("[]")
    if toward and not is_wildcard(toward):
        if is_loopback(toward):
            return "::1" if ":" in toward.strip("[]") else "127.0.0.1"
        routed = route_to(toward)
        if routed:
            return routed
    return primary_address()


def bracket(host: str) -> str:
    """``host`` as it goes in ``scheme://host:port``."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def with_host(address: str, host: str) -> str:
    """``scheme://old:port`` -> ``scheme://host:port``."""
    scheme, _, rest = address.partition("://")
    port = rest.rpartition(":")[2]
    return f"{scheme}://{bracket(host)}:{port}"


def host_of(address: str) -> str:
    """``scheme://host:port`` -> ``host`` (brackets removed)."""
    rest = address.split("://", 1)[-1]
    return rest.rpartition(":")[0].strip("[]")


def advertised_address(address: str, *, advertise: str | None = None, interface: str | None = None,
                       toward: str | None = None) -> str:
    """The address peers dial for a listener bound to ``address`` (``tcp://`` and
    ``zmq+tcp://``; other schemes are their own address). ``toward``: pMaster's address."""
    scheme = address.split("://", 1)[0]
    if scheme not in ("tcp", "zmq+tcp"):
        return address
    toward_host = host_of(toward) if toward and "://" in toward else toward
    host = advertise_host(host_of(address), advertise=advertise, interface=interface, toward=toward_host)
    return with_host(address, host)


def unreachable_reason(address: str, registrant_host: str | None, own_host: str) -> str | None:
    """Why an address a peer advertises cannot be dialed by others, as far as the address shows:
    a wildcard, or loopback advertised from another host than ``own_host`` (pMaster's identity).
    None when nothing is wrong that can be seen without dialing it."""
    scheme = address.split("://", 1)[0] if "://" in address else ""
    if scheme not in ("tcp", "zmq+tcp"):
        return None
    host = host_of(address)
    if is_wildcard(host):
        return f"it advertises {address}, a wildcard address no peer can dial"
    if is_loopback(host) and registrant_host and registrant_host != own_host:
        return (f"it advertises {address}, a loopback address, but it runs on another host than pMaster: "
                "no peer elsewhere can dial it")
    return None


ADVERTISE_HINT = (f"start it with --advertise ADDRESS ({ENV_ADVERTISE}) naming an address of its host that the "
                  f"others reach, or --interface NAME ({ENV_INTERFACE}) to take that interface's address")


def interface_toward(host: str) -> str | None:
    """The name of the interface this host reaches ``host`` through, or None (no route)."""
    routed = route_to(host)
    if routed is None:
        return None
    for name, addresses in interfaces().items():
        if routed in addresses:
            return name
    return None
