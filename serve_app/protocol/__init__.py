"""API families: request models, validation, translation to engine params, response rendering.

Place in the request path: between the ingress routes and the handles. One module per family
(`mindie`, `openai_chat`, `openai_completions`, `triton`); `errors` maps every failure to each
family's envelope in one place; `fields` holds the range validators that produce the messages
naming a parameter and its allowed range; `sampling` holds what the families share (finish
reasons, building `SamplingParams`).
"""
