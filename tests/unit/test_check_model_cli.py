"""`rltools check-model`'s input checks: refused before anything heavy is imported or built."""

import pytest

from rltools.cli import main

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("argv, message", [
    (["--sync", "lora,merged"], "--sync lora,merged: give some of lora, adapted, full"),
    (["--layers", "0"], "--layers and --experts must be at least 1"),
])
def test_bad_flags_are_refused_naming_them(repo, capsys, argv, message):
    assert main(["check-model", str(repo / "rltools" / "assets" / "tiny-arith"), *argv]) == 2
    assert message in capsys.readouterr().err


def test_a_directory_without_a_config_is_refused(tmp_path, capsys):
    assert main(["check-model", str(tmp_path)]) == 2
    assert "no config.json; give a Hugging Face model directory" in capsys.readouterr().err
