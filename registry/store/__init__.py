"""The store's write, read and maintenance path, which the Registry and the server run: a push's
steps (ingest, with access and deltas; recorded writes each durable pack), the server's side of the
protocol (service) and of the Hugging Face Hub's (hub), tiers, tags, figures (stats), prune, check,
lost packs and the audit log. Each module takes the typed context registry/context.Store."""
