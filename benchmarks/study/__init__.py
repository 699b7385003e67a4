"""The time-to-quality study as SLURM jobs (`cpt-study plan|submit|status|collect STUDY.yaml`)."""
