"""An OpenAI-compatible server over one exported program (``python -m exporters.serve``).

``protocol`` is what the clients send and get, ``engine`` runs one request at a time on the loaded program (the
cache kept across a chat's turns), ``app`` is the HTTP side (FastAPI, served by uvicorn).
"""
