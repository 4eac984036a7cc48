"""Fault handling inside a run: the guard, numerical faults, stragglers, injection, elasticity, stops."""
