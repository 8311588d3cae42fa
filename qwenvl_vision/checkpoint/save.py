"""Writing a vision-only checkpoint (``qwenvl-vision extract-weights``): the tower's tensors under the family's
names without prefix in one ``model.safetensors``, its ``config.json`` marked ``"format": "qwenvl-vision"`` and the
preprocessor configs, each file replaced whole and never through a link. ``weights.open_checkpoint`` reads it back.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from safetensors.torch import save

from ..model.names import to_checkpoint_state
from ..model.tower import VisionTower
from ..outputs.durable import refuse_link, replace_atomically
from .weights import (
    CONFIG_FILE,
    PREPROCESSOR_FILE,
    PROCESSOR_FILE,
    SINGLE_FILE,
    VIDEO_PREPROCESSOR_FILE,
    VISION_ONLY_FORMAT,
)

# Every name save_vision_only writes (or removes) in its folder, final and temporary: extract-weights refuses a
# target where one of them is a file of its source.
VISION_ONLY_FILES = (SINGLE_FILE, CONFIG_FILE, PREPROCESSOR_FILE, VIDEO_PREPROCESSOR_FILE, PROCESSOR_FILE)
TEMPORARY_SUFFIX = ".tmp"


def save_vision_only(model: VisionTower, folder: str | os.PathLike, preprocessor: dict | None = None,
                     video_preprocessor: dict | None = None) -> int:
    """Write a self-contained vision-only checkpoint that ``open_checkpoint`` reads back; returns the number of
    tensors written.

    Each file is replaced whole or not at all (``durable.replace_atomically``), and nothing is written through a
    symbolic link: a link at the folder or at any of the names written, final or temporary, is an
    ``OutputLinkError`` naming it, raised before any file is written. ``config.json`` is removed first and written
    last, so a folder left half-written (a full disk, a kill) does not load as a checkpoint with another's settings.
    """
    folder = Path(folder)
    config_json = {**model.config.to_config_json(), "format": VISION_ONLY_FORMAT}
    documents = {PREPROCESSOR_FILE: preprocessor, VIDEO_PREPROCESSOR_FILE: video_preprocessor, CONFIG_FILE: config_json}
    names = [SINGLE_FILE, *(name for name, document in documents.items() if document is not None)]
    for path in (folder, *(folder / name for name in names), *(folder / (name + TEMPORARY_SUFFIX) for name in names)):
        refuse_link(path)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / CONFIG_FILE).unlink(missing_ok=True)
    # Another checkpoint's transformers 5 settings, which transformers (and open_checkpoint) would read before ours.
    (folder / PROCESSOR_FILE).unlink(missing_ok=True)
    state = to_checkpoint_state(model.config, model.state_dict())
    for name in names:  # the weights first, config.json last
        data = save(state, metadata={"format": "pt", "family": model.config.model_type}) if name == SINGLE_FILE \
            else (json.dumps(documents[name], indent=2) + "\n").encode()
        # 0o666 less the umask, as a plain open() creates it: the folder's other files follow it
        replace_atomically(folder / name, folder / (name + TEMPORARY_SUFFIX), lambda f, data=data: f.write(data), 0o666)
    return len(state)
