"""The reference side of `rltools bench step`: TRL's GRPOTrainer on the same model and batch shape.

Run in its own process (one torch thread): `python -m rltools.bench.trl_reference MODEL STEPS ...`.
TRL as shipped: its GRPOConfig defaults (bf16 autocast, gradient checkpointing, beta 0.0), HF
`generate` for sampling, full fine-tuning. Prints one JSON object with per-step wall times.
"""

import json
import os
import sys
import time


def main(model: str, steps: int, prompts: int, group: int, max_tokens: int, learning_rate: float, seed: int) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from ..data import arithmetic

    rows = [
        {"prompt": arithmetic.model_text(p), "answer": p.answer}
        for step in range(steps)
        for p in arithmetic.train_prompts(seed, epoch=0, step=step, count=prompts)
    ]

    def reward(completions, answer, **_):
        return [arithmetic.reward(c, a) for c, a in zip(completions, answer)]

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.times = []

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter())

    timer = StepTimer()
    config = GRPOConfig(
        output_dir=os.environ.get("TMPDIR", "/tmp") + "/rltools-trl-bench",
        per_device_train_batch_size=prompts * group,
        num_generations=group,
        max_completion_length=max_tokens,
        learning_rate=learning_rate,
        max_steps=steps,
        save_strategy="no",
        report_to=[],
        logging_steps=10**6,
        seed=seed,
        dataloader_num_workers=0,
        use_cpu=True,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=config,
        train_dataset=Dataset.from_list(rows),
        processing_class=AutoTokenizer.from_pretrained(model, local_files_only=True),
        callbacks=[timer],
    )
    start = time.perf_counter()
    trainer.train()
    marks = [start] + timer.times
    settings = {"bf16": config.bf16, "gradient_checkpointing": config.gradient_checkpointing, "beta": config.beta}
    print(json.dumps({"step_s": [b - a for a, b in zip(marks, marks[1:])], "settings": settings}))


if __name__ == "__main__":
    model, steps, prompts, group, max_tokens, lr, seed = sys.argv[1:8]
    main(model, int(steps), int(prompts), int(group), int(max_tokens), float(lr), int(seed))
