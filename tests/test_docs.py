"""The README and docs/*.md as a reader meets them: every ```python block runs as written (a page's blocks in
order, in one namespace, so a block may use what an earlier one of the same page defined), every relative
link and anchor resolves, the README stays a landing page, and the lists that mirror the code (config
groups, the source layout) match it.

A block whose first line is ``# <relative path>`` is also written to that path (in a scratch folder, which is
the working directory and on ``sys.path``), so a page can show a user's file and then import it. A block that
cannot run here is preceded by ``<!-- not run: <reason> -->``; shell blocks are ```bash and never run.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# Pages other branches add; a link to one is allowed only while it does not exist yet.
PENDING = {"works_with.md", "trust.md", "parameters.md", "ssm.md", "loops.md", "own_method.md", "monitor.md"}
# What a block may need that only an extra installs: the block is skipped without it, not failed.
EXTRAS = {"transformers", "accelerate", "sklearn", "mlflow", "wandb", "tensorboard", "matplotlib", "hydra",
          "omegaconf"}
FENCE = re.compile(r"^(<!-- not run: (?P<why>[^>]+) -->\n)?```(?P<lang>[\w-]*)\n(?P<code>.*?)^```$", re.M | re.S)


def blocks(page: Path, lang: str) -> list[tuple[int, str, str | None]]:
    """``(line, code, reason not run)`` of each fenced ``lang`` block of ``page``."""
    text = page.read_text()
    return [(text[:m.start("code")].count("\n") + 1, m["code"], m["why"])
            for m in FENCE.finditer(text) if m["lang"] == lang]


def pages_with_python() -> list[Path]:
    return [page for page in PAGES if blocks(page, "python")]


@pytest.mark.parametrize("page", pages_with_python(), ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_python_block_runs_as_written(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    for line, code, _ in blocks(page, "yaml"):
        write_named_file(tmp_path, code)
    namespace = {"__name__": "__docs__"}
    for line, code, why in blocks(page, "python"):
        if why:
            continue
        write_named_file(tmp_path, code)
        where = f"{page.relative_to(REPO)}:{line}"
        try:
            exec(compile(code, where, "exec"), namespace)
        except ModuleNotFoundError as err:
            if (err.name or "").split(".")[0] in EXTRAS:
                pytest.skip(f"{where} needs {err.name}, an optional extra")
            raise AssertionError(f"the block at {where} fails as written: {err!r}") from err
        except Exception as err:
            raise AssertionError(f"the block at {where} fails as written: {err!r}") from err


def write_named_file(folder: Path, code: str) -> None:
    first = code.splitlines()[0] if code.strip() else ""
    match = re.fullmatch(r"# ([\w./-]+\.(?:py|yaml))", first)
    if match:
        path = folder / match[1]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(code)
        sys.modules.pop(path.parent.name, None)  # a module of that name imported by an earlier page


def test_the_blocks_not_run_say_why_and_are_few():
    skipped = [(page.name, line, why) for page in PAGES for line, _, why in blocks(page, "python") if why]
    assert all(why.strip() for _, _, why in skipped)
    assert len(skipped) <= 3, f"blocks not run: {skipped}"


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    return {slug(m[1]) for m in re.finditer(r"^#+ (.+)$", text, re.M)}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_relative_link_and_anchor_resolves(page):
    text = FENCE.sub("", page.read_text())
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"\w+://", target):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            if file.name not in PENDING:
                broken.append(target)
            continue
        if anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(target)
    assert not broken, f"{page.relative_to(REPO)}: links that lead nowhere: {broken}"


def test_the_readme_is_a_landing_page_with_contents():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 300
    contents = text[text.index("## Contents"):].split("\n## ", 1)[0]
    linked = set(re.findall(r"\]\(#([\w-]+)\)", contents))
    sections = {slug(h) for h in re.findall(r"^## (.+)$", text, re.M)} - {"contents"}
    assert sections <= linked, f"sections missing from the contents: {sections - linked}"


def test_the_config_group_table_names_every_option_and_no_other():
    """docs/hydra.md's table of config groups against configs/."""
    configs = REPO / "configs"
    rows = dict(re.findall(r"^\| `([\w/]+?)/?` \| (.+) \|$", (REPO / "docs" / "hydra.md").read_text(), re.M))
    for group in ("optimizer", "data", "trainer", "logger", "experiment", "hydra/launcher"):
        listed = set(re.findall(r"[\w]+", re.sub(r"\([^)]*\)", "", rows[group])))
        assert listed == {p.stem for p in (configs / group).glob("*.yaml")}, group
    model = rows["model"]
    for sub in ("attention", "mlp", "position"):
        listed = set(re.findall(r"\w+", re.search(rf"`model/{sub}`: ([^;)]+)", model)[1]))
        assert listed == {p.stem for p in (configs / "model" / sub).glob("*.yaml")}, f"model/{sub}"
    top = set(re.findall(r"`(\w+)`", re.sub(r"\([^)]*\)", "", model)))
    assert top == {p.stem for p in (configs / "model").glob("*.yaml")}, "model"


def test_the_layout_names_every_package_folder():
    package = REPO / "src" / "plasticity_callbacks"
    text = (REPO / "docs" / "layout.md").read_text()
    named = set(re.findall(r"^  (\w+)/", text, re.M))
    folders = {p.name for p in package.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert named == folders
