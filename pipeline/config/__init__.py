"""The run configuration: `RunConfig` (composed of each component's own section dataclass), YAML
presets in `presets/`, dotted overrides, and the two validation stages."""
