"""The documentation site builds with ``mkdocs build --strict`` (every page in the nav exists, every link and
anchor resolves, mkdocstrings renders every API page from the docstrings, including ``cde_nets.solvers``, found
through the installed package), and the built site, read as a reader would: no raw markup on any page, no broken
internal link, and every API page's parameter table shows each parameter's true default. The build is made once
per session (``built_site``); every test that reads it lives in this file, so that one worker builds it."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

# What a reader must never see: an unrendered mkdocstrings directive, Sphinx roles, reST literals and directives,
# and a path to a documentation source where a link belongs.
RAW = {
    "mkdocstrings directive": re.compile(r"^:::", re.M),
    "Sphinx role": re.compile(r":(class|func|meth|mod|data|attr|exc):`"),
    "reST literal": re.compile(r"``[^`\s][^`]*``"),
    "reST directive": re.compile(r"^\.\. [\w-]+::", re.M),
    "path to a docs page": re.compile(r"\bdocs/[\w/]+\.md\b"),
}


class _Page(HTMLParser):
    """A page's visible text outside code blocks, its link targets and its element ids."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.text: list[str] = []
        self.hrefs: list[str] = []
        self.ids: set[str] = set()
        self._skip = 0  # depth inside <pre>, <script>, <style>

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if a.get("id"):
            self.ids.add(a["id"])
        if tag == "a" and a.get("href"):
            self.hrefs.append(a["href"])
        if tag in ("pre", "script", "style"):
            self._skip += 1

    def handle_endtag(self, tag):
        if tag in ("pre", "script", "style") and self._skip:
            self._skip -= 1

    def handle_data(self, data):
        if not self._skip:
            self.text.append(data)


def _pages(site: Path) -> dict[Path, _Page]:
    pages = {}
    for path in sorted(site.rglob("*.html")):
        if path.name == "404.html":
            continue
        parser = _Page()
        parser.feed(path.read_text())
        pages[path] = parser
    return pages


pytestmark = pytest.mark.slow  # every test reads the built site (mkdocs build --strict, about 7 s)


@pytest.fixture(scope="module")
def site(built_site):
    folder, proc = built_site
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return folder, _pages(folder)


def test_mkdocs_build_strict(built_site):
    site, proc = built_site
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    api = (site / "api" / "discrete" / "index.html").read_text()
    assert 'id="cde_nets.solvers.schemes.Scheme"' in api  # the installed-only subpackage was found
    assert ":class:" not in api  # Sphinx roles render as code, not as markup
    assert (site / "reproductions" / "index.html").exists()


def test_no_page_shows_raw_markup(site):
    _, pages = site
    found = []
    for path, page in pages.items():
        text = "".join(page.text)
        found += [(path.parent.name, what, m.group(0)) for what, rx in RAW.items() for m in rx.finditer(text)]
    assert found == []


def test_every_internal_link_resolves(site):
    folder, pages = site
    broken = []
    for path, page in pages.items():
        for href in page.hrefs:
            parts = urlsplit(href)
            if parts.scheme or parts.netloc or href.startswith("mailto:"):
                continue
            target = (path.parent / unquote(parts.path)).resolve() if parts.path else path
            if target.is_dir():
                target = target / "index.html"
            if not target.exists():
                broken.append((str(path.relative_to(folder)), href))
            elif parts.fragment and target in pages and parts.fragment not in pages[target].ids:
                broken.append((str(path.relative_to(folder)), href))
    assert broken == []


def _resolve(path: str):
    """The object of a heading id such as ``cde_nets.ODEBlock.solve``."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(path)


_SECTION = re.compile(r'<h[2-6] id="(cde_nets\.[\w.]+)"')
_ROW = re.compile(r'<tr class="doc-section-item">(.*?)</tr>', re.S)
_CELL = re.compile(r"<td>(.*?)</td>", re.S)


def _cell_text(html: str) -> str:
    parser = _Page()
    parser.feed(html)
    return "".join(parser.text).strip()


def test_api_pages_show_the_true_defaults(site):
    folder, _ = site
    checked, wrong = 0, []
    for page in sorted((folder / "api").rglob("index.html")):
        html = page.read_text()
        heads = list(_SECTION.finditer(html))
        for head, nxt in zip(heads, [*heads[1:], None]):
            body = html[head.end() : nxt.start() if nxt else len(html)]
            rows = [_CELL.findall(r) for r in _ROW.findall(body)]
            rows = [r for r in rows if len(r) == 4]  # name, type, description, default: a parameters table
            if not rows:
                continue
            obj = _resolve(head.group(1))
            sig = inspect.signature(obj.__init__ if inspect.isclass(obj) else obj)
            for cells in rows:
                name, shown = _cell_text(cells[0]), _cell_text(cells[3])
                param = sig.parameters.get(name.lstrip("*"))
                checked += 1
                if param is None:
                    wrong.append((head.group(1), name, "no such parameter"))
                elif shown == "required":
                    if param.default is not inspect.Parameter.empty:
                        wrong.append((head.group(1), name, f"shown required, default {param.default!r}"))
                elif param.default is inspect.Parameter.empty and param.kind not in (
                    param.VAR_POSITIONAL,
                    param.VAR_KEYWORD,
                ):
                    wrong.append((head.group(1), name, f"shown {shown}, but required"))
                else:
                    try:
                        value = ast.literal_eval(shown)
                    except (ValueError, SyntaxError):
                        continue  # an expression (a constant's name, a call): shown as written in the source
                    if value != param.default:
                        wrong.append((head.group(1), name, f"shown {shown}, default {param.default!r}"))
    assert checked > 50 and wrong == []


_SIGNATURE = re.compile(r'<div class="doc-signature highlight"><pre><span></span><code>(.*?)</code></pre>', re.S)


def test_api_signatures_are_formatted_to_fit_the_page(site):
    """mkdocstrings lays a signature out one parameter a line only when Black or Ruff is installed (the docs extra
    brings Ruff); without it ODEBlock's signature was one line of 464 characters, cut off at the page's edge.
    Checked on every callable's signature (an attribute's value may hold a longer string)."""
    folder, _ = site
    signatures: list[tuple[str, list[str]]] = []
    for page in sorted((folder / "api").rglob("index.html")):
        for m in _SIGNATURE.finditer(page.read_text()):
            parser = _Page()
            parser.feed(m.group(1))
            lines = "".join(parser.text).splitlines()
            if lines and re.match(r"[\w.]+\(", lines[0]):
                signatures.append((lines[0].split("(")[0], lines))
    assert len(signatures) > 100
    assert len(dict(signatures)["ODEBlock"]) > 10  # one parameter a line
    wide = [(name, max(map(len, lines))) for name, lines in signatures if max(map(len, lines)) > 90]
    assert wide == []


def test_the_docs_extra_installs_a_signature_formatter():
    import tomllib

    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["docs"]
    assert any(re.match(r"(ruff|black)\b", requirement) for requirement in extra), extra


ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _python_blocks(text: str) -> list[list[str]]:
    return [b.split("\n")[1:] for b in re.findall(r"^```python\n(?:.*\n)*?(?=```)", text, re.M)]


def test_code_blocks_fit_a_1280_px_page():
    """Material's content column at 1280 px shows about 90 characters of code before a comment is clipped."""
    long = [
        (p.name, line) for p in PAGES for block in _python_blocks(p.read_text()) for line in block if len(line) > 90
    ]
    assert long == []


def test_readme_opens_with_a_quick_start_then_the_set_up_then_the_jobs():
    readme = (ROOT / "README.md").read_text()
    first = _python_blocks(readme)[0]
    code = [line for line in first if line.strip() and not line.startswith(("import", "from"))]
    assert len(code) <= 5 and any("ODEBlock(" in line for line in code)  # a field, a block, a solve
    order = [readme.index(s) for s in ("```python", "## Set up", "all --quick", "## The three jobs")]
    assert order == sorted(order)


def test_every_table_column_has_a_header():
    empty = []
    for p in PAGES:
        lines = p.read_text().splitlines()
        for above, line in zip(lines, lines[1:]):
            if re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", line.strip()):  # the separator: the line above is the header
                cells = [c.strip() for c in above.strip().strip("|").split("|")]
                empty += [(p.name, above)] if "" in cells else []
    assert empty == []
