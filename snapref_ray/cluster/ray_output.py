"""The batch cluster's old name for snapref_ray/ray_console.py, which both the cluster and Serve import.

The capture of Ray's console lines is process-wide state (one logger, one set of listeners), so this name is the
same module object, not a copy: cluster/pool.py and cluster/feasibility.py reach it here until they import
`snapref_ray.ray_console` themselves, and then this file goes.
"""

import sys

from snapref_ray import ray_console

sys.modules[__name__] = ray_console
