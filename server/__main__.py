"""`python -m server serve ...` (same as the `strata` console command)."""
import sys

from server.cli import main

sys.exit(main())
