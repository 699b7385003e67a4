"""DeepSpeed engine settings (ZeRO stage, buckets, offload, communication), shipped as package data.

Each `<name>.json` here is selectable as `deepspeed.config=<name>`; batch sizes, learning rate,
clipping and precision never live here (they belong to the run config, `pipeline.train.engine`)."""
from pathlib import Path

#: The directory holding the engine files (inside the installed package as well as the repository).
ENGINE_DIR = Path(__file__).resolve().parent
