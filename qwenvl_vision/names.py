"""Module tensor names <-> a family's checkpoint tensor names (without the prefix).

Our modules are named as the checkpoints name their tensors, except what ``config.Family.names`` lists: tensors
stacked at load time (gate/up into ``gate_up_proj``; Qwen2.5-Omni's q/k/v into ``qkv``: vLLM's
stacked_params_mapping), and renames (Qwen2-VL's ``fc1``/``fc2``; the ``ln_q``/``mlp.0``/``mlp.2`` mergers and
Qwen3-Omni's ``merger_list``). One function, ``checkpoint_names``, says where each module tensor comes from; the
rest follows from it, in both directions, so loading and writing cannot disagree.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

import torch

from .config import VisionConfig
from .errors import CheckpointError


def checkpoint_names(config: VisionConfig, module_name: str) -> tuple[str, ...]:
    """The checkpoint tensor(s) a module tensor is read from; several are stacked along dim 0, in order."""
    for pattern, templates in config.spec.names:
        match = re.fullmatch(pattern, module_name)
        if match:
            return tuple(match.expand(t) for t in templates)
    return (module_name,)


def to_module_state(config: VisionConfig, tensors: Mapping[str, torch.Tensor],
                    module_names: Iterable[str]) -> dict[str, torch.Tensor]:
    """Checkpoint tensors -> module state dict: parts stacked, renames applied. Consumes ``tensors`` entries
    as it goes when given a dict (so a load holds at most one stacked tensor beyond the tower)."""
    state: dict[str, torch.Tensor] = {}
    for module_name in module_names:
        parts = checkpoint_names(config, module_name)
        missing = [name for name in parts if name not in tensors]
        if missing:
            raise CheckpointError(f"missing tensor(s) {missing} for the {config.spec.label} tower")
        pieces = [tensors.pop(name) if isinstance(tensors, dict) else tensors[name] for name in parts]
        state[module_name] = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
    return state


def to_checkpoint_state(config: VisionConfig, module_state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Module state dict -> tensors named as the family's checkpoints name them (stacked tensors split)."""
    tensors: dict[str, torch.Tensor] = {}
    for module_name, value in module_state.items():
        parts = checkpoint_names(config, module_name)
        for name, piece in zip(parts, value.chunk(len(parts))):
            tensors[name] = piece if len(parts) == 1 else piece.clone()  # own storage: safetensors refuses shared
    return tensors
