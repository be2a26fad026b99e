"""``python -m properties.cli``: ua-verify."""

import sys

from .verify import verify_main

sys.exit(verify_main())
