"""Print the package's shape: modules per folder with their line counts, largest first.

A report, not a gate (size is a symptom: split a module when it holds two ideas, not when a
counter says so). Modules over ~300 lines are marked for a reader to look at.

    python scripts/module_report.py [--over 300]
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "gradaccum"


def module_lines(root: Path = SRC) -> dict[str, int]:
    """Lines of every module under ``root``, keyed by its path relative to ``root``."""
    return {str(p.relative_to(root)): len(p.read_text().splitlines()) for p in sorted(root.rglob("*.py"))}


def report(lines: dict[str, int], over: int) -> str:
    """The report's text: one table per folder, then the totals."""
    folders: dict[str, list[tuple[str, int]]] = defaultdict(list)
    for path, n in lines.items():
        folders[str(Path(path).parent)].append((Path(path).name, n))
    out = []
    for folder in sorted(folders):
        rows = sorted(folders[folder], key=lambda r: -r[1])
        out.append(f"{folder}/  ({len(rows)} modules, {sum(n for _, n in rows)} lines)")
        out += [f"  {n:5d}  {name}{'   <- over ' + str(over) if n > over else ''}" for name, n in rows]
    out.append(f"total: {len(lines)} modules, {sum(lines.values())} lines; "
               f"{sum(n > over for n in lines.values())} over {over}")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--over", type=int, default=300)
    print(report(module_lines(), parser.parse_args().over))


if __name__ == "__main__":
    main()
