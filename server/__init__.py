"""jaxserve server: the OpenAI-compatible HTTP front end over an `EngineClient`.

Modules: `engine_client` (the protocol the server codes against), `protocol` (request
models, error shape), `app` (routes + middleware, `create_app`), `serving` (one generation
request: fan-out, merge, JSON or SSE), `formats` (OpenAI response shapes), `metrics`
(Prometheus), `openapi`, `runner` (`serve` with graceful drain), `cli` (`jaxserve`),
`testing` (FakeEngine, test tokenizer, LiveServer). This package imports no JAX.
"""
