"""The rules that tie a recipe's sections together, one file per strategy (or concern), each a list of
tessel.config.rule.Rule entries; tessel.config.check runs them in one fixed order. A new strategy adds its
file here and names its list in that order."""
