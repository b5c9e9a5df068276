"""Ray actors and scheduling for batch jobs: a worker per GPU, reference affinity, K/V hand-off."""
