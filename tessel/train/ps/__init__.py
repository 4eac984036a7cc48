"""The parameter server's training side: its workers' loop (trainer.py) and its checkpoints (checkpoint.py),
beside tessel.parallel.ps (the servers and the worker Runner)."""
