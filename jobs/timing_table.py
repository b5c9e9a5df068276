"""`ray job submit --working-dir . -- python -m jobs.timing_table SPEC.yaml`

Measures one case under each setting (no reference, SnapRef default, ref_in_uncond, ref_guidance
with APG, ref_end 0.6, recompute every step, turbo) on one worker of the cluster the job was
submitted to; writes comparison_summary.json and comparison_summary.md to the spec's output.
"""

import sys

from snapref_ray.jobs.timing_table import main

if __name__ == "__main__":
    sys.exit(main())
