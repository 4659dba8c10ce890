"""``python -m hybridmeta.runtime [--model DIR] [--device cuda]``: the main job."""

import sys

from hybridmeta.runtime.job import main_job

sys.exit(main_job(sys.argv[1:]))
