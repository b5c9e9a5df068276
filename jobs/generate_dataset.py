"""`ray job submit --working-dir . -- python -m jobs.generate_dataset SPEC.yaml`

Runs a dataset-generation job spec on the cluster the job was submitted to (RAY_ADDRESS is
set by `ray job submit`); resubmitting the same spec resumes it.
"""

import sys

from snapref_ray.jobs.generate_dataset import main

if __name__ == "__main__":
    sys.exit(main())
