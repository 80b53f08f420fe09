"""llama.cpp's RPC backend: a target split across machines running ``rpc-server``.

mars-local builds llama.cpp with ``-DGGML_RPC=ON``; this module is the
pass-through (no distributed engine of our own):

* :func:`parse_endpoints` checks ``HOST:PORT[,HOST:PORT...]``;
* :func:`probe` connects with a bounded timeout and performs the RPC
  protocol's HELLO (command 14, a 24-byte capability block; the answer is the
  server's protocol version), so that a port with nothing listening, a
  listener that is not an RPC server, or a server of another protocol
  version is one clear line — llama.cpp itself would abort the process or
  wait without a timeout;
* :func:`register` then hands each server to llama.cpp
  (``ggml_backend_rpc_add_server`` + ``ggml_backend_register``): its devices
  join the device list, and :func:`rpc_devices` returns them for the
  target's ``llama_model_params.devices`` (layers split across them by
  ``tensor_split``, default proportional to their free memory, as llama.cpp);
* :func:`install_abort_handler`: a server that dies mid-generation makes
  ggml abort; the handler turns that into one line on stderr and exit 2
  (what was already written — streamed text, finished batch records — stays).

The protocol is unauthenticated and unencrypted: trusted networks only.
"""

from __future__ import annotations

import ctypes
import os
import socket
import struct
import sys
import threading
from dataclasses import dataclass

from ..core.errors import MarsError

__all__ = ["parse_endpoints", "probe", "register", "rpc_devices", "local_gpu_devices", "Device",
           "install_abort_handler", "PROBE_TIMEOUT", "parse_tensor_split", "placement", "protocol"]

PROBE_TIMEOUT = 5.0  # seconds for connect + HELLO
RPC_CMD_HELLO = 14
RPC_CONN_CAPS_SIZE = 24
RPC_PROTO_MAJOR = 7  # what the vendored llama.cpp speaks (ggml-rpc.h)
_HELLO_RSP_SIZE = 4 + RPC_CONN_CAPS_SIZE


def parse_endpoints(value: str | list[str] | tuple[str, ...] | None, flag: str = "--rpc") -> tuple[str, ...]:
    """``HOST:PORT`` items (comma-separated and/or repeated); MarsError naming the bad one."""
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else list(value)
    out: list[str] = []
    for item in items:
        for ep in item.split(","):
            ep = ep.strip()
            if not ep:
                continue
            host, sep, port = ep.rpartition(":")
            if ":" in host or host.startswith("["):  # llama.cpp's RPC client speaks IPv4 only
                raise MarsError(f"{flag}: {ep!r}: llama.cpp's RPC client connects over IPv4 only; "
                                "give an IPv4 address or a host name")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise MarsError(f"{flag}: {ep!r} is not HOST:PORT (e.g. 192.168.1.20:50052)")
            ep = f"{host}:{int(port)}"
            if ep not in out:
                out.append(ep)
    if not out:
        raise MarsError(f"{flag} needs at least one HOST:PORT")
    if len(out) > 16:
        raise MarsError(f"{flag}: at most 16 RPC servers (GGML_RPC_MAX_SERVERS), got {len(out)}")
    return tuple(out)


def _split(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    return host.strip("[]"), int(port)


def _recv(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        part = sock.recv(n - len(data))
        if not part:
            break
        data += part
    return data


def probe(endpoint: str, timeout: float = PROBE_TIMEOUT) -> tuple[int, int, int]:
    """The RPC protocol version of the server at ``endpoint``; one-line MarsError when it is not reachable
    or not a compatible llama.cpp RPC server."""
    host, port = _split(endpoint)
    where = f"RPC server {endpoint}"
    try:  # over IPv4, as llama.cpp's client will connect
        addr = socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_STREAM)[0][4]
        sock = socket.create_connection(addr, timeout=timeout)
    except socket.gaierror as exc:
        raise MarsError(f"{where}: {exc.strerror or exc}") from None
    except socket.timeout:
        raise MarsError(f"{where}: no answer within {timeout:g} s (is rpc-server running there?)") from None
    except OSError as exc:
        raise MarsError(f"{where}: {exc.strerror or exc} (is rpc-server running there?)") from None
    try:
        sock.settimeout(timeout)
        sock.sendall(bytes([RPC_CMD_HELLO]) + struct.pack("<Q", RPC_CONN_CAPS_SIZE) + bytes(RPC_CONN_CAPS_SIZE))
        head = _recv(sock, 8)
        size = struct.unpack("<Q", head)[0] if len(head) == 8 else None
        body = _recv(sock, _HELLO_RSP_SIZE) if size == _HELLO_RSP_SIZE else b""
    except socket.timeout:
        raise MarsError(f"{where}: it accepted the connection but did not answer the RPC handshake within "
                        f"{timeout:g} s (not an llama.cpp rpc-server?)") from None
    except OSError as exc:
        raise MarsError(f"{where}: the RPC handshake failed: {exc.strerror or exc}") from None
    finally:
        sock.close()
    if len(body) != _HELLO_RSP_SIZE:
        raise MarsError(f"{where}: it is not an llama.cpp rpc-server (no valid answer to the RPC handshake)")
    major, minor, patch = body[0], body[1], body[2]
    if major != RPC_PROTO_MAJOR:
        raise MarsError(f"{where} speaks RPC protocol {major}.{minor}.{patch}; this build needs {RPC_PROTO_MAJOR}.x "
                        "(use an rpc-server built from the same llama.cpp version)")
    return major, minor, patch


def parse_tensor_split(value: str | None) -> tuple[float, ...] | None:
    """``--tensor-split 3,1``: non-negative proportions per device (llama.cpp's spelling)."""
    if value is None:
        return None
    try:
        parts = tuple(float(x) for x in value.replace("/", ",").split(","))
    except ValueError:
        raise MarsError(f"--tensor-split must be numbers separated by commas (e.g. 3,1), got {value!r}") from None
    if not parts or any(not (p >= 0) or p == float("inf") for p in parts) or sum(parts) <= 0:
        raise MarsError(f"--tensor-split needs non-negative proportions with a positive sum, got {value!r}")
    return parts


# ------------------------------------------------------------ llama.cpp side
@dataclass(frozen=True)
class Device:
    """A ggml backend device (``handle`` is its ggml_backend_dev_t)."""

    handle: int
    name: str
    description: str
    kind: str  # cpu, gpu, igpu, accel, meta
    free: int
    total: int

    @property
    def rpc(self) -> bool:
        return self.name.startswith("RPC")

    def serves(self, endpoint: str) -> bool:
        """Whether this is a device of the RPC server ``endpoint`` (llama.cpp names them RPC<i>,
        described by the endpoint; older versions put it in the name: RPC<i>[endpoint])."""
        return self.rpc and (self.description == endpoint or self.name.endswith(f"[{endpoint}]"))


_KINDS = ("cpu", "gpu", "igpu", "accel", "meta")
_lock = threading.Lock()
_registered: dict[str, tuple[int, int, int]] = {}  # endpoint -> its RPC protocol version
_ggml = None


def _lib():
    """libggml (the device and backend registry API), with the signatures used here."""
    global _ggml
    if _ggml is None:
        from llama_cpp import _ggml as g

        lib = g.libggml
        vp, cp, sz = ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t
        for name, res, args in [
            ("ggml_backend_dev_count", sz, []), ("ggml_backend_dev_get", vp, [sz]),
            ("ggml_backend_dev_name", cp, [vp]), ("ggml_backend_dev_description", cp, [vp]),
            ("ggml_backend_dev_type", ctypes.c_int, [vp]),
            ("ggml_backend_dev_memory", None, [vp, ctypes.POINTER(sz), ctypes.POINTER(sz)]),
            ("ggml_backend_reg_by_name", vp, [cp]), ("ggml_backend_reg_get_proc_address", vp, [vp, cp]),
            ("ggml_backend_register", None, [vp]),
        ]:
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = res, args
        _ggml = lib
    return _ggml


def devices() -> list[Device]:
    """Every device llama.cpp knows now (CPU, GPUs, registered RPC servers' devices)."""
    from .backend import init_backend

    init_backend()
    lib = _lib()
    out = []
    for i in range(lib.ggml_backend_dev_count()):
        dev = lib.ggml_backend_dev_get(i)
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        lib.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        kind = lib.ggml_backend_dev_type(dev)
        out.append(Device(int(dev), (lib.ggml_backend_dev_name(dev) or b"").decode(),
                          (lib.ggml_backend_dev_description(dev) or b"").decode(),
                          _KINDS[kind] if 0 <= kind < len(_KINDS) else str(kind), free.value, total.value))
    return out


def local_gpu_devices() -> list[Device]:
    """This machine's GPUs (RPC devices excluded)."""
    return [d for d in devices() if d.kind in ("gpu", "igpu") and not d.rpc]


def rpc_devices(endpoints: tuple[str, ...]) -> list[Device]:
    """The devices of the registered servers ``endpoints``, in that order."""
    devs = [d for d in devices() if d.rpc]
    out = []
    for ep in endpoints:
        out += [d for d in devs if d.serves(ep)]
    return out


def register(endpoints: tuple[str, ...], timeout: float = PROBE_TIMEOUT) -> list[Device]:
    """Probe then register each server with llama.cpp (once per process); their devices."""
    from .backend import init_backend

    init_backend()
    with _lock:
        lib = _lib()
        reg = lib.ggml_backend_reg_by_name(b"RPC")
        add = lib.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_rpc_add_server") if reg else None
        if not add:
            raise MarsError("this llama.cpp build has no RPC backend; rebuild with `make install` "
                            "(mars-local builds it with -DGGML_RPC=ON)")
        add_server = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_char_p)(add)
        for ep in endpoints:
            if ep in _registered:
                continue
            version = probe(ep, timeout)
            install_abort_handler()
            server_reg = add_server(ep.encode())
            if not server_reg:
                raise MarsError(f"RPC server {ep}: llama.cpp could not register it")
            lib.ggml_backend_register(server_reg)
            _registered[ep] = version
    devs = rpc_devices(endpoints)
    missing = [ep for ep in endpoints if not any(d.serves(ep) for d in devs)]
    if missing:
        raise MarsError(f"RPC server {missing[0]} reports no devices")
    return devs


def protocol(endpoint: str) -> tuple[int, int, int] | None:
    """The RPC protocol version a registered server answered its handshake with (None: not registered)."""
    return _registered.get(endpoint)


def placement(rpc, rpc_draft: bool = False) -> tuple[list[int] | None, list[int] | None]:
    """The devices for the target and the draft (ggml handles; None: llama.cpp's default).

    With RPC servers the target's layers go to them and to this machine's GPUs;
    the draft stays on this machine's GPUs (or the CPU) unless ``rpc_draft``.
    Once a server is registered in this process, a model loaded without ``rpc``
    stays local too."""
    if not rpc and not _registered:
        return None, None
    remote = [d.handle for d in register(parse_endpoints(rpc))] if rpc else []
    local = [d.handle for d in local_gpu_devices()]
    target = remote + local
    return target, (target if rpc_draft else local)


# ------------------------------------------------------------ aborts
_ABORT_CB = ctypes.CFUNCTYPE(None, ctypes.c_char_p)
_abort_handler = None


def _on_abort(message: bytes | None) -> None:
    text = (message or b"").decode("utf-8", "replace").strip()
    reason = text.split(": ", 1)[-1] if ": " in text else text
    if _registered and ("RPC" in text or "rpc" in text or "socket" in text.lower()):
        servers = ", ".join(_registered)
        line = f"mars: error: lost the RPC server(s) {servers}: {reason}"
    else:
        line = f"mars: error: llama.cpp aborted: {reason}"
    try:
        sys.stdout.flush()
    except Exception:  # noqa: BLE001 - the process is ending
        pass
    try:
        sys.stderr.write("\n" + line + "\n")
        sys.stderr.flush()
    except Exception:  # noqa: BLE001
        pass
    os._exit(2)


def install_abort_handler() -> None:
    """ggml aborts (a lost RPC server among them) end the process with one line and exit code 2."""
    global _abort_handler
    if _abort_handler is not None:
        return
    lib = _lib()
    setter = getattr(lib, "ggml_set_abort_callback", None)
    if setter is None:  # an older ggml: the default abort message stays
        return
    setter.restype, setter.argtypes = ctypes.c_void_p, [_ABORT_CB]
    _abort_handler = _ABORT_CB(_on_abort)
    setter(_abort_handler)
