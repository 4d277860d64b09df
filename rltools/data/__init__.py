"""Problem sources for RL fine-tuning: generated arithmetic (the CPU demo) and, later, files of problems."""
