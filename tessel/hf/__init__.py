"""Hugging Face models read for tessel's rules: a family's config and shapes (shape, check), its plans on
the meta device (layout, lineage, region_inputs), and what each strategy can place (grid, context, ep_plan, head,
blocks). Used by the config's checks before any process and by the apply steps; torch only where deferred."""
