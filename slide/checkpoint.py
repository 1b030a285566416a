"""Checkpoint files: ``model-<step>.npz`` (arrays) + ``config.json`` (everything else).

No pickle anywhere. Each file is written under a temporary name and renamed into place; the
JSON, which names the npz it belongs to, is replaced last, so a crash at any point leaves the
previous checkpoint loadable. The sparse engine and the dense reference share this format.
"""
from __future__ import annotations

import json
import os

import numpy as np

FORMAT_VERSION = 1


def write_checkpoint(path, arrays: dict, meta: dict, step: int) -> None:
    """Write ``arrays`` (name → ndarray) and JSON-serialisable ``meta`` into directory ``path``."""
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    name = f"model-{int(step)}.npz"
    tmp = os.path.join(path, f".{name}.tmp")
    with open(tmp, "wb") as fh:
        np.savez(fh, **arrays)
    os.replace(tmp, os.path.join(path, name))
    meta = {"format": "slide", "format_version": FORMAT_VERSION, "arrays": name, **meta}
    tmp = os.path.join(path, ".config.json.tmp")
    with open(tmp, "w") as fh:
        json.dump(meta, fh, indent=1)
    os.replace(tmp, os.path.join(path, "config.json"))
    for f in os.listdir(path):  # older arrays are no longer referenced
        if f.startswith("model-") and f.endswith(".npz") and f != name:
            os.remove(os.path.join(path, f))


def read_checkpoint(path) -> tuple[dict, dict]:
    """Return ``(arrays, meta)`` of the checkpoint in directory ``path``."""
    path = os.fspath(path)
    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(cfg_path):
        raise FileNotFoundError(f"{path}: not a model directory (no config.json)")
    with open(cfg_path) as fh:
        try:
            meta = json.load(fh)
        except json.JSONDecodeError as e:
            raise ValueError(f"{cfg_path}: corrupt JSON ({e})") from None
    if meta.get("format") != "slide":
        raise ValueError(f"{cfg_path}: not a slide model")
    if meta.get("format_version", 0) > FORMAT_VERSION:
        raise ValueError(f"{cfg_path}: format version {meta['format_version']} is newer than this "
                         f"library's ({FORMAT_VERSION})")
    with np.load(os.path.join(path, meta["arrays"]), allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    return arrays, meta


def split_arrays(arrays: dict) -> tuple[dict, dict]:
    """Parameters and Adam moments (``adam.<param>.m|v``; zeros when the file has none)."""
    params = {k: v for k, v in arrays.items() if not k.startswith("adam.")}
    moments = {k[5:]: v for k, v in arrays.items() if k.startswith("adam.")}
    if not moments:
        moments = {f"{k}.{s}": np.zeros_like(v) for k, v in params.items() for s in "mv"}
    return params, moments


def join_arrays(params: dict, moments: dict) -> dict:
    return {**params, **{f"adam.{k}": v for k, v in moments.items()}}
