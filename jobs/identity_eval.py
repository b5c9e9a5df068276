"""`ray job submit --working-dir . -- python -m jobs.identity_eval SPEC.yaml`

Runs an identity-gap evaluation spec (jobs/example_eval_spec.yaml) on the cluster the job was
submitted to (RAY_ADDRESS is set by `ray job submit`); writes heldout_loss.json and
heldout_loss.parquet to the spec's output.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from pipelines.identity_eval import load_eval_spec, run_identity_eval


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("spec", help="evaluation spec YAML (local or s3://)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    report = run_identity_eval(load_eval_spec(args.spec))
    print(json.dumps({k: report[k] for k in ("n_cases", "n_failed", "mean_loss_right", "mean_loss_wrong", "gap",
                                             "gap_ci", "right_wins_fraction")}, indent=2))
    return 1 if report["n_failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
