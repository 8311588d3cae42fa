"""Reading released checkpoints: the vision tensors of a safetensors folder or file (``weights``), from a local path
or the Hugging Face Hub cache (``hub``); and writing a vision-only checkpoint (``save``, what ``extract-weights``
runs)."""
