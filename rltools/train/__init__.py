"""Training: the policy model (HF + peft LoRA + FSDP2), one GRPO step, and the trainer role loop."""
