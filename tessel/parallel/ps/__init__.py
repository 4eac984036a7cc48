"""The parameter server: servers own key ranges of the parameters, workers push and pull."""
