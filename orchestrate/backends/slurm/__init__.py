"""The Slurm backend: one sbatch job per run, a monitor beside the ranks, submitit for functions."""
