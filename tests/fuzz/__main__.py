"""``python -m tests.fuzz --n 4000``: the long fuzz campaign; prints the issue's table.

Seeds are written once into ``--seeds`` (default ``$TMPDIR/ckpttool-fuzz-seeds``) by the real
writers; ``--only 17,230`` reruns given mutants and prints what each run did.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from tests.fuzz.harness import Campaign, findings, materialize
from tests.fuzz.seeds import write_seeds


def campaign_seeds(root: Path, *, deepspeed: bool = True) -> dict[str, tuple[Path, str]]:
    """{seed name: (directory copied per mutant, path inside it given to the commands)}: the
    whole training directory is copied, so that files beside the checkpoint come along."""
    seeds = write_seeds(root, deepspeed=deepspeed)
    out: dict[str, tuple[Path, str]] = {}
    for name, path in seeds.items():
        top = root / path.relative_to(root).parts[0]
        out[name] = (top, str(path.relative_to(top)) if path != top else "")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=4000, help="number of mutants")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--minutes", type=float, default=None,
                    help="send no new mutant after this long; the table counts those run")
    ap.add_argument("--timeout", type=float, default=None,
                    help="CPU seconds one run may take (default: the harness's)")
    ap.add_argument("--campaign", type=int, default=0, help="the random seed of the campaign")
    ap.add_argument("--seeds", type=Path,
                    default=Path(tempfile.gettempdir()) / "ckpttool-fuzz-seeds")
    ap.add_argument("--only", help="comma-separated mutant indices to rerun")
    ap.add_argument("--materialize", type=Path,
                    help="with --only I: write mutant I into this directory and print the path "
                    "to give the commands; run nothing")
    ap.add_argument("--records", type=Path, help="write every run's record here (JSON lines)")
    ap.add_argument("--show", type=int, default=30, help="failing runs to print")
    args = ap.parse_args(argv)
    c = Campaign(campaign_seeds(args.seeds), campaign=args.campaign, workers=args.workers)
    if args.timeout is not None:
        c.timeout_s = args.timeout
    only = [int(i) for i in args.only.split(",")] if args.only else None
    if args.materialize is not None and only:
        for job in c.jobs(0, only[:1]):
            m, path = materialize(job, args.materialize)
            print(m.describe())
            print(path)
        return 0
    started = time.monotonic()
    c.run(args.n, only, progress=True, minutes=args.minutes)
    if args.records:
        with args.records.open("w") as f:
            for rec in c.records:
                f.write(json.dumps(rec) + "\n")
    for shown, (rows, rec) in enumerate(c.failures()):
        if shown < args.show:
            print(f"{','.join(rows)}: {rec['mutant']} | {rec['command']} exit {rec['exit']} | "
                  f"{(rec['stderr'].strip().splitlines() or [''])[-1][:200]} "
                  f"{rec.get('outside') or ''} {rec.get('bad_output') or ''}")
    if only:
        for rec in c.records:
            print(json.dumps(rec, indent=1)[:3000])
    print(c.render())
    print(f"({time.monotonic() - started:.0f} s)")
    return 1 if any(findings(r) for r in c.records) else 0


if __name__ == "__main__":
    sys.exit(main())
