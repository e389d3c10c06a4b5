"""docs/flags.md is generated from the flag parsers; it must match them (and name every option)."""

from __future__ import annotations

import re

from dev import flag_docs

from conftest import ROOT

FLAGS_MD = ROOT / "docs" / "flags.md"
STALE = f"docs/flags.md differs from the flag parsers; regenerate it with: {flag_docs.REGENERATE}"


def test_flags_doc_is_generated_from_the_parsers() -> None:
    assert FLAGS_MD.exists(), STALE
    assert FLAGS_MD.read_text(encoding="utf-8") == flag_docs.render(), STALE


def test_flags_doc_names_every_config_field() -> None:
    """Every field of TrainConfig (of its sub-configs, if it has them) is a flag in the doc."""
    text = FLAGS_MD.read_text(encoding="utf-8")
    missing = [f.name for f in flag_docs.config_fields() if f"`--{f.name}`" not in text]
    assert not missing, f"docs/flags.md lacks {missing}; {STALE}"


def test_check_option_reports_a_stale_doc(tmp_path, monkeypatch, capsys) -> None:
    stale = tmp_path / "flags.md"
    stale.write_text("# Flags\n", encoding="utf-8")
    monkeypatch.setattr(flag_docs, "DOC_PATH", stale)
    assert flag_docs.main(["--check"]) == 1
    assert flag_docs.REGENERATE in capsys.readouterr().err
    assert flag_docs.main([]) == 0
    assert flag_docs.main(["--check"]) == 0


def test_doc_links_point_at_files_and_headings_that_exist() -> None:
    """Relative links between README.md, README.zh-CN.md and docs/ name files (and headings)
    that exist."""
    pages = [ROOT / "README.md", ROOT / "README.zh-CN.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        text = page.read_text(encoding="utf-8")
        for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", text):
            if "://" in target:
                continue
            linked = (page.parent / target) if target else page
            if not linked.exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
            elif anchor and linked.is_file() and anchor not in _anchors(linked):
                broken.append(f"{page.relative_to(ROOT)} -> {target}#{anchor}")
    assert not broken, broken


def _anchors(page) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    headings = re.findall(r"^#+ (.+)$", text, flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_the_package_map_is_generated_from_the_docstrings() -> None:
    """docs/development.md's package map lists every module with its docstring's first
    sentence, short enough for two lines of the map."""
    from dev import module_map

    doc = module_map.DOC_PATH.read_text(encoding="utf-8")
    stale = f"docs/development.md's package map is stale; regenerate it: {module_map.REGENERATE}"
    assert module_map.updated(doc) == doc, stale
    unlisted = [
        str(path.relative_to(ROOT))
        for path in sorted((ROOT / "src" / "imgtrainer").rglob("*.py"))
        if path.name != "__init__.py" and f" {path.name} " not in doc.replace("\n", " ")
    ]
    assert not unlisted, f"modules missing from the package map: {unlisted}"
    assert not module_map.missing_summaries(), "modules without a docstring to list"
    long = [f"{path} ({len(text)})" for path, text in module_map.summaries() if len(text) > 150]
    assert not long, "first docstring sentences too long for the map (150 at most):\n" + "\n".join(
        long
    )


def test_the_map_check_reports_a_stale_map(tmp_path, monkeypatch, capsys) -> None:
    from dev import module_map

    doc = tmp_path / "development.md"
    doc.write_text(
        f"# Development\n\n{module_map.BEGIN}\nold\n{module_map.END}\n", encoding="utf-8"
    )
    monkeypatch.setattr(module_map, "DOC_PATH", doc)
    assert module_map.main(["--check"]) == 1
    assert module_map.REGENERATE in capsys.readouterr().err
    assert module_map.main([]) == 0 and module_map.main(["--check"]) == 0
    assert "  data/ " in doc.read_text(encoding="utf-8")
