"""The command layer: `tessel train | plan | simulate | export | launch | support | ...`, the launcher
(checks before any process, torchrun under supervision) and the cluster files. Nothing in tessel imports it
but `tessel/__main__.py` (contract commands-on-top)."""
