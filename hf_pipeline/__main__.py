"""``python -m hf_pipeline ...``: the ``hf-pipeline`` command without its installed script."""

import sys

from hf_pipeline.commands import main

sys.exit(main())
