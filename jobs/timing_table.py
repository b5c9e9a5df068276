"""`ray job submit --working-dir . -- python -m jobs.timing_table SPEC.yaml`

Measures one case under each setting (no reference, SnapRef default, ref_in_uncond, ref_guidance
with APG, ref_end 0.6, recompute every step, turbo) on one worker of the cluster the job was
submitted to; writes comparison_summary.json and comparison_summary.md to the spec's output.
"""

from __future__ import annotations

import argparse
import logging
import sys

from pipelines.timing_table import format_markdown, load_timing_spec, run_timing


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("spec", help="timing spec YAML (local or s3://)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    print(format_markdown(run_timing(load_timing_spec(args.spec))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
