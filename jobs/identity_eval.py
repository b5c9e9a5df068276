"""`ray job submit --working-dir . -- python -m jobs.identity_eval SPEC.yaml`

Runs an identity-gap evaluation spec (snapref_ray/examples/example_eval_spec.yaml) on the cluster the job was
submitted to (RAY_ADDRESS is set by `ray job submit`); writes heldout_loss.json and
heldout_loss.parquet to the spec's output.
"""

import sys

from snapref_ray.jobs.identity_eval import main

if __name__ == "__main__":
    sys.exit(main())
