"""``mars serve``: an OpenAI-compatible local server with per-request speculation.

One loaded pair serves requests in arrival order (:mod:`.worker`); each request
may choose its own speculation with the ``speculative`` extension object
(:mod:`.requests`), and every ``usage`` reports what drafting did
(:mod:`.responses`).  The app is FastAPI with sse-starlette for streams
(:mod:`.app`), served by uvicorn on a socket bound here first, so that a busy
port is one clear error line and ``--port 0`` picks a free one.

Needs the ``server`` extra (``pip install 'mars-local[server]'``).  May import anything of
mars_local but :mod:`mars_local.cli`.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable

from ..core.errors import MarsError

__all__ = ["bind", "is_loopback", "host_name", "check_origin", "check_allowed_host", "run_server", "check_installed"]

# seconds uvicorn waits for the requests in flight once shutting down begins (run_server)
GRACEFUL_SHUTDOWN_S = 3


def check_installed() -> None:
    """A one-line MarsError when the server's libraries are missing."""
    missing = []
    for mod in ("fastapi", "uvicorn", "sse_starlette", "prometheus_client"):
        try:
            __import__(mod)
        except ImportError:
            missing.append(mod.replace("_", "-"))
    if missing:
        raise MarsError(f"mars serve needs {', '.join(missing)}: pip install 'mars-local[server]'")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def host_name(value: str) -> str:
    """The host of a ``Host`` header (or a host given on the command line): lower
    case, without the port, an IPv6 address without its brackets."""
    v = value.strip().lower()
    if v.startswith("["):
        end = v.find("]")
        return v[1:end] if end > 0 else v
    if v.count(":") == 1:  # name:port (more colons: a bare IPv6 address)
        v = v.partition(":")[0]
    return v


def check_origin(value: str) -> str:
    """A ``--cors`` value as browsers send it in ``Origin`` (scheme and host in lower
    case, no default port), or '*'; a MarsError for anything else."""
    from urllib.parse import urlsplit

    if value.strip() == "*":
        return "*"
    bad = MarsError(f"--cors {value!r}: an origin is scheme://host[:port] with scheme http or https "
                    "(e.g. http://localhost:3000), or '*' for any")
    try:
        u = urlsplit(value.strip())
        port = u.port
    except ValueError:
        raise bad from None
    if (u.scheme.lower() not in ("http", "https") or not u.hostname or u.path or u.query or u.fragment
            or "@" in u.netloc or value.strip().endswith(("?", "#"))):
        raise bad
    scheme, host = u.scheme.lower(), u.hostname.lower()
    host = f"[{host}]" if ":" in host else host
    default = 80 if scheme == "http" else 443
    return f"{scheme}://{host}" + (f":{port}" if port is not None and port != default else "")


def check_allowed_host(value: str) -> str:
    """An ``--allowed-host`` value (a host name or address, no port), lower case; a
    MarsError for anything else."""
    name = host_name(value)
    if not name or name != value.strip().lower().strip("[]") or any(c in name for c in "/@?#* \t"):
        raise MarsError(f"--allowed-host {value!r}: give a host name or address without scheme or port "
                        "(e.g. mybox.lan)")
    return name


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on host:port; a MarsError naming both and the reason when it cannot be."""
    if not 0 <= port <= 65535:
        raise MarsError(f"--port must be in 0..65535, got {port}")
    if host == "localhost":  # IPv4 loopback, where clients look first (getaddrinfo may put ::1 first)
        host = "127.0.0.1"
    try:
        infos = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise MarsError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    family, type_, proto, _, addr = infos[0]
    sock = socket.socket(family, type_, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise MarsError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.set_inheritable(True)
    return sock


def run_server(app, sock: socket.socket, on_ready: Callable[[], None] | None = None,
               on_shutdown: Callable[[], None] | None = None) -> None:
    """Serve ``app`` on ``sock`` until Ctrl-C or SIGTERM (uvicorn; its access log off:
    the app logs one line per generation).  ``on_shutdown()`` as shutting down begins, before
    uvicorn waits (GRACEFUL_SHUTDOWN_S at most) for the requests in flight: they must end by then
    (mars serve cancels its generations, each answered 503), or uvicorn cancels their tasks (a
    traceback per request, and a plain-text 500 to a client waiting for a whole answer)."""
    import uvicorn

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None) -> None:
            if on_shutdown is not None:
                on_shutdown()
            await super().shutdown(sockets=sockets)

    config = uvicorn.Config(app, log_level="warning", access_log=False,
                            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S, lifespan="on")
    server = Server(config)
    if on_ready is not None:
        on_ready()
    server.run(sockets=[sock])
