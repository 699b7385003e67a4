"""What every section's config stands on: `ConfigError` and the shared checks (`checks`), loading
(presets in `presets/`, `inherit:`, dotted overrides, typed construction: `loader`). The run's composed
config (`RunConfig`, `load_config`, `check_run`) is `pipeline.train.run_config`, above the sections."""
