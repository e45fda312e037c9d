"""Model resolution and weight loading.

A model is named by one of:

- ``"neo-tiny"``: the built-in tiny model (``tiny.py``), weights generated in code;
- a shipped config name (``models/configs/<name>.json``, e.g. ``"llama-3.1-8b"``; case does not
  matter): real model shapes without weights, for ``load_format="dummy"`` benchmarks;
- a Hugging Face model directory: ``config.json`` + ``*.safetensors`` (one file, or shards
  listed in ``model.safetensors.index.json``).

Loading builds the model empty on its device and dtype, then fills it one checkpoint tensor at
a time: q/k/v are copied into their rows of the fused QKV weight and gate/up into the fused
gate/up weight. Host memory holds at most one checkpoint tensor (in the checkpoint's dtype)
beyond the memory-mapped files.

A tensor-parallel rank (``parallel.py``) reads only its part of each split tensor: a safetensors
slice of its rows or columns (``CheckpointTarget.part_index``). Its dummy weights are the
one-rank model's, sliced (``initialize_dummy_shards``).
"""

import glob
import json
import os
from dataclasses import replace
from importlib import resources

import torch
from safetensors import safe_open

from . import tiny
from .causal_lm import CausalLM
from .checkpoint import CheckpointTarget
from .config import ModelConfig, parse_dtype
from .parallel import TensorParallel
from .registry import config_from_hf, read_model_config

LOAD_FORMATS = ("auto", "safetensors", "dummy")
INDEX_FILE = "model.safetensors.index.json"
# Checkpoint tensors that carry no weights neo needs (precomputed rotary frequencies).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def builtin_config_names() -> list[str]:
    """Names of the shipped config files (without ``.json``), sorted."""
    files = resources.files("neo.models.configs").iterdir()
    return sorted(entry.name[:-len(".json")] for entry in files if entry.name.endswith(".json"))


def builtin_model_names() -> list[str]:
    """Every name ``resolve_model_config`` accepts besides a directory."""
    return [tiny.TINY_NAME] + builtin_config_names()


def _builtin_config(name: str) -> ModelConfig:
    text = resources.files("neo.models.configs").joinpath(f"{name}.json").read_text()
    return config_from_hf(json.loads(text), name=name)


def model_kind(model: str) -> str:
    """'tiny', 'builtin' or 'directory'; raises for anything else."""
    key = model.lower()
    if key == tiny.TINY_NAME:
        return "tiny"
    if key in builtin_config_names():
        return "builtin"
    if os.path.isdir(model):
        return "directory"
    raise ValueError(f"unknown model {model!r}: not a model directory and not a built-in name "
                     f"(built-in: {', '.join(builtin_model_names())})")


def resolve_model_config(model: str, dtype: torch.dtype | str | None = None) -> ModelConfig:
    """The ``ModelConfig`` of a model name or directory; ``dtype`` overrides the config's."""
    kind = model_kind(model)
    if kind == "tiny":
        config = tiny.tiny_config()
    elif kind == "builtin":
        config = _builtin_config(model.lower())
    else:
        config = read_model_config(model)
    return config if dtype is None else replace(config, dtype=parse_dtype(dtype))


def load_model(model: str, *, dtype: torch.dtype | str, device: torch.device | str,
               load_format: str = "auto", seed: int = 0,
               max_positions: int | None = None, parallel: TensorParallel | None = None) -> CausalLM:
    """Build a ``CausalLM`` on ``device`` in ``dtype`` and fill its weights.

    load_format: ``"auto"`` (safetensors for a directory, built-in weights for neo-tiny),
    ``"safetensors"`` (directories only) or ``"dummy"`` (uniform(-1e-3, 1e-3) weights and unit
    norm weights of the real shapes, generated on ``device`` from ``seed``). ``max_positions``
    caps the rotary table (and so the longest sequence) below the config's
    ``max_position_embeddings``; a model with a sliding window smaller than that context length
    is refused (``ModelConfig.context_length``). ``parallel``: the tensor-parallel group the
    model is one rank of (None: one rank); the rank loads its part of the weights only.
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load_format {load_format!r}; use one of "
                         f"{', '.join(LOAD_FORMATS)}")
    dtype = parse_dtype(dtype)
    config = resolve_model_config(model, dtype)
    kind = model_kind(model)
    if load_format != "dummy" and kind == "builtin":
        raise ValueError(f"{model!r} is a built-in config without weights; use "
                         f"load_format='dummy' for random weights of its shapes, or pass a "
                         f"Hugging Face model directory")
    if load_format == "safetensors" and kind == "tiny":
        raise ValueError(f"{tiny.TINY_NAME} has built-in weights, not safetensors files; use "
                         f"load_format='auto' (or save_tiny() it to a directory first)")
    with torch.no_grad():
        causal_lm = CausalLM(config, dtype=dtype, device=device, max_positions=max_positions,
                             parallel=parallel)
        if load_format == "dummy" and causal_lm.parallel.size > 1:
            initialize_dummy_shards(causal_lm, seed)
        elif load_format == "dummy":
            initialize_dummy_weights(causal_lm, seed)
        elif kind == "tiny":
            load_checkpoint_dict(causal_lm, tiny.tiny_checkpoint())
        else:
            load_safetensors(causal_lm, model)
    return causal_lm.eval()


def initialize_dummy_weights(model: CausalLM, seed: int, bound: float = 1e-3) -> None:
    """Fill every weight with uniform(-bound, bound) and every norm weight with 1, in place.

    Random numbers are drawn in place on the parameters' device and dtype: no host copy and
    no float32 temporary, one generator kernel per tensor. Deterministic for a given seed
    and device type. On the meta device it only walks the parameters.
    """
    device = model.final_norm_weight.device
    generator = None if device.type == "meta" else torch.Generator(device).manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm_weight"):
                parameter.fill_(1.0)
            else:
                parameter.uniform_(-bound, bound, generator=generator)


def initialize_dummy_shards(model: CausalLM, seed: int, bound: float = 1e-3) -> None:
    """Fill one tensor-parallel rank with its part of the dummy weights
    ``initialize_dummy_weights`` gives the one-rank model of the same seed.

    Walks the one-rank model's parameters (built on the meta device) in the same order, draws
    each whole on this rank's device from the same generator, and copies this rank's part of
    every checkpoint tensor it holds. Rank r of N thus holds exactly the rows and columns of the
    one-rank weights its checkpoint targets name; each rank draws every tensor (one at a time)
    but keeps only its part.
    """
    device = model.final_norm_weight.device
    dtype = model.final_norm_weight.dtype
    generator = torch.Generator(device).manual_seed(seed)
    whole_model = CausalLM(model.config, dtype=dtype, device="meta", max_positions=1)
    pieces_of: dict[int, list[tuple[str, CheckpointTarget]]] = {}
    for name, target in whole_model.checkpoint_targets().items():
        pieces_of.setdefault(id(target.parameter), []).append((name, target))
    rank_targets = model.checkpoint_targets()
    with torch.no_grad():
        for parameter_name, parameter in whole_model.named_parameters():
            values = torch.empty(parameter.shape, dtype=dtype, device=device)
            if parameter_name.endswith("norm_weight"):
                values.fill_(1.0)
            else:
                values.uniform_(-bound, bound, generator=generator)
            for name, target in pieces_of[id(parameter)]:
                copy_checkpoint_tensor(rank_targets[name], name, values.narrow(0, target.row_start, target.shape[0]))


def _ignorable(name: str, config: ModelConfig) -> bool:
    """Tensors a checkpoint may carry that neo does not use."""
    if name.endswith(_IGNORED_SUFFIXES):
        return True
    return config.tie_word_embeddings and name == "lm_head.weight"


def _listing(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


def verify_checkpoint_names(model: CausalLM, names,
                            source: str = "") -> dict[str, CheckpointTarget]:
    """The targets of ``model``'s checkpoint tensors, after checking a checkpoint's tensor names.

    Raises a ``ValueError`` naming the tensors when ``names`` (every tensor the checkpoint
    holds) lacks some the model needs or holds some it does not know.
    """
    targets = model.checkpoint_targets()
    present = set(names)
    missing = [name for name in targets if name not in present]
    unexpected = sorted(name for name in present
                        if name not in targets and not _ignorable(name, model.config))
    if missing or unexpected:
        problems = []
        if missing:
            problems.append(f"missing tensors: {_listing(missing)}")
        if unexpected:
            problems.append(f"unexpected tensors: {_listing(unexpected)}")
        where = f" in {source}" if source else ""
        raise ValueError(f"checkpoint{where} does not match the {model.config.architecture} "
                         f"config: " + "; ".join(problems))
    return targets


def check_checkpoint_shape(target: CheckpointTarget, name: str, shape: tuple[int, ...]) -> None:
    """A ``ValueError`` unless checkpoint tensor ``name`` of ``shape`` has the shape the config
    implies."""
    if shape != target.shape:
        raise ValueError(f"checkpoint tensor {name} has shape {shape}, the config implies {target.shape}")


def copy_checkpoint_tensor(target: CheckpointTarget, name: str, tensor: torch.Tensor) -> None:
    """Copy (this rank's part of) one whole checkpoint tensor into its place (converting dtype
    and device)."""
    check_checkpoint_shape(target, name, tuple(tensor.shape))
    with torch.no_grad():
        target.destination().copy_(tensor if target.shard_dim is None else tensor[target.part_index()])


def load_checkpoint_dict(model: CausalLM, checkpoint: dict[str, torch.Tensor]) -> None:
    """Fill ``model`` from an in-memory ``{Hugging Face name: tensor}`` checkpoint."""
    targets = verify_checkpoint_names(model, checkpoint)
    for name, tensor in checkpoint.items():
        if name in targets:
            copy_checkpoint_tensor(targets[name], name, tensor)


def safetensors_files(directory: str) -> list[str]:
    """A model directory's checkpoint files: the index's shards, else every ``*.safetensors``."""
    index_path = os.path.join(directory, INDEX_FILE)
    if os.path.isfile(index_path):
        with open(index_path) as file:
            weight_map = json.load(file).get("weight_map")
        if not weight_map:
            raise ValueError(f"{index_path} has no weight_map")
        files = [os.path.join(directory, shard) for shard in sorted(set(weight_map.values()))]
        absent = [os.path.basename(path) for path in files if not os.path.isfile(path)]
        if absent:
            raise FileNotFoundError(f"{INDEX_FILE} in {directory!r} lists shards that do not "
                                    f"exist: {_listing(absent)}")
        return files
    files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    if not files:
        other = sorted(os.path.basename(path) for pattern in ("*.bin", "*.pt", "*.pth")
                       for path in glob.glob(os.path.join(directory, pattern)))
        hint = (f" (found {_listing(other)}: neo reads safetensors only)" if other else "")
        raise FileNotFoundError(f"no *.safetensors files in model directory {directory!r}{hint}; "
                                f"use load_format='dummy' for random weights")
    return files


def load_safetensors(model: CausalLM, directory: str) -> None:
    """Fill ``model`` from the safetensors checkpoint in ``directory``, one tensor at a time (a
    tensor-parallel rank reads only its part of each split tensor)."""
    files = safetensors_files(directory)
    file_of: dict[str, str] = {}
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as checkpoint:
            for name in checkpoint.keys():
                if name in file_of:
                    raise ValueError(f"tensor {name} appears in both {file_of[name]} and "
                                     f"{os.path.basename(path)} of {directory!r}")
                file_of[name] = os.path.basename(path)
    targets = verify_checkpoint_names(model, file_of, source=directory)
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as checkpoint:
            for name in checkpoint.keys():
                target = targets.get(name)
                if target is None:
                    continue
                if target.shard_dim is None:
                    copy_checkpoint_tensor(target, name, checkpoint.get_tensor(name))
                    continue
                part = checkpoint.get_slice(name)
                check_checkpoint_shape(target, name, tuple(part.get_shape()))
                with torch.no_grad():
                    target.destination().copy_(part[target.part_index()])
