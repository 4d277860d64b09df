import re

from rltools.config.reference import END, START, reference


def test_readme_config_reference_is_in_sync(repo):
    text = (repo / "README.md").read_text()
    block = text.split(START, 1)[1].split(END, 1)[0]
    assert block.strip() == reference().strip(), "run: python -m rltools.config.reference README.md"


def test_ci_runs_the_readme_test_command(repo):
    readme = (repo / "README.md").read_text()
    quick_start = readme.split("## Quick start", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    test_command = re.search(r"^(bash scripts/test\.sh)\s", quick_start, re.M).group(1)
    assert test_command in (repo / ".ci" / "run").read_text()
