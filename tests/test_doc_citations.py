"""Every doc section the code cites exists where it is cited.

Docstrings say why in a sentence and cite the measurement, as
``docs/NAME.md, "Section"``; sections move (dated records went from
docs/BENCHMARKS.md to docs/HISTORY.md) and a citation left behind points at
nothing. A section is a heading or a bold paragraph title of that file."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCES = ("ua_kernels", "ua_reference", "properties", "benchmarks", "tests")
CITATION = re.compile(r'docs/([A-Z_]+\.md),?\s*\(?"([^"]+)"')


def _citations():
  for package in SOURCES:
    for path in sorted((ROOT / package).rglob("*.py")):
      if path == pathlib.Path(__file__).resolve():
        continue  # this docstring's example
      # Joined across lines and comment markers: a citation may wrap.
      text = re.sub(r"\n\s*#?\s*", " ", path.read_text())
      for doc, section in CITATION.findall(text):
        yield path.relative_to(ROOT), doc, section.rstrip(".,")


def _sections(doc: str) -> str:
  """The file's headings and bold paragraph titles, one per line."""
  text = (ROOT / "docs" / doc).read_text()
  titles = [line.lstrip("#").strip() for line in text.splitlines() if line.startswith("#")]
  titles += re.findall(r"\*\*([^*]+)\*\*", text)
  return "\n".join(titles).lower()


def test_every_cited_section_exists_in_its_doc():
  citations = list(_citations())
  assert len(citations) > 20, citations  # the pattern still finds the code's citations
  sections = {}
  missing = [f"{path}: docs/{doc}, {section!r}" for path, doc, section in citations
             if section.lower() not in sections.setdefault(doc, _sections(doc))]
  assert not missing, missing
