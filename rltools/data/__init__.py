"""Problem sources for RL fine-tuning: generated arithmetic (the CPU demo) and files of problems (JSONL, Parquet)."""
