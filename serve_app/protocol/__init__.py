"""API families: request models, validation, translation to engine params, response rendering.

Place in the request path: between the ingress routes and the handles (docs/lifecycle.md). One
module per family (`mindie`, `openai_chat`, `openai_completions`, `triton`), whose request model
translates itself: `check(pd_mode)`, `tokenize_request(model)`, `replica_request(request_id,
prompt, defaults)`. Shared: `defaults` (`ServerDefaults`, what a request leaves out, built once
from the config), `pd_refusals` (what PD mode cannot run), `errors` (every failure's
`ErrorKind` in each family's envelope), `fields` (range validators whose messages name a
parameter and its range), `sampling` (finish-reason words, `SamplingParams`, the MindIE-style
`parameters` translation).
"""
