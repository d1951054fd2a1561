"""Structured outputs: output constrained to a JSON schema, a regular expression, a list of
choices or a grammar, through the llguidance grammar engine.

``params`` (torch-free, used by the frontend) turns a request's constraint into a grammar
and rejects one the engine cannot compile; ``matchers`` (engine side) keeps one matcher
per constrained request, advanced by every accepted token, and fills one token bitmask
per step for the whole batch; ``bitmask`` applies it to the logits before sampling."""
