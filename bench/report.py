"""The README's performance table, generated from the committed results in ``bench/results/``.

Run: ``python -m bench.report`` (print the table), ``python -m bench.report --readme`` (rewrite the
block between the README's ``bench-table`` markers), ``python -m bench.report --check`` (exit 1 when
the README's block is not what the results give). One row per target of every full-size result
(quick-size results are skipped): benchmark, target, measured ratio, wanted, met?. The discussion of
the numbers lives in docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench.common import RESULTS_DIR

README = Path(__file__).resolve().parent.parent / "README.md"
START, END = "<!-- bench-table:start -->", "<!-- bench-table:end -->"
SKIP = ("summary",)  # run_all's summary repeats the benchmarks' own targets


def load_results(results_dir: Path = RESULTS_DIR) -> list[dict]:
    """Every full-size result JSON in ``results_dir``, by name."""
    out = []
    for path in sorted(results_dir.glob("*.json")):
        result = json.loads(path.read_text())
        if result.get("name") in SKIP or result.get("meta", {}).get("quick"):
            continue
        out.append(result)
    return out


def table(results: list[dict]) -> str:
    """Markdown: one row per target, then one line per result saying when and where it was measured."""
    lines = ["| benchmark | target | measured | wanted | met? |", "|---|---|---|---|---|"]
    for result in results:
        for name, t in result.get("targets", {}).items():
            met = "yes" if t["passed"] else "**no**"
            lines.append(f"| `bench.{result['name']}` | {name} | {t['measured']:.3g} | {t['target']} | {met} |")
    lines.append("")
    for result in results:
        meta = result.get("meta", {})
        where = ", ".join(str(meta[k]) for k in ("measured_at", "machine", "load") if meta.get(k))
        lines.append(f"- `bench.{result['name']}`: {where or 'when and where not recorded'}")
    return "\n".join(lines)


def replace_block(text: str, block: str) -> str:
    if text.count(START) != 1 or text.count(END) != 1:
        raise SystemExit(f"README.md must hold exactly one {START} ... {END} block")
    head, rest = text.split(START)
    _, tail = rest.split(END)
    return f"{head}{START}\n{block}\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="The README's performance table from bench/results/")
    parser.add_argument("--readme", action="store_true", help="rewrite the README's bench-table block")
    parser.add_argument("--check", action="store_true", help="exit 1 if the README's block is out of date")
    parser.add_argument("--results", type=Path, default=RESULTS_DIR)
    parser.add_argument("--readme-path", type=Path, default=README)
    args = parser.parse_args(argv)
    block = table(load_results(args.results))
    if not (args.readme or args.check):
        print(block)
        return 0
    text = args.readme_path.read_text()
    wanted = replace_block(text, block)
    if args.check:
        if wanted != text:
            print(f"{args.readme_path.name}'s performance table is out of date: run python -m bench.report --readme",
                  file=sys.stderr)
            return 1
        return 0
    args.readme_path.write_text(wanted)
    print(f"rewrote the table in {args.readme_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
