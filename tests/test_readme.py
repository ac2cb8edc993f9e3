"""README.md stays what a newcomer reads in two minutes, and true: under 120 lines, its
test command the one `.ci/run` runs, its picture present, each figure it quotes linked
to its row in docs/benchmarks.md."""

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _read(*path):
    with open(os.path.join(ROOT, *path), encoding="utf-8") as f:
        return f.read()


def test_readme_is_short_and_its_commands_and_picture_are_the_real_ones():
    readme = _read("README.md")
    assert len(readme.splitlines()) < 120
    ci = _read(".ci", "run")
    command = re.search(r"^\.venv/bin/python -m pytest .*$", ci, re.M)[0]
    assert f"\n{command}\n" in readme  # .ci/run runs exactly the README's test command
    assert "keras-gpufix demo" in readme
    for image in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", readme):
        assert os.path.isfile(os.path.join(ROOT, image)), image


def test_every_figure_the_readme_quotes_links_to_its_row_in_benchmarks_md():
    readme, benchmarks = _read("README.md"), _read("docs", "benchmarks.md")
    rows = set(re.findall(r'<a id="([\w-]+)"></a>', benchmarks))
    measured = readme.split("## Measured", 1)[1].split("\n## ", 1)[0]
    items = measured.split("\n- ")[1:]
    assert 1 <= len(items) <= 3  # at most three headline figures
    for item in items:
        links = re.findall(r"\(docs/benchmarks\.md#([\w-]+)\)", item)
        assert links and set(links) <= rows, item
