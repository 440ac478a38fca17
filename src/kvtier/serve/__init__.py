"""Serving: an engine with continuous batching, prefix caching and admission control over the
paged tier (:mod:`kvtier.serve.engine`), and an OpenAI-compatible HTTP server around it
(:mod:`kvtier.serve.api`). See ``docs/serving.md``."""
