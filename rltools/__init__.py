"""rltools: Slurm-native RL fine-tuning of LLMs (GRPO/PPO on LoRA adapters, vLLM generation)."""

__version__ = "0.1.0"
