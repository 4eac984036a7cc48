"""Expert parallelism: experts sharded over ep, tokens dispatched by all-to-all."""
