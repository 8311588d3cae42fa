"""The teardown study: what an encoder leaves behind once closed, in bytes (``qwenvl-vision bench teardown``).
``study`` runs it, ``cycles`` loads and frees encoders in one process, ``census`` counts what stays."""
