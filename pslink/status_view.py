"""How ``pslink service status`` shows a status: tables of Aggregators, jobs, migrations in
flight and stalled rounds (rich)."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table


def host_labels(aggregators: list[dict]) -> dict[str, str]:
    """Aggregator -> its host as a reader tells hosts apart: the host name, and where hosts of
    one name differ (containers, network namespaces of one machine) the address too."""
    ids_by_name: dict[str, set] = {}
    for a in aggregators:
        ids_by_name.setdefault(a.get("host") or "?", set()).add(a.get("host_id") or a.get("host"))
    labels = {}
    for a in aggregators:
        name = a.get("host") or "?"
        address = a["address"].split("://", 1)[-1].rpartition(":")[0]
        labels[a["name"]] = name if len(ids_by_name[name]) < 2 else f"{name} ({address})"
    return labels


def render_status(status: dict, out: Console) -> None:
    master = status.get("master", {})
    out.print(f"[bold]pMaster[/] {master.get('address', '?')} (pid {master.get('pid', '?')}, "
              f"state {master.get('state') or 'in memory'})")
    leading = status.get("leadership")
    if leading is not None:
        _leadership(leading, out)
    aggs = Table(title="Aggregators")
    for column in ("name", "host", "address", "pid", "alive", "tasks by job", "replicas (no state)", "MB", "cycle ms",
                   "free ms", "load", "task rounds/s", "bad msgs"):
        left = column in ("name", "host", "address", "tasks by job")
        aggs.add_column(column, justify="left" if left else "right", no_wrap=column in ("name", "address"))
    labels = host_labels(status["aggregators"])
    for a in status["aggregators"]:
        jobs = ", ".join(f"{j}:{n}" for j, n in sorted(a["jobs"].items())) or "-"
        if a.get("reserved_for"):
            jobs += f" (kept for {a['reserved_for']})"
        alive = ("[yellow]draining[/]" if a.get("draining") else "yes") if a["alive"] else "[red]no[/]"
        behind = a.get("replicas_without_state", 0)
        aggs.add_row(a["name"], labels[a["name"]], a["address"], str(a["pid"]), alive, jobs,
                     str(a.get("replicas", 0)) + (f" [yellow]({behind})[/]" if behind else ""),
                     f"{a['bytes'] / 1e6:.2f}", f"{a.get('cycle', 0) * 1e3:.1f}", f"{a.get('free', 0) * 1e3:.1f}",
                     f"{a.get('load', 0):.0%}", f"{a['task_rounds_per_s']:.1f}", str(a["errors"]))
    out.print(aggs)
    jobs = Table(title="Jobs")
    for column in ("job", "mode", "workers (hosts)", "keys", "tasks", "MB", "phase", "iteration ms (alone)",
                   "slowdown (SLO)", "rounds/s", "aggregators"):
        jobs.add_column(column, justify="left" if column in ("job", "mode", "phase", "aggregators") else "right",
                        no_wrap=column == "job")
    for j in status["jobs"]:
        mode = j["mode"] + (f" ({j['optimizer']})" if j.get("optimizer") else "") + (" asp" if j.get("sync") == "asp" else "")
        control = j.get("control") or {}
        current, alone, loss = control.get("current"), control.get("standalone"), control.get("loss")
        timing = (f"{current * 1e3:.1f}" if current else "-") + (f" ({alone * 1e3:.1f})" if alone else "")
        hosts = f" ({j['worker_hosts']})" if j.get("worker_hosts", 1) > 1 else ""
        jobs.add_row(j["job"], mode, f"{j['workers']}/{j['num_workers']}{hosts}", str(j["keys"]), str(j["tasks"]),
                     f"{j['bytes'] / 1e6:.2f}", control.get("phase", "-"), timing,
                     (f"{loss:.0%}" if loss is not None else "-") + (f" ({control['slo']:.0%})" if control.get("slo") else "")
                     + (" high" if control.get("priority") == "high" else ""), f"{j['rounds_per_s']:.1f}",
                     ", ".join(j["aggregators"]) or "-")
    if status["jobs"]:
        out.print(jobs)
    else:
        out.print("no jobs")
    migrations = status.get("migrations") or []
    if migrations:
        moving = Table(title="Migrations in flight")
        for column in ("job", "key", "part", "from", "to", "seconds", "copied", "why"):
            moving.add_column(column)
        for m in migrations:
            moving.add_row(m["job"], str(m["key"]), str(m["part"]), m["source"], m["target"],
                           "queued" if m.get("queued") else f"{m['seconds']:.2f}",
                           "yes" if m["copied"] else "no", m["reason"])
        out.print(moving)
    stalled = status.get("stalled") or []
    if stalled:
        table = Table(title="Stalled rounds (waiting longer than the stall threshold)")
        for column in ("job", "key", "part", "round", "waiting for ranks", "pushed", "seconds", "aggregator"):
            table.add_column(column)
        for st in stalled:
            table.add_row(st["job"], str(st["key"]), str(st["part"]), str(st["round"]),
                          ", ".join(map(str, st["waiting"])), ", ".join(map(str, st["pushed"])),
                          f"{st['seconds']:.1f}", st["aggregator"])
        out.print(table)
    out.print(f"migrations done: {status.get('migrations_done', 0)}")
    if master.get("http"):
        out.print(f"page: {master['http']}/   metrics: {master['http']}/metrics")


def _leadership(leading: dict, out: Console) -> None:
    """Who leads the service over its shared store, and who stands by to take over."""
    leader = leading.get("leader") or {}
    store = "reachable" if leading.get("store_reachable") else "[red]unreachable[/] (serving on from memory)"
    pending = leading.get("pending_writes", 0)
    out.print(f"[bold]leader[/] {leader.get('address', '?')} on {leader.get('host', '?')} (pid {leader.get('pid', '?')}, "
              f"epoch {leading.get('epoch')}); state store {leading.get('store')}: {store}"
              + (f", {pending} write(s) waiting" if pending else ""))
    standbys = leading.get("standbys") or []
    if not standbys:
        out.print("[yellow]standby[/] none: nobody takes over if this pMaster's host is lost")
    for standby in standbys:
        out.print(f"[bold]standby[/] {standby.get('address', '?')} on {standby.get('host', '?')} "
                  f"(pid {standby.get('pid', '?')}): {standby.get('state', '?')}, ready to take over within "
                  f"{leading.get('lease_seconds', '?')} s of a loss")
