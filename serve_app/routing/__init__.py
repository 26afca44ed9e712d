"""Choosing a model replica for a request: by the prompt prefixes each replica already caches."""
