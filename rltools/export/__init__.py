"""`rltools export`: a trainer checkpoint of either backend as a PEFT adapter or a merged Hugging Face
model that vLLM, transformers and model stores load, checked with vLLM against the trainer's probe.

- `trained`: what a checkpoint changes in its base (the LoRA adapters, or a full fine-tune's weights).
- `merge`: the merged model, written tensor by tensor (an NVFP4 base dequantised first).
- `write`: one export's files, written beside their place, checked, then renamed into place.
- `serve`: vLLM on a policy, for `rltools eval` and for the check of an export: one path.

`write` and `serve` are light at import (torch and vLLM are imported inside their functions):
`rltools.jobs.export`, which the login side hands to Slurm, imports them; `trained` and `merge`
import torch and run only where the export is written.
"""
