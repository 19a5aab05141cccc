"""The OpenAI-compatible HTTP server: Starlette routes over one `AsyncEngine`.

`serve.main(argv)` is `ninfer serve`; `app.build_app` builds the ASGI app for tests and embedding.
"""
