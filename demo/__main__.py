"""`python -m demo`: the whole pipeline on a small default (see `demo.run`)."""
import sys

from demo.run import main

sys.exit(main())
