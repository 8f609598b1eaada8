"""Regenerate the golden corpus' expected records from requests.json (or compare them with --check).

    PYTHONPATH=. python tests/cli/golden/make.py                  # write tests/cli/golden/expected/<name>.json for every request
    PYTHONPATH=. python tests/cli/golden/make.py NAME...          # only these requests
    PYTHONPATH=. python tests/cli/golden/make.py --check          # compare instead of writing (exit 1 on a difference)
    PYTHONPATH=. python tests/cli/golden/make.py --check --reverse --times   # in reverse order, with each request's time

Writing also removes expected records of requests no longer in requests.json (unless NAMEs are given).
"""

from __future__ import annotations

import argparse
import sys
import time

from harness import EXPECTED_DIR, differences, dumps, expected_path, load_expected, load_requests, run_request


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", help="only these requests (default: all)")
    ap.add_argument("--check", action="store_true", help="compare with expected/ instead of writing")
    ap.add_argument("--reverse", action="store_true", help="run the requests in reverse order")
    ap.add_argument("--times", action="store_true", help="print each request's time")
    args = ap.parse_args(argv)

    reqs = load_requests()
    unknown = set(args.names) - {r["name"] for r in reqs}
    if unknown:
        ap.error(f"unknown request names: {sorted(unknown)}")
    chosen = [r for r in reqs if not args.names or r["name"] in args.names]
    if args.reverse:
        chosen.reverse()
    EXPECTED_DIR.mkdir(exist_ok=True)
    failed, total = [], 0.0
    for req in chosen:
        t0 = time.perf_counter()
        rec = run_request(req)
        dt = time.perf_counter() - t0
        total += dt
        if args.times:
            print(f"{dt:7.3f} s  exit {rec['exit_code']}  {req['name']}")
        if args.check:
            path = expected_path(req["name"])
            diffs = differences(load_expected(req["name"]), rec) if path.exists() else [f"{path} is missing"]
            if diffs:
                failed.append(req["name"])
                print(f"DIFF {req['name']}:\n  " + "\n  ".join(diffs))
        else:
            expected_path(req["name"]).write_text(dumps(rec))
    if not args.check and not args.names:
        keep = {expected_path(r["name"]).name for r in reqs}
        for stale in EXPECTED_DIR.glob("*.json"):
            if stale.name not in keep:
                stale.unlink()
                print(f"removed {stale}")
    verb = "checked" if args.check else "wrote"
    print(f"{verb} {len(chosen)} requests in {total:.2f} s" + (f"; {len(failed)} differ: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
