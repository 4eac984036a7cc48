"""`tessel launch`: the files a scheduler takes to run a recipe on many nodes (Slurm, Kubernetes)."""
