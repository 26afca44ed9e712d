"""The HTTP front: a FastAPI app whose thin routes parse, call the handles, and render.

Place in the request path: first. `app.create_app(config, backend)` builds the FastAPI app for a
`Backend` (Ray handles in Serve, plain objects in unit tests); `pipeline` runs one request through
tokenizer pool and model replica with timeouts, stopInfer and disconnects turned into aborts;
each API family's routes live in their own module.
"""
