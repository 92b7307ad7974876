"""``python -m example_project``: the demo (see :mod:`example_project.demo`)."""

import sys

from example_project import stopping

# Before the demo's imports: from here on Ctrl-C and SIGTERM only ask the demo to stop, so
# none lands as a KeyboardInterrupt in the middle of an import (see example_project.stopping).
stopping.install()
stopping.pause_point("start")

from example_project.demo import main  # noqa: E402

sys.exit(main())
