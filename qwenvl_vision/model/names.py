"""Module tensor names <-> a family's checkpoint tensor names (without the prefix).

Our modules are named as the checkpoints name their tensors, except what the rule sets here (``RULE_SETS``; a
family's ``config.Family.names`` says which apply to it) change: tensors stacked at load time (gate/up into
``gate_up_proj``; Qwen2.5-Omni's q/k/v into ``qkv``: vLLM's stacked_params_mapping), and renames (Qwen2-VL's
``fc1``/``fc2``; the ``ln_q``/``mlp.0``/``mlp.2`` mergers and Qwen3-Omni's ``merger_list``). One function,
``checkpoint_names``, says where each module tensor comes from; the rest follows from it, in both directions, so
loading and writing cannot disagree.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

import torch

from ..errors import CheckpointError
from .config import VisionConfig

# A rule: (module tensor name pattern, the checkpoint tensor name(s) it is read from). Several names are stacked
# along dim 0 at load time (vLLM's stacked_params_mapping); one name is a rename. Unmatched module names are read
# under their own name. Matched with re.fullmatch, templates filled with match.expand.
Rule = tuple[str, tuple[str, ...]]
RULE_SETS: dict[str, tuple[Rule, ...]] = {
    # Qwen2.5's gate_proj and up_proj, one matmul here (layers.GatedMLP).
    "fused_gate_up": ((r"(.*\.mlp)\.gate_up_proj\.(weight|bias)", (r"\1.gate_proj.\2", r"\1.up_proj.\2")),),
    # Qwen2.5-Omni's separate q, k, v (the other families already store one qkv).
    "split_qkv": ((r"(.*\.attn)\.qkv\.(weight|bias)", (r"\1.q.\2", r"\1.k.\2", r"\1.v.\2")),),
    # Qwen2-VL's MLP calls its layers fc1 / fc2.
    "fc_mlp": ((r"(.*\.mlp)\.linear_fc(1|2)\.(weight|bias)", (r"\1.fc\2.\3",)),),
    # The final merger as Qwen2-VL, Qwen2.5-VL and the Omni models name it: ln_q, mlp.0, mlp.2.
    "ln_q_merger": (
        (r"merger\.norm\.(weight|bias)", (r"merger.ln_q.\1",)),
        (r"merger\.linear_fc1\.(weight|bias)", (r"merger.mlp.0.\1",)),
        (r"merger\.linear_fc2\.(weight|bias)", (r"merger.mlp.2.\1",)),
    ),
    # Qwen3-Omni's DeepStack mergers: merger_list.N with the same ln_q / mlp names.
    "ln_q_deepstack": (
        (r"deepstack_merger_list\.(\d+)\.norm\.(weight|bias)", (r"merger_list.\1.ln_q.\2",)),
        (r"deepstack_merger_list\.(\d+)\.linear_fc1\.(weight|bias)", (r"merger_list.\1.mlp.0.\2",)),
        (r"deepstack_merger_list\.(\d+)\.linear_fc2\.(weight|bias)", (r"merger_list.\1.mlp.2.\2",)),
    ),
}


def rules(config: VisionConfig) -> tuple[Rule, ...]:
    """The rules of the config's family, in the order its ``Family.names`` lists the sets."""
    return tuple(rule for set_name in config.family.names for rule in RULE_SETS[set_name])


def checkpoint_names(config: VisionConfig, module_name: str) -> tuple[str, ...]:
    """The checkpoint tensor(s) a module tensor is read from; several are stacked along dim 0, in order."""
    for pattern, templates in rules(config):
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
            raise CheckpointError(f"missing tensor(s) {missing} for the {config.family.label} tower")
        pieces = [tensors.pop(name) if isinstance(tensors, dict) else tensors[name] for name in parts]
        state[module_name] = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
    return state


def to_module_names_(config: VisionConfig, state: dict[str, torch.Tensor], module_names: Iterable[str],
                     prefix: str = "") -> None:
    """In place on a state dict about to be loaded: every module tensor absent under its own name whose checkpoint
    tensors are all there gets them, stacked or renamed, under its module name (the parts leave the dict).

    Anything else is left as it is, so that ``load_state_dict`` still reports it: a module tensor with a part
    missing stays missing and its other parts stay unexpected.
    """
    for module_name in module_names:
        key = prefix + module_name
        parts = [prefix + name for name in checkpoint_names(config, module_name)]
        if key in state or parts == [key] or not all(part in state for part in parts):
            continue
        pieces = [state.pop(part) for part in parts]
        state[key] = pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def to_checkpoint_state(config: VisionConfig, module_state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Module state dict -> tensors named as the family's checkpoints name them (stacked tensors split)."""
    tensors: dict[str, torch.Tensor] = {}
    for module_name, value in module_state.items():
        parts = checkpoint_names(config, module_name)
        for name, piece in zip(parts, value.chunk(len(parts))):
            tensors[name] = piece if len(parts) == 1 else piece.clone()  # own storage: safetensors refuses shared
    return tensors
