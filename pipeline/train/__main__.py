"""`python -m pipeline.train`: the pretraining entry point (see `pipeline.train.loop`)."""
import sys

from pipeline.train.loop import main

sys.exit(main())
