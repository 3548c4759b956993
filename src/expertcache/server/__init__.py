"""OpenAI-compatible HTTP server: `create_app(model)` (app.py) over a slot scheduler (slots.py)."""
