"""The Megatron trainer backend (`trainer.backend: megatron`): a megatron-core GPTModel with tensor
parallelism and LoRA on its parallel linear layers, behind the same interface as the FSDP2 backend
(the Trainer's step, weight export under Hugging Face names, PEFT-named adapters, checkpoints)."""
