"""The OpenAI-compatible HTTP front of the router (FastAPI on uvicorn, on the router's own loop)."""
