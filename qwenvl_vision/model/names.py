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

from .config import VisionConfig

# A rule: (module tensor name pattern, the checkpoint tensor name(s) it is read from). Several names are stacked
# along dim 0 at load time (vLLM's stacked_params_mapping); one name is a rename. Unmatched module names are read
# under their own name. Matched with re.fullmatch, templates filled with match.expand.
LN_Q = {"norm": "ln_q", "linear_fc1": "mlp.0", "linear_fc2": "mlp.2"}  # a merger's layers as ln_q / mlp.N name them
RULE_SETS: dict[str, tuple[tuple[str, tuple[str, ...]], ...]] = {
    # Qwen2.5's gate_proj and up_proj, one matmul here (layers.GatedMLP).
    "fused_gate_up": ((r"(.*\.mlp)\.gate_up_proj\.(weight|bias)", (r"\1.gate_proj.\2", r"\1.up_proj.\2")),),
    # Qwen2.5-Omni's separate q, k, v (the other families already store one qkv).
    "split_qkv": ((r"(.*\.attn)\.qkv\.(weight|bias)", (r"\1.q.\2", r"\1.k.\2", r"\1.v.\2")),),
    # Qwen2-VL's MLP calls its layers fc1 / fc2.
    "fc_mlp": ((r"(.*\.mlp)\.linear_fc(1|2)\.(weight|bias)", (r"\1.fc\2.\3",)),),
    # The final merger as Qwen2-VL, Qwen2.5-VL and the Omni models name it.
    "ln_q_merger": tuple((rf"merger\.{ours}\.(weight|bias)", (rf"merger.{theirs}.\1",))
                         for ours, theirs in LN_Q.items()),
    # Qwen3-Omni's DeepStack mergers: merger_list.N with the same names.
    "ln_q_deepstack": tuple((rf"deepstack_merger_list\.(\d+)\.{ours}\.(weight|bias)", (rf"merger_list.\1.{theirs}.\2",))
                            for ours, theirs in LN_Q.items()),
}


def checkpoint_names(config: VisionConfig, module_name: str) -> tuple[str, ...]:
    """The checkpoint tensor(s) a module tensor is read from; several are stacked along dim 0, in order."""
    for set_name in config.family.names:
        for pattern, templates in RULE_SETS[set_name]:
            if match := re.fullmatch(pattern, module_name):
                return tuple(match.expand(t) for t in templates)
    return (module_name,)


def to_module_names_(config: VisionConfig, state: dict[str, torch.Tensor], module_names: Iterable[str],
                     prefix: str = "") -> dict[str, torch.Tensor]:
    """In place on a state dict about to be loaded: every module tensor absent under its own name whose checkpoint
    tensors are all there gets them, stacked or renamed, under its module name; ``state`` is returned.

    The parts leave the dict as they are stacked, so a load holds at most one stacked tensor beyond the tower.
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
    return state


def to_checkpoint_state(config: VisionConfig, module_state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Module state dict -> tensors named as the family's checkpoints name them (stacked tensors split)."""
    tensors: dict[str, torch.Tensor] = {}
    for module_name, value in module_state.items():
        parts = checkpoint_names(config, module_name)
        for name, piece in zip(parts, value.chunk(len(parts))):
            tensors[name] = piece if len(parts) == 1 else piece.clone()  # own storage: safetensors refuses shared
    return tensors
