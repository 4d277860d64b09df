import re

from rltools.config.reference import END, START, reference


def test_config_reference_is_in_sync(repo):
    text = (repo / "docs" / "configuration.md").read_text()
    block = text.split(START, 1)[1].split(END, 1)[0]
    assert block.strip() == reference().strip(), "run: python -m rltools.config.reference"


def test_ci_runs_the_readme_test_command(repo):
    readme = (repo / "README.md").read_text()
    quick_start = readme.split("## Quick start", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    test_command = re.search(r"^(bash scripts/test\.sh)\s", quick_start, re.M).group(1)
    assert test_command in (repo / ".ci" / "run").read_text()


def test_every_relative_link_in_the_docs_leads_to_a_file(repo):
    broken = []
    for page in [repo / "README.md", *sorted((repo / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" not in target and not (page.parent / target).exists():
                broken.append(f"{page.relative_to(repo)} -> {target}")
    assert not broken, broken


def test_the_readme_fits_a_screenful_of_scrolling(repo):
    assert len((repo / "README.md").read_text().splitlines()) <= 300, "move detail to docs/"


def test_the_model_matrix_doc_is_generated_from_the_tested_table(repo):
    from rltools.models import ARCHITECTURES, TESTED, render

    assert (repo / "docs" / "models.md").read_text() == render(), "run: python -m rltools.models"
    assert any(status == TESTED for a in ARCHITECTURES for status in a.sync.values())
