"""OpenAI's completions and chat: schemas, plans, choices, bodies, and the token routes."""
