"""`ray job submit --working-dir . -- python -m jobs.generate_dataset SPEC.yaml`

Runs a dataset-generation job spec on the cluster the job was submitted to (RAY_ADDRESS is
set by `ray job submit`); resubmitting the same spec resumes it.
"""

from __future__ import annotations

import argparse
import logging
import sys

from pipelines.generate_dataset import run_job
from snapref_ray.storage.jobspec import load_job_spec


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("spec", help="job spec YAML (local or s3://)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (logs only)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    summary = run_job(load_job_spec(args.spec), progress=not args.no_progress)
    return 1 if summary["failed_items"] else 0


if __name__ == "__main__":
    sys.exit(main())
