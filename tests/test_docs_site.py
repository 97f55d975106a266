"""The docs build as a site with every link and anchor resolved (issue 43 item 16).

`mkdocs build --strict` (mkdocs.yml: `validation: anchors: warn`, strict turns warnings into a
failure) checks every link between the pages of docs/, including its `#anchor`. The README is not a
page of the site, so its links into docs/ are checked here against the built HTML. Code comments and
messages name a page and a section in prose (`docs/lora.md`, `docs/algorithms.md, "DAPO"`): the page
must exist, and for the pages split out of training.md the quoted section must be a heading there.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
# training.md and the topic pages split out of it: a pointer's quoted section must be one of their headings.
SPLIT_PAGES = ("training.md", "algorithms.md", "lora.md", "rewards.md", "memory.md", "packing.md")


def build_site(project: Path, site: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                          cwd=project, capture_output=True, text=True, timeout=300)


class _Ids(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.ids: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.ids.update(value for name, value in attrs if name == "id" and value)


def html_ids(path: Path) -> set[str]:
    parser = _Ids()
    parser.feed(path.read_text())
    return parser.ids


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    result = build_site(ROOT, out)
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stderr}"
    return out


def test_the_docs_build_strict_with_no_warning(site: Path) -> None:
    pages = {p.stem for p in DOCS.glob("*.md")}
    assert pages <= {p.stem for p in site.glob("*.html")}, "a page of docs/ is missing from the site"


def test_a_broken_anchor_fails_the_strict_build(tmp_path: Path) -> None:
    shutil.copytree(DOCS, tmp_path / "docs")
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    page = tmp_path / "docs" / "training.md"
    page.write_text(page.read_text() + "\nSee [nothing](algorithms.md#no-such-section).\n")
    result = build_site(tmp_path, tmp_path / "site")
    assert result.returncode != 0
    assert "training.md" in result.stderr and "#no-such-section" in result.stderr


def test_every_readme_link_into_the_docs_resolves(site: Path) -> None:
    links = re.findall(r"\]\(docs/([\w-]+)\.md(?:#([^)\s]+))?\)", (ROOT / "README.md").read_text())
    assert len(links) >= 10 and any(anchor for _, anchor in links)
    broken = []
    for page, anchor in links:
        html = site / f"{page}.html"
        if not html.is_file():
            broken.append(f"docs/{page}.md")
        elif anchor and anchor not in html_ids(html):
            broken.append(f"docs/{page}.md#{anchor}")
    assert not broken, f"README.md links to what the docs do not have: {broken}"


def _headings(page: Path) -> list[str]:
    return [re.sub(r"[`*]", "", line.lstrip("#").strip()).lower()
            for line in page.read_text().splitlines() if re.match(r"#{1,6} ", line)]


def test_every_pointer_into_the_docs_names_a_page_and_section_that_exist() -> None:
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split("\0")
    pointer = re.compile(r"docs/([\w-]+\.md)(?:,?\s*[\"']([^\"'\n]{2,80})[\"'])?")
    headings = {page: _headings(DOCS / page) for page in SPLIT_PAGES}
    stale = []
    for name in tracked:
        path = ROOT / name
        if not name or path.suffix not in {".py", ".sh", ".md", ".yaml", ".yml", ".txt", ".toml"} \
                or not path.is_file():
            continue
        for match in pointer.finditer(path.read_text(errors="replace")):
            page, section = match.groups()
            if not (DOCS / page).is_file():
                stale.append(f"{name}: docs/{page}")
            elif section and page in headings and not any(section.lower() in h for h in headings[page]):
                stale.append(f"{name}: docs/{page} {section!r}")
    assert not stale, f"pointers to a docs page or section that does not exist: {stale}"
