"""Environment doctor: the pre-flight checks (:mod:`grpo_npu.preflight`) as a table or JSON.

Usage::

    python -m grpo_npu.doctor [--sleep-mode | --no-sleep-mode] [--json [PATH]]

Prints one row per check with OK / WARN / FAIL and, where it is not OK, a one-line fix. The exit
code is 1 when any check FAILs (0 otherwise, 2 on bad arguments), so a launch script can run it
first. On a plain CPU machine nothing FAILs: the NPU-only checks report "n/a". ``--sleep-mode``
says the vLLM rollout will sleep between steps (sleep-mode conflicts FAIL), ``--no-sleep-mode``
that it will not; without either they WARN. The trainer runs the same checks at start-up.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from typing import Sequence

from grpo_npu.io import write_atomic
from grpo_npu.preflight import OK, Check, has_failures, run_checks, summary_line


def format_table(checks: Sequence[Check]) -> str:
    """The printed table: status, name, detail; a fix line under each non-OK row."""
    width = max(len(c.name) for c in checks)
    lines = []
    for c in checks:
        lines.append(f"{c.status:<4}  {c.name:<{width}}  {c.detail}")
        if c.status != OK and c.fix:
            lines.append(f"{'':<4}  {'':<{width}}  fix: {c.fix}")
    lines.append(summary_line(checks))
    return "\n".join(lines)


def to_json(checks: Sequence[Check]) -> str:
    return json.dumps({"ok": not has_failures(checks), "summary": summary_line(checks),
                       "checks": [asdict(c) for c in checks]}, indent=2) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m grpo_npu.doctor",
                                description="Check versions, devices and NPU RL environment settings.")
    p.add_argument("--sleep-mode", action=argparse.BooleanOptionalAction, default=None,
                   help="whether the vLLM rollout uses sleep mode (default: unknown, conflicts WARN)")
    p.add_argument("--json", nargs="?", const="-", metavar="PATH",
                   help="write the checks as JSON to PATH (or stdout with no PATH, instead of the table)")
    args = p.parse_args(argv)
    checks = run_checks(sleep_mode=args.sleep_mode)
    if args.json == "-":
        sys.stdout.write(to_json(checks))
    else:
        print(format_table(checks))
        if args.json:
            try:
                write_atomic(args.json, to_json(checks).encode("utf-8"))
            except OSError as exc:
                print(f"doctor: error: {exc}", file=sys.stderr)
                return 2
    return 1 if has_failures(checks) else 0


if __name__ == "__main__":
    sys.exit(main())
