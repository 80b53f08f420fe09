"""`mars models`, `mars pull` and `mars doctor` (registered by :mod:`mars_local.cli.main`)."""

from __future__ import annotations

import json
import os
import re
from typing import Optional

import typer
from typer import echo

from ..core.errors import MarsError


def _size(n: Optional[int]) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)  # pragma: no cover


def registry_rows() -> tuple[object, list[dict]]:
    from ..core.config import GenerateConfig
    from ..models.hub import describe
    from ..models.registry import load_registry

    from ..llama.mtp import mtp_layers

    reg = load_registry()
    rows = []
    for name, pair in reg.pairs.items():
        settings = GenerateConfig(**pair.overrides)
        target = describe(pair.target)
        rows.append(
            {
                "name": name,
                "default": name == reg.default,
                "description": pair.description,
                "target": target,
                "draft": describe(pair.draft) if pair.draft else None,
                "drafter": pair.drafter,
                "theta": settings.theta,
                "draft_max": settings.draft_max,
                # the target's own multi-token-prediction layers (--drafter mtp), read from the file's
                # header when it is on this machine (None: not downloaded)
                "mtp_layers": mtp_layers(target["path"])[1] if target["present"] else None,
            }
        )
    return reg, rows


def models(as_json: bool = typer.Option(False, "--json", help="Print the registry as JSON.")) -> None:
    """The model registry (models.yaml plus your own), with what is on this machine."""
    reg, rows = registry_rows()
    if as_json:
        echo(json.dumps({"sources": reg.sources, "default": reg.default, "models": rows}, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(box=None, header_style="bold")
    for col in ("NAME", "TARGET", "DRAFT", "DRAFTER", "θ", "K", "MTP", "LOCAL", "SIZE"):
        table.add_column(col, no_wrap=col in ("NAME", "LOCAL", "SIZE"), overflow="fold")  # (names never cut)
    for r in rows:
        parts = [r["target"]] + ([r["draft"]] if r["draft"] else [])
        present = all(p["present"] for p in parts)
        size = sum(p["size"] or 0 for p in parts) if present else None
        table.add_row(
            r["name"] + (" (default)" if r["default"] else ""),
            r["target"]["file"],
            r["draft"]["file"] if r["draft"] else "-",
            r["drafter"],
            f"{r['theta']:g}",
            str(r["draft_max"]),
            "?" if r["mtp_layers"] is None else (str(r["mtp_layers"]) if r["mtp_layers"] else "-"),
            "yes" if present else "no",
            _size(size),
        )
    console = Console()
    if not console.is_terminal:  # piped (grep, a file): whole lines, not folded to 80 columns
        console = Console(width=1000)
    console.print(table)
    echo(f"registry: {', '.join(reg.sources)}; `mars pull NAME` downloads a pair, --json shows the sources; "
         "MTP: the target's multi-token-prediction layers (--drafter mtp), ? until downloaded")


def pull(
    name: str = typer.Argument(..., help="A registry name (see `mars models`) or hf:OWNER/REPO/FILE.gguf."),
    force: bool = typer.Option(False, "--force", help="Download again even if cached."),
) -> None:
    """Download a pair's target and draft into the Hugging Face cache (resumable)."""
    from ..models.hub import download_file, pull_pair
    from ..models.registry import load_registry, parse_hf

    hf = parse_hf(name)
    if hf is not None:
        paths = [download_file(*hf, force=force)]
    else:
        paths = pull_pair(load_registry().get(name), force=force)
    for p in paths:
        echo(str(p))


def doctor_report() -> dict:
    from .. import __version__
    from ..llama.kernels import cuda_graph_cache, kernel_paths
    from ..llama.runtime import backend_info

    info = backend_info()
    try:
        from ..speculate import native

        native_ok = bool(native.available())
    except ImportError:
        native_ok = False
    # a broken registry is one failed check; the others still run
    try:
        reg, rows = registry_rows()
        registry = {"sources": reg.sources, "problem": None}
    except MarsError as exc:
        rows, registry = [], {"sources": None, "problem": " ".join(str(exc).split())}
    from ..llama.runtime import build_fingerprint
    from ..speculate.learned import default_store

    store = default_store()
    entries = store.entries()
    build = build_fingerprint()
    return {
        "mars_local": __version__,
        "llama_cpp_python": info["llama_cpp_python"],
        "backend": info["backend"],
        "gpu_offload": info["gpu_offload"],
        "native_hot_path": native_ok,
        "verify_backend": "native" if native_ok else "numpy",
        "system_info": info["system_info"],
        # which exact (batch-invariant) kernels a verify window and a plain step take, per weight type
        "exact_kernels": kernel_paths(info["system_info"], info["backend"]),
        "cuda_graphs": cuda_graph_cache(os.environ) if info["backend"] == "cuda" else None,
        "registry": registry,
        "models": {
            r["name"]: all(p["present"] for p in [r["target"]] + ([r["draft"]] if r["draft"] else [])) for r in rows
        },
        # which downloaded targets can draft with their own MTP layers (--drafter mtp): their nextn layers
        "mtp_layers": {r["name"]: r["mtp_layers"] for r in rows if r["mtp_layers"] is not None},
        "learned": {
            "path": str(store.path),
            "problem": store.problem,
            "entries": {k: _learned_summary(v) for k, v in entries.items()},
            # what a forward costs and whether repacking is exact were measured per llama.cpp build
            # (llama.runtime.build_fingerprint: every reinstall is a new one); other builds' entries stay
            # in the file (another environment may share it) but this one never reads them
            "build": build,
            "other_builds": [k for k in entries if _learned_build(k) not in (None, build)],
        },
    }


_BUILD_FIELD = re.compile(r"[0-9a-f]{12}")  # llama.runtime.build_fingerprint() in a learned-state key


def _learned_build(key: str) -> str | None:
    """The llama.cpp build a learned-state key was measured with (its bare 12-hex field), if any."""
    return next((p for p in key.split("|")[1:] if _BUILD_FIELD.fullmatch(p)), None)


def _learned_summary(v: dict) -> str:
    """One line about one learned-state entry."""
    if "mode" in v or "cost" in v or "wide_alike" in v:  # a Scheduler's (speculate/batched.py)
        return _batch_summary(v)
    if "time" in v:
        sizes = sorted(int(w) for w in v["time"])
        t1 = v["time"].get("1")
        one = f", 1 row {1e3 * t1[0] / t1[1]:.1f} ms" if t1 and t1[1] else ""
        return f"verify-window costs for {len(sizes)} window sizes{one}"
    if "draft" in v:
        t, n = v["draft"]
        return f"draft cost {1e3 * t / n:.1f} ms/token" if n else "draft cost (none yet)"
    if v.get("recurrent"):
        return "a recurrent target: loads without repacking (its state cannot be probed)"
    if "invariant" in v:
        return ("repacked weights exact on this CPU: the target loads repacked" if v["invariant"]
                else "repacked weights not exact on this CPU: the target loads without repacking")
    if "counts" in v:
        pool = next((c for c in v["counts"] if c[0] == "__pooled__"), None)
        acc = f", pooled acceptance {pool[1] / (pool[1] + pool[2]):.0%}" if pool and pool[1] + pool[2] else ""
        return f"acceptance for {len(v['counts'])} keys{acc}"
    return "unknown entry"


def _batch_summary(v: dict) -> str:
    """One line about what batched rounds learned: shapes timed, drafting's rate against plain
    rounds' per load (sequences a round)."""
    try:
        shapes = len((v.get("cost") or {}).get("time") or {})
        rates: dict = {}
        for n, drafted, t, sec, count, _ in (v.get("mode") or {}).get("rates") or ():
            if sec > 0 and count:
                rates.setdefault(n, {})[drafted] = t / sec
        loads = ", ".join(f"{n}: {r[True] / r[False]:.2f}x" for n, r in sorted(rates.items(), key=lambda kv: kv[0] or 0)
                          if r.get(True) and r.get(False))
    except (TypeError, ValueError, AttributeError, ZeroDivisionError):
        return "batched rounds (unreadable)"
    wide = {True: "; prompt chunks of over 64 rows compute rows alike (a chat's next turn keeps its conversation)",
            False: "; prompt chunks of over 64 rows differ by length (a longer prompt re-evaluates them)"}
    return (f"batched rounds: {shapes} shapes timed" + (f"; drafting / plain rate per load {loads}" if loads else "")
            + wide.get(v.get("wide_alike"), ""))


def rpc_report(value: str) -> list[dict]:
    """Each RPC server's protocol and devices (free/total memory), or its ``error`` (one line: host,
    port, reason) when it cannot be reached within a bounded connect timeout."""
    from ..llama.rpc import parse_endpoints, protocol, register

    out = []
    for ep in parse_endpoints(value):
        try:
            devs = register((ep,))  # the handshake first, then llama.cpp's registration
        except MarsError as exc:
            out.append({"endpoint": ep, "error": str(exc)})
            continue
        out.append({"endpoint": ep, "protocol": ".".join(map(str, protocol(ep))), "devices": [
            {"name": d.name, "description": d.description, "free": d.free, "total": d.total} for d in devs]})
    return out


def _rpc_failures(servers) -> None:
    """One line per unreachable RPC server on stderr, then exit 2."""
    bad = [s["error"] for s in servers or () if "error" in s]
    if bad:
        for line in bad:
            echo(f"error: {line}", err=True)
        raise typer.Exit(2)


def doctor(
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    reset_learned: bool = typer.Option(
        False, "--reset-learned", help="Forget what the adaptive draft length learned (window costs, acceptance)."
    ),
    rpc: Optional[str] = typer.Option(
        None, "--rpc", help="Check llama.cpp RPC servers HOST:PORT[,...]: reachable, protocol, free/total memory."
    ),
) -> None:
    """What this installation can do: llama.cpp build, backend, GPU offload, hot path, models, learned state.

    Exits 1 when a check failed (an unreadable models.yaml), after reporting all of them; 2 when an
    RPC server given with --rpc cannot be reached (one line: host, port, reason).
    """
    if reset_learned:
        from ..speculate.learned import default_store

        store = default_store()
        n = store.clear()
        echo(f"forgot {n} learned-state entr{'y' if n == 1 else 'ies'} ({store.path})")
        return
    rep = doctor_report()
    servers = rpc_report(rpc) if rpc is not None else None
    if servers is not None:
        rep["rpc"] = servers
    failed = rep["registry"]["problem"] is not None
    if as_json:
        echo(json.dumps(rep, indent=2))
        _rpc_failures(servers)
        if failed:
            raise typer.Exit(1)
        return
    echo("\n".join(_doctor_lines(rep, servers)))
    _rpc_failures(servers)
    if failed:
        echo("error: a check failed: model registry (see above)", err=True)
        raise typer.Exit(1)


def _doctor_lines(rep: dict, servers) -> list[str]:
    """The report of `mars doctor` as lines of text (the RPC servers' after the rest)."""
    avail = [n for n, ok in rep["models"].items() if ok]
    reg = rep["registry"]
    if reg["problem"] is not None:
        reg_line, models_line = f"FAILED: {reg['problem']}", "unknown (the registry could not be read)"
    else:
        reg_line = "ok (" + ", ".join(reg["sources"]) + ")"
        models_line = ", ".join(avail) if avail else "none (mars pull NAME)"
    learned = rep["learned"]
    other = set(learned.get("other_builds", ()))
    lines = [
        f"mars-local:           {rep['mars_local']}",
        f"llama-cpp-python:     {rep['llama_cpp_python']}",
        f"backend:              {rep['backend']}",
        f"GPU offload:          {'yes' if rep['gpu_offload'] else 'no (CPU build; rebuild with CMAKE_ARGS=-DGGML_CUDA=on or -DGGML_METAL=on)'}",
        f"native hot path:      {'yes' if rep['native_hot_path'] else 'no (verification runs in numpy)'}",
        f"model registry:       {reg_line}",
        f"models on this disk:  {models_line}",
        "MTP drafting:         " + (", ".join(f"{n} ({k} nextn layer{'s' if k > 1 else ''})"
                                            for n, k in rep["mtp_layers"].items() if k) or "none of them has MTP layers")
        + " (--drafter mtp)",
        f"system:               {rep['system_info']}",
        "exact kernels:        one row and a verify window sum alike (strict == plain); costs vs stock: "
        "benchmarks/kernel_costs.py",
        *(f"  {types}: {path}" for types, path in rep["exact_kernels"].items()),
        *([f"CUDA graphs:          {rep['cuda_graphs']}"] if rep.get("cuda_graphs") else []),
        f"learned state:        {len(learned['entries'])} entr{'y' if len(learned['entries']) == 1 else 'ies'}"
        f" in {learned['path']}" + (f" ({learned['problem']})" if learned["problem"] else "")
        + (f", {len(other)} of them from other llama.cpp builds" if other else "")
        + " (mars doctor --reset-learned forgets it)",
    ]
    for k, v in sorted(learned["entries"].items(), key=lambda kv: kv[0] in other):  # this build's first
        kind, *parts = k.split("|")
        where = " · ".join(p.split("@")[0] for p in parts if not _BUILD_FIELD.fullmatch(p))  # names, not hashes
        lines.append(f"  {kind:<7} {where}: {v}" + (" (another llama.cpp build: not used by this one)" if k in other else ""))
    for srv in servers or ():
        if "error" in srv:
            lines.append(f"RPC server {srv['endpoint']}: FAILED (see below)")
            continue
        lines.append(f"RPC server {srv['endpoint']}: ok (protocol {srv['protocol']})")
        for d in srv["devices"]:
            lines.append(f"  {d['name']} {d['description']}: {d['free'] >> 20} MiB free of {d['total'] >> 20} MiB")
    return lines
