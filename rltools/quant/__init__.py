"""NVFP4: the format (nvfp4), the checkpoint layout vLLM reads (layout, checkpoint), the trainer's
frozen 4-bit linear layers (linear) and what a generator serves (serving)."""
