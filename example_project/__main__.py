"""``python -m example_project``: the demo (see :mod:`example_project.demo`)."""

import sys

from example_project.demo import main

sys.exit(main())
