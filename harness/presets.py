"""Model geometries as HF `config.json` files, materialized into a cache dir for dummy-weight engines.

A preset is `harness/presets/<name>.json` = {name, source, config}. `materialize_model` writes the
config (with the layer count and position limit the plan asks for) to a content-addressed folder, so
two runs of the same plan load the same directory and a changed plan never reuses a stale one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from ..kernels.config import ConfigError

log = logging.getLogger(__name__)

_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4}


def preset_names() -> tuple[str, ...]:
    folder = resources.files(__package__).joinpath("presets")
    return tuple(sorted(p.name[: -len(".json")] for p in folder.iterdir() if p.name.endswith(".json")))


def load_preset_config(name: str) -> dict:
    """The HF config dict of preset `name` (a fresh copy)."""
    if name not in preset_names():
        raise ConfigError(f"model preset {name!r} unknown; use one of {', '.join(preset_names())} or a local model dir")
    text = resources.files(__package__).joinpath("presets", f"{name}.json").read_text()
    return dict(json.loads(text)["config"])


@dataclass(frozen=True)
class ModelGeometry:
    """What bytes-per-step needs: KV geometry of the attention layers and the cache dtype size."""

    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    kv_dtype_bytes: int

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token across all layers and KV heads."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.kv_dtype_bytes

    @classmethod
    def from_config(cls, config: dict, dtype: str = "auto") -> "ModelGeometry":
        q_heads = int(config["num_attention_heads"])
        head_dim = int(config.get("head_dim") or config["hidden_size"] // q_heads)
        dtype_name = config.get("torch_dtype", "bfloat16") if dtype == "auto" else dtype
        return cls(
            num_layers=int(config["num_hidden_layers"]),
            num_q_heads=q_heads,
            num_kv_heads=int(config.get("num_key_value_heads", q_heads)),
            head_dim=head_dim,
            kv_dtype_bytes=_DTYPE_BYTES.get(str(dtype_name), 2),
        )


def read_model_dir_config(model_dir: str | os.PathLike) -> dict:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"model dir {model_dir} has no config.json; pass an HF model folder or a preset name")
    return json.loads(path.read_text())


def build_config(name: str, num_layers: int | None, max_model_len: int) -> tuple[dict, dict]:
    """Preset config with overrides applied, plus a dict naming every change (stored in records)."""
    config = load_preset_config(name)
    changes: dict = {}
    if num_layers is not None and num_layers != config["num_hidden_layers"]:
        changes["num_hidden_layers"] = {"preset": config["num_hidden_layers"], "used": num_layers}
        config["num_hidden_layers"] = num_layers
    if max_model_len > config["max_position_embeddings"]:
        # Dummy weights only: positions past the trained range cost the same time.
        changes["max_position_embeddings"] = {"preset": config["max_position_embeddings"], "used": max_model_len}
        config["max_position_embeddings"] = max_model_len
    return config, changes


def materialize_model(config: dict, cache_dir: str | os.PathLike | None = None) -> Path:
    """Write `config` as config.json under a content-hash folder; returns the folder (idempotent)."""
    text = json.dumps(config, indent=1, sort_keys=True)
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]
    root = Path(cache_dir) if cache_dir else Path(tempfile.gettempdir()) / "locks-toolkit-models"
    folder = root / f"{config.get('model_type', 'model')}-L{config['num_hidden_layers']}-{digest}"
    target = folder / "config.json"
    if not target.is_file() or target.read_text() != text:
        folder.mkdir(parents=True, exist_ok=True)
        scratch = folder / f".config.json.{os.getpid()}"
        scratch.write_text(text)
        os.replace(scratch, target)  # atomic: a concurrent reader never sees half a file
        log.debug("wrote %s", target)
    return folder
