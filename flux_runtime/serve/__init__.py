"""`flux-serve`: an OpenAI-compatible image server over one loaded pipeline.

`api` holds the request models and the OpenAI-shaped errors, `worker` the bounded queue, the batching and
the one GPU worker thread, `app` the FastAPI routes, the URL store and the metrics, `command` the click
entry point. The server imports the pipeline; nothing in the package imports the server.
"""
