"""OpenAI's Responses API: its requests, output items, stored responses and routes."""
