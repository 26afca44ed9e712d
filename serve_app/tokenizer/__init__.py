"""Text <-> token ids: tokenizer pool, chat templates, incremental detokenizer, stop strings.

In the request path this package sits on both sides of the engine: the tokenizer pool turns text
or chat messages into prompt ids before any replica work, and inside the model replica the
incremental detokenizer and the stop matcher turn each step's new token ids into text deltas, so
a stop string ends generation at the exact step. Like `engine/`, it imports no fastapi, pydantic
or ray; submodules are imported explicitly (nothing heavy is exported here).
"""
