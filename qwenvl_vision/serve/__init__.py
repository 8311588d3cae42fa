"""``qwenvl-vision serve``: the encoder over HTTP (FastAPI, uvicorn, prometheus_client: the ``[serve]`` extra),
never imported by ``import qwenvl_vision``. ``main`` holds the command line, ``app`` the routes, ``batcher`` the
queue and the thread that encodes, ``media`` the request items under the media policy."""
