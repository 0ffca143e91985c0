"""The documentation works as written: docstring examples of the public entry points run, every
``python`` block of the README and of the pages in docs/ runs, every ``py`` sketch (code that
needs a cluster, a dataset or a model of your own) at least parses, and every relative link
resolves, to a heading where it names one."""

from __future__ import annotations

import doctest
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "gradtap"


def _modules_with_examples() -> list[str]:
    """Every gradtap module whose docstrings hold an example (``>>>``), found by reading the
    sources, so a new module's examples run without being listed here."""
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if ">>>" not in path.read_text():
            continue
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        names.append(".".join(p for p in parts if p != "__init__"))
    return names


DOCTEST_MODULES = _modules_with_examples()


def test_every_public_verb_has_a_runnable_example():
    import inspect

    import gradtap

    missing = [name for name in gradtap.__all__
               if (inspect.isfunction(getattr(gradtap, name))
                   and ">>>" not in (inspect.getdoc(getattr(gradtap, name)) or ""))]
    assert not missing, f"public functions without a docstring example: {missing}"


@pytest.mark.parametrize("name", DOCTEST_MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0, f"{name} has no examples"
    assert result.failed == 0


README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]
README_MAX_LINES = 300

# A fenced block: its language (``python`` runs, ``py`` is a sketch that is only parsed) and body.
_FENCE = re.compile(r"^```([\w-]*)[ \t]*\n(.*?)^```[ \t]*$", flags=re.S | re.M)
_KNOWN_LANGUAGES = {"python", "py", "bash", "text", ""}


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _fenced_blocks(page: Path) -> list[tuple[str, int, str]]:
    """(language, line of the opening fence, code) of every fenced block of ``page``."""
    text = page.read_text()
    return [(m.group(1), text.count("\n", 0, m.start()) + 1, m.group(2))
            for m in _FENCE.finditer(text)]


def _blocks(language: str) -> list:
    return [pytest.param(page, line, code, id=f"{_rel(page)}:{line}")
            for page in PAGES
            for lang, line, code in _fenced_blocks(page) if lang == language]


def _source(page: Path, line: int, code: str):
    # Padded with blank lines so a traceback gives the line number in the page itself.
    return compile("\n" * line + code, _rel(page), "exec")


def test_pages_hold_runnable_examples():
    runnable = {param.values[0] for param in _blocks("python")}
    assert README in runnable
    guides = sorted(DOCS.glob("guide-*.md"))
    assert guides, "no guide pages in docs/"
    assert [p for p in guides if p in runnable], "no guide page has a python block"


@pytest.mark.parametrize(("page", "line", "code"), _blocks("python"))
def test_python_blocks_run(page, line, code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # whatever a block writes lands in a scratch folder
    namespace: dict = {}
    try:
        exec(_source(page, line, code), namespace)  # noqa: S102 - our own docs
    finally:
        # What a block made (models, taps and their records) goes with it, even where a cache
        # keeps a function the block defined (and so its globals) alive.
        namespace.clear()


@pytest.mark.parametrize(("page", "line", "code"), _blocks("py"))
def test_sketches_parse(page, line, code):
    _source(page, line, code)


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_fences_name_a_known_language(page):
    unknown = [(line, lang) for lang, line, _ in _fenced_blocks(page)
               if lang not in _KNOWN_LANGUAGES]
    assert not unknown, (f"{_rel(page)}: fenced blocks with a language this test neither runs "
                         f"nor knows (python runs, py parses): {unknown}")
    indented = [n for n, line in enumerate(page.read_text().splitlines(), 1)
                if re.match(r"\s+```", line)]
    assert not indented, f"{_rel(page)}: indented fences, which this test does not read: {indented}"


def _without_code(text: str) -> str:
    text = _FENCE.sub("", text)
    return re.sub(r"`[^`\n]*`", "", text)


def _slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    for line in _FENCE.sub("", page.read_text()).splitlines():
        match = re.match(r"#{1,6} +(.*?) *#*$", line)
        if not match:
            continue
        slug = _slug(match.group(1))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        if count:
            seen[f"{slug}-{count}"] = 1
    return set(seen)


def _links(page: Path) -> list[str]:
    return re.findall(r"\]\(([^)\s]+)\)", _without_code(page.read_text()))


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_relative_links_resolve(page):
    broken = []
    for target in _links(page):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and (dest.suffix != ".md" or anchor not in _anchors(dest)):
            broken.append(f"{target} (no heading #{anchor} in {dest.name})")
    assert not broken, f"{_rel(page)}: broken links: {broken}"


def test_every_docs_page_is_reachable():
    index = DOCS / "index.md"
    assert "docs/index.md" in _links(README), "the README does not link docs/index.md"
    linked = {(DOCS / t.partition("#")[0]).resolve() for t in _links(index)}
    orphans = [_rel(p) for p in PAGES[1:] if p != index and p.resolve() not in linked]
    assert not orphans, f"pages docs/index.md does not link: {orphans}"


def test_readme_is_a_front_door():
    lines = len(README.read_text().splitlines())
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines (at most {README_MAX_LINES}): move the detail into a "
        "guide in docs/ and link it")
    assert "make test" in README.read_text()  # CI (.ci/run) runs the README's test command


def test_critical_batch_size_example_agrees_with_its_oracle():
    """The worked example of docs/health.md, in its quick form: the noise scale from samples
    equals the one from torch.func's per-sample gradients, and micro-batches equal ranks (the
    same halves of each batch, one process or two DDP ranks)."""
    import importlib
    import sys

    from tests._dist import gloo_available

    if not gloo_available():
        pytest.skip("torch.distributed with gloo is not in this torch build")
    sys.path.insert(0, str(ROOT / "examples"))  # also for the ranks it spawns
    try:
        got = list(importlib.import_module("critical_batch_size").main(["--quick"]).values())
    finally:
        sys.path.remove(str(ROOT / "examples"))
    # float32 gradients; |G|^2 is a difference of nearly equal numbers (B_simple >> B)
    assert got[0] == pytest.approx(got[3], rel=1e-4)
    assert got[1] == pytest.approx(got[2], rel=1e-4)

