"""The project's one family of exceptions: catch ``QwenVLVisionError`` to catch every error this package raises
on purpose. Each is also the builtin a caller would catch for it (``ValueError``, ``RuntimeError``, ...)."""

from __future__ import annotations


class QwenVLVisionError(Exception):
    """Base of every error the package raises on purpose; the message names the culprit in one line."""


class ConfigError(QwenVLVisionError, ValueError):
    """A config (config.json, preset, preprocessor settings or an option) that does not describe a supported tower."""


class CheckpointError(QwenVLVisionError, ValueError):
    """A checkpoint that cannot be loaded as it is; the message names the file or tensor at fault."""


class InputError(QwenVLVisionError, ValueError):
    """pixel_values / grid_thw that do not describe a valid packed batch."""


class PreprocessError(QwenVLVisionError, ValueError):
    """An input that cannot be preprocessed. The message names the input (index and/or path) and why."""


class EncoderClosedError(QwenVLVisionError, RuntimeError):
    """The encoder was closed; its weights and caches are gone."""


class NumericalError(QwenVLVisionError, FloatingPointError):
    """The tower's outputs are not finite (float16 overflows in the Qwen2.5-VL tower): use bfloat16 or float32."""


class CacheFolderError(QwenVLVisionError, ValueError):
    """A vLLM encoder-cache folder that holds another model's items, or items of unknown origin."""


class EmbedError(QwenVLVisionError):
    """An embed run that cannot start or go on; ``exit_code`` is what the CLI exits with."""

    exit_code = 2


class ManifestError(EmbedError, ValueError):
    """A damaged manifest line or run.json; the message names the file and line."""


class OutputFaultError(EmbedError):
    """Writing the output failed (disk full, read-only, ...); what is recorded is intact, --resume finishes."""

    exit_code = 3


class OutputLinkError(OutputFaultError):
    """A symbolic link where this package writes a file of its own (a lock, a temporary file, a config it
    writes): refused and left as it is, never written through. Exit 3, like any fault of the output folder."""


class ForwardFaultError(QwenVLVisionError, RuntimeError):
    """A forward failed for the machine's reasons, not an input's (a kernel's RuntimeError, or out of memory on a
    batch that then also failed item by item for another reason). The message names the batch's inputs; the
    original error is its ``__cause__``. ``embed`` stops with exit 4; what is recorded is kept, ``--resume``
    goes on."""

    exit_code = 4


class PeerFailedError(EmbedError):
    """Another rank failed and said why; this rank stops quietly with the same exit code."""

    quiet = True  # the CLI prints nothing for it

    def __init__(self, exit_code: int) -> None:
        super().__init__(f"another rank failed (exit code {exit_code})")
        self.exit_code = exit_code


def first_line(error: BaseException, limit: int = 300) -> str:
    """The error's type and the first line of its message, at most ``limit`` characters (torch's run long)."""
    text = (str(error).strip().splitlines() or [""])[0]
    if not text:
        return type(error).__name__
    return f"{type(error).__name__}: {text if len(text) <= limit else text[:limit] + '...'}"
