#!/usr/bin/env bash
# One prepared run for a lent GPU (a session's device budget is ~15 minutes; this is sized for ~8):
# the CUDA tests, then bf16 throughput of qwen2.5-vl-3b and qwen3-vl-8b against transformers (sdpa),
# eager and compiled, on the mixed batch (29k / 22k tokens) and on 16 images of 1024 patches (16k tokens).
# JSON goes to ${OUT:-bench/results}. It uses the machine's python3 with this repo on PYTHONPATH: the GPU
# machine cannot reach PyPI, and its image already holds torch, transformers, safetensors and pytest.
#
#   bash bench/cuda_check.sh            (from the repository root, on the GPU machine)
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
out="${OUT:-bench/results}"
mkdir -p "$out"

python3 - <<'PY'
import torch, transformers
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0),
      "transformers", transformers.__version__)
try:
    import flash_attn
    print("flash-attn", flash_attn.__version__)
except Exception as e:  # noqa: BLE001
    print("flash-attn not usable (torch varlen_attn instead):", type(e).__name__)
PY

timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_compile.py 2>&1 | tail -30

for preset in qwen2.5-vl-3b qwen3-vl-8b; do
  timeout 150 python3 bench/throughput.py --device cuda --dtype bf16 --preset "$preset" --inputs mixed \
    --repeats 5 --warmup 2 --compile --json "$out/cuda-$preset-mixed.json"
  timeout 90 python3 bench/throughput.py --device cuda --dtype bf16 --preset "$preset" --inputs 1024-patch \
    --repeats 5 --warmup 2 --json "$out/cuda-$preset-1024.json"
done
