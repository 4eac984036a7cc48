"""Elastic training: a rank's life across layouts (its entry under torchrun, restarts on another world
re-planned dp-only or whole, a slow rank's rebalance or eviction). Above tessel.train, which never imports it."""
